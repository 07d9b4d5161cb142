"""Packing flattened documents into passes.

A Pass is a flat run of up to ``max_pass_tokens`` rows holding several documents, each at a
128-aligned offset (documents are already padded to 128 rows). Packing is greedy first-fit in
arrival order; a document larger than the budget gets a pass of its own. Documents of one
pass that share a root are read as one (engine/merge.py), so a document whose root is
already in a pass costs that pass only the rows its branches add.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from ..tiles import padded_rows
from .layout import FlatDoc


@dataclass
class Pass:
    docs: list[int] = field(default_factory=list)   # indices into the caller's doc list
    rows: int = 0
    roots: dict[Hashable, int] = field(default_factory=dict)   # root key -> its real rows

    def cost(self, doc: FlatDoc, key: Hashable | None) -> int:
        """Rows ``doc`` adds to this pass (merged with a document of the same root)."""
        if key is None or key not in self.roots:
            return doc.length
        tokens = self.roots[key]
        return padded_rows(tokens + doc.tokens - doc.root) - padded_rows(tokens)

    def add(self, i: int, doc: FlatDoc, key: Hashable | None) -> None:
        self.rows += self.cost(doc, key)
        self.docs.append(i)
        if key is not None:
            self.roots[key] = self.roots.get(key, doc.root) + doc.tokens - doc.root


def pack(docs: Sequence[FlatDoc], max_pass_tokens: int,
         keys: Sequence[Hashable | None] | None = None) -> list[Pass]:
    """``keys``: each document's merge.root_key (None: nothing is merged)."""
    keys = keys if keys is not None else [None] * len(docs)
    passes: list[Pass] = []
    for i, (doc, key) in enumerate(zip(docs, keys, strict=True)):
        target = next((p for p in passes if p.rows + p.cost(doc, key) <= max_pass_tokens),
                      None)
        if target is None:
            target = Pass()
            passes.append(target)
        target.add(i, doc, key)
    return passes

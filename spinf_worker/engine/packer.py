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

from ..tiles import PassRows
from .layout import FlatDoc


@dataclass
class Pass(PassRows):
    docs: list[int] = field(default_factory=list)   # indices into the caller's doc list

    def place(self, i: int, doc: FlatDoc, key: Hashable | None) -> None:
        self.add(doc, key)
        self.docs.append(i)


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
        target.place(i, doc, key)
    return passes

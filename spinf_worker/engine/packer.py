"""Packing flattened documents into passes.

A Pass is a flat run of up to ``max_pass_tokens`` rows holding several documents, each at a
128-aligned offset (documents are already padded to 128 rows). Packing is greedy first-fit in
arrival order; a document larger than the budget gets a pass of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .layout import FlatDoc


@dataclass
class Pass:
    docs: list[int] = field(default_factory=list)   # indices into the caller's doc list
    rows: int = 0


def pack(docs: Sequence[FlatDoc], max_pass_tokens: int) -> list[Pass]:
    passes: list[Pass] = []
    for i, doc in enumerate(docs):
        target = next((p for p in passes if p.rows + doc.length <= max_pass_tokens), None)
        if target is None:
            target = Pass()
            passes.append(target)
        target.docs.append(i)
        target.rows += doc.length
    return passes

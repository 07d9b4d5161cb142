"""Roots read before: their keys and values kept across passes and calls.

A client that sends the same document again (new questions about it, one question per
request, a job run twice) would have its root read again in every pass. A root's keys and
values at every layer depend only on its own tokens (the tree's rule: a root row sees the
root alone), so once a pass has read a root they are kept here, keyed by what makes two roots
the same (engine/merge.root_key), and a later pass that needs that root lays out only its
branch rows: they attend to the kept keys and values as they would to the root's rows in the
pass, in the same products, so every score keeps its bits (tests/test_root_cache.py).

Kept: text roots of scoring documents (no media, no completion prompts; extraction slots
decode from the kept root's keys and values and their branch's), whose readouts all lie in
the branches (a template with no text before
its slot reads out at the root's last row), on models whose layers are all attention
(DeltaNet layers carry a state instead). The least recently used roots go first once the
byte budget is spent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from .layout import FlatDoc


@dataclass
class KeptRoot:
    """A root's keys and values at every attention layer: ``layers[layer] = (k, v)``, each
    [root rows, kv heads, head dim], and its positions' count."""

    layers: dict[int, tuple[torch.Tensor, torch.Tensor]]
    rows: int

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers.values())


def keepable(doc: FlatDoc) -> bool:
    """Whether ``doc``'s root may be kept, or read from here (see the module's docstring)."""
    return (doc.prompts is None and not doc.media and doc.root > 0
            and bool((doc.block.readout_rows >= 0).all()))


class RootCache:
    """The kept roots, least recently used first; at most ``max_bytes`` of keys and values."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.roots: OrderedDict[Hashable, KeptRoot] = OrderedDict()
        self.hits = self.misses = 0
        self.rows_saved = 0      # the kept roots' rows of the hits: rows not read again

    def __len__(self) -> int:
        return len(self.roots)

    def get(self, key: Hashable) -> KeptRoot | None:
        root = self.roots.get(key)
        if root is None:
            self.misses += 1
            return None
        self.hits += 1
        self.rows_saved += root.rows
        self.roots.move_to_end(key)
        return root

    def put(self, key: Hashable, root: KeptRoot) -> None:
        """Keep ``root``, dropping the least recently used ones while over budget (a root
        larger than the whole budget is not kept)."""
        size = root.nbytes
        if size > self.max_bytes or key in self.roots:
            return
        while self.bytes + size > self.max_bytes:
            _, old = self.roots.popitem(last=False)
            self.bytes -= old.nbytes
        self.roots[key] = root
        self.bytes += size

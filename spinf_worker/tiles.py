"""Row tiles shared by the engine and the torch-free queue tier, and the rows a pass holds.

A document starts at, and is padded to, a multiple of ROW_TILE rows in a pass, so its key
blocks are laid out the same wherever it lands; the LM head runs over each document's readout
rows padded to READOUT_TILE. All are fixed: changing one moves scores' bits.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

ROW_TILE = 128      # body rows: the document alignment
READOUT_TILE = 32   # LM-head rows: each document's readouts are padded to this
# CPU attention of branch rows: a tile of rows at a time, over the root and a path padded to
# a power of two of at least PATH_MIN, so a row's shapes depend on its own path alone
BRANCH_TILE = 32
PATH_MIN = 8


def padded_rows(tokens: int) -> int:
    """Rows a document of ``tokens`` real rows takes in a pass."""
    return -(-tokens // ROW_TILE) * ROW_TILE


@dataclass
class RowPart:
    """A document's rows before it is laid out (Preparer.row_parts; a FlatDoc has the same
    three): its root's tokens, all its tokens, and what another document must share to be
    read with it (None: read alone)."""

    key: Hashable | None
    root: int
    tokens: int

    @property
    def length(self) -> int:
        return padded_rows(self.tokens)


@dataclass
class PassRows:
    """The rows of a pass being filled. Documents of one pass that share a root are read as
    one (engine/merge.py): a document whose root is already in the pass costs only the rows
    its branches add. The packer fills passes by it, and the queue worker its passes."""

    rows: int = 0
    roots: dict[Hashable, int] = field(default_factory=dict)   # root key -> its real rows

    def cost(self, doc, key: Hashable | None) -> int:
        """Rows ``doc`` (a FlatDoc or a RowPart) adds to this pass."""
        if key is None or key not in self.roots:
            return doc.length
        tokens = self.roots[key]
        return padded_rows(tokens + doc.tokens - doc.root) - padded_rows(tokens)

    def add(self, doc, key: Hashable | None) -> None:
        self.rows += self.cost(doc, key)
        if key is not None:
            self.roots[key] = self.roots.get(key, doc.root) + doc.tokens - doc.root

    def with_parts(self, parts: Sequence[RowPart]) -> PassRows:
        """This pass with a request's documents added, merged where they can be (a copy)."""
        trial = PassRows(self.rows, dict(self.roots))
        trial.add_parts(parts)
        return trial

    def add_parts(self, parts: Sequence[RowPart]) -> None:
        for part in parts:
            self.add(part, part.key)

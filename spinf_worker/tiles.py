"""Row tiles shared by the engine and the torch-free queue tier, and the rows a pass holds.

A document starts at, and is padded to, a multiple of ROW_TILE rows in a pass, so its key
blocks are laid out the same wherever it lands; the LM head runs over each document's readout
rows padded to READOUT_TILE. All are fixed: changing one moves scores' bits.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

ROW_TILE = 128      # body rows: the document alignment
READOUT_TILE = 32   # LM-head rows: each document's readouts are padded to this
# CPU attention of branch rows: a tile of rows at a time, over the root and a path padded to
# a power of two of at least PATH_MIN, so a row's shapes depend on its own path alone
BRANCH_TILE = 32
PATH_MIN = 8
# a completion prompt's block: its rows are laid out and attended block by block, and prompts
# of a pass whose leading blocks hold the same tokens read them once (engine/prompt_blocks.py)
PROMPT_BLOCK = ROW_TILE


def padded_rows(tokens: int) -> int:
    """Rows a document of ``tokens`` real rows takes in a pass."""
    return -(-tokens // ROW_TILE) * ROW_TILE


@dataclass(frozen=True)
class BlockChain:
    """A completion prompt's whole blocks (PROMPT_BLOCK tokens each), each named by a digest of
    the prompt's tokens up to the block's end and of its top-N: two prompts with equal digests
    at a block have that block and all before it in common. The tokens after the last whole
    block, the tail, are laid out token by token after the blocks, and prompts of one document
    share the tail tokens they have in common after the same last block: each tail token is
    named by a hash of that block's digest (or the top-N) and the tail up to it."""

    digests: tuple[bytes, ...]
    tail: tuple[int, ...]
    top: int

    @classmethod
    def of(cls, ids: Sequence[int], top: int) -> BlockChain:
        h = hashlib.blake2b(str(top).encode(), digest_size=16)
        digests = []
        whole = len(ids) - len(ids) % PROMPT_BLOCK
        for lo in range(0, whole, PROMPT_BLOCK):
            h.update(array("q", ids[lo:lo + PROMPT_BLOCK]).tobytes())
            digests.append(h.copy().digest())
        at = hash(digests[-1] if digests else ("tail", top))
        tail = []
        for token in ids[whole:]:
            at = hash((at, token))
            tail.append(at)
        return cls(tuple(digests), tuple(tail), top)

    @property
    def group(self) -> Hashable:
        """The prompts one document holds (engine/merge.py): those with the same top-N and the
        same first block; prompts shorter than a block, per top-N."""
        return ("prompt", self.top, self.digests[0] if self.digests else None)


@dataclass
class RowPart:
    """A document's rows before it is laid out (Preparer.row_parts; a FlatDoc has the same
    three): its root's tokens, all its tokens, and what another document must share to be
    read with it (None: read alone; a BlockChain: a completion prompt)."""

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
    its branches add, and a completion prompt only its blocks and tail tokens no other prompt
    of the pass holds. The packer fills passes by it, and the queue worker its passes."""

    rows: int = 0
    roots: dict[Hashable, int] = field(default_factory=dict)   # root key -> its real rows
    blocks: set[bytes | int] = field(default_factory=set)     # prompts' blocks, tail tokens

    def cost(self, doc, key: Hashable | None) -> int:
        """Rows ``doc`` (a FlatDoc or a RowPart) adds to this pass: a completion prompt, its
        blocks and tail tokens no other prompt of its document holds."""
        if isinstance(key, BlockChain):
            tokens = self.roots.get(key.group, 0)
            return padded_rows(tokens + self._prompt_rows(key)) - padded_rows(tokens)
        if key is None or key not in self.roots:
            return doc.length
        tokens = self.roots[key]
        return padded_rows(tokens + doc.tokens - doc.root) - padded_rows(tokens)

    def _prompt_rows(self, chain: BlockChain) -> int:
        return (PROMPT_BLOCK * self._absent(chain.digests) + self._absent(chain.tail))

    def _absent(self, chain: tuple) -> int:
        """How many of a chain's names this pass lacks: a name is here only with every name
        before it in its chain (they are added chain by chain), so the first one missing is
        found by bisection."""
        return len(chain) - bisect.bisect_left(chain, True, key=lambda n: n not in self.blocks)

    def add(self, doc, key: Hashable | None) -> None:
        self.rows += self.cost(doc, key)
        if isinstance(key, BlockChain):
            self.roots[key.group] = self.roots.get(key.group, 0) + self._prompt_rows(key)
            self.blocks.update(key.digests)
            self.blocks.update(key.tail)
        elif key is not None:
            self.roots[key] = self.roots.get(key, doc.root) + doc.tokens - doc.root

    def with_parts(self, parts: Sequence[RowPart]) -> PassRows:
        """This pass with a request's documents added, merged where they can be (a copy)."""
        trial = PassRows(self.rows, dict(self.roots), set(self.blocks))
        trial.add_parts(parts)
        return trial

    def add_parts(self, parts: Sequence[RowPart]) -> None:
        for part in parts:
            self.add(part, part.key)

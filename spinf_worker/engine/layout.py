"""The read-once tree: one DocTree per document.

``root`` = BOS + the presented content. One branch per (query, combination) holds the template
text up to its ``{?}``; a multi-token option gets a sub-branch holding all its tokens but the
last. A branch's tokens take the positions right after its parent's last position, so every
branch sees exactly what a one-question prompt would see.

Branches are laid out as a prefix tree: questions that start with the same tokens (a pack's
shared "Question:" preamble, the same template asked with different options) share those
rows, since a row's keys, values and logits depend only on its own tokens and ancestors.
Rows follow the tree depth first, so every row's descendants are the rows right after it:
row k is on row q's path iff ``k <= q < end[k]``.

Readouts are the rows whose logits predict an option token: the last token of a branch (its
first option token, shared by all options) and each sub-branch token.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..tiles import BRANCH_TILE, PATH_MIN, READOUT_TILE, ROW_TILE

if TYPE_CHECKING:
    from .prompt_blocks import PromptBlocks


@dataclass
class Branch:
    prefix: list[int]            # template tokens up to the slot (no BOS)
    options: list[list[int]]     # each option's tokens, in request order; [] for extraction
    decode: dict | None = None   # extraction slots: SlotJob settings (engine/decode.py)
    group: str | None = None     # a query group (a pack's) has a prefix tree of its own


@dataclass
class ImageRows:
    """An image in a document's root: its soft tokens are rows [start, end), which hold the
    image's features and attend to each other both ways (engine/media.py)."""

    start: int
    end: int
    pixels: object               # [3, H, W] preprocessed (Gemma 4: [rows, columns, patch];
    #                              audio: its (log-mel features, frame mask))
    frame: bool = False          # a video's frame
    kind: str = "image"          # "image" (a video frame too) or "audio"
    seconds: float = 0.0         # audio: the seconds read


@dataclass
class EchoReadout:
    """A completion prompt's readouts (engine/completion.py): at each readout row the logprob
    of the token that follows it and the ``top`` most likely tokens."""

    top: int                     # >= 1 (the first is the greedy token)
    next_ids: np.ndarray         # [readouts] the token after each readout row; -1: none yet


@dataclass
class FlatDoc:
    """A DocTree flattened into padded rows, ready to be placed in a pass."""

    input_ids: torch.Tensor      # [length] (padded to ROW_TILE)
    positions: torch.Tensor      # [length]
    root: int                    # rows [0, root) hold the root
    tokens: int                  # real (unpadded) rows; [root, tokens) are branch tokens
    # [length] int32: row k is on row q's path iff k <= q < span_end[k] (root rows: every real
    # row; a padding row: itself only).
    span_end: np.ndarray
    # the branches' layout and readout summands, shared by the documents that ask them
    block: BranchBlock
    readout_rows: torch.Tensor   # [n_readouts padded to READOUT_TILE] row within the document
    # extraction branches: branch -> (readout index, context rows (root + branch), settings)
    extract: dict[int, tuple[int, list[int], dict]] = field(default_factory=dict)
    media: list[ImageRows] = field(default_factory=list)   # images in the root, in order
    echo: EchoReadout | None = None   # a completion prompt: its readouts' tokens and top-N
    # completion prompts: their rows as blocks (engine/prompt_blocks.py), attended block by
    # block; root == tokens, the last real row + 1, and padding rows may lie before it
    prompts: PromptBlocks | None = None
    # max_position, when the layout knows it without reading the rows (BranchBlock.place)
    last_position: int | None = field(default=None, repr=False, compare=False)
    # a root read in an earlier pass (engine/root_cache.KeptRoot): the rows are the branches'
    # alone (root == 0), at their positions after the kept root's
    kept_root: object | None = None

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @cached_property
    def max_position(self) -> int:
        """The last position of a real row (asked of each document several times: its
        checks, its root key, the CPU attention's masks)."""
        if self.last_position is not None:
            return self.last_position
        return int(self.positions[: self.tokens].max())

    def context_positions(self, rows: torch.Tensor) -> torch.Tensor:
        """The positions of an extraction slot's context ``rows`` (``extract``'s): on a kept
        root, its rows come first, at positions 0 onwards."""
        if self.kept_root is None:
            return self.positions[rows]
        root = self.kept_root.rows
        return torch.where(rows < root, rows, self.positions[(rows - root).clamp(min=0)])

    @cached_property
    def paths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per branch token its own path (its branch ancestors and itself, as rows of this
        document), zero-padded to ``[branch tokens, L]``, and which entries are real. Only
        the CPU attention asks."""
        rows, ok = self.block.paths
        return torch.from_numpy(rows + self.root), torch.from_numpy(ok)


@dataclass
class PathBucket:
    """Branch rows whose own paths pad to one ``width``, in whole BRANCH_TILEs."""

    rows: np.ndarray     # [n] branch-token index (row - root); the last tile padded with rows[0]
    real: int            # rows[:real] are the bucket's own
    path: np.ndarray     # [n, width] each row's path (row - root), zero-padded
    ok: np.ndarray       # [n, width] bool: real path entries


class TokenTrie:
    """Token prefix tree of the branches; node 0 is the root's end."""

    def __init__(self):
        self.children: list[dict[int, int]] = [{}]
        self.token: list[int] = [-1]
        self.parent: list[int] = [-1]
        self.depth: list[int] = [-1]    # 0: a first token

    def walk(self, tokens: list[int], group: Hashable | None = None) -> list[int]:
        """The nodes of ``tokens`` below the root, added where missing; a group's first
        token is a node of its own, so the group shares rows only within itself."""
        node, nodes = 0, []
        for tok in tokens:
            key = (group, tok) if node == 0 and group is not None else tok
            child = self.children[node].get(key)
            if child is None:
                child = self.children[node][key] = len(self.token)
                self.children.append({})
                self.token.append(tok)
                self.parent.append(node)
                self.depth.append(self.depth[node] + 1)
            nodes.append(child)
            node = child
        return nodes

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Depth-first rows (row of node n, node 0 excluded: row -1) and each node's subtree
        end row."""
        row, end = [-1] * len(self.token), [0] * len(self.token)
        stack, next_row = [(0, False)], 0
        while stack:
            node, done = stack.pop()
            if done:
                end[node] = next_row
                continue
            if node:
                row[node], next_row = next_row, next_row + 1
            stack.append((node, True))
            stack.extend((c, False) for c in reversed(self.children[node].values()))
        return np.asarray(row, dtype=np.int64), np.asarray(end, dtype=np.int64)

    def layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Depth first: each node's row (node 0: -1), and per row its token, its depth (0:
        a first token), the end row of its subtree and its parent's row (-1: node 0)."""
        row, end = self.rows()
        n = len(self.token) - 1
        node_at = np.empty(n, dtype=np.int64)
        node_at[row[1:]] = np.arange(1, n + 1)
        parent = np.asarray(self.parent, dtype=np.int64)
        return (row, np.asarray(self.token, dtype=np.int64)[node_at],
                np.asarray(self.depth, dtype=np.int64)[node_at], end[node_at],
                row[parent[node_at]])


@dataclass
class BranchBlock:
    """The branches of a DocTree laid out after a root of any length: rows and positions
    relative to the root's end (row ``root + r``, position ``root + p``). Bulk jobs ask the
    same questions of every document, so one block is built once and placed after each
    document's root (``place``)."""

    ids: np.ndarray              # [branch tokens]
    pos: np.ndarray              # [branch tokens] position - root
    end: np.ndarray              # [branch tokens] end of the row's subtree, row - root
    parent: np.ndarray           # [branch tokens] the parent's row - root (-1: the root)
    readout_rows: np.ndarray     # [readouts] row - root (-1: the root's last token)
    # An option's logprob is the sum of its summands: (readout index, token id) pairs, listed
    # option after option; option k belongs to branch option_branch[k].
    term_readout: np.ndarray     # [summands] readout index
    term_token: np.ndarray       # [summands] the token whose logprob is read there
    term_option: np.ndarray      # [summands] option index within the document
    option_branch: np.ndarray    # [options] branch index
    n_branches: int
    n_scored: int                # option tokens read out (usage)
    # extraction branches: branch -> (readout index, its path rows (row - root), settings)
    extract: dict[int, tuple[int, list[int], dict]] = field(default_factory=dict)

    @classmethod
    def build(cls, branches: list[Branch]) -> BranchBlock:
        trie = TokenTrie()
        readout_nodes: list[int] = []       # 0: the root's last token
        term_readout: list[int] = []
        term_token: list[int] = []
        term_option: list[int] = []
        option_branch: list[int] = []
        extract: dict[int, tuple[int, int, dict]] = {}
        for b, br in enumerate(branches):
            nodes = trie.walk(br.prefix, br.group)
            # The first option token is predicted by the last template token (the root's
            # last token when the template has no text before its slot).
            shared = len(readout_nodes)
            readout_nodes.append(nodes[-1] if nodes else 0)
            if not br.options:   # an extraction slot: decoded later from this readout
                extract[b] = (shared, readout_nodes[-1], br.decode or {})
            for opt in br.options:
                k = len(option_branch)
                option_branch.append(b)
                term_readout.append(shared)
                term_token.append(opt[0])
                term_option.append(k)
                # a sub-branch holding all its tokens but the last
                for node, tok in zip(trie.walk(br.prefix + opt[:-1], br.group)[len(br.prefix):],
                                     opt[1:], strict=True):
                    readout_nodes.append(node)
                    term_readout.append(len(readout_nodes) - 1)
                    term_token.append(tok)
                    term_option.append(k)

        row, ids, pos, end, parent_row = trie.layout()

        def arr(values: list[int]) -> np.ndarray:
            return np.array(values, dtype=np.int64)

        def path(node: int) -> list[int]:   # the rows from the first branch token to node
            rows = []
            while node:
                rows.append(int(row[node]))
                node = trie.parent[node]
            return rows[::-1]

        return cls(ids, pos, end, parent_row, row[arr(readout_nodes)], arr(term_readout),
                   arr(term_token), arr(term_option), arr(option_branch), len(branches),
                   sum(len(o) for br in branches for o in br.options),
                   {b: (r, path(node), settings) for b, (r, node, settings) in extract.items()})

    @classmethod
    def unread(cls, trie: TokenTrie) -> tuple[BranchBlock, np.ndarray]:
        """The rows of ``trie`` with no options read out of them (a completion prompt's
        tails, engine/prompt_blocks.py), and each node's row."""
        row, ids, pos, end, parent_row = trie.layout()
        return cls.unread_rows(ids, pos, end, parent_row), row

    @classmethod
    def unread_rows(cls, ids: np.ndarray, pos: np.ndarray, end: np.ndarray,
                    parent: np.ndarray) -> BranchBlock:
        """Branch rows with no options read out of them, laid out already."""
        none = np.zeros(0, dtype=np.int64)
        return cls(ids, pos, end, parent, none, none, none, none, none, 0, 0)

    @classmethod
    def concat(cls, blocks: list[BranchBlock]) -> BranchBlock:
        """The blocks one after the other under one root: each keeps its own rows (no prefix
        is shared across blocks), its branches, options and readouts numbered after the
        previous blocks'. A row's bits depend only on its own path, so every block's figures
        are the ones it gets alone (engine/merge.py)."""
        rows = np.cumsum([0, *(len(b.ids) for b in blocks)])
        reads = np.cumsum([0, *(len(b.readout_rows) for b in blocks)])
        opts = np.cumsum([0, *(len(b.option_branch) for b in blocks)])
        brs = np.cumsum([0, *(b.n_branches for b in blocks)])

        def cat(values: list[np.ndarray]) -> np.ndarray:
            return np.concatenate([np.zeros(0, dtype=np.int64), *values])

        def shifted(name: str, by: np.ndarray) -> np.ndarray:   # -1 (the root) stays -1
            return cat([np.where(getattr(b, name) >= 0, getattr(b, name) + by[k], -1)
                        for k, b in enumerate(blocks)])

        return cls(
            cat([b.ids for b in blocks]), cat([b.pos for b in blocks]),
            cat([b.end + rows[k] for k, b in enumerate(blocks)]),
            shifted("parent", rows), shifted("readout_rows", rows),
            cat([b.term_readout + reads[k] for k, b in enumerate(blocks)]),
            cat([b.term_token for b in blocks]),
            cat([b.term_option + opts[k] for k, b in enumerate(blocks)]),
            cat([b.option_branch + brs[k] for k, b in enumerate(blocks)]),
            int(brs[-1]), sum(b.n_scored for b in blocks),
            {int(brs[k]) + br: (r + int(reads[k]), [p + int(rows[k]) for p in path], settings)
             for k, b in enumerate(blocks) for br, (r, path, settings) in b.extract.items()})

    @cached_property
    def option_start(self) -> np.ndarray:
        """[branches + 1]: branch b's options are [option_start[b], option_start[b + 1])."""
        return np.searchsorted(self.option_branch, np.arange(self.n_branches + 1))

    @cached_property
    def root_children(self) -> np.ndarray:
        """The branch tokens whose parent is the root (parent -1)."""
        return np.flatnonzero(self.parent < 0)

    @cached_property
    def top_position(self) -> int:
        """The last branch position - root (-1: no branch tokens, the root's last is)."""
        return int(self.pos.max()) if len(self.pos) else -1

    @cached_property
    def paths(self) -> tuple[np.ndarray, np.ndarray]:
        """Each row's path (row - root), filled from the row itself up to its first branch
        token, zero-padded to [branch tokens, L], and which entries are real."""
        n = len(self.ids)
        width = int(self.pos.max()) + 1 if n else 1
        rows = np.zeros((n, width), dtype=np.int64)
        ok = np.arange(width)[None, :] <= self.pos[:, None]
        at, col = np.arange(n), self.pos.copy()
        for _ in range(width):
            live = col >= 0
            rows[np.flatnonzero(live), col[live]] = at[live]
            at, col = np.where(live, self.parent[np.maximum(at, 0)], 0), col - 1
        return rows, ok

    @cached_property
    def path_buckets(self) -> list[PathBucket]:
        """The branch rows grouped by the width their own path pads to (a power of two, at
        least PATH_MIN), each group padded to whole BRANCH_TILEs. The CPU attention computes
        a tile of a group at a time, so a row is always reduced in a product of one shape
        (BRANCH_TILE rows, root + width keys) whatever other branches the tree holds."""
        return self.buckets(np.arange(len(self.ids)))

    def buckets(self, members: np.ndarray) -> list[PathBucket]:
        """``path_buckets`` of some branch rows only (those that see the same root)."""
        if not len(members):
            return []
        rows, ok = self.paths
        lengths = self.pos[members] + 1
        widths = np.maximum(PATH_MIN, 1 << np.ceil(np.log2(lengths)).astype(np.int64))
        buckets = []
        for width in np.unique(widths):
            chosen = members[widths == width]
            pad = -len(chosen) % BRANCH_TILE
            index = np.concatenate([chosen, np.full(pad, chosen[0])])
            path = np.zeros((len(index), width), dtype=np.int64)
            keep = np.zeros((len(index), width), dtype=bool)
            used = min(int(width), rows.shape[1])
            path[:, :used], keep[:, :used] = rows[index, :used], ok[index, :used]
            buckets.append(PathBucket(index, len(chosen), path, keep))
        return buckets

    def place(self, root_ids: list[int], pad_id: int) -> FlatDoc:
        """The FlatDoc of these branches after ``root_ids``."""
        root = len(root_ids)
        tokens = root + len(self.ids)
        length = tokens + -tokens % ROW_TILE
        # the root's rows, the branches' after them, then the padding rows
        ids = np.full(length, pad_id, dtype=np.int64)
        ids[:root], ids[root:tokens] = root_ids, self.ids
        positions = np.zeros(length, dtype=np.int64)
        positions[:root], positions[root:tokens] = np.arange(root), self.pos + root
        span_end = np.arange(1, length + 1, dtype=np.int32)   # a padding row: itself only
        span_end[:root], span_end[root:tokens] = tokens, self.end + root
        readout_rows = np.zeros(len(self.readout_rows) + -len(self.readout_rows) % READOUT_TILE,
                                dtype=np.int64)
        readout_rows[:len(self.readout_rows)] = self.readout_rows + root
        return FlatDoc(
            input_ids=torch.from_numpy(ids),
            positions=torch.from_numpy(positions),
            root=root,
            tokens=tokens,
            span_end=span_end,
            block=self,
            readout_rows=torch.from_numpy(readout_rows),
            extract={b: (r, [*range(root), *(root + p for p in path)], settings)
                     for b, (r, path, settings) in self.extract.items()},
            last_position=root + self.top_position,
        )

    def place_on_kept(self, kept, pad_id: int) -> FlatDoc:
        """The FlatDoc of these branches under a root kept from an earlier pass
        (engine/root_cache.KeptRoot): their rows alone, at the positions ``place`` gives them
        after a root of ``kept.rows`` tokens."""
        tokens = len(self.ids)
        length = tokens + -tokens % ROW_TILE
        ids = np.full(length, pad_id, dtype=np.int64)
        ids[:tokens] = self.ids
        positions = np.zeros(length, dtype=np.int64)
        positions[:tokens] = self.pos + kept.rows
        span_end = np.arange(1, length + 1, dtype=np.int32)
        span_end[:tokens] = self.end
        readout_rows = np.zeros(len(self.readout_rows) + -len(self.readout_rows) % READOUT_TILE,
                                dtype=np.int64)
        readout_rows[:len(self.readout_rows)] = self.readout_rows
        # an extraction slot's context: the kept root's rows, then its branch's (the rows of
        # the keys and values the pass keeps for this document: runner.ModelRunner.launch)
        extract = {b: (r, [*range(kept.rows), *(kept.rows + p for p in path)], settings)
                   for b, (r, path, settings) in self.extract.items()}
        return FlatDoc(input_ids=torch.from_numpy(ids), positions=torch.from_numpy(positions),
                       root=0, tokens=tokens, span_end=span_end, block=self,
                       readout_rows=torch.from_numpy(readout_rows), extract=extract,
                       last_position=kept.rows + self.top_position, kept_root=kept)


@dataclass
class DocTree:
    root: list[int]
    branches: list[Branch] = field(default_factory=list)

    def flatten(self, pad_id: int) -> FlatDoc:
        return BranchBlock.build(self.branches).place(self.root, pad_id)

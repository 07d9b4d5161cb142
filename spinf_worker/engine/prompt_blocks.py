"""Completion prompts as paths of blocks and tails: prompts that begin alike read it once.

A prompt's whole blocks (PROMPT_BLOCK tokens each) are laid out a block at a time, each on a
block boundary of its document, whether the prompt is alone or beside others; the tokens after
its last whole block, its tail, come after all the blocks, token by token, the way a question's
tokens come after a document's root (engine/layout.py). A block row attends to its path block
by block: every block before its own whole, its own causally, in position order and in shapes
that depend only on the row's depth (kernels/attention.py on the CPU; on CUDA the block masks
visit the same blocks, kernels/flex_tree.py). A tail row sees the blocks its prompt's last
whole block (its anchor) sees, and its own tail token by token (the CPU's branch tiles; on
CUDA kernels/branch_paths.py). So a row's keys, values and logits depend only on its prompt's
tokens up to itself, and prompts of one pass whose leading blocks hold the same tokens
(lm-evaluation-harness: one request per option, the same context each time) share those
blocks, and the leading tokens of their tails too: they are laid out once, as a trie of blocks
with a token trie of tails under each anchor, and each prompt's readouts are cut out of the
shared ones with the bits it gets alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ..tiles import PROMPT_BLOCK, READOUT_TILE, ROW_TILE, BlockChain
from .layout import BranchBlock, EchoReadout, FlatDoc, TokenTrie


@dataclass
class Prompt:
    """One completion prompt to read: its tokens, read out at rows ``first..len(ids) - 1``,
    each readout with its ``top`` most likely tokens."""

    ids: list[int]
    first: int
    top: int

    @cached_property
    def chain(self) -> BlockChain:
        return BlockChain.of(self.ids, self.top)


@dataclass
class PromptBlocks:
    """The prompts of a FlatDoc as a trie of blocks, depth first (block b is rows
    ``[b * PROMPT_BLOCK, (b + 1) * PROMPT_BLOCK)`` and a block's descendants are the blocks
    right after it), then their tails (FlatDoc.block: rows from FlatDoc.root on)."""

    prompts: list[Prompt]
    parent: np.ndarray           # [blocks] the block before it on its path (-1: a first block)
    depth: np.ndarray            # [blocks] its place on its path (position // PROMPT_BLOCK)
    anchor: np.ndarray           # [tail rows] the block whose path a tail row sees (-1: none)
    # per prompt, its readouts (rows first..len(ids) - 1 of its path) as indices into the
    # document's readouts (FlatDoc.echo): a row shared by prompts is read out once, or once
    # per token that follows it where their paths part after it
    readouts: list[np.ndarray]

    @cached_property
    def paths(self) -> list[np.ndarray]:
        """Per block, the rows of its path's blocks in position order (its own last)."""
        out: list[np.ndarray] = []
        for b, up in enumerate(self.parent.tolist()):
            own = np.arange(b * PROMPT_BLOCK, (b + 1) * PROMPT_BLOCK, dtype=np.int64)
            out.append(own if up < 0 else np.concatenate([out[up], own]))
        return out

    @cached_property
    def tail_groups(self) -> list[tuple[int, np.ndarray]]:
        """The tail rows (row - FlatDoc.root) under each anchor block, anchors in block
        order: the rows that see the same blocks."""
        return [(int(a), np.flatnonzero(self.anchor == a)) for a in np.unique(self.anchor)]

    def block_view(self, root: int) -> np.ndarray:
        """[real rows] the row whose view of the blocks each row has: itself, or for a tail row
        its anchor's last row (-1: a tail with no block before it sees none)."""
        view = np.arange(root + len(self.anchor), dtype=np.int64)
        view[root:root + len(self.anchor)] = np.where(
            self.anchor >= 0, (self.anchor + 1) * PROMPT_BLOCK - 1, -1)
        return view


def lay_out(prompts: list[Prompt], pad_id: int) -> FlatDoc:
    """One FlatDoc of ``prompts`` (all with the same top-N): the blocks they have in common
    laid out once, and under each block the tails that go on from it as one token trie."""
    assert len({p.top for p in prompts}) == 1, "prompts of one document share their top-N"
    return _alone(prompts[0], pad_id) if len(prompts) == 1 else _shared(prompts, pad_id)


def _alone(prompt: Prompt, pad_id: int) -> FlatDoc:
    """``_shared`` of one prompt, without the tries (every request's prompt is laid out
    alone first): its tokens row after row, each row read out once."""
    n, whole = len(prompt.ids), len(prompt.ids) - len(prompt.ids) % PROMPT_BLOCK
    blocks, tail = whole // PROMPT_BLOCK, n - whole
    ids = np.full(n + -n % ROW_TILE, pad_id, dtype=np.int64)
    ids[:n] = prompt.ids
    positions = np.zeros(len(ids), dtype=np.int64)
    positions[:n] = np.arange(n)
    span_end = np.arange(1, len(ids) + 1, dtype=np.int32)
    span_end[:whole], span_end[whole:n] = whole, n
    tails = BranchBlock.unread_rows(ids[whole:n], np.arange(tail), np.full(tail, tail),
                                    np.arange(tail) - 1)
    read = np.arange(prompt.first, n, dtype=np.int64)
    return _flat(ids, positions, span_end, whole, tails, read,
                 np.append(ids[prompt.first + 1:n], -1),
                 PromptBlocks([prompt], np.arange(blocks) - 1, np.arange(blocks),
                              np.full(tail, blocks - 1), [np.arange(len(read))]))


def _flat(ids: np.ndarray, positions: np.ndarray, span_end: np.ndarray, root: int,
          tails: BranchBlock, read_rows: np.ndarray, read_next: np.ndarray,
          prompts: PromptBlocks) -> FlatDoc:
    """The FlatDoc of a layout: its rows, its tails after ``root``, its readouts ((row,
    token after it) pairs, each once)."""
    pad = -len(read_rows) % READOUT_TILE
    flat = FlatDoc(
        input_ids=torch.from_numpy(ids), positions=torch.from_numpy(positions),
        root=root, tokens=root + len(tails.ids), span_end=span_end, block=tails,
        readout_rows=torch.from_numpy(np.concatenate([read_rows, np.zeros(pad, np.int64)])),
        echo=EchoReadout(prompts.prompts[0].top, np.ascontiguousarray(read_next)))
    flat.prompts = prompts
    return flat


def _shared(prompts: list[Prompt], pad_id: int) -> FlatDoc:
    children: list[dict[tuple[int, ...], int]] = [{}]   # node 0: before the first block
    tokens: list[tuple[int, ...]] = [()]
    walks = []
    for prompt in prompts:
        node, walk = 0, []
        for lo in range(0, len(prompt.ids) - len(prompt.ids) % PROMPT_BLOCK, PROMPT_BLOCK):
            key = tuple(prompt.ids[lo:lo + PROMPT_BLOCK])
            child = children[node].get(key)
            if child is None:
                child = children[node][key] = len(tokens)
                children.append({})
                tokens.append(key)
            walk.append(child)
            node = child
        walks.append(walk)
    # depth first, children in the order they came: node -> block
    block_of = np.full(len(tokens), -1, dtype=np.int64)
    parent, depth, subtree_end = [], [], {}
    stack: list[tuple[int, int, int, bool]] = [(c, -1, 0, False)
                                               for c in reversed(children[0].values())]
    while stack:
        node, up, d, done = stack.pop()
        if done:
            subtree_end[node] = len(parent)
            continue
        block_of[node] = len(parent)
        parent.append(up)
        depth.append(d)
        stack.append((node, up, d, True))
        stack.extend((c, int(block_of[node]), d + 1, False)
                     for c in reversed(children[node].values()))
    root = len(parent) * PROMPT_BLOCK

    # the tails: one token trie, its first tokens keyed by their anchor, anchors in block
    # order (a tail query block then spans few anchors' paths)
    anchors = [int(block_of[walk[-1]]) if walk else -1 for walk in walks]
    trie, tail_nodes = TokenTrie(), [[] for _ in prompts]
    for i in sorted(range(len(prompts)), key=anchors.__getitem__):
        tail_nodes[i] = trie.walk(prompts[i].ids[len(walks[i]) * PROMPT_BLOCK:], anchors[i])
    tails, tail_row = BranchBlock.unread(trie)
    anchor = np.empty(len(tails.ids), dtype=np.int64)
    for i, nodes in enumerate(tail_nodes):
        anchor[tail_row[nodes]] = anchors[i]
    tokens_end = root + len(tails.ids)
    rows = tokens_end + -tokens_end % ROW_TILE
    ids = np.full(rows, pad_id, dtype=np.int64)
    positions = np.zeros(rows, dtype=np.int64)
    # a padding row's subtree is itself; a block row's runs to its block's last descendant
    span_end = np.arange(1, rows + 1, dtype=np.int32)
    for node in range(1, len(tokens)):
        b = int(block_of[node])
        at = slice(b * PROMPT_BLOCK, (b + 1) * PROMPT_BLOCK)
        ids[at] = tokens[node]
        positions[at] = depth[b] * PROMPT_BLOCK + np.arange(PROMPT_BLOCK)
        span_end[at] = subtree_end[node] * PROMPT_BLOCK
    # a tail's positions go on from its anchor's (its blocks' count: the anchor's depth + 1)
    blocks_before = np.asarray([-1, *depth], dtype=np.int64)[anchor + 1] + 1
    ids[root:tokens_end] = tails.ids
    positions[root:tokens_end] = blocks_before * PROMPT_BLOCK + tails.pos
    span_end[root:tokens_end] = root + tails.end

    # readouts: (row, token after it) pairs, each once
    read_rows, read_next, counts = [], [], []
    for prompt, walk, nodes in zip(prompts, walks, tail_nodes, strict=True):
        in_blocks = (block_of[np.asarray(walk, dtype=np.int64)][:, None] * PROMPT_BLOCK
                     + np.arange(PROMPT_BLOCK)).reshape(-1)
        row_of = np.concatenate([in_blocks, root + tail_row[np.asarray(nodes, dtype=np.int64)]])
        read_rows.append(row_of[prompt.first:])
        read_next.append(np.asarray([*prompt.ids[prompt.first + 1:], -1], dtype=np.int64))
        counts.append(len(prompt.ids) - prompt.first)
    # each pair as one integer in (row, token) order: a 1-D unique, several times faster
    # than one over rows of pairs, in the same order
    rows_read, next_read = np.concatenate(read_rows), np.concatenate(read_next)
    span = int(next_read.max()) + 2            # tokens + 1 (-1: none)
    keys, inverse = np.unique(rows_read * span + next_read + 1, return_inverse=True)
    inverse = inverse.reshape(-1)
    return _flat(ids, positions, span_end, root, tails, keys // span, keys % span - 1,
                 PromptBlocks(list(prompts), np.asarray(parent, dtype=np.int64),
                              np.asarray(depth, dtype=np.int64), anchor,
                              np.split(inverse, np.cumsum(counts)[:-1])))

"""Completion prompts as paths of blocks: prompts that begin with the same blocks read them once.

A prompt's rows are laid out PROMPT_BLOCK at a time, each block on a block boundary of its
document (the last one padded), whether the prompt is alone or beside others. A row attends to
its own path block by block: every block before its own whole, its own causally, in position
order and in shapes that depend only on the row's depth (kernels/attention.py on the CPU; on
CUDA the block masks visit the same blocks, kernels/flex_tree.py). So a row's keys, values and
logits depend only on its prompt's tokens up to the end of its block, and prompts of one pass
whose leading blocks hold the same tokens (lm-evaluation-harness: one request per option, the
same context each time) share those blocks: they are laid out once, as a trie of blocks, and
each prompt's readouts are cut out of the shared ones with the bits it gets alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ..tiles import PROMPT_BLOCK, READOUT_TILE, BlockChain
from .layout import BranchBlock, EchoReadout, FlatDoc

_NO_BRANCHES = BranchBlock.build([])


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
    """The prompts of a FlatDoc as a trie of blocks, depth first: block b is rows
    ``[b * PROMPT_BLOCK, (b + 1) * PROMPT_BLOCK)`` and a block's descendants are the blocks
    right after it."""

    prompts: list[Prompt]
    parent: np.ndarray           # [blocks] the block before it on its path (-1: a first block)
    depth: np.ndarray            # [blocks] its place on its path (position // PROMPT_BLOCK)
    real: np.ndarray             # [rows] bool: the rows holding tokens (the rest is padding)
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


def lay_out(prompts: list[Prompt], pad_id: int) -> FlatDoc:
    """One FlatDoc of ``prompts`` (all with the same top-N), the blocks they have in common
    laid out once."""
    assert len({p.top for p in prompts}) == 1, "prompts of one document share their top-N"
    children: list[dict[tuple[int, ...], int]] = [{}]   # node 0: before the first block
    tokens: list[tuple[int, ...]] = [()]
    walks = []
    for prompt in prompts:
        node, walk = 0, []
        for lo in range(0, len(prompt.ids), PROMPT_BLOCK):
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
    n_blocks = len(parent)
    rows = n_blocks * PROMPT_BLOCK
    ids = np.full(rows, pad_id, dtype=np.int64)
    positions = np.zeros(rows, dtype=np.int64)
    real = np.zeros(rows, dtype=bool)
    # a padding row's subtree is itself; a real row's runs to its block's last descendant
    # (a block with none: its last token, so its padding rows are nobody's descendants)
    span_end = np.arange(1, rows + 1, dtype=np.int32)
    for node in range(1, len(tokens)):
        b, fill = int(block_of[node]), len(tokens[node])
        at = slice(b * PROMPT_BLOCK, b * PROMPT_BLOCK + fill)
        ids[at] = tokens[node]
        positions[at] = depth[b] * PROMPT_BLOCK + np.arange(fill)
        real[at] = True
        last = subtree_end[node]
        span_end[at] = last * PROMPT_BLOCK if last > b + 1 else b * PROMPT_BLOCK + fill

    # readouts: (row, token after it) pairs, each once
    read_rows, read_next, counts = [], [], []
    for prompt, walk in zip(prompts, walks, strict=True):
        j = np.arange(prompt.first, len(prompt.ids), dtype=np.int64)
        read_rows.append(block_of[np.asarray(walk)][j // PROMPT_BLOCK] * PROMPT_BLOCK
                         + j % PROMPT_BLOCK)
        read_next.append(np.asarray([*prompt.ids[prompt.first + 1:], -1], dtype=np.int64))
        counts.append(len(j))
    # each pair as one integer in (row, token) order: a 1-D unique, several times faster
    # than one over rows of pairs, in the same order
    rows_read, next_read = np.concatenate(read_rows), np.concatenate(read_next)
    span = int(next_read.max()) + 2            # tokens + 1 (-1: none)
    keys, inverse = np.unique(rows_read * span + next_read + 1, return_inverse=True)
    pairs = np.stack([keys // span, keys % span - 1], axis=1)
    inverse = inverse.reshape(-1)
    pad = -len(pairs) % READOUT_TILE
    tokens_end = int(np.flatnonzero(real)[-1]) + 1
    flat = FlatDoc(
        input_ids=torch.from_numpy(ids), positions=torch.from_numpy(positions),
        root=tokens_end, tokens=tokens_end, span_end=span_end, block=_NO_BRANCHES,
        readout_rows=torch.from_numpy(np.concatenate([pairs[:, 0], np.zeros(pad, np.int64)])),
        echo=EchoReadout(prompts[0].top, np.ascontiguousarray(pairs[:, 1])))
    flat.prompts = PromptBlocks(list(prompts), np.asarray(parent, dtype=np.int64),
                                np.asarray(depth, dtype=np.int64), real,
                                np.split(inverse, np.cumsum(counts)[:-1]))
    return flat

"""Documents of one pass that share a root, read once.

Two documents with the same root tokens and the same media (a client that sends one question
per request about the same text, the floors of several queries) need the root's rows only
once: their branch blocks go one after the other under one root (``BranchBlock.concat``), and
each document's scores are cut back out of the merged document's. A branch row's keys, values
and logits depend only on the root and its own path, so every document keeps the bits it has
alone. Completion prompts of one pass that begin with the same block are laid out together
as a trie of blocks and tails (engine/prompt_blocks.py), and each one's readouts are cut back
out. The
packer counts a merged document's rows (engine/packer.py); the scheduler merges a pass's
documents before it runs and splits their scores after (engine/scheduler.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch

from ..tiles import BlockChain
from .layout import BranchBlock, FlatDoc
from .prompt_blocks import lay_out
from .runner import DocScores


def root_key(doc: FlatDoc, window: int) -> Hashable | None:
    """What documents must share to be merged (None: never merged). A completion prompt: its
    blocks (prompts merge on their first block, or on having none, and share all the leading
    blocks and tail tokens they have in common). Whether the sliding window cuts a scoring
    document picks the CPU attention's masks, so only documents that agree on it merge."""
    if doc.prompts is not None:
        (prompt,) = doc.prompts.prompts
        return prompt.chain
    return (doc.input_ids[:doc.root].numpy().tobytes(), doc.max_position >= window,
            tuple((m.start, m.end, m.kind, m.frame, _digest(m.pixels)) for m in doc.media))


def _digest(value: object) -> str:
    """A media part's decoded pixels (or audio features) as a hash, so equal media compare
    equal however they were sent."""
    h = hashlib.blake2b(digest_size=16)

    def feed(v: object) -> None:
        if isinstance(v, torch.Tensor):
            v = v.detach().cpu().contiguous().numpy()
        if isinstance(v, np.ndarray):
            h.update(f"{v.dtype}{v.shape}".encode())
            h.update(v.tobytes())
        elif isinstance(v, (tuple, list)):
            for part in v:
                feed(part)
        else:
            h.update(repr(v).encode())

    feed(value)
    return h.hexdigest()


@dataclass
class Part:
    """One document's share of a merged document: its branches and options start here."""

    branch: int
    option: int
    block: BranchBlock


@dataclass
class PromptPart:
    """One completion prompt's share of a merged document: its readouts there."""

    readouts: np.ndarray


def merge(docs: list[FlatDoc], keys: list[Hashable | None], pad_id: int
          ) -> list[tuple[FlatDoc, list[tuple[int, Part | PromptPart | None]]]]:
    """The pass's documents with those of one key merged (in the place of the first): per
    merged document, its members (index into ``docs``, their part)."""
    groups: dict[Hashable, list[int]] = {}
    order: list[list[int]] = []
    for i, key in enumerate(keys):
        if isinstance(key, BlockChain):
            key = key.group
        if key is not None and key in groups:
            groups[key].append(i)
            continue
        order.append([i])
        if key is not None:
            groups[key] = order[-1]
    return [(docs[m[0]], [(m[0], None)]) if len(m) == 1 else _merged(docs, m, pad_id)
            for m in order]


def _merged(docs: list[FlatDoc], members: list[int], pad_id: int
            ) -> tuple[FlatDoc, list[tuple[int, Part | PromptPart | None]]]:
    first = docs[members[0]]
    if first.prompts is not None:
        flat = lay_out([docs[i].prompts.prompts[0] for i in members], pad_id)
        return flat, [(i, PromptPart(readouts))
                      for i, readouts in zip(members, flat.prompts.readouts, strict=True)]
    blocks = [docs[i].block for i in members]
    if first.kept_root is not None:    # a root kept from an earlier pass (root_cache.py)
        flat = BranchBlock.concat(blocks).place_on_kept(first.kept_root, pad_id)
    else:
        flat = BranchBlock.concat(blocks).place(first.input_ids[:first.root].tolist(), pad_id)
    flat.media = first.media
    parts, branch, option = [], 0, 0
    for i, block in zip(members, blocks, strict=True):
        parts.append((i, Part(branch, option, block)))
        branch, option = branch + block.n_branches, option + len(block.option_branch)
    return flat, parts


def split(scores: DocScores, part: Part | PromptPart | None) -> DocScores:
    """A member's scores cut out of its merged document's (``None``: not merged)."""
    if part is None:
        return scores
    if isinstance(part, PromptPart):
        return dataclasses.replace(scores, echo=tuple(a[part.readouts] for a in scores.echo))
    block, b, o = part.block, part.branch, part.option
    n_b, n_o = block.n_branches, len(block.option_branch)
    return DocScores(scores.option_logprobs[o:o + n_o], block.option_start,
                     scores.residual[b:b + n_b],
                     {k - b: v for k, v in scores.found.items() if b <= k < b + n_b},
                     probs=None if scores.probs is None else scores.probs[o:o + n_o])

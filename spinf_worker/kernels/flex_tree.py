"""Packed tree attention on CUDA through FlexAttention.

The tree rule becomes a ``mask_mod`` over per-token tensors of the pass (document, branch,
option sub-branch, position). Which 128-token key blocks each query block visits comes from
per-block summaries of the tree (``tree_blocks``: a few [blocks, blocks] comparisons, not
the dense [rows, rows] mask), so a document's key blocks are the same tiles, visited in the
same order, wherever the 128-aligned document lands in the pass. Passes are padded to a few
fixed sizes so the compiled kernels are reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

BLOCK = 128
# Heads wider than 256 (Gemma 4's global layers: 512): FlexAttention's default tiles ask for
# more shared memory than an H100/H200 has, so smaller ones are named (fixed, whatever the
# pass: a document's reduction order stays the same wherever it lands).
WIDE_HEAD_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 2, "num_warps": 8}


@dataclass
class TreeTokens:
    """Per-row tensors of a pass, on the device. ids are unique across the pass; -1 = none."""

    doc: torch.Tensor      # -1 for padding rows
    branch: torch.Tensor   # -1 for root rows
    option: torch.Tensor   # -1 outside option sub-branches
    pos: torch.Tensor

    @classmethod
    def of_pass(cls, inputs: torch.Tensor) -> TreeTokens:
        """From a pass's [5, rows] rows (engine/runner.pass_rows): ids, positions, document,
        branch, option."""
        return cls(inputs[2], inputs[3], inputs[4], inputs[1])


@dataclass
class FlexPlan:
    full: BlockMask
    window: BlockMask


def build_flex_plan(tokens: TreeTokens, window: int) -> FlexPlan:
    doc, branch, option, pos = tokens.doc, tokens.branch, tokens.option, tokens.pos

    def visible(b, h, q, k):
        on_path = (branch[k] < 0) | ((branch[k] == branch[q])
                                     & ((option[k] < 0) | (option[k] == option[q])))
        tree = (doc[q] == doc[k]) & (doc[q] >= 0) & on_path & (pos[k] <= pos[q])
        # A padding row sees itself only, so no row is fully masked.
        return tree | ((doc[q] < 0) & (q == k))

    def visible_in_window(b, h, q, k):
        return visible(b, h, q, k) & (pos[q] - pos[k] < window)

    return FlexPlan(_block_mask(tokens, visible, None),
                    _block_mask(tokens, visible_in_window, window))


def _block_mask(tokens: TreeTokens, mask_mod, window: int | None) -> BlockMask:
    """Each query block visits its kept key blocks in block order; ``mask_mod`` decides
    inside each block."""
    n = tokens.doc.shape[0]
    keep = tree_blocks(tokens, window)
    counts = keep.sum(1, dtype=torch.int32)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True).to(torch.int32)
    return BlockMask.from_kv_blocks(counts[None, None], order[None, None], BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(n, n),
                                    compute_q_blocks=False)


def tree_blocks(tokens: TreeTokens, window: int | None) -> torch.Tensor:
    """[blocks, blocks] bool: (query block, key block) pairs kept because their document,
    branch ranges and positions allow some query to see some key: a superset of the exact
    rule that depends only on the document's own blocks."""
    n = tokens.doc.shape[0]
    nb = n // BLOCK
    doc, branch, pos = (t.view(nb, BLOCK) for t in (tokens.doc, tokens.branch, tokens.pos))
    real = doc >= 0
    big = torch.iinfo(torch.int32).max
    block_doc = doc.amax(1)                 # a document's rows never share a block with another's
    in_branch = real & (branch >= 0)
    has_root = (real & (branch < 0)).any(1)
    br_lo = torch.where(in_branch, branch, big).amin(1)
    br_hi = torch.where(in_branch, branch, -1).amax(1)
    pos_lo = torch.where(real, pos, big).amin(1)
    pos_hi = torch.where(real, pos, -1).amax(1)
    q, k = (slice(None), None), (None, slice(None))
    keep = ((block_doc[q] == block_doc[k]) & (block_doc[q] >= 0)
            & (pos_lo[k] <= pos_hi[q])                                    # causal
            & (has_root[k] | ((br_lo[q] <= br_hi[k]) & (br_lo[k] <= br_hi[q]))))
    if window is not None:
        keep &= pos_lo[q] - pos_hi[k] < window
    return keep | (torch.eye(nb, dtype=torch.bool, device=keep.device) & (block_doc < 0)[q])


@cache
def _compiled_flex():
    # One compiled kernel per (pass bucket, head layout): allow more than dynamo's default.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


def flex_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FlexPlan, *,
                        sliding: bool, scale: float) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]."""
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    options = WIDE_HEAD_OPTIONS if q.shape[-1] > 256 else None
    out = _compiled_flex()(qh, kh, vh, block_mask=plan.window if sliding else plan.full,
                           scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                           kernel_options=options)
    return out[0].transpose(0, 1)

"""Packed tree attention on CUDA through FlexAttention.

The tree rule becomes a ``mask_mod`` over per-token tensors of the pass (document, branch,
option sub-branch, position); ``create_block_mask`` turns it into a block-sparse mask with
128-token blocks, so a document's key blocks are the same tiles, visited in the same order,
wherever the 128-aligned document lands in the pass. Passes are padded to a few fixed sizes
so the compiled kernels are reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

BLOCK = 128


@dataclass
class TreeTokens:
    """Per-row tensors of a pass, on the device. ids are unique across the pass; -1 = none."""

    doc: torch.Tensor      # -1 for padding rows
    branch: torch.Tensor   # -1 for root rows
    option: torch.Tensor   # -1 outside option sub-branches
    pos: torch.Tensor


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

    n = doc.shape[0]
    kwargs = dict(B=None, H=None, Q_LEN=n, KV_LEN=n, device=doc.device, BLOCK_SIZE=BLOCK,
                  _compile=True)
    return FlexPlan(create_block_mask(visible, **kwargs),
                    create_block_mask(visible_in_window, **kwargs))


@cache
def _compiled_flex():
    # One compiled kernel per (pass bucket, head layout): allow more than dynamo's default.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


def flex_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FlexPlan, *,
                        sliding: bool, scale: float) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]."""
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = _compiled_flex()(qh, kh, vh, block_mask=plan.window if sliding else plan.full,
                           scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)

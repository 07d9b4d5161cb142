"""Packed tree attention on CUDA through FlexAttention.

The tree rule becomes a ``mask_mod`` over per-token tensors of the pass (each row's subtree
end and position). Which 128-token key blocks each query block visits, and in which of them
every query sees every key (no ``mask_mod`` needed), comes from per-block summaries of the
tree (``tree_blocks``: a few [blocks, blocks] comparisons, not the dense [rows, rows] mask),
so a document's key blocks are the same tiles, visited in the same order, wherever the
128-aligned document lands in the pass. Passes are padded to a few
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
    """Per-row tensors of a pass, on the device."""

    doc: torch.Tensor      # document index, -1 for padding rows
    end: torch.Tensor      # end of the row's subtree (pass rows): k is on q's path iff k <= q < end[k]
    pos: torch.Tensor

    @classmethod
    def of_pass(cls, inputs: torch.Tensor) -> TreeTokens:
        """From a pass's [4, rows] rows (engine/runner.pass_rows): ids, positions, document,
        subtree end."""
        return cls(inputs[2], inputs[3], inputs[1])


@dataclass
class FlexPlan:
    full: BlockMask
    window: BlockMask


def build_flex_plan(tokens: TreeTokens, window: int) -> FlexPlan:
    return FlexPlan(_block_mask(tokens, tree_mask(tokens, None), None),
                    _block_mask(tokens, tree_mask(tokens, window), window))


def tree_mask(tokens: TreeTokens, window: int | None):
    """The ``mask_mod`` of the tree rule (and the window, if any) over the pass's rows."""
    end, pos = tokens.end, tokens.pos

    def visible(b, h, q, k):
        # Rows follow the tree depth first, so q's ancestors are the rows k before it whose
        # subtree reaches it; a padding row's subtree is itself only.
        return (k <= q) & (q < end[k])

    def visible_in_window(b, h, q, k):
        return visible(b, h, q, k) & (pos[q] - pos[k] < window)

    return visible if window is None else visible_in_window


def _block_mask(tokens: TreeTokens, mask_mod, window: int | None) -> BlockMask:
    """Each query block visits its partial key blocks, then its full ones (no ``mask_mod``
    there), each list in block order."""
    n = tokens.doc.shape[0]
    keep, full = tree_blocks(tokens, window)
    partial = keep & ~full

    def listed(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = blocks.sum(1, dtype=torch.int32)
        order = torch.argsort((~blocks).to(torch.int8), dim=1, stable=True).to(torch.int32)
        return counts[None, None], order[None, None]

    return BlockMask.from_kv_blocks(*listed(partial), *listed(full), BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(n, n),
                                    compute_q_blocks=False)


def tree_blocks(tokens: TreeTokens, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two [blocks, blocks] bool tensors over (query block, key block) pairs: ``keep``, the
    pairs where some query may see some key (a superset of the exact rule that depends only
    on the document's own blocks), and ``full``, those where every query sees every key."""
    n = tokens.doc.shape[0]
    nb = n // BLOCK
    doc, end, pos = (t.view(nb, BLOCK) for t in (tokens.doc, tokens.end, tokens.pos))
    row = torch.arange(n, device=doc.device, dtype=end.dtype).view(nb, BLOCK)
    real = doc >= 0
    big = torch.iinfo(torch.int32).max

    def lo(t: torch.Tensor) -> torch.Tensor:
        return torch.where(real, t, big).amin(1)

    def hi(t: torch.Tensor) -> torch.Tensor:
        return torch.where(real, t, -1).amax(1)

    block_doc = doc.amax(1)                 # a document's rows never share a block with another's
    row_lo, row_hi = lo(row), hi(row)
    q, k = (slice(None), None), (None, slice(None))
    keep = ((block_doc[q] == block_doc[k]) & (block_doc[q] >= 0)
            & (row_lo[k] <= row_hi[q]) & (hi(end)[k] > row_lo[q]))
    all_real = real.all(1)
    full = (keep & all_real[q] & all_real[k]
            & (row_hi[k] <= row_lo[q]) & (lo(end)[k] > row_hi[q]))
    if window is not None:
        pos_lo, pos_hi = lo(pos), hi(pos)
        keep &= pos_lo[q] - pos_hi[k] < window
        full &= pos_hi[q] - pos_lo[k] < window
    keep |= torch.eye(nb, dtype=torch.bool, device=keep.device) & (block_doc < 0)[q]
    return keep, full


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

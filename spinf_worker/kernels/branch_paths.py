"""A branch row's attention to its own path, merged into its attention to the root (CUDA).

FlexAttention computes each row's attention to its document's root (kernels/flex_tree.py). A
branch row (a token of a question) also sees its own path: the branch tokens from the
question's first token down to itself. Here one program per row walks that path
through the rows' parents, one key at a time with an online softmax in fp32, and merges the
result with FlexAttention's root part through the two log-sum-exps. A row's reduction thus
depends on its root and its own path alone, never on the other questions laid out beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from .flex_tree import TreeTokens


@triton.jit
def _branch_path_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, parent_ptr, root_end_ptr, pos_ptr,
                        q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                        o_stride_t, o_stride_h, lse_stride_h, scale, window,
                        HEADS: tl.constexpr, HEADS_P2: tl.constexpr, GROUP: tl.constexpr,
                        HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, WINDOWED: tl.constexpr):
    row = tl.program_id(0)
    # root and padding rows keep FlexAttention's output
    if row >= tl.load(root_end_ptr + row):
        h = tl.arange(0, HEADS_P2)
        d = tl.arange(0, DIM_P2)
        tile_ok = (h < HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        kv_offsets = (h // GROUP)[:, None] * k_stride_h + d[None, :]
        vv_offsets = (h // GROUP)[:, None] * v_stride_h + d[None, :]
        q = tl.load(q_ptr + row * q_stride_t + h[:, None] * q_stride_h + d[None, :],
                    mask=tile_ok, other=0.0).to(tl.float32)
        q_pos = tl.load(pos_ptr + row)
        m = tl.full([HEADS_P2], float("-inf"), tl.float32)
        total = tl.zeros([HEADS_P2], tl.float32)
        acc = tl.zeros([HEADS_P2, DIM_P2], tl.float32)
        key = row
        while key >= 0:     # the row itself, then its parents up to its first branch token
            up = tl.load(parent_ptr + key)
            k = tl.load(k_ptr + key * k_stride_t + kv_offsets, mask=tile_ok,
                        other=0.0).to(tl.float32)
            v = tl.load(v_ptr + key * v_stride_t + vv_offsets, mask=tile_ok,
                        other=0.0).to(tl.float32)
            s = tl.sum(q * k, axis=1) * scale
            if WINDOWED:
                s = tl.where(q_pos - tl.load(pos_ptr + key) < window, s, float("-inf"))
            m_new = tl.maximum(m, s)
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            total = total * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v
            m = m_new
            key = up
        o_ptrs = o_ptr + row * o_stride_t + h[:, None] * o_stride_h + d[None, :]
        o_root = tl.load(o_ptrs, mask=tile_ok, other=0.0).to(tl.float32)
        lse_root = tl.load(lse_ptr + h * lse_stride_h + row, mask=h < HEADS,
                           other=float("-inf"))
        top = tl.maximum(lse_root, m)
        w_root = tl.exp(lse_root - top)     # 0 where no root key is visible (sliding window)
        w_path = tl.exp(m - top)
        root_part = tl.where(w_root[:, None] > 0, o_root * w_root[:, None], 0.0)
        out = (root_part + acc * w_path[:, None]) / (w_root + total * w_path)[:, None]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=tile_ok)


def add_branch_paths(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, tokens: TreeTokens, window: int | None,
                     scale: float) -> None:
    """Merge each branch row's own-path attention into ``out`` in place. q: [T, Hq, D]; k/v:
    [T, Hkv, D]; out: [T, Hq, D], the root part; lse: [Hq, T], its log-sum-exps (natural)."""
    rows, heads, dim = q.shape
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    assert out.stride(-1) == 1 and lse.stride(-1) == 1
    heads_p2, dim_p2 = triton.next_power_of_2(heads), triton.next_power_of_2(dim)
    # one program per row, all heads: the walk up the path is shared by the heads
    _branch_path_kernel[(rows,)](
        q, k, v, out, lse, tokens.parent, tokens.root_end, tokens.pos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), scale, window or 0,
        HEADS=heads, HEADS_P2=heads_p2, GROUP=heads // k.shape[1], HEAD_DIM=dim,
        DIM_P2=dim_p2, WINDOWED=window is not None,
        num_warps=4 if heads_p2 * dim_p2 <= 4096 else 8)

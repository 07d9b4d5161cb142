"""A decoding step's attention on CUDA: each beam's new row against its slot's kept context
and its own generated tokens (engine/decode.py).

One program per (beam, key-value head) reads that beam's keys straight from the pass's kept
K/V through its slot's row list (no per-beam copies), in fixed blocks of keys with an online
softmax in fp32: the context's blocks in order, then the generated tokens'. A beam's result
thus depends on its own slot and tokens alone, never on how many beams or slots share the
step, nor on the longest context among them (a batched product over a padded width would).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 8192    # query heads x keys x head dim of one block: registers per program


@triton.jit
def _attend_block(q, k, v, key_ok, m, total, acc, scale):
    """Fold one block of keys into the running max, sum and weighted values (fp32)."""
    s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale           # [G, BLOCK]
    s = tl.where(key_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)    # nothing seen yet: no NaN
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, total, acc


@triton.jit
def _decode_kernel(q_ptr, kk_ptr, kv_ptr, gk_ptr, gv_ptr, o_ptr, ctx_rows_ptr, ctx_pos_ptr,
                   ctx_len_ptr, gen_pos_ptr, beam_slot_ptr, q_pos_ptr,
                   q_st, q_sh, kk_st, kk_sh, kv_st, kv_sh, gk_sb, gk_st, gk_sh,
                   gv_sb, gv_st, gv_sh, o_st, o_sh, ctx_st, gen_pos_st, n_gen, scale, window,
                   GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                   DIM_P2: tl.constexpr, BLOCK: tl.constexpr, WINDOWED: tl.constexpr):
    beam = tl.program_id(0)
    head = tl.program_id(1)              # key-value head; its GROUP query heads together
    slot = tl.load(beam_slot_ptr + beam)
    q_pos = tl.load(q_pos_ptr + beam)
    n_ctx = tl.load(ctx_len_ptr + slot)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, DIM_P2)
    j = tl.arange(0, BLOCK)
    d_ok = d < HEAD_DIM
    q_heads = head * GROUP + g
    q = tl.load(q_ptr + beam * q_st + q_heads[:, None] * q_sh + d[None, :],
                mask=(g < GROUP)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m = tl.full([GROUP_P2], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, DIM_P2], tl.float32)
    at = n_ctx * 0     # a tensor, not a constant: it changes in the loop
    while at < n_ctx:                           # the slot's root and template branch
        key_ok = at + j < n_ctx
        rows = tl.load(ctx_rows_ptr + slot * ctx_st + at + j, mask=key_ok, other=0)
        if WINDOWED:
            pos = tl.load(ctx_pos_ptr + slot * ctx_st + at + j, mask=key_ok, other=0)
            key_ok = key_ok & (q_pos - pos < window)
        tile_ok = key_ok[:, None] & d_ok[None, :]
        k = tl.load(kk_ptr + rows[:, None] * kk_st + head * kk_sh + d[None, :], mask=tile_ok,
                    other=0.0).to(tl.float32)
        v = tl.load(kv_ptr + rows[:, None] * kv_st + head * kv_sh + d[None, :], mask=tile_ok,
                    other=0.0).to(tl.float32)
        m, total, acc = _attend_block(q, k, v, key_ok, m, total, acc, scale)
        at += BLOCK
    t0 = beam * 0
    while t0 < n_gen:                           # the beam's own tokens, this step's last
        t = t0 + j
        key_ok = t < n_gen
        if WINDOWED:
            pos = tl.load(gen_pos_ptr + beam * gen_pos_st + t, mask=key_ok, other=0)
            key_ok = key_ok & (q_pos - pos < window)
        tile_ok = key_ok[:, None] & d_ok[None, :]
        k = tl.load(gk_ptr + beam * gk_sb + t[:, None] * gk_st + head * gk_sh + d[None, :],
                    mask=tile_ok, other=0.0).to(tl.float32)
        v = tl.load(gv_ptr + beam * gv_sb + t[:, None] * gv_st + head * gv_sh + d[None, :],
                    mask=tile_ok, other=0.0).to(tl.float32)
        m, total, acc = _attend_block(q, k, v, key_ok, m, total, acc, scale)
        t0 += BLOCK
    out = acc / total[:, None]
    tl.store(o_ptr + beam * o_st + q_heads[:, None] * o_sh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=(g < GROUP)[:, None] & d_ok[None, :])


def block_keys(group: int, head_dim: int) -> int:
    """Keys per block for a head layout: fixed by the model's shape, never by the step."""
    per_key = triton.next_power_of_2(group) * triton.next_power_of_2(head_dim)
    return max(1, min(64, TILE_ELEMENTS // per_key))


def decode_attention(q: torch.Tensor, kept_k: torch.Tensor, kept_v: torch.Tensor,
                     gen_k: torch.Tensor, gen_v: torch.Tensor, ctx_rows: torch.Tensor,
                     ctx_pos: torch.Tensor, ctx_len: torch.Tensor, gen_pos: torch.Tensor,
                     beam_slot: torch.Tensor, q_pos: torch.Tensor, window: int | None,
                     scale: float, out: torch.Tensor) -> None:
    """Write each beam's attention into ``out`` [n, Hq, D]. q: [n, Hq, D]; kept_k/v: [R, Hkv, D]
    (the pass's kept rows); gen_k/v: [n, T, Hkv, D] (the beam's tokens, this step's last);
    ctx_rows / ctx_pos: [slots, L] (a slot's context: rows into kept_k/v and their positions,
    its first ctx_len[slot] entries); gen_pos: [n, T]; beam_slot, q_pos: [n]. ``window``:
    the sliding window (None: a global layer)."""
    n, heads, dim = q.shape
    kv_heads = kept_k.shape[1]
    group = heads // kv_heads
    q, kept_k, kept_v, gen_k, gen_v = (t if t.stride(-1) == 1 else t.contiguous()
                                       for t in (q, kept_k, kept_v, gen_k, gen_v))
    ctx_rows, ctx_pos, gen_pos = (t.contiguous() for t in (ctx_rows, ctx_pos, gen_pos))
    assert ctx_rows.stride(0) == ctx_pos.stride(0) and out.stride(-1) == 1
    _decode_kernel[(n, kv_heads)](
        q, kept_k, kept_v, gen_k, gen_v, out, ctx_rows, ctx_pos, ctx_len, gen_pos, beam_slot,
        q_pos, q.stride(0), q.stride(1), kept_k.stride(0), kept_k.stride(1), kept_v.stride(0),
        kept_v.stride(1), gen_k.stride(0), gen_k.stride(1), gen_k.stride(2), gen_v.stride(0),
        gen_v.stride(1), gen_v.stride(2), out.stride(0), out.stride(1), ctx_rows.stride(0),
        gen_pos.stride(0), gen_k.shape[1], scale, window or 0,
        GROUP=group, GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=dim,
        DIM_P2=triton.next_power_of_2(dim), BLOCK=block_keys(group, dim),
        WINDOWED=window is not None, num_warps=4)

"""A decoding step's attention on CUDA: each beam's new row against its slot's kept context
and its own generated tokens (engine/decode.py).

One program per (chunk of one slot's beams, key-value head): the slot's context keys are
read once for all its beams (straight from the pass's kept K/V through the slot's row list,
no per-beam copies), each block's scores and weighted values one ``tl.dot`` over the chunk's
rows, in fixed blocks of keys with an online softmax in fp32: the context's blocks in
order, then each beam's own generated tokens (a block updates only that beam's rows), read
from the steps' key and value buffers through the beam's row list (a beam kept for the next
step keeps its list; no keys are copied). A slot's beams are always decoded together (a
document alone or packed holds all of them) and chunked in their own order, so a beam's result depends on its slot alone, never on how
many beams or slots share the step, nor on the longest context among them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BEAM_ROWS = 16           # query rows of one program: a slot's beams x a head group's heads


@triton.jit
def _attend_block(q, k, v, key_ok, mine, m, total, acc, scale):
    """Fold one block of keys into the running max, sum and weighted values (fp32) of the
    rows ``mine``; other rows keep theirs untouched. ("ieee": fp32 inputs, the tests',
    multiplied exactly; bf16 ones as they are.)"""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale      # [M, BLOCK]
    s = tl.where(key_ok & mine[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)    # nothing seen yet: no NaN
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    total = tl.where(mine, total * alpha + tl.sum(p, axis=1), total)
    acc = tl.where(mine[:, None], acc * alpha[:, None] + pv, acc)
    return tl.where(mine, m_new, m), total, acc


@triton.jit
def _decode_kernel(q_ptr, kk_ptr, kv_ptr, gk_ptr, gv_ptr, gen_rows_ptr, o_ptr, chunks_ptr,
                   ctx_rows_ptr, ctx_pos_ptr, ctx_len_ptr, gen_pos_ptr, beam_slot_ptr, q_pos_ptr,
                   q_st, q_sh, kk_st, kk_sh, kv_st, kv_sh, gk_st, gk_sr, gk_sh,
                   gv_st, gv_sr, gv_sh, o_st, o_sh, ctx_st, gen_st, n_gen, scale, window,
                   BEAMS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                   HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, BLOCK: tl.constexpr,
                   GEN_BLOCK: tl.constexpr, WINDOWED: tl.constexpr):
    chunk = tl.program_id(0)             # up to BEAMS beams of one slot
    head = tl.program_id(1)              # key-value head; its GROUP query heads together
    first = tl.load(chunks_ptr + chunk * BEAMS)
    if first >= 0:
        slot = tl.load(beam_slot_ptr + first)
        n_ctx = tl.load(ctx_len_ptr + slot)
        r = tl.arange(0, BEAMS * GROUP_P2)           # row: (beam of the chunk, query head)
        which = r // GROUP_P2
        g = r % GROUP_P2
        beam = tl.load(chunks_ptr + chunk * BEAMS + which)
        row_ok = (beam >= 0) & (g < GROUP)
        beam = tl.where(beam >= 0, beam, first)
        q_pos = tl.load(q_pos_ptr + beam)
        d = tl.arange(0, DIM_P2)
        d_ok = d < HEAD_DIM
        q_heads = head * GROUP + g
        rows_ok = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + beam[:, None] * q_st + q_heads[:, None] * q_sh + d[None, :],
                    mask=rows_ok, other=0.0)
        m = tl.full([BEAMS * GROUP_P2], float("-inf"), tl.float32)
        total = tl.zeros([BEAMS * GROUP_P2], tl.float32)
        acc = tl.zeros([BEAMS * GROUP_P2, DIM_P2], tl.float32)
        j = tl.arange(0, BLOCK)
        at = n_ctx * 0     # a tensor, not a constant: it changes in the loop
        while at < n_ctx:                           # the slot's context, read once for its beams
            key_in = at + j < n_ctx
            rows = tl.load(ctx_rows_ptr + slot * ctx_st + at + j, mask=key_in, other=0)
            key_ok = tl.broadcast_to(key_in[None, :], (BEAMS * GROUP_P2, BLOCK))
            if WINDOWED:
                pos = tl.load(ctx_pos_ptr + slot * ctx_st + at + j, mask=key_in, other=0)
                key_ok = key_ok & (q_pos[:, None] - pos[None, :] < window)
            tile_ok = key_in[:, None] & d_ok[None, :]
            k = tl.load(kk_ptr + rows[:, None] * kk_st + head * kk_sh + d[None, :],
                        mask=tile_ok, other=0.0)
            v = tl.load(kv_ptr + rows[:, None] * kv_st + head * kv_sh + d[None, :],
                        mask=tile_ok, other=0.0)
            m, total, acc = _attend_block(q, k, v, key_ok, row_ok, m, total, acc, scale)
            at += BLOCK
        t_in = tl.arange(0, GEN_BLOCK)
        for b in range(BEAMS):                      # each beam's own tokens, this step's last
            own = tl.load(chunks_ptr + chunk * BEAMS + b)
            if own >= 0:
                mine = row_ok & (which == b)
                t0 = chunk * 0    # a tensor: n_gen may be specialised to a constant
                while t0 < n_gen:
                    t = t0 + t_in
                    gen_in = t < n_gen
                    key_ok = tl.broadcast_to(gen_in[None, :], (BEAMS * GROUP_P2, GEN_BLOCK))
                    if WINDOWED:
                        pos = tl.load(gen_pos_ptr + own * gen_st + t, mask=gen_in, other=0)
                        key_ok = key_ok & (q_pos[:, None] - pos[None, :] < window)
                    # the beam's token of step t: row gen_rows[own, t] of that step's keys
                    at_row = tl.load(gen_rows_ptr + own * gen_st + t, mask=gen_in, other=0)
                    tile_ok = gen_in[:, None] & d_ok[None, :]
                    k = tl.load(gk_ptr + t[:, None] * gk_st + at_row[:, None] * gk_sr
                                + head * gk_sh + d[None, :], mask=tile_ok, other=0.0)
                    v = tl.load(gv_ptr + t[:, None] * gv_st + at_row[:, None] * gv_sr
                                + head * gv_sh + d[None, :], mask=tile_ok, other=0.0)
                    m, total, acc = _attend_block(q, k, v, key_ok, mine, m, total, acc,
                                                  scale)
                    t0 += GEN_BLOCK
        out = acc / tl.where(row_ok, total, 1.0)[:, None]
        tl.store(o_ptr + beam[:, None] * o_st + q_heads[:, None] * o_sh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=rows_ok)


def beams_per_program(group: int) -> int:
    """Beams of one slot a program attends for together: BEAM_ROWS query rows (or one beam
    where a head group alone is more), fixed by the model's shape, never by the step."""
    return max(1, BEAM_ROWS // triton.next_power_of_2(group))


def block_keys(head_dim: int) -> int:
    """Context keys per block: fixed by the model's shape, never by the step (its K and V
    tiles fit shared memory)."""
    return 64 if head_dim <= 256 else 32


def beam_chunks(beam_slot: torch.Tensor, beams: int) -> torch.Tensor:
    """[n, beams] int32: row c lists the beams of chunk c, at most ``beams`` of one slot
    (-1 padded); rows past the last chunk are all -1. On the device, without reading back:
    once per step, for every layer."""
    n = beam_slot.shape[0]
    order = torch.argsort(beam_slot, stable=True)
    slots = beam_slot[order]
    rank = torch.arange(n, device=beam_slot.device) - torch.searchsorted(slots, slots)
    chunk = torch.cumsum(rank % beams == 0, 0) - 1
    out = torch.full((n, beams), -1, dtype=torch.int32, device=beam_slot.device)
    out[chunk, rank % beams] = order.to(torch.int32)
    return out


def decode_attention(q: torch.Tensor, kept_k: torch.Tensor, kept_v: torch.Tensor,
                     gen_k: torch.Tensor, gen_v: torch.Tensor, gen_rows: torch.Tensor,
                     ctx_rows: torch.Tensor, ctx_pos: torch.Tensor, ctx_len: torch.Tensor,
                     gen_pos: torch.Tensor, beam_slot: torch.Tensor, q_pos: torch.Tensor,
                     window: int | None, scale: float, out: torch.Tensor,
                     chunks: torch.Tensor | None = None) -> None:
    """Write each beam's attention into ``out`` [n, Hq, D]. q: [n, Hq, D]; kept_k/v: [R, Hkv, D]
    (the pass's kept rows); gen_k/v: [steps, rows, Hkv, D], each step's generated keys and
    values by row; gen_rows / gen_pos: [n, T] (a beam's tokens, this step's last: the row of
    each step that holds it, and its position); ctx_rows / ctx_pos: [slots, L] (a slot's
    context: rows into kept_k/v and their positions, its first ctx_len[slot] entries);
    beam_slot, q_pos: [n]. ``window``:
    the sliding window (None: a global layer). ``chunks``: ``beam_chunks(beam_slot,
    beams_per_program(group))``, computed once per step (here when not given)."""
    n, heads, dim = q.shape
    kv_heads = kept_k.shape[1]
    group = heads // kv_heads
    beams = beams_per_program(group)
    if chunks is None:
        chunks = beam_chunks(beam_slot, beams)
    q, kept_k, kept_v, gen_k, gen_v = (t if t.stride(-1) == 1 else t.contiguous()
                                       for t in (q, kept_k, kept_v, gen_k, gen_v))
    ctx_rows, ctx_pos, gen_rows, gen_pos = (t.contiguous()
                                            for t in (ctx_rows, ctx_pos, gen_rows, gen_pos))
    assert ctx_rows.stride(0) == ctx_pos.stride(0) and gen_rows.stride(0) == gen_pos.stride(0)
    assert out.stride(-1) == 1 and chunks.shape == (n, beams)
    _decode_kernel[(n, kv_heads)](
        q, kept_k, kept_v, gen_k, gen_v, gen_rows, out, chunks, ctx_rows, ctx_pos, ctx_len,
        gen_pos, beam_slot, q_pos, q.stride(0), q.stride(1), kept_k.stride(0), kept_k.stride(1),
        kept_v.stride(0), kept_v.stride(1), gen_k.stride(0), gen_k.stride(1), gen_k.stride(2),
        gen_v.stride(0), gen_v.stride(1), gen_v.stride(2), out.stride(0), out.stride(1),
        ctx_rows.stride(0), gen_pos.stride(0), gen_rows.shape[1], scale, window or 0,
        BEAMS=beams, GROUP=group, GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=dim,
        DIM_P2=triton.next_power_of_2(dim), BLOCK=block_keys(dim), GEN_BLOCK=16,
        WINDOWED=window is not None, num_warps=4)

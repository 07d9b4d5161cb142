"""Decoding steps' attention inputs (kernels/decode_attention.py) and the checks on them,
shared by the GPU tests (tests/gpu/test_gpu_extraction.py) and the interpreter's
(tests/test_decode_triton.py)."""

from __future__ import annotations

import torch

# beams of slots of other lengths; and one slot with more beams than a program takes
STEPS = [[2, 1, 0, 2, 3, 1, 2], [1, 0, 0, 2, 0, 0, 3, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0]]


def step(heads: int, kv_heads: int, dim: int, lens: list[int], beam_slot: list[int],
         generated: int, seed: int, device: str) -> list[torch.Tensor]:
    """A decoding step's inputs: kept K/V, the steps' generated K/V (a beam's token of each
    step at a row of its own, the rows shuffled and some spare), per-slot contexts, beams."""
    gen = torch.Generator().manual_seed(seed)
    rows_kept = 400
    kept_k, kept_v = torch.randn(2, rows_kept, kv_heads, dim, generator=gen).unbind(0)
    width = max(lens)
    ctx_rows = torch.zeros(len(lens), width, dtype=torch.long)
    ctx_pos = torch.zeros(len(lens), width, dtype=torch.long)
    for s, n in enumerate(lens):
        ctx_rows[s, :n] = torch.randperm(rows_kept, generator=gen)[:n]
        ctx_pos[s, :n] = torch.arange(n)
    n = len(beam_slot)
    q_pos = torch.tensor([lens[s] + generated for s in beam_slot])
    gen_pos = torch.stack([torch.arange(lens[s], lens[s] + generated + 1) for s in beam_slot])
    q = torch.randn(n, heads, dim, generator=gen)
    steps, rows = generated + 1, n + 3
    gen_k, gen_v = torch.randn(2, steps, rows, kv_heads, dim, generator=gen).unbind(0)
    gen_rows = torch.stack([torch.randperm(rows, generator=gen)[:n] for _ in range(steps)], 1)
    return [t.to(device) for t in (q, kept_k, kept_v, gen_k, gen_v, gen_rows, ctx_rows, ctx_pos,
                                   torch.tensor(lens), gen_pos, torch.tensor(beam_slot), q_pos)]


def reference(q, kept_k, kept_v, gen_k, gen_v, gen_rows, ctx_rows, ctx_pos, lens, gen_pos,
              beam_slot, q_pos, window, scale) -> torch.Tensor:
    """Each beam by itself in float64: softmax over its context's keys and its own tokens."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // kept_k.shape[1]
    for b in range(q.shape[0]):
        s = int(beam_slot[b])
        rows = ctx_rows[s, :int(lens[s])]
        own = (torch.arange(gen_rows.shape[1]), gen_rows[b])
        keys = torch.cat((kept_k[rows], gen_k[own])).double()
        values = torch.cat((kept_v[rows], gen_v[own])).double()
        pos = torch.cat((ctx_pos[s, :int(lens[s])], gen_pos[b]))
        seen = (q_pos[b] - pos < window) if window else torch.ones_like(pos, dtype=torch.bool)
        for h in range(q.shape[1]):
            scores = keys[:, h // group] @ q[b, h].double() * scale
            scores = scores.masked_fill(~seen, float("-inf"))
            out[b, h] = torch.softmax(scores, 0) @ values[:, h // group]
    return out


def close_to_reference(heads: int, kv_heads: int, dim: int, window: int | None,
                       dtype: torch.dtype, device: str) -> float:
    """The kernel's relative error against ``reference`` on a step of three slots."""
    from spinf_worker.kernels.decode_attention import decode_attention

    args = step(heads, kv_heads, dim, [70, 130, 9], [0, 0, 1, 2, 1, 0], 3, seed=heads + dim,
                device=device)
    args = [t.to(dtype) if t.is_floating_point() else t for t in args]
    out = torch.zeros_like(args[0])
    decode_attention(*args, window, 0.0625, out)
    want = reference(*[t.cpu() for t in args], window, 0.0625)
    return float((out.double().cpu() - want).norm() / want.norm())


def slots_alone_as_in_their_step(window: int | None, beam_slot: list[int], device: str) -> None:
    """Each slot's beams alone (the slot alone, its context at its own width) and among other
    slots' beams with longer and shorter contexts: bit-identical."""
    from spinf_worker.kernels.decode_attention import decode_attention

    q, kept_k, kept_v, gen_k, gen_v, gen_rows, ctx_rows, ctx_pos, lens, gen_pos, beam_slot, \
        q_pos = step(16, 8, 256, [33, 300, 120, 7], beam_slot, 4, seed=5, device=device)
    args = (kept_k, kept_v, gen_k, gen_v)
    out = torch.zeros_like(q)
    decode_attention(q, *args, gen_rows, ctx_rows, ctx_pos, lens, gen_pos, beam_slot,
                     q_pos, window, 0.0625, out)
    for s in range(len(lens)):
        mine = torch.nonzero(beam_slot == s).flatten()
        n = int(lens[s])
        alone = torch.zeros_like(q[mine])
        decode_attention(q[mine], *args, gen_rows[mine], ctx_rows[s:s + 1, :n],
                         ctx_pos[s:s + 1, :n], lens[s:s + 1], gen_pos[mine],
                         torch.zeros_like(beam_slot[mine]), q_pos[mine], window, 0.0625, alone)
        assert torch.equal(alone, out[mine]), s

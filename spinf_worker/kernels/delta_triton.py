"""The gated delta rule over a pass's read-once tree on CUDA, in Triton: token by token, the
state in fp32 registers (flash-linear-attention's fused recurrent kernel), a few launches a
layer instead of kernels/delta_tree.py's ops per document and per branch tile.

- Roots: one program per (document, head, block of ROOT_BV value columns) runs the root's rows
  from a zero state, writes each row's output and the state after the root's last row.
- Long roots (CHUNKED_ROOT rows or more) go by CHUNK-row chunks instead, as the torch path
  does (``chunk_delta_rule``): one program per (chunk, head) solves its chunk's triangular
  system (the UT transform, independent of the state, so every chunk of every long root at
  once), then one program per (document, head, block of CHUNK_BV value columns) carries the
  state from chunk to chunk with matrix products: a root of R rows costs R / CHUNK serial
  steps instead of R. Which path a root takes depends on its own length only.
- Branch rows: one program per (branch row, head, block of BRANCH_BV value columns); a leaf's
  (a row on no other row's path) loads its document's root state, runs its own path (its
  branch ancestors, then itself) and writes the output of every row on it; the others' do
  nothing. A row on several leaves' paths (a question's tokens before its options) gets the
  same bits from each: the same steps from the same state. So a chain of d rows costs d
  steps, not the d^2 / 2 of each row re-running its own path.

Per token, as transformers' ``torch_recurrent_gated_delta_rule``:
``S *= exp(g); u = beta * (v - k S); S += k^T u; o = q S`` (S: [dk, dv], one value column of
S never reads another, hence the column blocks). Block sizes and warps are fixed, never tuned
per shape, and a program reads only its own document's root or its own path (loop bounds are
its own lengths, never the pass's padded width), so a row's bits never depend on what else
shares the pass.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .attention import AttentionPlan

# value columns per program and warps: roots are long serial scans, so narrow blocks give more
# programs to run side by side; a branch program re-reads its path's keys for each of its
# blocks, so wider ones read them fewer times
ROOT_BV, ROOT_WARPS = 8, 1
BRANCH_BV, BRANCH_WARPS = 32, 4
# roots of at least this many rows go by chunks; SPINF_DELTA_CHUNKED_ROOT=0 (the default):
# none does. On an H100 the chunk kernels took 59x the token-by-token scan's time for roots of
# 512 and 2,048 rows (benchmarks/delta_roots.py), so they wait to be made fast
_CHUNKED = os.environ.get("SPINF_DELTA_CHUNKED_ROOT", "0")
if not _CHUNKED.isdigit():
    raise ValueError(f"SPINF_DELTA_CHUNKED_ROOT={_CHUNKED!r}: expected a row count (0: never)")
CHUNKED_ROOT = int(_CHUNKED) or 1 << 62
CHUNK = 64             # rows of a chunk (the torch path's)
# the chunk kernels' products on tensor cores in three TF32 products each (near fp32, fixed
# order): "ieee" fp32 products compile to FMA loops that hold whole tiles per thread, and
# ptxas spilled them to a 19-25 KiB stack a thread (sm_90: 32 registers), ~59x the token-by-
# token scan's time on an H100; tf32x3 compiles to 255 registers and 0.5-2 KiB of spills
DOT_PRECISION: tl.constexpr = tl.constexpr("tf32x3")
SOLVE_WARPS = 8
CHUNK_BV, CHUNK_WARPS = 16, 4
DOT_MIN = 16           # tl.dot's smallest side: narrower heads are padded (masked) to it


@dataclass
class TreeRows:
    """The tree of a pass as the kernels read it, built once per pass (``of``) on the device,
    without waiting for it: pass rows (int64), lengths (int32)."""

    root_start: torch.Tensor     # [docs] each document's first row
    root_len: torch.Tensor       # [docs] its root's rows
    short_roots: torch.Tensor    # [s] the documents (indices) whose roots go token by token
    long_roots: torch.Tensor     # [l] the others: by chunks
    first_chunk: torch.Tensor    # [l] a long root's first chunk (an index into chunk_doc)
    chunk_doc: torch.Tensor      # [c] each chunk's document (an index into root_start)
    chunk_at: torch.Tensor       # [c] its first row in its root
    branch_doc: torch.Tensor     # [n] each branch row's document (an index into root_start)
    path: torch.Tensor           # [n, width] its own path's rows, itself last; then padding
    path_len: torch.Tensor       # [n] the path's real rows; 0 unless the row is a leaf

    @classmethod
    def of(cls, plan: AttentionPlan, device) -> TreeRows:
        if plan.delta_rows is None:
            plan.delta_rows = cls._build(plan, device)
        return plan.delta_rows

    @classmethod
    def _build(cls, plan: AttentionPlan, device) -> TreeRows:
        rows, docs, paths, lengths = [], [], [], []
        for d, doc in enumerate(plan.docs):
            s, r = doc.start, doc.root
            for tiles in doc.branches:
                n = tiles.real
                if n == 0:
                    continue
                rows.append(tiles.rows[:n] + (s + r))
                docs.append(torch.full((n,), d, dtype=torch.int32, device=device))
                paths.append(tiles.path[:n] + s)
                lengths.append(tiles.path_ok[:n].sum(1, dtype=torch.int32))
        long = dict(dtype=torch.int64, device=device)
        int32 = dict(dtype=torch.int32, device=device)
        starts = torch.tensor([doc.start for doc in plan.docs], **long)
        roots = torch.tensor([doc.root for doc in plan.docs], **int32)
        by_chunks = [d for d, doc in enumerate(plan.docs) if doc.root >= CHUNKED_ROOT]
        chunks = [-(-plan.docs[d].root // CHUNK) for d in by_chunks]
        split = dict(
            short_roots=torch.tensor(sorted(set(range(len(plan.docs))) - set(by_chunks)),
                                     **int32),
            long_roots=torch.tensor(by_chunks, **int32),
            first_chunk=torch.tensor([0, *itertools.accumulate(chunks)][:len(chunks)], **int32),
            chunk_doc=torch.tensor([d for d, n in zip(by_chunks, chunks, strict=True)
                                    for _ in range(n)], **int32),
            chunk_at=torch.tensor([i * CHUNK for n in chunks for i in range(n)], **int32))
        if not rows:
            return cls(starts, roots, **split, branch_doc=torch.empty(0, **int32),
                       path=torch.empty(0, 1, **long), path_len=torch.empty(0, **int32))
        width = max(p.shape[1] for p in paths)
        row = torch.cat(rows).long()
        path = torch.cat([F.pad(p, (0, width - p.shape[1])) for p in paths]).long()
        length = torch.cat(lengths)
        # a leaf (a row on no other row's path) runs its path and writes every row on it;
        # the other rows' programs do nothing (shapes fixed: no wait for the device)
        above = torch.arange(width, device=device) < (length - 1)[:, None]
        below = torch.zeros(max(doc.start + doc.tokens for doc in plan.docs),
                            dtype=torch.int32, device=device)
        below.scatter_add_(0, path.flatten(), above.flatten().int())
        return cls(starts, roots, **split, branch_doc=torch.cat(docs), path=path,
                   path_len=torch.where(below[row] == 0, length, 0))


@triton.jit
def _load_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, row, ok, i_h, offs_k, offs_v, mask_k,
              mask_v, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    """Pass row ``row`` (int64) of head ``i_h``: q, k [BK], v [BV], its decay exp(g) and beta
    (zeros unless ``ok``)."""
    at = row * H + i_h
    q = tl.load(q_ptr + at * DK + offs_k, mask=mask_k & ok, other=0.0)
    k = tl.load(k_ptr + at * DK + offs_k, mask=mask_k & ok, other=0.0)
    v = tl.load(v_ptr + at * DV + offs_v, mask=mask_v & ok, other=0.0)
    decay = tl.exp(tl.load(g_ptr + at, mask=ok, other=0.0))
    return q, k, v, decay, tl.load(beta_ptr + at, mask=ok, other=0.0)


@triton.jit
def _update(h, k, v, decay, beta):
    """The state [BK, BV] after one row."""
    h = h * decay
    u = (v - tl.sum(h * k[:, None], 0)) * beta
    return h + k[:, None] * u[None, :]


# Both kernels load a row's inputs one step ahead, so the loads run while the step before is
# computed (the math is the same). While loops, not range(n): the bound is a loaded value,
# and the interpreter's range needs a Python int.

@triton.jit
def _root_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, start_ptr, len_ptr,
                 docs_ptr, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr):
    i_d, i_h, i_v = tl.load(docs_ptr + tl.program_id(0)), tl.program_id(1), tl.program_id(2)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    row = tl.load(start_ptr + i_d)
    end = row + tl.load(len_ptr + i_d)
    h = tl.zeros([BK, BV], dtype=tl.float32)
    q, k, v, decay, beta = _load_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, row, row < end, i_h,
                                     offs_k, offs_v, mask_k, mask_v, H, DK, DV)
    while row < end:
        q1, k1, v1, decay1, beta1 = _load_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, row + 1,
                                              row + 1 < end, i_h, offs_k, offs_v, mask_k,
                                              mask_v, H, DK, DV)
        h = _update(h, k, v, decay, beta)
        tl.store(out_ptr + (row * H + i_h) * DV + offs_v, tl.sum(h * q[:, None], 0),
                 mask=mask_v)
        q, k, v, decay, beta = q1, k1, v1, decay1, beta1
        row += 1
    at = (i_d * H + i_h).to(tl.int64) * DK
    tl.store(state_ptr + (at + offs_k[:, None]) * DV + offs_v[None, :], h,
             mask=mask_k[:, None] & mask_v[None, :])


@triton.jit
def _load_chunk(q_ptr, k_ptr, g_ptr, beta_ptr, row, n, i_h, offs_c, offs_k, mask_k,
                H: tl.constexpr, DK: tl.constexpr):
    """The ``n`` (<= C) rows of head ``i_h`` from pass row ``row`` on, zeros past them (as the
    torch path's padding: no decay, no update): q, k [C, BK], the log decay from the chunk's
    start (g's running sum) [C], beta [C], and which rows are real."""
    ok = offs_c < n
    at = (row + offs_c) * H + i_h
    mask = ok[:, None] & mask_k[None, :]
    q = tl.load(q_ptr + at[:, None] * DK + offs_k[None, :], mask=mask, other=0.0)
    k = tl.load(k_ptr + at[:, None] * DK + offs_k[None, :], mask=mask, other=0.0)
    decay = tl.cumsum(tl.load(g_ptr + at, mask=ok, other=0.0), 0)
    return q, k, decay, tl.load(beta_ptr + at, mask=ok, other=0.0), ok


@triton.jit
def _chunk_pairs(decay, offs_c, diagonal: tl.constexpr):
    """[C, C] exp(decay_i - decay_j) for j before i (and j == i with ``diagonal``), else 0."""
    keep = (offs_c[:, None] > offs_c[None, :]) | (diagonal & (offs_c[:, None] == offs_c[None, :]))
    return tl.where(keep, tl.exp(tl.where(keep, decay[:, None] - decay[None, :], 0.0)), 0.0)


@triton.jit
def _chunk_solve_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, u_ptr, w_ptr, start_ptr, len_ptr,
                        chunk_doc_ptr, chunk_at_ptr, H: tl.constexpr,
                        DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                        BDV: tl.constexpr, C: tl.constexpr):
    """One (chunk, head): T = (I + strictly lower(beta k k^T * decay))^-1 by forward
    substitution, then u = T (beta v) [C, DV] and w = T (beta k exp(decay)) [C, DK], written to
    the chunk's rows of ``u``/``w`` (chunk-major, C rows a chunk)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    d, lo = tl.load(chunk_doc_ptr + i_c), tl.load(chunk_at_ptr + i_c)
    offs_c, offs_k, offs_v = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BDV)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    row = tl.load(start_ptr + d) + lo
    q, k, decay, beta, ok = _load_chunk(q_ptr, k_ptr, g_ptr, beta_ptr, row, tl.load(
        len_ptr + d) - lo, i_h, offs_c, offs_k, mask_k, H, DK)
    at = (row + offs_c) * H + i_h
    v = tl.load(v_ptr + at[:, None] * DV + offs_v[None, :], mask=ok[:, None] & mask_v[None, :],
                other=0.0)
    k_beta = k * beta[:, None]
    a = tl.dot(k_beta, tl.trans(k), input_precision=DOT_PRECISION) * _chunk_pairs(decay, offs_c, False)
    t = tl.where(offs_c[:, None] == offs_c[None, :], 1.0, 0.0)
    for i in range(1, C):     # row i: e_i - sum_{j < i} a[i, j] t[j]  (a[i, j] = 0 for j >= i)
        a_i = tl.sum(tl.where(offs_c[:, None] == i, a, 0.0), 0)
        t_i = tl.where(offs_c == i, 1.0, -tl.sum(a_i[:, None] * t, 0))
        t = tl.where(offs_c[:, None] == i, t_i[None, :], t)
    u = tl.dot(t, v * beta[:, None], input_precision=DOT_PRECISION)
    w = tl.dot(t, k_beta * tl.exp(decay)[:, None], input_precision=DOT_PRECISION)
    out = (i_c.to(tl.int64) * C + offs_c) * H + i_h
    tl.store(u_ptr + out[:, None] * DV + offs_v[None, :], u, mask=mask_v[None, :])
    tl.store(w_ptr + out[:, None] * DK + offs_k[None, :], w, mask=mask_k[None, :])


@triton.jit
def _chunk_state_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, u_ptr, w_ptr, out_ptr, state_ptr,
                        start_ptr, len_ptr, first_chunk_ptr, docs_ptr, H: tl.constexpr,
                        DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr, C: tl.constexpr):
    """One (long root, head, block of BV value columns): chunk after chunk, the rows' outputs
    from the state before the chunk and the chunk's own rows, then the state after it."""
    i_l, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_d = tl.load(docs_ptr + i_l)
    chunk = tl.load(first_chunk_ptr + i_l).to(tl.int64)
    offs_c, offs_k = tl.arange(0, C), tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    start, n = tl.load(start_ptr + i_d), tl.load(len_ptr + i_d)
    h = tl.zeros([BK, BV], dtype=tl.float32)
    lo = 0
    while lo < n:
        q, k, decay, beta, ok = _load_chunk(q_ptr, k_ptr, g_ptr, beta_ptr, start + lo, n - lo,
                                            i_h, offs_c, offs_k, mask_k, H, DK)
        at = (chunk * C + offs_c) * H + i_h
        u = tl.load(u_ptr + at[:, None] * DV + offs_v[None, :], mask=mask_v[None, :], other=0.0)
        w = tl.load(w_ptr + at[:, None] * DK + offs_k[None, :], mask=mask_k[None, :], other=0.0)
        v_new = u - tl.dot(w, h, input_precision=DOT_PRECISION)
        attn = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * _chunk_pairs(decay, offs_c, True)
        o = (tl.dot(q * tl.exp(decay)[:, None], h, input_precision=DOT_PRECISION)
             + tl.dot(attn, v_new, input_precision=DOT_PRECISION))
        rows = (start + lo + offs_c) * H + i_h
        tl.store(out_ptr + rows[:, None] * DV + offs_v[None, :], o,
                 mask=ok[:, None] & mask_v[None, :])
        last = tl.sum(tl.where(offs_c == C - 1, decay, 0.0), 0)
        k_dec = k * tl.exp(last - decay)[:, None]
        h = h * tl.exp(last) + tl.dot(tl.trans(k_dec), v_new, input_precision=DOT_PRECISION)
        lo += C
        chunk += 1
    at = (i_d * H + i_h).to(tl.int64) * DK
    tl.store(state_ptr + (at + offs_k[:, None]) * DV + offs_v[None, :], h,
             mask=mask_k[:, None] & mask_v[None, :])


@triton.jit(do_not_specialize=["width"])
def _branch_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, doc_ptr, path_ptr,
                   len_ptr, width, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr):
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    n = tl.load(len_ptr + i_n)      # 0: not a leaf, nothing to do
    at = (tl.load(doc_ptr + i_n) * H + i_h).to(tl.int64) * DK
    h = tl.load(state_ptr + (at + offs_k[:, None]) * DV + offs_v[None, :],
                mask=mask_k[:, None] & mask_v[None, :] & (n > 0), other=0.0)
    at = i_n.to(tl.int64) * width
    end = at + n
    row = tl.load(path_ptr + at, mask=at < end, other=0)
    q, k, v, decay, beta = _load_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, row, at < end, i_h,
                                     offs_k, offs_v, mask_k, mask_v, H, DK, DV)
    while at < end:
        row1 = tl.load(path_ptr + at + 1, mask=at + 1 < end, other=0)
        q1, k1, v1, decay1, beta1 = _load_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, row1,
                                              at + 1 < end, i_h, offs_k, offs_v, mask_k,
                                              mask_v, H, DK, DV)
        h = _update(h, k, v, decay, beta)
        # leaves that share this row store the same bits: the same steps from the same state
        tl.store(out_ptr + (row * H + i_h) * DV + offs_v, tl.sum(h * q[:, None], 0),
                 mask=mask_v)
        row, q, k, v, decay, beta = row1, q1, k1, v1, decay1, beta1
        at += 1


def tree_delta_rule(plan: AttentionPlan, q, k, v, g, beta) -> torch.Tensor:
    """delta_tree.tree_delta_rule's contract: q, k [rows, H, dk] (normalised, q scaled), v
    [rows, H, dv], g, beta [rows, H], fp32 -> [rows, H, dv] (padding rows: zeros)."""
    assert all(x.dtype == torch.float32 for x in (q, k, v, g, beta))
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    heads, dk = k.shape[1:]
    dv = v.shape[-1]
    out = torch.zeros_like(v)
    tree = TreeRows.of(plan, q.device)
    docs = tree.root_start.shape[0]
    if docs == 0:
        return out
    bk = triton.next_power_of_2(dk)
    bk_dot, bv_dot = max(bk, DOT_MIN), max(triton.next_power_of_2(dv), DOT_MIN)
    state = torch.empty(docs, heads, dk, dv, dtype=torch.float32, device=q.device)
    if tree.short_roots.shape[0]:
        _root_kernel[(tree.short_roots.shape[0], heads, triton.cdiv(dv, ROOT_BV))](
            q, k, v, g, beta, out, state, tree.root_start, tree.root_len, tree.short_roots,
            H=heads, DK=dk, DV=dv, BK=bk, BV=ROOT_BV, num_warps=ROOT_WARPS)
    if tree.long_roots.shape[0]:
        chunks = tree.chunk_doc.shape[0]
        u = torch.empty(chunks * CHUNK, heads, dv, dtype=torch.float32, device=q.device)
        w = torch.empty(chunks * CHUNK, heads, dk, dtype=torch.float32, device=q.device)
        _chunk_solve_kernel[(chunks, heads)](
            q, k, v, g, beta, u, w, tree.root_start, tree.root_len, tree.chunk_doc,
            tree.chunk_at, H=heads, DK=dk, DV=dv, BK=bk_dot, BDV=bv_dot, C=CHUNK,
            num_warps=SOLVE_WARPS)
        _chunk_state_kernel[(tree.long_roots.shape[0], heads, triton.cdiv(dv, CHUNK_BV))](
            q, k, g, beta, u, w, out, state, tree.root_start, tree.root_len, tree.first_chunk,
            tree.long_roots, H=heads, DK=dk, DV=dv, BK=bk_dot, BV=CHUNK_BV, C=CHUNK,
            num_warps=CHUNK_WARPS)
    n = tree.path.shape[0]
    if n:
        _branch_kernel[(n, heads, triton.cdiv(dv, BRANCH_BV))](
            q, k, v, g, beta, out, state, tree.branch_doc, tree.path, tree.path_len,
            tree.path.shape[1], H=heads, DK=dk, DV=dv, BK=bk, BV=BRANCH_BV,
            num_warps=BRANCH_WARPS)
    return out

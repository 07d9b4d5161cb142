"""Batch-invariant W4A16 GEMM for GPTQ int4 weights, in Triton: ``out = a @ dequant(w).T``.

The weight stays packed as GPTQ stores it (``qweight`` int32 ``[K / 8, N]``, eight 4-bit codes
per word along K, lowest bits first), with its zero points unpacked (int32 ``[G, N]``) and
its scales in fp32 (``[G, N]``, G = K / group size). Each K step of a program dequantises its
weight tile in registers, ``scale * (code - zero)`` in fp32 (exact: an fp16 scale times an
integer in [-15, 15]) cast to bf16, and runs the same ``tl.dot`` as the bf16 GEMM
(kernels/triton_matmul.py) with the bf16 tiling and K order. So the tile the dot sees is
exactly the dequantised weight in bf16 and ``int4_matmul(a, ...) == matmul(a, dequantised.to(
bfloat16))`` bit for bit: one fixed tiling, no split-K, a row's bits independent of M.
(docs/engineering/gptq-int4-gemm.md)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_matmul import CONFIGS, tile_of

CODES_PER_WORD = 8


@triton.jit
def _group_rows(ptr, k, K, N, offs_n, n_ok, GROUP: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The zeros or scales of a K step's rows, ``[BLOCK_K, BLOCK_N]``: the ``ROWS`` groups the
    step spans (1 when BLOCK_K divides the group size), each loaded once and repeated over its
    inputs."""
    g = k // GROUP + tl.arange(0, ROWS)
    rows = tl.load(ptr + g[:, None] * N + offs_n[None, :],
                   mask=(g[:, None] < K // GROUP) & n_ok[None, :], other=0)
    return tl.reshape(tl.broadcast_to(rows[:, None, :], (ROWS, BLOCK_K // ROWS, BLOCK_N)),
                      (BLOCK_K, BLOCK_N))


@triton.jit
def _int4_matmul_kernel(a_ptr, q_ptr, z_ptr, s_ptr, out_ptr, M, N, K,
                        stride_am, stride_om, GROUP: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr):
    pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)             # the step's words along K
    nibbles = tl.arange(0, 8) * 4
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < K - k), other=0.0)
        word_rows = k // 8 + offs_w
        words = tl.load(q_ptr + word_rows[:, None] * N + offs_n[None, :],
                        mask=(word_rows[:, None] < K // 8) & n_ok[None, :], other=0)
        # word i, nibble j -> input row 8 i + j (GPTQ's order: lowest bits first)
        codes = tl.reshape((words[:, None, :] >> nibbles[None, :, None]) & 15, (BLOCK_K, BLOCK_N))
        zeros = _group_rows(z_ptr, k, K, N, offs_n, n_ok, GROUP, ROWS, BLOCK_K, BLOCK_N)
        scales = _group_rows(s_ptr, k, K, N, offs_n, n_ok, GROUP, ROWS, BLOCK_K, BLOCK_N)
        w = (scales * (codes - zeros).to(tl.float32)).to(tl.bfloat16)      # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & n_ok[None, :])


def int4_matmul(a: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor,
                scales: torch.Tensor, group_size: int, out_dtype: torch.dtype | None = None
                ) -> torch.Tensor:
    """``a``: bf16 ``[M, K]``; ``qweight`` int32 ``[K / 8, N]``; ``zeros`` int32 ``[G, N]``;
    ``scales`` fp32 ``[G, N]``; ``K`` a multiple of ``group_size`` and of 8."""
    assert a.dtype == torch.bfloat16 and qweight.dtype == torch.int32
    m, k = a.shape
    n = qweight.shape[1]
    assert qweight.shape[0] * CODES_PER_WORD == k and k % group_size == 0
    bm, bn, bk, gm, warps, stages = CONFIGS[torch.bfloat16]
    assert group_size % bk == 0 or bk % group_size == 0
    assert tuple(zeros.shape) == tuple(scales.shape) == (k // group_size, n)
    assert zeros.dtype == torch.int32 and scales.dtype == torch.float32
    a = a.contiguous()
    out = torch.empty(m, n, dtype=out_dtype or a.dtype, device=a.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _int4_matmul_kernel[grid](a, qweight.contiguous(), zeros.contiguous(), scales.contiguous(),
                              out, m, n, k, a.stride(0), out.stride(0), GROUP=group_size,
                              ROWS=max(bk // group_size, 1),
                              BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
                              num_warps=warps, num_stages=stages)
    return out

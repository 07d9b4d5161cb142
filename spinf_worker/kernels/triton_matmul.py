"""Batch-invariant GEMM for CUDA, in Triton: ``out = (a @ w.T) * a_scale[:, None] * w_scale``.

One fixed tiling per operand dtype and no split-K, whatever M is: every output tile reduces
K in the same BLOCK_K steps in the same order, so a row's bits never depend on how many
rows share the pass (cuBLAS picks its algorithm, and sometimes a split-K, from M). The
config is fixed, never autotuned per shape: autotuning would make the choice, and so the
bits, depend on the first shape a process happened to see. Extraction slots' decoding steps
(a few hundred rows, where a pass has thousands) may take tiles of their own, ``STEP_CONFIGS``:
with a pass's tiles their GEMMs may run fewer programs than the GPU has SMs. Which table
a GEMM uses is fixed by the call site (a pass or a step), never by its row count.

Scales (fp8 W8A8): ``a_scale`` per row (per token: a per-tensor scale computed per pass would
mix documents) or one static scale fixed before any pass (a 0-dim tensor: ``A_SCALAR``),
``w_scale`` per output channel, all fp32, applied in the epilogue on the fp32 accumulator:
``(acc * a_scale) * w_scale``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) per operand dtype.
CONFIGS = {
    torch.bfloat16: (128, 256, 64, 8, 8, 3),
    torch.float16: (128, 256, 64, 8, 8, 3),
    torch.float8_e4m3fn: (128, 256, 128, 8, 8, 3),
    torch.float32: (64, 64, 32, 8, 4, 2),
}
# decoding steps' GEMMs (engine/decode.py): a pass's tiles, which benchmarks/step_tiles.py
# found fastest on an H100 for the 12B shape's steps (within 4% of smaller tiles at 384 rows,
# 30% ahead of them at 640; benchmarks/RESULTS.md, 2026-12-07)
STEP_CONFIGS = dict(CONFIGS)


def config(dtype: torch.dtype, step: bool = False) -> tuple[int, ...]:
    """The tiling of a GEMM of ``dtype`` operands: a pass's, or a decoding step's."""
    return (STEP_CONFIGS if step else CONFIGS)[dtype]


@triton.jit
def tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The (row tile, column tile) program ``pid`` computes. Grouped order keeps a band of
    weight tiles in L2; it changes which tile runs when, never how a tile is reduced."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return first_m + (pid % group) % size_m, (pid % group) // size_m


@triton.jit
def tile_product(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, pid_m, pid_n, M, N, K, stride_am,
                 stride_wn, HAS_SCALE: tl.constexpr, A_SCALAR: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One fp32 output tile of ``(a @ w.T) * a_scale[:, None] * w_scale`` (``A_SCALAR``: one
    ``a_scale`` for every row), K reduced in BLOCK_K steps from 0 up."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_left = K - k
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(offs_n[:, None] < N) & (offs_k[None, :] < k_left), other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_SCALE:
        w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
        if A_SCALAR:
            acc = acc * tl.load(a_scale_ptr) * w_scale[None, :]
        else:
            a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
            acc = acc * a_scale[:, None] * w_scale[None, :]
    return acc


@triton.jit
def _matmul_kernel(a_ptr, w_ptr, out_ptr, a_scale_ptr, w_scale_ptr, M, N, K,
                   stride_am, stride_wn, stride_om,
                   HAS_SCALE: tl.constexpr, A_SCALAR: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tile_product(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, pid_m, pid_n, M, N, K,
                       stride_am, stride_wn, HAS_SCALE, A_SCALAR, BLOCK_M, BLOCK_N, BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def matmul(a: torch.Tensor, w: torch.Tensor, *, a_scale: torch.Tensor | None = None,
           w_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
           step: bool = False) -> torch.Tensor:
    """``a``: [M, K] row-major; ``w``: [N, K] row-major (a Linear's weight); ``a_scale``:
    [M] per row, or 0-dim (a static scale); ``step``: a decoding step's GEMM."""
    assert a.dtype == w.dtype and a.shape[1] == w.shape[1]
    a, w = a.contiguous(), w.contiguous()
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or a.dtype, device=a.device)
    if m == 0:
        return out
    bm, bn, bk, gm, warps, stages = config(a.dtype, step)
    has_scale = a_scale is not None
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _matmul_kernel[grid](a, w, out, a_scale if has_scale else a, w_scale if has_scale else w,
                         m, n, k, a.stride(0), w.stride(0), out.stride(0),
                         HAS_SCALE=has_scale, A_SCALAR=has_scale and a_scale.dim() == 0,
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
                         num_warps=warps, num_stages=stages)
    return out

"""Row-wise kernels for CUDA, one program per row, so a row's reduction never depends on
how many rows there are (a library reduction may re-split a long row when rows are few):
RMSNorm, fp8 quantisation per token or with a static scale."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.fp8 import INV_FP8_MAX


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, D, eps, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(out_ptr + row * D + cols, (x * rms * (OFFSET + w)).to(out_ptr.dtype.element_ty),
             mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm ``x / rms(x) * (offset + w)`` (Gemma: offset 1), fp32 inside, over the last dim."""
    d = x.shape[-1]
    x2 = x.contiguous().view(-1, d)
    out = torch.empty_like(x2)
    _rmsnorm_kernel[(x2.shape[0],)](x2, weight, out, d, eps, OFFSET=offset,
                                      BLOCK=triton.next_power_of_2(d))
    return out.view(x.shape)


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, D, INV_FP8_MAX, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, D, BLOCK):
        x = tl.load(x_ptr + row * D + start + cols, mask=start + cols < D, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    # The rule of quant/fp8.py to the bit: scale = amax * fp32(1/448), then an IEEE division.
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) * INV_FP8_MAX
    store_quantized_row(x_ptr, out_ptr, scale_ptr, row, D, scale, BLOCK)


@triton.jit
def store_quantized_row(x_ptr, out_ptr, scale_ptr, row, D, scale, BLOCK: tl.constexpr):
    """Row ``row`` of ``x`` [rows, D] divided by its ``scale`` (IEEE division, clamped to
    ±448) into fp8, chunk by chunk, and the scale stored."""
    cols = tl.arange(0, BLOCK)
    for start in range(0, D, BLOCK):
        mask = start + cols < D
        x = tl.load(x_ptr + row * D + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
        tl.store(out_ptr + row * D + start + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 e4m3 quantisation in one read and one write (quant/fp8.py's rule)."""
    x = x.contiguous()
    rows, d = x.shape
    out = torch.empty(rows, d, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(rows,)](x, out, scale, d, INV_FP8_MAX, BLOCK=1024, num_warps=4)
    return out, scale


@triton.jit
def _quantize_static_kernel(x_ptr, out_ptr, scale_ptr, D, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    scale = tl.load(scale_ptr)
    cols = tl.arange(0, BLOCK)
    for start in range(0, D, BLOCK):
        mask = start + cols < D
        x = tl.load(x_ptr + row * D + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
        tl.store(out_ptr + row * D + start + cols, q.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_static_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 e4m3 with one fixed scale (0-dim fp32, quant/fp8_static.py's rule), row by row."""
    x = x.contiguous()
    rows, d = x.shape
    out = torch.empty(rows, d, dtype=torch.float8_e4m3fn, device=x.device)
    if rows:
        _quantize_static_kernel[(rows,)](x, out, scale, d, BLOCK=1024, num_warps=4)
    return out

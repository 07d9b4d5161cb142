"""int8 weight-only: symmetric per-output-channel scales computed once at load; activations
stay in the engine's dtype (fp32 on the CPU, bf16 on CUDA).

The product runs on the dequantised weight through the same batch-invariant ``linear`` as the
other schemes (fixed row tiles on the CPU, the fixed-tiling GEMM on CUDA), so a row's bits still
depend on nothing but the row. int8 values are exact in fp32 and bf16, so dequantising is a
cast; the per-channel scale multiplies the output columns, a row-wise step.
"""

from __future__ import annotations

import torch

from ..kernels.matmul import linear
from ..tiles import ROW_TILE
from .fp8 import row_amax

INT8_MAX = 127.0


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 [N, K], fp32 scale [N]), round to nearest, symmetric in [-127, 127]."""
    w = weight.to(torch.float32, copy=True)    # one fp32 copy, worked on in place
    scale = row_amax(w).clamp(min=1e-12) / INT8_MAX
    return w.div_(scale[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *,
                tile: int = ROW_TILE) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T`` for an int8 ``weight``, batch-invariant."""
    y = linear(x, weight.to(x.dtype), tile=tile)
    return (y.float() * scale).to(x.dtype)

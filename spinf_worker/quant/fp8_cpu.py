"""Per-token fp8 W8A8 on the CPU: the exact reference path of the fp8 scheme (the
fp8-static scheme's is quant/fp8_static.py). Apart from quant/fp8.py, which the CUDA
kernels import, since this one imports the matmul that imports them."""

from __future__ import annotations

import torch

from ..kernels.matmul import tiled_linear
from ..tiles import ROW_TILE
from .fp8 import quantize_rows


def fp8_dynamic_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
                       tile: int = ROW_TILE) -> torch.Tensor:
    """Each row quantised by its own scale (quant/fp8.py's rule), the fp8 values multiplied in
    fp32 (a product of two e4m3 values is exact in fp32; only the sums round) through the
    fixed-tile matmul, then ``acc * x_scale * weight_scale`` in the Triton GEMM's order
    (kernels/triton_matmul.py)."""
    xq, x_scale = quantize_rows(x)
    acc = tiled_linear(xq.float(), weight.float(), tile)
    return (acc * x_scale[:, None] * weight_scale).to(x.dtype)

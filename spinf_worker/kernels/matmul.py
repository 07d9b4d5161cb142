"""Batch-invariant matmul.

A library GEMM picks its kernel, thread split and so its reduction order from the shape: the
same row multiplied inside 128 rows or inside 30,000 rows can come out with different bits
(on this CPU's MKL a lone [128, 2048] product and a batched one already differ). Every call
here hands the library one fixed shape, ``[tile, K] @ [K, N]``, tile after tile, so a row's
bits never depend on how many other rows share the pass. Documents start at tile
boundaries, so a tile never mixes two documents either.
"""

from __future__ import annotations

import torch

from ..tiles import ROW_TILE


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` of shape ``[M, K]`` with ``M % tile == 0``."""
    rows = x.shape[0]
    if rows % tile:
        raise ValueError(f"{rows} rows is not a multiple of the {tile}-row tile")
    out = x.new_empty(rows, weight.shape[0])
    w_t = weight.t()
    for i in range(0, rows, tile):
        torch.mm(x[i:i + tile], w_t, out=out[i:i + tile])
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
           *, x_scale: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
           tile: int = ROW_TILE, out_dtype: torch.dtype | None = None,
           step: bool = False) -> torch.Tensor:
    """A bias-free linear layer, batch-invariant on every device.

    CPU: fixed-shape library products, tile after tile. CUDA: the fixed-tiling Triton GEMM;
    with an fp8 weight (``weight_scale`` set) the activations are quantised per token, or
    with the static ``input_scale`` (0-dim) when given, unless ``x`` already is fp8 with its
    ``x_scale`` (per row, or the static one: from a fused kernel). ``step``: a decoding
    step's GEMM (CUDA: its own tiles, triton_matmul.STEP_CONFIGS)."""
    if not x.is_cuda:
        return tiled_linear(x, weight, tile)
    from .rowwise import quantize_rows_fp8, quantize_static_fp8
    from .triton_matmul import matmul

    if weight_scale is None:
        return matmul(x, weight, out_dtype=out_dtype, step=step)
    if x_scale is None:
        out_dtype = out_dtype or x.dtype
        if input_scale is None:
            x, x_scale = quantize_rows_fp8(x)
        else:
            x, x_scale = quantize_static_fp8(x, input_scale), input_scale
    return matmul(x, weight, a_scale=x_scale, w_scale=weight_scale,
                  out_dtype=out_dtype or torch.bfloat16, step=step)

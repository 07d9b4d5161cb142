"""Building blocks shared by every model family: the batch-invariant linear layer, RMSNorm and
rotary embeddings over packed ``[tokens, ...]`` activations."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.matmul import linear
from ..quant.fp8 import quantize_weight


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, row-wise, scaled by ``offset + w`` (Gemma stores ``w - 1``, so
    its offset is 1; Llama and Qwen use 0)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from ..kernels.rowwise import rmsnorm

            return rmsnorm(x, self.weight, self.eps, self.offset)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (self.offset + self.weight.float())).type_as(x)


class Linear(nn.Module):
    """Bias-free linear layer through the batch-invariant matmul (bf16/fp32, or fp8 W8A8)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.weight_scale: torch.Tensor | None = None

    def to_fp8(self) -> None:
        """Per-output-channel fp8 weights, computed once at load."""
        w8, scale = quantize_weight(self.weight.data)
        self.weight = nn.Parameter(w8, requires_grad=False)
        self.weight_scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.weight_scale)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float, linear_factor: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float,
                                            device=positions.device) / head_dim))
    freqs = positions.float()[:, None] * (inv_freq / linear_factor)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

"""fp8 (e4m3) W8A8: per-output-channel weight scales computed once at load, per-token
activation scales computed per pass. A per-tensor activation scale would take its max over
the whole pass and so mix documents; a per-token one depends on the token's own row only."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INV_FP8_MAX = 1.0 / FP8_MAX   # scales are amax * fp32(1/448): one rule for torch and Triton


def row_amax(w: torch.Tensor) -> torch.Tensor:
    """max |w| per row without an [N, K] temporary (loading quantises layer by layer)."""
    return torch.maximum(w.amax(dim=1), -w.amin(dim=1))


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (fp8 [N, K], fp32 scale [N])."""
    w = weight.to(torch.float32, copy=True)    # one fp32 copy, divided and clamped in place
    scale = row_amax(w).clamp(min=1e-12) / FP8_MAX
    return w.div_(scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (fp8 [M, K], fp32 scale [M]). Max and division are exact per row."""
    xf = x.float()
    scale = xf.abs().amax(dim=1).clamp(min=1e-12) * INV_FP8_MAX
    return (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale

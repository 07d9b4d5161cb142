"""fp8 (e4m3) W8A8 with static activation scales: one fp32 scale per linear layer's input,
calibrated offline (tools/fp8_calibrate.py) and read at load; weights per output channel as
in quant/fp8.py.

The rule, for the calibration and every device: ``scale = max(amax, 1e-12) * fp32(1/448)``,
``amax`` the largest |x| the layer's input took over the calibration rows; an input is
quantised as ``clamp(x / scale, -448, 448)`` (an IEEE division) cast to e4m3. A static scale
depends on nothing in the pass, so a row's fp8 values are its own: batch-invariant by
construction.

Scales files are safetensors: one 0-dim fp32 tensor per linear layer, keyed by the module's
name plus ``.input_scale`` (fused projections by their fused name: q|k|v and gate|up share
their input), with the model's weights digest in the metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..kernels.matmul import tiled_linear
from ..tiles import ROW_TILE
from .fp8 import FP8, FP8_MAX, INV_FP8_MAX

SCALES_FILE = "fp8-static-scales.safetensors"   # looked for next to a checkpoint
SUFFIX = ".input_scale"
RULE = "scale = max(amax, 1e-12) * fp32(1/448); amax = max |x| of the layer's input over the " \
       "calibration rows; x -> clamp(x / scale, -448, 448) as e4m3"


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The static scale (0-dim fp32) of an input whose largest |x| is ``amax``."""
    return torch.clamp(amax.to(torch.float32), min=1e-12) * INV_FP8_MAX


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] -> fp8 with the fixed ``scale`` (torch: the CPU and the tests' reference)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_static_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      input_scale: torch.Tensor, *, tile: int = ROW_TILE) -> torch.Tensor:
    """The CPU path: ``x`` quantised with its static scale, the fp8 values multiplied in fp32
    (a product of two e4m3 values is exact in fp32; only the sums round) through the
    fixed-tile matmul, then ``acc * input_scale * weight_scale`` in the Triton GEMM's order."""
    acc = tiled_linear(quantize_static(x, input_scale).float(), weight.float(), tile)
    return (acc * input_scale * weight_scale).to(x.dtype)


def scales_path(explicit: str | Path | None, checkpoint_dir: Path | None) -> Path:
    """The scales file: the one given, else ``fp8-static-scales.safetensors`` beside the
    checkpoint's config.json."""
    if explicit:
        return Path(explicit)
    if checkpoint_dir is not None and (Path(checkpoint_dir) / SCALES_FILE).is_file():
        return Path(checkpoint_dir) / SCALES_FILE
    raise ValueError(f"scheme fp8-static needs activation scales: pass --fp8-scales FILE "
                     f"(from `spinf-serve quantize fp8-static`) or put {SCALES_FILE} beside "
                     "the checkpoint")


def save_scales(path: Path, scales: dict[str, torch.Tensor], metadata: dict) -> None:
    """``scales``: module name -> 0-dim fp32 scale."""
    from safetensors.torch import save_file

    tensors = {name + SUFFIX: s.detach().to(torch.float32).reshape(()).cpu().contiguous()
               for name, s in sorted(scales.items())}
    save_file(tensors, str(path), metadata={k: str(v) if isinstance(v, str) else json.dumps(v)
                                            for k, v in metadata.items()})


def load_scales(path: Path, weights_digest: str | None = None
                ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(module name -> 0-dim fp32 scale, the file's metadata). A file calibrated on other
    weights (its ``weights_digest`` differs) or with a bad entry is a ValueError."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise ValueError(f"fp8 scales file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            raw = {key: f.get_tensor(key) for key in f.keys()}   # noqa: SIM118 (not a dict)
    except Exception as err:   # safetensors raises its own error types for a bad header
        raise ValueError(f"fp8 scales file {path}: not a safetensors file ({err})") from None
    stored = meta.get("weights_digest")
    if weights_digest and stored and stored != weights_digest:
        raise ValueError(f"fp8 scales file {path} was calibrated on other weights "
                         f"(digest {stored[:12]}, the model's {weights_digest[:12]})")
    scales = {}
    for key, value in raw.items():
        if not key.endswith(SUFFIX) or value.numel() != 1:
            raise ValueError(f"fp8 scales file {path}: unexpected entry {key!r} "
                             f"{tuple(value.shape)}")
        s = value.to(torch.float32).reshape(())
        if not bool(torch.isfinite(s)) or float(s) <= 0:
            raise ValueError(f"fp8 scales file {path}: {key} is {float(s)}, not a positive scale")
        scales[key[: -len(SUFFIX)]] = s
    return scales, meta

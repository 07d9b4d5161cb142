"""fp8 checkpoints as published (compressed-tensors "float-quantized", quant/fp8_config.py):
their linear layers read as stored, for the fp8 and fp8-static schemes, and dequantised for
the others.

Per quantised linear layer ``X`` of ``in`` inputs and ``out`` outputs a checkpoint holds:

- ``X.weight`` float8_e4m3fn ``[out, in]``;
- ``X.weight_scale`` fp32 ``[out, 1]`` (per channel) or ``[1]`` / ``[]`` (per tensor):
  ``weight = weight_scale * X.weight``;
- ``X.input_scale`` fp32 ``[1]`` / ``[]`` when activations are static: an input is
  ``clamp(x / input_scale, -448, 448)`` in e4m3, as quant/fp8_static.py quantises.

The engine's fp8 weights are that layout already (e4m3 ``[out, in]`` and a per-channel fp32
scale, quant/fp8.py): the codes are served as stored, a per-tensor scale broadcast to every
channel (the same product for each output), no dequantise-requantise round trip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8 import FP8
from .fp8_config import Fp8Format
from .gptq_config import unsupported

SCALE = ".weight_scale"


@dataclass(frozen=True)
class Fp8Weight:
    """One layer's stored fp8 weight, as the engine's fp8 Linear holds it."""

    weight: torch.Tensor                  # float8_e4m3fn [out, in], as stored
    weight_scale: torch.Tensor            # fp32 [out]
    input_scale: torch.Tensor | None      # 0-dim fp32 (static activations), else None
    # a fused projection's parts' input scales when they differed (``input_scale`` is their max)
    part_input_scales: tuple[float, ...] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dense(self) -> torch.Tensor:
        """The fp32 weight ``[out, in]``: ``code * scale`` (what compressed-tensors decompresses)."""
        return self.weight.float() * self.weight_scale[:, None]

    def to(self, device: torch.device) -> Fp8Weight:
        return Fp8Weight(self.weight.to(device), self.weight_scale.to(device),
                         None if self.input_scale is None else self.input_scale.to(device),
                         self.part_input_scales)

    @classmethod
    def join(cls, parts: list[Fp8Weight], interleave: bool) -> Fp8Weight:
        """A fused projection's weight from its parts' (rows concatenated, or interleaved as
        ``join_parts`` does a dense one's). The parts read one input, which the fused GEMM
        quantises once: with one input scale. Checkpoints calibrate each part on that same
        input, so their scales agree and the join is exact; where they differ the largest is
        taken (as vLLM does): no part's input is clipped, those with a smaller scale get
        coarser steps; the parts' scales are kept in ``part_input_scales``."""
        def rows(tensors: list[torch.Tensor]) -> torch.Tensor:
            return (torch.stack(tensors, dim=1).flatten(0, 1) if interleave
                    else torch.cat(tensors))
        scales = [p.input_scale for p in parts]
        if any(s is None for s in scales) and not all(s is None for s in scales):
            raise unsupported("the parts of a fused projection mix static and dynamic "
                              "activation scales")
        joined, differ = None, None
        if scales[0] is not None:
            joined = torch.stack(scales).max()
            if any(not torch.equal(s, joined) for s in scales):
                differ = tuple(float(s) for s in scales)
        return cls(rows([p.weight for p in parts]), rows([p.weight_scale for p in parts]),
                   joined, differ)


def _scalar(name: str, value: torch.Tensor) -> torch.Tensor:
    if value.numel() != 1:
        raise unsupported(f"fp8 {name} of shape {tuple(value.shape)}, not one scale")
    s = value.to(torch.float32).reshape(())
    if not bool(torch.isfinite(s)) or float(s) <= 0:
        raise unsupported(f"fp8 {name} is {float(s)}, not a positive scale")
    return s


def stored_layer(prefix: str, weights: dict[str, torch.Tensor], fmt: Fp8Format) -> Fp8Weight:
    """Layer ``prefix``'s tensors checked and held as the engine serves them."""
    weight, scale = weights[prefix + ".weight"], weights[prefix + SCALE]
    if weight.dtype != FP8 or weight.dim() != 2:
        raise unsupported(f"{prefix}.weight is {weight.dtype} {tuple(weight.shape)}, not "
                          "float8_e4m3fn [out, in]")
    out = weight.shape[0]
    if scale.numel() == 1:
        per_channel = _scalar(prefix + SCALE, scale).expand(out).contiguous()
    elif tuple(scale.shape) in ((out,), (out, 1)):
        per_channel = scale.to(torch.float32).reshape(out).contiguous()
    else:
        raise unsupported(f"{prefix}{SCALE} of shape {tuple(scale.shape)} for a weight of "
                          f"{out} channels (supported: per channel, per tensor)")
    stored = weights.get(prefix + ".input_scale")
    if fmt.static and stored is None:
        raise unsupported(f"{prefix} lacks input_scale (static activations)")
    input_scale = _scalar(prefix + ".input_scale", stored) if fmt.static else None
    return Fp8Weight(weight, per_channel, input_scale)


def split_fp8(weights: dict[str, torch.Tensor], fmt: Fp8Format
              ) -> tuple[dict[str, torch.Tensor], dict[str, Fp8Weight]]:
    """(the other tensors, the fp8 layers as stored by ``X``). A layer is fp8 where the
    checkpoint stores its weight so (the ``ignore``d ones are stored dense): with its
    ``X.weight_scale``. Its dense weight is not made here: a scheme that wants it dequantises
    one layer at a time as it loads (``Fp8Weight.dense``), so loading holds no fp32 copy of
    the model."""
    dense, stored = dict(weights), {}
    for key, tensor in weights.items():
        if tensor.dtype == FP8 and key.endswith(".weight") and key[:-7] + SCALE not in weights:
            raise unsupported(f"{key} is float8_e4m3fn without a weight_scale")
    for prefix in [k.removesuffix(SCALE) for k in weights if k.endswith(SCALE)]:
        if prefix + ".weight" not in weights:
            raise unsupported(f"{prefix}{SCALE} without {prefix}.weight")
        layer = stored_layer(prefix, weights, fmt)
        for leaf in (".weight", SCALE, ".input_scale", ".weight_zero_point",
                     ".input_zero_point"):
            dense.pop(prefix + leaf, None)
        stored[prefix] = layer
    if not stored:
        raise unsupported("compressed-tensors fp8 config but no fp8 weights in the checkpoint")
    return dense, stored

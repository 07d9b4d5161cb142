"""A checkpoint -> the model on its device: device and scheme choice, the stack built on the
meta device, weights loaded (or random with the real shapes), quantised."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .loader import Checkpoint

SCHEMES = ("fp32", "bf16", "fp8", "int8")


@dataclass
class BuiltModel:
    model: torch.nn.Module
    config: object        # the family's config dataclass
    device: torch.device
    scheme: str           # fp32 | bf16 | fp8 | int8
    dtype: torch.dtype    # activations


def pick_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_scheme(scheme: str, device: torch.device) -> str:
    """``auto``: fp8 on GPUs with fp8 tensor cores, bf16 on other GPUs, fp32 on the CPU."""
    if scheme == "auto":
        if device.type != "cuda":
            return "fp32"
        return "fp8" if torch.cuda.get_device_capability(device) >= (8, 9) else "bf16"
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantisation scheme {scheme!r} ({', '.join(SCHEMES)})")
    if scheme not in ("fp32", "int8") and device.type != "cuda":
        raise ValueError(f"scheme {scheme} runs on CUDA only; the CPU runs fp32")
    return scheme


def activation_dtype(scheme: str, device: torch.device) -> torch.dtype:
    # int8 is weight-only: activations in fp32 on the CPU, bf16 on CUDA.
    if scheme == "fp32" or (scheme == "int8" and device.type != "cuda"):
        return torch.float32
    return torch.bfloat16


def init_random(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights with the real shapes: for speed measurements where values don't matter."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
    for module in model.modules():   # norms that scale by w (not 1 + w) start at 1
        if getattr(module, "offset", None) == 0:
            module.weight.data.fill_(1.0)


def build_model(checkpoint: Checkpoint, device: str | None = None, scheme: str = "auto"
                ) -> BuiltModel:
    """``checkpoint.weights = None`` builds random weights with the real shapes."""
    from .registry import family_for

    where = pick_device(device)
    scheme = pick_scheme(scheme, where)
    dtype = activation_dtype(scheme, where)
    family = family_for(checkpoint.config)
    config = family.config(checkpoint.config)
    with torch.device("meta"):
        model = family.build(config)
    model = model.to_empty(device=where).to(dtype)
    with torch.no_grad():
        if checkpoint.weights is None:
            init_random(model)
        else:
            model.load_hf_weights(checkpoint.weights)
        if scheme == "fp8":
            model.to_fp8()
        elif scheme == "int8":
            model.to_int8()
    return BuiltModel(model.eval(), config, where, scheme, dtype)

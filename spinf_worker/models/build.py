"""A checkpoint -> the model on its device: device and scheme choice, the stack built on the
meta device, weights loaded (or random with the real shapes), quantised."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .loader import Checkpoint

SCHEMES = ("fp32", "bf16", "fp8", "fp8-static", "int8")


@dataclass
class BuiltModel:
    model: torch.nn.Module
    config: object        # the family's config dataclass
    device: torch.device
    scheme: str           # fp32 | bf16 | fp8 | fp8-static | int8
    dtype: torch.dtype    # activations


def pick_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_scheme(scheme: str, device: torch.device, stored: str | None = None) -> str:
    """``auto``: fp8 on GPUs with fp8 tensor cores, bf16 on other GPUs, fp32 on the CPU.
    ``stored``: the checkpoint's own quantisation (GPTQ int4), whose dequantised weights are
    served as they are (fp32 / bf16): quantising them again would only lose more."""
    if scheme == "auto":
        if device.type != "cuda":
            return "fp32"
        if stored:
            return "bf16"
        return "fp8" if torch.cuda.get_device_capability(device) >= (8, 9) else "bf16"
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantisation scheme {scheme!r} ({', '.join(SCHEMES)})")
    if stored and scheme in ("fp8", "fp8-static", "int8"):
        raise ValueError(f"scheme {scheme} does not apply to a {stored} checkpoint "
                         "(its weights are already quantised): use auto, fp32 or bf16")
    if scheme not in ("fp32", "int8", "fp8-static") and device.type != "cuda":
        raise ValueError(f"scheme {scheme} runs on CUDA only; the CPU runs fp32, int8 and "
                         "fp8-static")
    return scheme


def activation_dtype(scheme: str, device: torch.device) -> torch.dtype:
    # int8 is weight-only and fp8-static's CPU path multiplies the fp8 values in fp32: their
    # activations are fp32 on the CPU, bf16 on CUDA.
    if scheme == "fp32" or (scheme in ("int8", "fp8-static") and device.type != "cuda"):
        return torch.float32
    return torch.bfloat16


def init_random(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights with the real shapes: for speed measurements where values don't matter."""
    fill = random_filler(model, next(model.parameters()).device, seed)
    for name, p in model.named_parameters():
        fill(name, p)


def random_filler(model: torch.nn.Module, device: torch.device, seed: int = 0):
    """A ``fill(name, param)`` drawing each weight in turn from one generator (the order of
    ``named_parameters``); norms start at 0 (1 where they scale by w, not 1 + w)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    plain_norms = {f"{prefix}.weight" if prefix else "weight"
                   for prefix, module in model.named_modules()
                   if getattr(module, "offset", None) == 0}

    def fill(name: str, param: torch.Tensor) -> None:
        if name.endswith("norm.weight"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=gen)
        if name in plain_norms:
            param.fill_(1.0)

    return fill


def materialize(model: torch.nn.Module, device: torch.device, fill, scheme: str,
                input_scales: dict[str, torch.Tensor] | None = None) -> None:
    """Give a meta-built model its tensors module by module, each directly in the model's
    dtype on ``device``, filled (``fill(name, param)``) and, for fp8 / int8, the body's
    linear layers quantised at once: only one layer's full-precision weight exists at a time,
    so loading peaks near the served size, not at the full-precision model's. fp8-static:
    ``input_scales`` (module name -> static activation scale) has one for every such layer."""
    quantised = (set(model.body_linears()) if scheme in ("fp8", "fp8-static", "int8")
                 else set())
    if scheme == "fp8-static":
        names = {m: name for name, m in model.named_modules()}
        lacking = sorted(names[m] for m in quantised if names[m] not in (input_scales or {}))
        if lacking:
            raise ValueError(f"the fp8 scales lack {len(lacking)} of the model's "
                             f"{len(quantised)} linear layers, e.g. {lacking[:3]}")
    for prefix, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is None:
            continue
        module.to_empty(device=device, recurse=False)
        for name, param in module.named_parameters(recurse=False):
            fill(f"{prefix}.{name}" if prefix else name, param)
        if module in quantised:
            if scheme == "int8":
                module.to_int8()
            else:
                module.to_fp8(input_scales[prefix] if scheme == "fp8-static" else None)


def build_model(checkpoint: Checkpoint, device: str | None = None, scheme: str = "auto",
                input_scales: dict[str, torch.Tensor] | None = None) -> BuiltModel:
    """``checkpoint.weights = None`` builds random weights with the real shapes;
    ``input_scales``: fp8-static's activation scales (quant/fp8_static.load_scales)."""
    from .registry import family_for

    where = pick_device(device)
    scheme = pick_scheme(scheme, where, checkpoint.quantization)
    dtype = activation_dtype(scheme, where)
    family = family_for(checkpoint.config)
    config = family.config(checkpoint.config)
    with torch.device("meta"):
        model = family.build(config).to(dtype)
    if checkpoint.weights is None:
        fill = random_filler(model, where)
    else:
        missing = []

        def fill(name: str, param: torch.Tensor) -> None:
            if not model.load_weight(checkpoint.weights, name, param):
                missing.append(name)

    with torch.no_grad():
        materialize(model, where, fill, scheme, input_scales)
    if checkpoint.weights is not None and missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    return BuiltModel(model.eval(), config, where, scheme, dtype)

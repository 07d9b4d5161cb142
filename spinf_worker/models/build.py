"""A checkpoint -> the model on its device: device and scheme choice, the stack built on the
meta device, weights loaded (or random with the real shapes), quantised."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant.gptq import Int4Weight
from .loader import Checkpoint

SCHEMES = ("fp32", "bf16", "fp8", "fp8-static", "int8", "int4")
INT4_RANDOM_GROUP = 128     # the group size of random int4 weights (speed runs)


@dataclass
class BuiltModel:
    model: torch.nn.Module
    config: object        # the family's config dataclass
    device: torch.device
    scheme: str           # fp32 | bf16 | fp8 | fp8-static | int8 | int4
    dtype: torch.dtype    # activations


def pick_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_scheme(scheme: str, device: torch.device, stored: str | None = None,
                random: bool = False) -> str:
    """``auto``: fp8 on GPUs with fp8 tensor cores, bf16 on other GPUs, fp32 on the CPU.
    ``stored``: the checkpoint's own quantisation (GPTQ int4), served as it is: its packed
    weights through the W4A16 GEMM on CUDA (int4), dequantised on the CPU (fp32), or
    dequantised in bf16 when asked; quantising them again would only lose more. ``random``:
    random weights, which int4 draws as random codes."""
    if scheme == "auto":
        if device.type != "cuda":
            return "fp32"
        if stored:
            return "int4"
        return "fp8" if torch.cuda.get_device_capability(device) >= (8, 9) else "bf16"
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantisation scheme {scheme!r} ({', '.join(SCHEMES)})")
    if stored and scheme in ("fp8", "fp8-static", "int8"):
        raise ValueError(f"scheme {scheme} does not apply to a {stored} checkpoint "
                         "(its weights are already quantised): use auto, int4, fp32 or bf16")
    if scheme == "int4" and not (stored or random):
        raise ValueError("scheme int4 serves GPTQ int4 checkpoints (or random weights); "
                         "this checkpoint is not quantised: use auto, bf16, fp8 or int8")
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
                input_scales: dict[str, torch.Tensor] | None = None, int4=None) -> None:
    """Give a meta-built model its tensors module by module, each directly in the model's
    dtype on ``device``, filled (``fill(name, param)``) and, for fp8 / int8, the body's
    linear layers quantised at once: only one layer's full-precision weight exists at a time,
    so loading peaks near the served size, not at the full-precision model's. fp8-static:
    ``input_scales`` (module name -> static activation scale) has one for every such layer.
    int4: ``int4(prefix, module)`` gives a body layer's packed weight (None: the layer is
    dense)."""
    quantised = (set(model.fp8_linears()) if scheme in ("fp8", "fp8-static") else
                 set(model.body_linears()) if scheme in ("int8", "int4") else set())
    if scheme == "fp8-static":
        names = {m: name for name, m in model.named_modules()}
        lacking = sorted(names[m] for m in quantised if names[m] not in (input_scales or {}))
        if lacking:
            raise ValueError(f"the fp8 scales lack {len(lacking)} of the model's "
                             f"{len(quantised)} linear layers, e.g. {lacking[:3]}")
    for prefix, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is None:
            continue
        if module in quantised and scheme == "int4":
            packed = int4(prefix, module)
            if packed is not None:      # a layer the checkpoint keeps dense stays dense
                module.to_empty(device=device, recurse=False)
                module.to_int4(packed)
                if module.bias is not None:
                    fill(f"{prefix}.bias", module.bias)
                continue
        module.to_empty(device=device, recurse=False)
        for name, param in module.named_parameters(recurse=False):
            fill(f"{prefix}.{name}" if prefix else name, param)
        if module in quantised and scheme == "int8":
            module.to_int8()
        elif module in quantised and scheme != "int4":
            module.to_fp8(input_scales[prefix] if scheme == "fp8-static" else None)


def int4_source(model: torch.nn.Module, checkpoint: Checkpoint, device: torch.device):
    """``int4(prefix, module)``: a GPTQ checkpoint's packed weight of a layer on ``device``,
    or random codes of its shape for random weights."""
    if checkpoint.weights is None:
        gen = torch.Generator(device=device).manual_seed(0)

        def random_int4(prefix: str, module) -> Int4Weight:
            out, d_in = module.weight.shape
            return Int4Weight.random(out, d_in, INT4_RANDOM_GROUP, device, gen)
        return random_int4

    def packed(prefix: str, module) -> Int4Weight | None:
        found = model.int4_weight(checkpoint.int4 or {}, prefix)
        return None if found is None else found.to(device)
    return packed


def build_model(checkpoint: Checkpoint, device: str | None = None, scheme: str = "auto",
                input_scales: dict[str, torch.Tensor] | None = None) -> BuiltModel:
    """``checkpoint.weights = None`` builds random weights with the real shapes;
    ``input_scales``: fp8-static's activation scales (quant/fp8_static.load_scales)."""
    from .registry import family_for

    where = pick_device(device)
    scheme = pick_scheme(scheme, where, checkpoint.quantization, checkpoint.weights is None)
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
        materialize(model, where, fill, scheme, input_scales,
                    int4_source(model, checkpoint, where))
    if checkpoint.weights is not None and missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    return BuiltModel(model.eval(), config, where, scheme, dtype)

"""A checkpoint -> the model on its device: device and scheme choice, the stack built on the
meta device, weights loaded (or random with the real shapes), quantised."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..quant.formats import StoredFormat
from ..quant.fp8_checkpoint import Fp8Weight
from ..quant.fp8_static import scale_of
from ..quant.gptq import Int4Weight
from .loader import Checkpoint

logger = logging.getLogger(__name__)

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


# the schemes that serve a quantised checkpoint, by its own (stored) scheme: its weights as
# stored, or dequantised (fp32, bf16); quantising them again would only lose more
STORED_SCHEMES = {"int4": ("int4", "fp32", "bf16"),
                  "fp8-static": ("fp8-static", "fp8", "fp32", "bf16"),
                  "fp8": ("fp8", "fp8-static", "fp32", "bf16")}


def pick_scheme(scheme: str, device: torch.device, stored: StoredFormat | None = None,
                random: bool = False) -> str:
    """``auto``: fp8 on GPUs with fp8 tensor cores, bf16 on other GPUs, fp32 on the CPU.
    ``stored``: the checkpoint's own quantisation, served as it is. GPTQ int4: its packed
    weights through the W4A16 GEMM on CUDA (int4), dequantised on the CPU (fp32), or
    dequantised in bf16 when asked. fp8 (compressed-tensors): its codes and scales as stored,
    activations by its static scales (fp8-static) or per token (fp8), on the CPU through the
    exact reference paths too; dequantised in bf16 on GPUs without fp8 tensor cores.
    ``random``: random weights, which int4 draws as random codes."""
    native = stored.scheme if stored is not None else None
    cuda = device.type == "cuda"
    if scheme == "auto":
        fp8_cores = cuda and torch.cuda.get_device_capability(device) >= (8, 9)
        if native in ("fp8", "fp8-static"):
            return native if fp8_cores or not cuda else "bf16"
        if not cuda:
            return "fp32"
        if native:
            return native
        return "fp8" if fp8_cores else "bf16"
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantisation scheme {scheme!r} ({', '.join(SCHEMES)})")
    if native and scheme not in STORED_SCHEMES[native]:
        raise ValueError(f"scheme {scheme} does not apply to a {stored.describe()} checkpoint "
                         "(its weights are already quantised): use auto, "
                         f"{', '.join(STORED_SCHEMES[native])}")
    if scheme == "int4" and not (stored or random):
        raise ValueError("scheme int4 serves GPTQ int4 checkpoints (or random weights); "
                         "this checkpoint is not quantised: use auto, bf16, fp8 or int8")
    if scheme not in ("fp32", "int8", "fp8", "fp8-static") and not cuda:
        raise ValueError(f"scheme {scheme} runs on CUDA only; the CPU runs fp32, int8, fp8 "
                         "and fp8-static")
    return scheme


def activation_dtype(scheme: str, device: torch.device) -> torch.dtype:
    # int8 is weight-only and fp8's CPU paths multiply the fp8 values in fp32: their
    # activations are fp32 on the CPU, bf16 on CUDA.
    if scheme == "fp32" or (scheme in ("int8", "fp8", "fp8-static") and device.type != "cuda"):
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
                input_scales: dict[str, torch.Tensor] | None = None, stored=None) -> None:
    """Give a meta-built model its tensors module by module, each directly in the model's
    dtype on ``device``, filled (``fill(name, param)``) and, for fp8 / int8, the body's
    linear layers quantised at once: only one layer's full-precision weight exists at a time,
    so loading peaks near the served size, not at the full-precision model's. fp8-static:
    ``input_scales`` (module name -> static activation scale) has one for every such layer.

    ``stored(prefix, module)``: a quantised checkpoint served in its own format (int4, fp8,
    fp8-static) gives a body layer's weight as stored (None: the checkpoint keeps that layer
    dense, and it stays so); nothing is quantised at load then. A stored fp8 layer's static
    input scale is ``input_scales``'s when given, else the checkpoint's."""
    quantised = (set(model.fp8_linears()) if scheme in ("fp8", "fp8-static") else
                 set(model.body_linears()) if scheme in ("int8", "int4") else set())
    if scheme == "fp8-static" and stored is None:
        names = {m: name for name, m in model.named_modules()}
        lacking = sorted(names[m] for m in quantised if names[m] not in (input_scales or {}))
        if lacking:
            raise ValueError(f"the fp8 scales lack {len(lacking)} of the model's "
                             f"{len(quantised)} linear layers, e.g. {lacking[:3]}")
    for prefix, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is None:
            continue
        packed = stored(prefix, module) if stored is not None and module in quantised else None
        module.to_empty(device=device, recurse=False)
        for name, param in module.named_parameters(recurse=False):
            if packed is None or name != "weight":      # a stored weight replaces it
                fill(f"{prefix}.{name}" if prefix else name, param)
        if packed is not None:
            module.set_stored(packed, _static_scale(prefix, packed, input_scales)
                              if scheme == "fp8-static" else None)
        elif stored is not None:
            continue
        elif module in quantised and scheme == "int8":
            module.to_int8()
        elif module in quantised:
            module.to_fp8(input_scales[prefix] if scheme == "fp8-static" else None)


def _static_scale(prefix: str, packed: Fp8Weight, input_scales: dict[str, torch.Tensor] | None
                  ) -> torch.Tensor:
    """A stored fp8 layer's static input scale: the scales file's, else the checkpoint's."""
    if input_scales is not None:
        if prefix not in input_scales:
            raise ValueError(f"the fp8 scales lack the linear layer {prefix}")
        return input_scales[prefix]
    if packed.input_scale is None:
        raise ValueError(f"scheme fp8-static: {prefix} has no stored input scale (dynamic "
                         "activations): pass --fp8-scales FILE or use scheme fp8")
    return packed.input_scale


def stored_source(model: torch.nn.Module, checkpoint: Checkpoint, scheme: str,
                  device: torch.device):
    """``stored(prefix, module)`` for ``materialize``: the checkpoint's weight of a layer as
    stored, on ``device`` (random int4 codes of its shape for random weights); None where
    the scheme does not serve the checkpoint's own format."""
    if scheme == "int4" and checkpoint.weights is None:
        gen = torch.Generator(device=device).manual_seed(0)

        def random_int4(prefix: str, module) -> Int4Weight:
            out, d_in = module.weight.shape
            return Int4Weight.random(out, d_in, INT4_RANDOM_GROUP, device, gen)
        return random_int4
    fmt = checkpoint.stored_format
    if checkpoint.weights is None or fmt is None or scheme in ("fp32", "bf16"):
        return None

    def as_stored(prefix: str, module) -> Int4Weight | Fp8Weight | None:
        found = model.stored_weight(checkpoint.stored or {}, prefix)
        if isinstance(found, Fp8Weight) and found.part_input_scales and scheme == "fp8-static":
            logger.warning("%s: its parts' static input scales %s differ; the fused GEMM "
                           "quantises its input once, by the largest", prefix,
                           found.part_input_scales)
        return None if found is None else found.to(device)
    return as_stored


def build_model(checkpoint: Checkpoint, device: str | None = None, scheme: str = "auto",
                input_scales: dict[str, torch.Tensor] | None = None) -> BuiltModel:
    """``checkpoint.weights = None`` builds random weights with the real shapes;
    ``input_scales``: fp8-static's activation scales (quant/fp8_static.load_scales)."""
    from .registry import family_for

    where = pick_device(device)
    scheme = pick_scheme(scheme, where, checkpoint.stored_format, checkpoint.weights is None)
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
            if model.load_weight(checkpoint.weights, name, param):
                return
            # an fp8 checkpoint's layer served dense: dequantised here, one layer at a time
            kept = (model.stored_weight(checkpoint.stored, name.removesuffix(".weight"))
                    if checkpoint.stored and name.endswith(".weight") else None)
            if kept is None:
                missing.append(name)
            elif tuple(kept.shape) != tuple(param.shape):
                raise ValueError(f"weight {name}: checkpoint shape {tuple(kept.shape)}, "
                                 f"model shape {tuple(param.shape)}")
            else:
                param.copy_(kept.dense())

    stored = stored_source(model, checkpoint, scheme, where)
    if (scheme == "fp8-static" and input_scales is None and stored is None
            and checkpoint.weights is None and checkpoint.stored_format is not None):
        # random weights of an fp8-static checkpoint: its scales' values don't matter either
        fp8 = set(model.fp8_linears())
        input_scales = {name: scale_of(torch.tensor(1.0)) for name, m in model.named_modules()
                        if m in fp8}
    with torch.no_grad():
        materialize(model, where, fill, scheme, input_scales, stored)
    if checkpoint.weights is not None and missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    return BuiltModel(model.eval(), config, where, scheme, dtype)

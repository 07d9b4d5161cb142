"""A config.json ``quantization_config`` -> the GPTQ layout the loader can read exactly
(quant/gptq.py); anything else is an error naming it, in one line. No torch: ``spinf-serve
models`` checks checkpoints with it too."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError

BITS = 4
GROUP_SIZES = (32, 128)
FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class GptqFormat:
    group_size: int
    sym: bool
    v2: bool                           # zeros stored as they are (gptq_v2), else minus one

    scheme = "int4"                    # the engine's scheme that serves these weights as stored

    def describe(self) -> str:
        return (f"gptq int4 g{self.group_size} {'sym' if self.sym else 'asym'} "
                f"{'gptq_v2' if self.v2 else 'gptq'}")


def unsupported(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"quantised checkpoint not supported: {what}", param="model")


def gptq_format(qcfg: dict) -> GptqFormat:
    """A config.json ``quantization_config`` -> the GPTQ layout it names; anything this
    loader cannot read exactly is an error naming it (one line)."""
    method = str(qcfg.get("quant_method", "")).lower()
    if method != "gptq":
        raise unsupported(f"quant_method {method or None!r} (supported: gptq int4)")
    bits = qcfg.get("bits")
    if bits != BITS:
        raise unsupported(f"GPTQ bits {bits} (supported: 4)")
    group = qcfg.get("group_size")
    if group not in GROUP_SIZES:
        raise unsupported(f"GPTQ group_size {group} (supported: 32, 128)")
    if qcfg.get("desc_act"):
        raise unsupported("GPTQ act-order (desc_act: true); supported: desc_act false")
    # transformers' GPTQConfig: checkpoint_format (the newer key) wins over format
    fmt = str(qcfg.get("checkpoint_format") or qcfg.get("format") or "gptq").lower()
    if fmt not in FORMATS:
        raise unsupported(f"GPTQ checkpoint format {fmt!r} (supported: gptq, gptq_v2)")
    pack = qcfg.get("pack_dtype", "int32")
    if str(pack).removeprefix("torch.") != "int32":
        raise unsupported(f"GPTQ pack_dtype {pack!r} (supported: int32)")
    if qcfg.get("dynamic"):
        raise unsupported("GPTQ per-module overrides (dynamic)")
    return GptqFormat(group, bool(qcfg.get("sym", True)), fmt == "gptq_v2")

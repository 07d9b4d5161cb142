"""A config.json ``quantization_config`` -> the stored layout the loader reads: GPTQ int4
(quant/gptq_config.py) or compressed-tensors fp8 (quant/fp8_config.py); anything else is an
error naming it, in one line. No torch."""

from __future__ import annotations

from .fp8_config import Fp8Format, fp8_format
from .gptq_config import GptqFormat, gptq_format

StoredFormat = GptqFormat | Fp8Format


def stored_format(qcfg: dict) -> StoredFormat:
    if str(qcfg.get("quant_method", "")).lower() == "gptq":
        return gptq_format(qcfg)
    return fp8_format(qcfg)

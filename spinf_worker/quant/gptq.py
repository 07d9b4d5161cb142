"""GPTQ int4 checkpoints (transformers / optimum / GPTQModel layout), dequantised at load.

Per quantised linear layer ``X`` of ``in`` inputs and ``out`` outputs a checkpoint holds:

- ``X.qweight`` int32 ``[in / 8, out]``: eight 4-bit codes per word along the inputs, input
  row ``8 i + k`` in bits ``4k .. 4k + 3`` of word ``i`` (lowest bits first);
- ``X.qzeros`` int32 ``[groups, out / 8]``: the zero points, packed the same way along the
  outputs; the old format (``gptq``, v1) stores ``zero - 1`` in every nibble, written as one
  int32 subtraction of 0x11111111 (borrows included), so adding it back is exact; ``gptq_v2``
  stores the zeros themselves;
- ``X.scales`` fp16 ``[groups, out]``, ``X.g_idx`` int32 ``[in]`` (input row -> group; with
  act-order off it is ``row // group_size``), and an optional ``X.bias``.

``weight[o, i] = scales[g, o] * (code[i, o] - zero[g, o])`` with ``g = g_idx[i]``. An fp16
scale times an integer in [-15, 15] fits fp32's mantissa, so the dequantised weight is exact
in fp32 whatever the order of operations: the CPU engine then scores with exactly the
dequantised model's weights (the reference the int4 GPU kernel is held to).
"""

from __future__ import annotations

import torch

from .gptq_config import BITS, GptqFormat, unsupported

PACK = 32 // BITS                      # codes per int32 word
V1_ZERO_OFFSET = 0x11111111            # +1 in each nibble: v1 zeros -> v2


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` words -> codes ``[8 n, m]`` of the same dtype: word ``i`` holds rows
    ``8i .. 8i + 7`` (a negative int32 shifts in ones, which the mask drops)."""
    shifts = torch.arange(0, 32, BITS, dtype=packed.dtype)
    codes = (packed[:, None, :] >> shifts[None, :, None]) & (2 ** BITS - 1)
    return codes.reshape(-1, packed.shape[1])


def unpack_zeros(qzeros: torch.Tensor, out: int, v2: bool) -> torch.Tensor:
    """int32 ``[groups, ceil(out / 8)]`` -> int32 zeros ``[groups, out]``."""
    words = qzeros.to(torch.int64) & 0xFFFFFFFF
    if not v2:
        words = (words + V1_ZERO_OFFSET) & 0xFFFFFFFF   # as GPTQModel's v1 -> v2 conversion
    return unpack_rows(words.T).T[:, :out].to(torch.int32)


def dequantize(name: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor | None, fmt: GptqFormat) -> torch.Tensor:
    """One layer's fp32 weight ``[out, in]`` (``name`` for the errors)."""
    d_in, out = qweight.shape[0] * PACK, qweight.shape[1]
    groups = -(-d_in // fmt.group_size)
    if (qweight.dtype != torch.int32 or tuple(scales.shape) != (groups, out)
            or tuple(qzeros.shape) != (groups, -(-out // PACK))):
        raise unsupported(f"GPTQ tensors of {name} do not match int4 group_size "
                          f"{fmt.group_size} (qweight {tuple(qweight.shape)}, "
                          f"scales {tuple(scales.shape)}, qzeros {tuple(qzeros.shape)})")
    in_order = torch.arange(d_in, dtype=torch.int64) // fmt.group_size
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), in_order):
        raise unsupported(f"GPTQ g_idx of {name} is not in input order (act-order)")
    codes = unpack_rows(qweight)                                     # [in, out]
    zeros = unpack_zeros(qzeros, out, fmt.v2)[in_order]              # [in, out]
    return (scales.float()[in_order] * (codes - zeros).float()).T.contiguous()


def dequantize_weights(weights: dict[str, torch.Tensor], fmt: GptqFormat
                       ) -> dict[str, torch.Tensor]:
    """Every ``X.qweight`` group of a checkpoint's tensors replaced by an fp32 ``X.weight``;
    the other tensors (embeddings, norms, layers left unquantised, biases) pass through."""
    out = dict(weights)
    for key in [k for k in weights if k.endswith(".qweight")]:
        prefix = key.removesuffix(".qweight")
        parts = {leaf: out.pop(f"{prefix}.{leaf}", None)
                 for leaf in ("qweight", "qzeros", "scales", "g_idx")}
        if parts["qzeros"] is None or parts["scales"] is None:
            raise unsupported(f"GPTQ layer {prefix} lacks qzeros or scales")
        out[f"{prefix}.weight"] = dequantize(prefix, fmt=fmt, **parts)
    return out

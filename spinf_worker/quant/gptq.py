"""GPTQ int4 checkpoints (transformers / optimum / GPTQModel layout): dequantised at load, and
kept packed for the int4 scheme (``Int4Weight``, kernels/int4_matmul.py).

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

from dataclasses import dataclass

import torch

from .gptq_config import BITS, GptqFormat, unsupported

PACK = 32 // BITS                      # codes per int32 word
V1_ZERO_OFFSET = 0x11111111            # +1 in each nibble: v1 zeros -> v2


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` words -> codes ``[8 n, m]`` of the same dtype: word ``i`` holds rows
    ``8i .. 8i + 7`` (a negative int32 shifts in ones, which the mask drops)."""
    shifts = torch.arange(0, 32, BITS, dtype=packed.dtype, device=packed.device)
    codes = (packed[:, None, :] >> shifts[None, :, None]) & (2 ** BITS - 1)
    return codes.reshape(-1, packed.shape[1])


def unpack_zeros(qzeros: torch.Tensor, out: int, v2: bool) -> torch.Tensor:
    """int32 ``[groups, ceil(out / 8)]`` -> int32 zeros ``[groups, out]``."""
    words = qzeros.to(torch.int64) & 0xFFFFFFFF
    if not v2:
        words = (words + V1_ZERO_OFFSET) & 0xFFFFFFFF   # as GPTQModel's v1 -> v2 conversion
    return unpack_rows(words.T).T[:, :out].to(torch.int32)


@dataclass(frozen=True)
class Int4Weight:
    """One layer's packed weight as the W4A16 GEMM takes it (kernels/int4_matmul.py)."""

    qweight: torch.Tensor     # int32 [in / 8, out], as stored
    zeros: torch.Tensor       # int32 [groups, out], unpacked (v2: the zeros themselves)
    scales: torch.Tensor      # fp32 [groups, out]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        """``[out, in]``, the dense weight's."""
        return self.qweight.shape[1], self.qweight.shape[0] * PACK

    def dense(self) -> torch.Tensor:
        """The fp32 weight ``[out, in]``: ``scale * (code - zero)`` of each input's group, exact."""
        d_in = self.qweight.shape[0] * PACK
        group = torch.arange(d_in, dtype=torch.int64, device=self.qweight.device) // self.group_size
        codes = unpack_rows(self.qweight)                                # [in, out]
        return (self.scales[group] * (codes - self.zeros[group]).float()).T.contiguous()

    def to(self, device: torch.device) -> Int4Weight:
        return Int4Weight(self.qweight.to(device), self.zeros.to(device),
                          self.scales.to(device), self.group_size)

    @classmethod
    def join(cls, parts: list[Int4Weight], interleave: bool) -> Int4Weight:
        """A fused projection's packed weight from its parts': their output columns
        concatenated, or interleaved (g0 u0 g1 u1 ...) as ``join_parts`` does a dense one's rows."""
        def cols(tensors: list[torch.Tensor]) -> torch.Tensor:
            return (torch.stack(tensors, dim=2).flatten(1, 2) if interleave
                    else torch.cat(tensors, dim=1))
        if len({p.group_size for p in parts}) != 1:
            raise unsupported("the parts of a fused projection have different group sizes")
        return cls(cols([p.qweight for p in parts]), cols([p.zeros for p in parts]),
                   cols([p.scales for p in parts]), parts[0].group_size)

    @classmethod
    def random(cls, out: int, d_in: int, group_size: int, device: torch.device,
               gen: torch.Generator) -> Int4Weight:
        """Random codes, zeros and scales of the shapes (speed runs: values don't matter);
        weights of about the scale of ``random_filler``'s N(0, 0.02)."""
        groups = -(-d_in // group_size)
        words = torch.randint(-2 ** 31, 2 ** 31, (d_in // PACK, out), generator=gen,
                              device=device, dtype=torch.int64).to(torch.int32)
        zeros = torch.randint(0, 16, (groups, out), generator=gen, device=device,
                              dtype=torch.int32)
        scales = torch.full((groups, out), 0.004, device=device)
        return cls(words, zeros, scales, group_size)


def packed_layer(name: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 g_idx: torch.Tensor | None, fmt: GptqFormat) -> Int4Weight:
    """One layer's tensors checked and unpacked where the kernel needs it (``name`` for the
    errors)."""
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
    return Int4Weight(qweight, unpack_zeros(qzeros, out, fmt.v2), scales.float(), fmt.group_size)


def split_gptq(weights: dict[str, torch.Tensor], fmt: GptqFormat
               ) -> tuple[dict[str, torch.Tensor], dict[str, Int4Weight]]:
    """(the tensors with every ``X.qweight`` group replaced by an fp32 ``X.weight``, every
    such layer packed by ``X``): each layer checked and unpacked once, its dense weight
    derived from the packed one. The other tensors (embeddings, norms, layers left
    unquantised, biases) pass through."""
    dense, packed = dict(weights), {}
    for prefix in [k.removesuffix(".qweight") for k in weights if k.endswith(".qweight")]:
        parts = {leaf: dense.pop(f"{prefix}.{leaf}", None)
                 for leaf in ("qweight", "qzeros", "scales", "g_idx")}
        if parts["qzeros"] is None or parts["scales"] is None:
            raise unsupported(f"GPTQ layer {prefix} lacks qzeros or scales")
        packed[prefix] = packed_layer(prefix, fmt=fmt, **parts)
        dense[f"{prefix}.weight"] = packed[prefix].dense()
    return dense, packed

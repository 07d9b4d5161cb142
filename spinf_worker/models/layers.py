"""Building blocks shared by every model family: the batch-invariant linear layer, RMSNorm and
rotary embeddings over packed ``[tokens, ...]`` activations."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kernels.matmul import linear
from ..quant.fp8 import quantize_weight
from ..tiles import READOUT_TILE


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, row-wise, scaled by ``offset + w`` (Gemma stores ``w - 1``, so
    its offset is 1; Llama and Qwen use 0)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from ..kernels.rowwise import rmsnorm

            return rmsnorm(x, self.weight, self.eps, self.offset)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (self.offset + self.weight.float())).type_as(x)


class Linear(nn.Module):
    """Linear layer through the batch-invariant matmul (bf16/fp32, fp8 W8A8 or int8 weights);
    bias-free unless asked (Llama-style ``attention_bias`` / ``mlp_bias``)."""

    def __init__(self, d_in: int, d_out: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.weight_scale: torch.Tensor | None = None
        self.bias = nn.Parameter(torch.empty(d_out)) if bias else None

    def to_fp8(self) -> None:
        """Per-output-channel fp8 weights, computed once at load."""
        w8, scale = quantize_weight(self.weight.data)
        self.weight = nn.Parameter(w8, requires_grad=False)
        self.weight_scale = scale

    def to_int8(self) -> None:
        """int8 weights with per-output-channel scales (weight-only), computed once at load."""
        from ..quant.int8 import quantize_weight_int8

        w8, scale = quantize_weight_int8(self.weight.data)
        self.weight = nn.Parameter(w8, requires_grad=False)
        self.weight_scale = scale

    def forward(self, x: torch.Tensor, x_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``x_scale``: ``x`` is already fp8, quantised per row with these scales."""
        if self.weight.dtype == torch.int8:
            from ..quant.int8 import int8_linear

            y = int8_linear(x, self.weight, self.weight_scale)
        else:
            y = linear(x, self.weight, self.weight_scale, x_scale=x_scale)
        return y if self.bias is None else y + self.bias   # row-wise: still batch-invariant


def concat_linears(*parts: Linear, interleave: bool = False) -> Linear:
    """One linear layer computing several that share their input (q|k|v, gate|up): one larger
    GEMM instead of several. Each output column is reduced exactly as before. ``interleave``:
    output columns alternate between the parts (g0 u0 g1 u1 ...) instead of following one
    another, so one GEMM tile holds matching columns of each (kernels/fused.gate_up_act)."""
    dtype = parts[0].weight.dtype   # fp8 is concatenated as bytes

    def join(tensors: list[torch.Tensor]) -> torch.Tensor:
        if interleave:
            return torch.stack(tensors, dim=1).flatten(0, 1)
        return torch.cat(tensors)

    weight = join([p.weight.data.view(torch.uint8) if dtype.itemsize == 1 else p.weight.data
                   for p in parts])
    with torch.device("meta"):
        fused = Linear(weight.shape[1], weight.shape[0], bias=parts[0].bias is not None)
    fused.weight = nn.Parameter(weight.view(dtype), requires_grad=False)
    if parts[0].weight_scale is not None:
        fused.weight_scale = join([p.weight_scale for p in parts])
    if fused.bias is not None:
        fused.bias = nn.Parameter(join([p.bias.data for p in parts]), requires_grad=False)
    return fused


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float, linear_factor: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float,
                                            device=positions.device) / head_dim))
    freqs = positions.float()[:, None] * (inv_freq / linear_factor)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    """Inverse frequencies of one RoPE variant, from transformers' ``rope_parameters`` (or an
    old ``rope_scaling`` dict plus ``rope_theta``): default, linear, llama3 (Llama 3.1+) and
    proportional (Gemma 4 global layers: the first ``partial_rotary_factor`` of the angles
    rotate, the rest keep frequency 0). Computed on the CPU, in float32, as transformers does."""
    kind = params.get("rope_type") or params.get("type") or "default"
    base = float(params.get("rope_theta", 10_000.0))
    partial = float(params.get("partial_rotary_factor") or 1.0)
    if kind == "proportional":
        angles = int(partial * head_dim // 2)
        inv = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.float) / head_dim))
        inv = torch.cat((inv, torch.zeros(head_dim // 2 - angles)))
        return inv / float(params.get("factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial rotary embeddings are not supported for RoPE type {kind!r}")
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(params["factor"])
    if kind == "llama3":
        factor, low, high = (float(params[k]) for k in ("factor", "low_freq_factor",
                                                        "high_freq_factor"))
        old = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"RoPE type {kind!r} is not supported "
                     "(supported: default, linear, llama3, proportional)")


def rope_cos_sin_from(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, 1, head_dim]`` for given inverse frequencies (see ``rope_inv_freq``)."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


class PackedLM(nn.Module):
    """What every stack shares: the LM head on the readout rows only, fp8 at load time, HF
    weights by name. A subclass sets ``cfg``, ``embed_tokens`` and ``lm_head`` (None: tied)."""

    def readout_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary log-softmax in fp32 for ``[n, dim]`` rows, ``n % READOUT_TILE == 0``."""
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, head, tile=READOUT_TILE, out_dtype=torch.float32).float()
        cap = getattr(self.cfg, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return torch.log_softmax(logits, dim=-1)

    def to_fp8(self) -> None:
        """W8A8 for every linear layer of the body; embeddings and the LM head stay as they are."""
        for module in self.modules():
            if isinstance(module, Linear) and module is not self.lm_head:
                module.to_fp8()

    def load_hf_weights(self, weights: dict[str, torch.Tensor],
                        optional: tuple[str, ...] = ()) -> None:
        """Copy HF-named tensors (with or without the ``model.`` prefix) into the model;
        names ending in one of ``optional`` keep their value when the checkpoint lacks them."""
        missing = []
        for name, param in self.state_dict().items():
            src = weights.get("model." + name, weights.get(name))
            if src is None:
                if not name.endswith(optional):
                    missing.append(name)
                continue
            if src.shape != param.shape:
                raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)}, "
                                 f"model shape {tuple(param.shape)}")
            param.copy_(src)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")


"""Building blocks shared by every model family: the batch-invariant linear layer, RMSNorm and
rotary embeddings over packed ``[tokens, ...]`` activations."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kernels.matmul import linear
from ..quant.fp8 import quantize_weight
from ..quant.fp8_checkpoint import Fp8Weight
from ..quant.fp8_cpu import fp8_dynamic_linear
from ..quant.fp8_static import fp8_static_linear
from ..quant.gptq import Int4Weight
from ..quant.gptq_config import unsupported
from ..quant.int8 import int8_linear, quantize_weight_int8
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
    bias-free unless asked (Llama-style ``attention_bias`` / ``mlp_bias``).

    fp8 activations are quantised per token, or with a static ``input_scale`` (0-dim fp32,
    calibrated offline: quant/fp8_static.py, or stored in the checkpoint) when the layer has
    one."""

    def __init__(self, d_in: int, d_out: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.weight_scale: torch.Tensor | None = None
        self.int4: Int4Weight | None = None
        self.input_scale: torch.Tensor | None = None
        self.bias = nn.Parameter(torch.empty(d_out)) if bias else None

    def to_fp8(self, input_scale: torch.Tensor | None = None) -> None:
        """Per-output-channel fp8 weights, computed once at load; ``input_scale``: the
        activations' static scale (else per token)."""
        self.set_fp8(*quantize_weight(self.weight.data), input_scale)

    def set_fp8(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                input_scale: torch.Tensor | None = None) -> None:
        """fp8 ``weight`` [out, in] with its fp32 per-channel ``weight_scale`` [out], as they
        are; ``input_scale``: the activations' static scale (else per token)."""
        if tuple(weight.shape) != tuple(self.weight.shape):
            raise ValueError(f"fp8 weight of shape {tuple(weight.shape)}, layer "
                             f"{tuple(self.weight.shape)}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = weight_scale
        if input_scale is not None:
            self.input_scale = input_scale.to(torch.float32).reshape(()).to(weight.device)

    def to_int8(self) -> None:
        """int8 weights with per-output-channel scales (weight-only), computed once at load."""
        w8, scale = quantize_weight_int8(self.weight.data)
        self.weight = nn.Parameter(w8, requires_grad=False)
        self.weight_scale = scale

    def to_int4(self, packed: Int4Weight) -> None:
        """A GPTQ int4 weight kept packed (W4A16, CUDA): ``weight`` holds its codes."""
        if packed.shape != tuple(self.weight.shape):
            raise ValueError(f"int4 weight of shape {packed.shape}, layer {tuple(self.weight.shape)}")
        self.weight = nn.Parameter(packed.qweight, requires_grad=False)
        self.int4 = packed

    def set_stored(self, stored: Int4Weight | Fp8Weight,
                   input_scale: torch.Tensor | None = None) -> None:
        """A quantised checkpoint's own weight, served as stored (``input_scale``: fp8's
        static activation scale, None: per token)."""
        if isinstance(stored, Int4Weight):
            self.to_int4(stored)
        else:
            self.set_fp8(stored.weight, stored.weight_scale, input_scale)

    def forward(self, x: torch.Tensor, x_scale: torch.Tensor | None = None, *,
                step: bool = False) -> torch.Tensor:
        """``x_scale``: ``x`` is already fp8, quantised with these scales (per row, or the
        static ``input_scale``); ``step``: a decoding step's rows (CUDA: their GEMM tiles)."""
        if self.weight.dtype == torch.int8:
            y = int8_linear(x, self.weight, self.weight_scale)
        elif self.weight.dtype == torch.int32:
            from ..kernels.int4_matmul import int4_matmul

            p = self.int4
            y = int4_matmul(x, p.qweight, p.zeros, p.scales, p.group_size)
        elif self.input_scale is not None and not x.is_cuda:
            y = fp8_static_linear(x, self.weight, self.weight_scale, self.input_scale)
        elif self.weight_scale is not None and not x.is_cuda:
            y = fp8_dynamic_linear(x, self.weight, self.weight_scale)
        else:
            y = linear(x, self.weight, self.weight_scale, x_scale=x_scale,
                       input_scale=self.input_scale, step=step)
        return y if self.bias is None else y + self.bias   # row-wise: still batch-invariant


# Projections that share their input are one Linear from the start (one larger GEMM): the
# checkpoint's parts are joined when the weights are loaded. gate|up is interleaved
# (g0 u0 g1 u1 ...) so one GEMM tile holds matching columns of each (kernels/fused.gate_up_act).
FUSED_PROJECTIONS = {"qkv_proj": (("q_proj", "k_proj", "v_proj"), False),
                     "gate_up_proj": (("gate_proj", "up_proj"), True),
                     # a Gated DeltaNet's input projections (models/qwen3_5.py)
                     "in_proj": (("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), False)}


def join_parts(parts: list[torch.Tensor], interleave: bool) -> torch.Tensor:
    """The rows of a fused projection's weight (or bias) from its parts'."""
    return torch.stack(parts, dim=1).flatten(0, 1) if interleave else torch.cat(parts)


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up back from the interleaved gate|up projection's output."""
    gate, up = gate_up.unflatten(-1, (-1, 2)).unbind(-1)
    return gate, up


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
    """What every stack shares: the LM head on the readout rows only, fp8 / int8 at load time,
    HF weights by name. A subclass sets ``cfg``, ``embed_tokens`` and ``lm_head`` (None: tied).

    ``fusable``: its weights and shapes suit the fused CUDA forward (models/fused_stack.py);
    ``use_fused`` is set by the runner that chooses it, and ``forward`` then runs it on CUDA
    (the same weights, other kernels). ``capturable``: that forward makes no host syncs and no
    host tensors, so a pass can be captured as a CUDA graph (engine/cuda_graphs.py)."""

    use_fused = False

    @property
    def fusable(self) -> bool:
        return False

    @property
    def capturable(self) -> bool:
        return False

    # a decision model's readout (set_codes): the head's rows of its code tokens, their ids
    code_head: torch.Tensor | None = None
    code_ids: torch.Tensor | None = None
    code_temperature = 1.0

    def set_codes(self, ids: list[int], temperature: float = 1.0) -> None:
        """Read out over these tokens only (a decision model's codes): their logits at
        ``temperature``, log-softmax over them, every other token -inf."""
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        index = torch.tensor(ids, dtype=torch.long, device=head.device)
        self.code_head = head.index_select(0, index).contiguous()   # taken once, not per pass
        self.code_ids, self.code_temperature = index, float(temperature)

    def readout_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary log-softmax in fp32 for ``[n, dim]`` rows, ``n % READOUT_TILE == 0``
        (a decision model: over its codes, -inf elsewhere)."""
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.code_head is not None:
            head = self.code_head
        logits = linear(hidden, head, tile=READOUT_TILE, out_dtype=torch.float32).float()
        cap = getattr(self.cfg, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if self.code_head is None:
            if logits.is_cuda:
                return torch.log_softmax(logits, dim=-1)
            # in place on the CPU: the same kernel and bits without a second [n, vocab] buffer,
            # whose fresh pages cost ~2.5x the log-softmax itself (a GiB a 1,024-row chunk)
            return torch.ops.aten._log_softmax.out(logits, -1, False, out=logits)
        codes = torch.log_softmax(logits / self.code_temperature, dim=-1)
        vocab = self.embed_tokens.weight.shape[0] if self.lm_head is None else (
            self.lm_head.weight.shape[0])
        out = torch.full((logits.shape[0], vocab), -torch.inf, dtype=torch.float32,
                         device=logits.device)
        return out.index_copy_(1, self.code_ids, codes)

    def body_linears(self) -> list[Linear]:
        """The linear layers a quantised scheme converts: all but the LM head."""
        return [m for m in self.modules() if isinstance(m, Linear) and m is not self.lm_head]

    # A multimodal stack's media modules (its towers, projector, embedders), by attribute:
    # fp8 is the text stack's scheme; these keep the engine's dtype (bf16), a small share of
    # the weights, their features read by every soft token.
    MEDIA_MODULES: tuple[str, ...] = ()

    def fp8_linears(self) -> list[Linear]:
        """The linear layers fp8 converts: the body's, the media modules' aside."""
        media = {m for name in self.MEDIA_MODULES if getattr(self, name, None) is not None
                 for m in getattr(self, name).modules()}
        return [m for m in self.body_linears() if m not in media]

    def to_fp8(self, input_scales: dict[str, torch.Tensor] | None = None) -> None:
        """W8A8 for every linear layer of the body but the media modules'; embeddings and the
        LM head stay as they are. ``input_scales``: module name -> static activation scale
        (fp8-static), one for every layer."""
        names = {m: name for name, m in self.named_modules()}
        for module in self.fp8_linears():
            module.to_fp8(None if input_scales is None else input_scales[names[module]])

    def to_int8(self) -> None:
        """int8 weight-only for every linear layer of the body; the embeddings, the LM head
        (or the tied embedding) and the norms stay in the engine's dtype."""
        for module in self.body_linears():
            module.to_int8()

    # Weights a checkpoint may lack, and the value they keep then (a subclass's).
    OPTIONAL_WEIGHTS: dict[str, float] = {}

    def load_weight(self, weights: dict[str, torch.Tensor], name: str,
                    param: torch.Tensor) -> bool:
        """Copy the HF-named tensor (with or without the ``model.`` prefix) of the model's
        ``name`` into ``param``, the parts of a fused projection joined (FUSED_PROJECTIONS).
        False when the checkpoint lacks it (an OPTIONAL_WEIGHTS entry is then filled)."""
        def find(key: str) -> torch.Tensor | None:
            return weights.get("model." + key, weights.get(key))

        src = find(name)
        owner, _, leaf = name.rpartition(".")
        parent, _, projection = owner.rpartition(".")
        if src is None and projection in FUSED_PROJECTIONS:
            names, interleave = FUSED_PROJECTIONS[projection]
            parts = [find(f"{parent}.{part}.{leaf}") for part in names]
            src = None if any(p is None for p in parts) else join_parts(parts, interleave)
        if src is None:
            default = self.OPTIONAL_WEIGHTS.get(leaf)
            if default is None:
                return False
            param.fill_(default)
            return True
        if src.shape != param.shape:
            raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)}, "
                             f"model shape {tuple(param.shape)}")
        param.copy_(src)
        return True

    def stored_weight(self, stored: dict[str, Int4Weight | Fp8Weight], linear: str
                      ) -> Int4Weight | Fp8Weight | None:
        """A quantised checkpoint's weight of the linear layer named ``linear`` as stored (a
        fused projection's joined from its parts'), or None when the checkpoint keeps that
        layer dense. A fused projection of which only some parts are stored quantised is an
        error: one GEMM serves them all."""
        def find(key: str) -> Int4Weight | Fp8Weight | None:
            return stored.get("model." + key, stored.get(key))

        src = find(linear)
        parent, _, projection = linear.rpartition(".")
        if src is None and projection in FUSED_PROJECTIONS:
            names, interleave = FUSED_PROJECTIONS[projection]
            parts = [find(f"{parent}.{part}") for part in names]
            if all(p is None for p in parts):
                return None
            if any(p is None for p in parts) or len({type(p) for p in parts}) > 1:
                raise unsupported(f"{linear}: the checkpoint quantises only some of "
                                  f"{', '.join(names)}, which share one GEMM here")
            src = type(parts[0]).join(parts, interleave)
        return src

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy every weight of an already materialised model from HF-named tensors."""
        missing = [name for name, param in self.state_dict().items()
                   if not self.load_weight(weights, name, param)]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")

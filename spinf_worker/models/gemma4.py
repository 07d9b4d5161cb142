"""Gemma 4 text stack (dense variants) over packed ``[tokens, dim]`` activations.

What it adds to Gemma 3: RMSNorms scale by ``w`` (not ``1 + w``); queries and keys are
normalised per head and attention runs unscaled; values get a weight-free RMSNorm; global
layers have their own head dim (and KV-head count) and a proportional RoPE that rotates only
a fraction of the angles; per-layer input embeddings (PLE) feed a gated residual into every
layer; the last ``num_kv_shared_layers`` layers compute no keys/values and reuse those of the
last earlier layer of their type; with ``attention_k_eq_v`` the global layers' values are their
(un-normalised) keys; every layer output is scaled by a stored ``layer_scalar``.

KV sharing is done here, not in the attention plan: during a forward the source layers keep
their RoPE'd K/V and the sharing layers hand those to ``plan.attend`` under their own layer
index, so kept K/V for decoding (keyed by layer) work unchanged. Mixture-of-experts variants
and all-bidirectional attention are refused at load (bidirectional attention among an image's
tokens is models/gemma4_vision.py's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.attention import AttentionPlan
from .layers import Linear, PackedLM, RMSNorm, apply_rope, rope_cos_sin_from, rope_inv_freq

_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1_000_000.0},
}


@dataclass
class Gemma4Config:
    vocab_size: int = 262144
    hidden_size: int = 1536
    intermediate_size: int = 6144
    num_layers: int = 35
    num_heads: int = 8
    rms_norm_eps: float = 1e-6
    sliding_window: int = 512
    layer_types: tuple[str, ...] = ()
    head_dims: tuple[int, ...] = ()          # per layer (global layers have their own)
    kv_heads: tuple[int, ...] = ()           # per layer
    rope: dict = field(default_factory=lambda: dict(_DEFAULT_ROPE))   # per layer type
    max_position_embeddings: int = 131072
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    hidden_size_per_layer_input: int = 0     # 0: no per-layer input embeddings
    vocab_size_per_layer_input: int = 262144
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False

    @classmethod
    def from_hf(cls, cfg: dict) -> Gemma4Config:
        cfg = cfg.get("text_config", cfg)
        if cfg.get("enable_moe_block"):
            raise ValueError("Gemma 4 mixture-of-experts variants are not supported (dense only)")
        if cfg.get("use_bidirectional_attention") == "all":
            raise ValueError("bidirectional Gemma 4 variants are not supported (causal only)")
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"activation {cfg['hidden_activation']!r} is not supported")
        n = cfg["num_hidden_layers"]
        layer_types = list(cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
        layer_types[-1] = "full_attention"   # transformers forces it too
        k_eq_v = bool(cfg.get("attention_k_eq_v", False))
        # Global layers' shapes: config.json written by transformers spells them per layer
        # (per_layer_config, empty when the global layers' shapes are the others'); the
        # original configs give global_head_dim and friends.
        per_layer = {str(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
        global_kv = cfg.get("num_global_key_value_heads") if k_eq_v else None
        global_shape = {"head_dim": cfg.get("global_head_dim", 512)}
        if global_kv is not None:
            global_shape["num_key_value_heads"] = global_kv
        head_dims, kv_heads = [], []
        for i, kind in enumerate(layer_types):
            own = per_layer.get(str(i)) if "per_layer_config" in cfg else (
                global_shape if kind == "full_attention" else {})
            head_dims.append((own or {}).get("head_dim") or cfg.get("head_dim", 256))
            kv_heads.append((own or {}).get("num_key_value_heads") or cfg["num_key_value_heads"])
        rope = {**_DEFAULT_ROPE, **(cfg.get("rope_parameters") or {})}
        for kind in set(layer_types):
            rope_inv_freq(2, rope[kind])   # unsupported RoPE types fail here, at load
        shared = cfg.get("num_kv_shared_layers", 0) or 0
        if shared >= n:
            raise ValueError("num_kv_shared_layers must leave some layers computing keys/values")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=n,
            num_heads=cfg["num_attention_heads"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            sliding_window=cfg.get("sliding_window") or 512,
            layer_types=tuple(layer_types),
            head_dims=tuple(head_dims),
            kv_heads=tuple(kv_heads),
            rope=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 131072),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            hidden_size_per_layer_input=cfg.get("hidden_size_per_layer_input") or 0,
            vocab_size_per_layer_input=cfg.get("vocab_size_per_layer_input", cfg["vocab_size"]),
            attention_k_eq_v=k_eq_v,
            num_kv_shared_layers=shared,
            use_double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)),
        )

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys/values ``layer`` reuses, or None when it computes its own."""
        first_shared = self.num_layers - self.num_kv_shared_layers
        if layer < first_shared:
            return None
        kind = self.layer_types[layer]
        return max(i for i in range(first_shared) if self.layer_types[i] == kind)


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (Gemma 4's value norm), fp32, row-wise."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: Gemma4Config, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.sliding = cfg.layer_types[layer] == "sliding_attention"
        self.head_dim = hd = cfg.head_dims[layer]
        self.source = cfg.kv_source(layer)
        kv = cfg.kv_heads[layer]
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * hd)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        if self.source is None:
            self.k_proj = Linear(cfg.hidden_size, kv * hd)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.v_proj = (None if cfg.attention_k_eq_v and not self.sliding
                           else Linear(cfg.hidden_size, kv * hd))
        self.o_proj = Linear(cfg.num_heads * hd, cfg.hidden_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                plan: AttentionPlan, shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
        t, hd = x.shape[0], self.head_dim
        q = apply_rope(self.q_norm(self.q_proj(x).view(t, -1, hd)), *rope)
        if self.source is not None:
            k, v = shared_kv[self.source]
        else:
            k_raw = self.k_proj(x).view(t, -1, hd)
            v_raw = k_raw if self.v_proj is None else self.v_proj(x).view(t, -1, hd)
            k = apply_rope(self.k_norm(k_raw), *rope)
            v = _unit_rms(v_raw, self.cfg.rms_norm_eps)
            shared_kv[self.layer] = (k, v)
        o = plan.attend(q, k, v, layer=self.layer, sliding=self.sliding, scale=1.0)
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Gemma4Config, width: int):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, width)
        self.up_proj = Linear(cfg.hidden_size, width)
        self.down_proj = Linear(width, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4Config, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        shared = self.self_attn.source is not None
        wide = 2 if cfg.use_double_wide_mlp and shared else 1
        self.mlp = MLP(cfg, cfg.intermediate_size * wide)
        eps, d = cfg.rms_norm_eps, cfg.hidden_size
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.pre_feedforward_layernorm = RMSNorm(d, eps)
        self.post_feedforward_layernorm = RMSNorm(d, eps)
        self.ple = cfg.hidden_size_per_layer_input
        if self.ple:
            self.per_layer_input_gate = Linear(d, self.ple)
            self.per_layer_projection = Linear(self.ple, d)
            self.post_per_layer_input_norm = RMSNorm(d, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(self, x, rope, plan, shared_kv, per_layer_input):
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), rope, plan, shared_kv))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.ple:
            h = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(h))
        return x * self.layer_scalar


class Gemma4Model(PackedLM):
    """``forward`` returns the final-norm hidden states of every packed token;
    ``readout_logprobs`` applies the LM head to the few rows that predict option tokens."""

    OPTIONAL_WEIGHTS = {"layer_scalar": 1.0}   # a checkpoint without it keeps scale 1

    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        ple = cfg.hidden_size_per_layer_input
        if ple:
            self.embed_tokens_per_layer = nn.Embedding(cfg.vocab_size_per_layer_input,
                                                       cfg.num_layers * ple)
            self.per_layer_model_projection = Linear(cfg.hidden_size, cfg.num_layers * ple)
            self.per_layer_projection_norm = RMSNorm(ple, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, layers, ple]: token-identity embedding plus a projection of the input embedding."""
        cfg, ple = self.cfg, self.cfg.hidden_size_per_layer_input
        t = input_ids.shape[0]
        scale = torch.tensor(math.sqrt(ple), dtype=x.dtype)
        ident = (self.embed_tokens_per_layer(input_ids) * scale).view(t, cfg.num_layers, ple)
        proj = self.per_layer_model_projection(x) * torch.tensor(cfg.hidden_size ** -0.5,
                                                                  dtype=x.dtype)
        proj = self.per_layer_projection_norm(proj.view(t, cfg.num_layers, ple))
        return (proj + ident) * torch.tensor(2.0 ** -0.5, dtype=x.dtype)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=x.dtype)

    def _embed_inputs(self, input_ids: torch.Tensor, plan) -> tuple[torch.Tensor, torch.Tensor]:
        """The first layer's input and the ids the per-layer inputs look up (a multimodal
        stack puts its media features in their rows and reads them as the pad token,
        models/gemma4_vision.py)."""
        return self._embed(input_ids), input_ids

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                plan: AttentionPlan) -> torch.Tensor:
        cfg = self.cfg
        x, ple_ids = self._embed_inputs(input_ids, plan)
        per_layer = self._per_layer_inputs(ple_ids, x) if cfg.hidden_size_per_layer_input else None
        ropes: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            key = (cfg.layer_types[i], cfg.head_dims[i])
            if key not in ropes:
                ropes[key] = rope_cos_sin_from(
                    positions, rope_inv_freq(key[1], cfg.rope[key[0]]), x.dtype)
            x = layer(x, ropes[key], plan, shared_kv,
                      None if per_layer is None else per_layer[:, i])
        return self.norm(x)

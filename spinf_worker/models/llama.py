"""Llama text stack (Llama 2/3.x, SmolLM2) over packed ``[tokens, dim]`` activations.

Pre-norm blocks (RMSNorm with plain ``w``), GQA, RoPE (default, linear or llama3 scaling),
SwiGLU MLP, optional attention / MLP biases, tied or separate LM head. Qwen3 (qwen3.py) is the
same block plus qk-norm and optional sliding-window layers, so both share the modules here.
Every linear layer goes through the tiled, batch-invariant matmul; attention follows the
read-once tree rule (kernels/attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.attention import AttentionPlan
from .fused_stack import FusedStyle, fusable, fused_forward, real_rows
from .layers import (
    Linear,
    PackedLM,
    RMSNorm,
    apply_rope,
    rope_cos_sin_from,
    rope_inv_freq,
    split_gate_up,
)

NO_WINDOW = 1 << 30   # "sliding_window" of a stack without sliding layers: never masks


def rope_params(cfg: dict, default_theta: float) -> dict:
    """One RoPE parameter dict from a transformers 5 config (``rope_parameters``) or an older
    one (``rope_theta`` + ``rope_scaling``)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", default_theta))
    if params.get("rope_type", params.get("type", "default")) == "llama3":
        params.setdefault("original_max_position_embeddings",
                          cfg.get("max_position_embeddings", 8192))
    return params


@dataclass
class LlamaConfig:
    vocab_size: int = 128256
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_layers: int = 16
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 500_000.0})
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False                    # Qwen3
    sliding_window: int = NO_WINDOW          # the window of the layers marked sliding
    layer_types: tuple[str, ...] = ()        # "full_attention" | "sliding_attention" per layer

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaConfig:
        cfg = cfg.get("text_config", cfg)
        if cfg.get("pretraining_tp", 1) not in (1, None):
            raise ValueError("pretraining_tp > 1 is not supported")
        return cls(**cls.common_fields(cfg, 2048), mlp_bias=bool(cfg.get("mlp_bias", False)),
                   layer_types=("full_attention",) * cfg["num_hidden_layers"])

    @staticmethod
    def common_fields(cfg: dict, default_context: int) -> dict:
        """The fields Llama-like configs spell alike (Llama, SmolLM2, Qwen3)."""
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"activation {cfg['hidden_act']!r} is not supported (silu)")
        heads = cfg["num_attention_heads"]
        rope = rope_params(cfg, 10_000.0)
        rope_inv_freq(2, rope)   # unsupported RoPE types fail here, at load
        return dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", default_context),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.sliding = cfg.layer_types[layer] == "sliding_attention"
        hd, bias = cfg.head_dim, cfg.attention_bias
        self.qkv_proj = Linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, bias)
        self.o_proj = Linear(cfg.num_heads * hd, cfg.hidden_size, bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                plan: AttentionPlan) -> torch.Tensor:
        """``plan``: a packed pass (AttentionPlan) or decoding steps (engine.decode.DecodePlan)."""
        t, hd = x.shape[0], self.cfg.head_dim
        hq, hkv = self.cfg.num_heads * hd, self.cfg.num_kv_heads * hd
        q, k, v = (p.reshape(t, -1, hd) for p in self.qkv_proj(x).split([hq, hkv, hkv], dim=-1))
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o = plan.attend(q, k, v, layer=self.layer, sliding=self.sliding, scale=hd ** -0.5)
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        bias = cfg.mlp_bias
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = split_gate_up(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, plan):
        x = x + self.self_attn(self.input_layernorm(x), rope, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(PackedLM):
    """``forward`` returns the final-norm hidden states of every packed token;
    ``readout_logprobs`` applies the LM head to the few rows that predict option tokens."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self._inv_freq: torch.Tensor | None = None   # the fused forward's, on its device

    @property
    def fusable(self) -> bool:
        """Stacks with biases or int8 weights keep the module forward on CUDA."""
        cfg = self.cfg
        return not (cfg.attention_bias or cfg.mlp_bias) and fusable(self, cfg.head_dim)

    @property
    def capturable(self) -> bool:
        return self.use_fused

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                plan: AttentionPlan) -> torch.Tensor:
        if input_ids.is_cuda and self.use_fused:
            return self._forward_fused(input_ids, positions, plan)
        x = self.embed_tokens(input_ids)
        rope = rope_cos_sin_from(positions, rope_inv_freq(self.cfg.head_dim, self.cfg.rope),
                                 x.dtype)
        for layer in self.layers:
            x = layer(x, rope, plan)
        return self.norm(x)

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       plan) -> torch.Tensor:
        """The same stack with the elementwise work fused (models/fused_stack.py)."""
        cfg, rows = self.cfg, input_ids.shape[0]
        m = real_rows(plan, rows)
        x = self.embed_tokens(input_ids[:m])
        if self._inv_freq is None or self._inv_freq.device != x.device:
            # once, on the device: a host copy in every pass would break a graph's capture
            self._inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope).to(x.device)
        cos, sin = (t[:, 0].contiguous()
                    for t in rope_cos_sin_from(positions[:m], self._inv_freq, x.dtype))
        style = FusedStyle(norm_offset=0.0, act="silu", qk_norm=cfg.qk_norm, sandwich=False,
                           attn_scale=cfg.head_dim ** -0.5)
        return fused_forward(self.layers, self.norm, x, rows, plan, lambda att: (cos, sin),
                             cfg, style)

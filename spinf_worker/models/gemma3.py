"""Gemma 3 text stack over packed ``[tokens, dim]`` activations.

Scaled embeddings, sandwich RMSNorms (``1 + w``), qk-norm, GQA, local (sliding window, local
RoPE base) and global layers, tied LM head. Every linear layer goes through the tiled,
batch-invariant matmul; attention follows the read-once tree rule (kernels/attention.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.attention import AttentionPlan
from .fused_stack import FusedStyle, fused_forward, real_rows
from .layers import Linear, PackedLM, RMSNorm, apply_rope, rope_cos_sin, split_gate_up


@dataclass
class Gemma3Config:
    vocab_size: int = 262144
    hidden_size: int = 640
    intermediate_size: int = 2048
    num_layers: int = 18
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256
    sliding_window: int = 512
    layer_types: tuple[str, ...] = ()
    rope_global_base: float = 1_000_000.0
    rope_local_base: float = 10_000.0
    rope_global_linear_factor: float = 1.0
    max_position_embeddings: int = 32768
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True

    @classmethod
    def from_hf(cls, cfg: dict) -> Gemma3Config:
        cfg = cfg.get("text_config", cfg)
        n_layers = cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6) == 0
            else "sliding_attention" for i in range(n_layers)]
        # transformers 5 keeps RoPE settings per layer type; older configs keep flat keys.
        rope = cfg.get("rope_parameters") or {}
        full = rope.get("full_attention") or {}
        local = rope.get("sliding_attention") or {}
        scaling = cfg.get("rope_scaling") or full
        factor = scaling.get("factor", 1.0) if scaling.get("rope_type", "default") == "linear" else 1.0
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=n_layers,
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
            sliding_window=cfg.get("sliding_window") or 4096,
            layer_types=tuple(layer_types),
            rope_global_base=full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)),
            rope_local_base=local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0)),
            rope_global_linear_factor=factor,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        )


class Attention(nn.Module):
    def __init__(self, cfg: Gemma3Config, sliding: bool, layer: int):
        super().__init__()
        self.cfg, self.sliding, self.layer = cfg, sliding, layer
        hd = cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd)
        self.o_proj = Linear(cfg.num_heads * hd, cfg.hidden_size)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, offset=1.0)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hq, hkv = self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim
        return self.qkv_proj(x).split([hq, hkv, hkv], dim=-1)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                plan: AttentionPlan) -> torch.Tensor:
        """``plan``: a packed pass (AttentionPlan) or decoding steps (engine.decode.DecodePlan)."""
        t, hd = x.shape[0], self.cfg.head_dim
        q, k, v = self.project(x)
        q = self.q_norm(q.reshape(t, -1, hd))
        k = self.k_norm(k.reshape(t, -1, hd))
        v = v.reshape(t, -1, hd)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o = plan.attend(q, k, v, layer=self.layer, sliding=self.sliding,
                        scale=self.cfg.query_pre_attn_scalar ** -0.5)
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Gemma3Config):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = split_gate_up(self.gate_up_proj(x))
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, sliding: bool, layer: int):
        super().__init__()
        self.sliding = sliding
        self.self_attn = Attention(cfg, sliding, layer)
        self.mlp = MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)

    def forward(self, x, rope, plan):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, plan))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(PackedLM):
    """``forward`` returns the final-norm hidden states of every packed token;
    ``readout_logprobs`` applies the LM head to the few rows that predict option tokens."""

    def __init__(self, cfg: Gemma3Config):
        super().__init__()
        if cfg.attn_logit_softcapping is not None:
            raise ValueError("attention logit soft-capping is not supported by this stack")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, t == "sliding_attention", i) for i, t in enumerate(cfg.layer_types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                plan: AttentionPlan) -> torch.Tensor:
        if input_ids.is_cuda and self.use_fused:
            return self._forward_fused(input_ids, positions, plan)
        x = self._embed_inputs(input_ids, plan)
        ropes = self._ropes(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, ropes[layer.sliding], plan)
        return self.norm(x)

    def _embed_inputs(self, input_ids: torch.Tensor, plan) -> torch.Tensor:
        """The first layer's input: the scaled token embeddings (a multimodal stack puts its
        media features in their rows, models/gemma3_vision.py)."""
        return self._embed(input_ids)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=x.dtype)

    def _ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        cfg = self.cfg
        return {True: rope_cos_sin(positions, cfg.head_dim, cfg.rope_local_base, 1.0, dtype),
                False: rope_cos_sin(positions, cfg.head_dim, cfg.rope_global_base,
                                    cfg.rope_global_linear_factor, dtype)}

    @property
    def fusable(self) -> bool:
        return True   # the fused forward takes every scheme (int8, int4: gate|up then gelu_mul)

    @property
    def capturable(self) -> bool:
        return True   # the module forward on CUDA too

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       plan) -> torch.Tensor:
        """The same stack with the elementwise work fused (models/fused_stack.py)."""
        cfg, rows = self.cfg, input_ids.shape[0]
        m = real_rows(plan, rows)
        x = self._embed_inputs(input_ids[:m], plan)
        ropes = {sliding: tuple(t[:, 0].contiguous() for t in pair)
                 for sliding, pair in self._ropes(positions[:m], x.dtype).items()}
        style = FusedStyle(norm_offset=1.0, act="gelu_tanh", qk_norm=True, sandwich=True,
                           attn_scale=cfg.query_pre_attn_scalar ** -0.5)
        return fused_forward(self.layers, self.norm, x, rows, plan,
                             lambda att: ropes[att.sliding], cfg, style)

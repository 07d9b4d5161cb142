"""Qwen3 text stack (dense): the Llama block (llama.py) plus RMSNorm on each query and key head
before RoPE, and, when the config turns it on, sliding-window attention on the layers
``layer_types`` marks (or on those from ``max_window_layers`` on, as transformers derives it)."""

from __future__ import annotations

from dataclasses import dataclass

from .layers import rope_inv_freq
from .llama import NO_WINDOW, LlamaConfig, LlamaModel, rope_params


@dataclass
class Qwen3Config(LlamaConfig):
    qk_norm: bool = True

    @classmethod
    def from_hf(cls, cfg: dict) -> Qwen3Config:
        cfg = cfg.get("text_config", cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"activation {cfg['hidden_act']!r} is not supported (silu)")
        n_layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        # transformers ignores sliding_window unless use_sliding_window is set.
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if window is not None and i >= cfg.get("max_window_layers", 28)
            else "full_attention" for i in range(n_layers)]
        if window is None:
            layer_types = ["full_attention"] * n_layers
        rope = rope_params(cfg, 10_000.0)
        rope_inv_freq(2, rope)   # unsupported RoPE types fail here, at load
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=True,
            sliding_window=window or NO_WINDOW,
            layer_types=tuple(layer_types),
        )


class Qwen3Model(LlamaModel):
    """The Llama stack built from a ``Qwen3Config`` (qk-norm on, windows as configured)."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__(cfg)

"""Qwen3 text stack (dense): the Llama block (llama.py) plus RMSNorm on each query and key head
before RoPE, and, when the config turns it on, sliding-window attention on the layers
``layer_types`` marks (or on those from ``max_window_layers`` on, as transformers derives it)."""

from __future__ import annotations

from dataclasses import dataclass

from .llama import NO_WINDOW, LlamaConfig, LlamaModel


@dataclass
class Qwen3Config(LlamaConfig):
    qk_norm: bool = True

    @classmethod
    def from_hf(cls, cfg: dict) -> Qwen3Config:
        cfg = cfg.get("text_config", cfg)
        n_layers = cfg["num_hidden_layers"]
        # transformers ignores sliding_window unless use_sliding_window is set.
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if window is not None and i >= cfg.get("max_window_layers", 28)
            else "full_attention" for i in range(n_layers)]
        if window is None:
            layer_types = ["full_attention"] * n_layers
        return cls(**cls.common_fields(cfg, 32768), qk_norm=True,
                   sliding_window=window or NO_WINDOW, layer_types=tuple(layer_types))


class Qwen3Model(LlamaModel):
    """The Llama stack built from a ``Qwen3Config`` (qk-norm on, windows as configured)."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__(cfg)

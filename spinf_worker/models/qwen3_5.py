"""Qwen3.5 text stack (dense hybrid) over packed ``[tokens, dim]`` activations.

Layers are Gated DeltaNet linear attention or full attention (``layer_types``; three to one in
the released checkpoints), each followed by the SwiGLU MLP; norms scale by ``1 + w``.
- Full attention: q|gate per head from one projection, qk-norm, RoPE on the first
  ``partial_rotary_factor`` of each head, the output times sigmoid(gate); the read-once tree
  rule of kernels/attention.py.
- Gated DeltaNet: q|k|v through a short causal depthwise convolution and SiLU, l2-normalised
  q and k, beta = sigmoid(b), log decay g = -exp(A_log) * softplus(a + dt_bias), the gated
  delta rule over the tree (kernels/delta_tree.py), then an RMSNorm gated by SiLU(z).
A ``qwen3_5`` wrapper's text model is served text-only. No fused CUDA forward yet: on CUDA
the module forward runs (the attention through FlexAttention, the DeltaNet's recurrence in
Triton, kernels/delta_triton.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.attention import AttentionPlan
from ..kernels.delta_tree import TreeScan, l2norm, rowsum, tree_delta_rule
from .layers import Linear, PackedLM, RMSNorm, apply_rope, rope_cos_sin_from, rope_inv_freq
from .llama import MLP, NO_WINDOW, rope_params

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class Qwen3_5Config:
    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_layers: int = 32
    num_heads: int = 16
    num_kv_heads: int = 4
    head_dim: int = 256
    rotary_dim: int = 64                     # the rotated part of each head
    rms_norm_eps: float = 1e-6
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e7})
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    layer_types: tuple[str, ...] = ()        # "linear_attention" | "full_attention" per layer
    conv_kernel: int = 4
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    sliding_window: int = NO_WINDOW          # no sliding layers

    @classmethod
    def from_hf(cls, cfg: dict) -> Qwen3_5Config:
        cfg = cfg.get("text_config", cfg)
        if cfg.get("num_experts") or cfg.get("num_experts_per_tok"):
            raise ValueError("mixture-of-experts layers are not supported (dense Qwen3.5 only)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"activation {cfg['hidden_act']!r} is not supported (silu)")
        n_layers = cfg["num_hidden_layers"]
        every = cfg.get("full_attention_interval", 4)
        layer_types = tuple(cfg.get("layer_types") or [
            "full_attention" if (i + 1) % every == 0 else "linear_attention"
            for i in range(n_layers)])
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer type {unknown[0]!r} is not supported "
                             f"({', '.join(LAYER_TYPES)})")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = rope_params(cfg, 10_000.0)
        partial = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"RoPE type {rope['rope_type']!r} is not supported (default)")
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=n_layers,
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim, rotary_dim=int(head_dim * partial),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=bool(cfg.get("attention_bias", False)), layer_types=layer_types,
            conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
            linear_num_key_heads=cfg.get("linear_num_key_heads", 16),
            linear_num_value_heads=cfg.get("linear_num_value_heads", 32),
            linear_key_head_dim=cfg.get("linear_key_head_dim", 128),
            linear_value_head_dim=cfg.get("linear_value_head_dim", 128))


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of each head; the rest pass as they are."""
    rot = cos.shape[-1]
    return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)


class GatedAttention(nn.Module):
    """Full attention whose output is gated per channel by sigmoid of a second query half."""

    def __init__(self, cfg: Qwen3_5Config, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        hd, bias = cfg.head_dim, cfg.attention_bias
        # q_proj's rows hold, head by head, the query then its gate
        self.qkv_proj = Linear(cfg.hidden_size, (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * hd,
                               bias)
        self.o_proj = Linear(cfg.num_heads * hd, cfg.hidden_size, bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, offset=1.0)

    def forward(self, x: torch.Tensor, rope, plan: AttentionPlan) -> torch.Tensor:
        t, hd = x.shape[0], self.cfg.head_dim
        hq, hkv = self.cfg.num_heads * hd, self.cfg.num_kv_heads * hd
        q_gate, k, v = self.qkv_proj(x).split([2 * hq, hkv, hkv], dim=-1)
        q, gate = q_gate.reshape(t, -1, 2 * hd).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(t, -1, hd))
        q, k = partial_rope(q, *rope), partial_rope(k, *rope)
        o = plan.attend(q, k, v.reshape(t, -1, hd), layer=self.layer, sliding=False,
                        scale=hd ** -0.5)
        o = o.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(o)


class GatedRMSNorm(nn.Module):
    """RMSNorm (plain ``w``) of each head's output, times SiLU of the gate, in fp32."""

    offset = 0.0     # build.random_filler: a norm that scales by w starts at 1

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(rowsum(xf * xf) / xf.shape[-1] + self.eps)
        return ((self.weight * xf.to(x.dtype)) * F.silu(gate.float())).to(x.dtype)


class ConvWeight(nn.Module):
    """The depthwise convolution's weight, as the checkpoint stores it ([C, 1, kernel]); the
    convolution itself follows the tree (kernels/delta_tree.TreeScan.conv)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Qwen3_5Config, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        self.value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        hv = cfg.linear_num_value_heads
        # in_proj_qkv | in_proj_z | in_proj_b | in_proj_a, joined at load
        self.in_proj = Linear(cfg.hidden_size, self.conv_dim + self.value_dim + 2 * hv)
        self.conv1d = ConvWeight(self.conv_dim, cfg.conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, cfg.hidden_size)

    def forward(self, x: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        if not isinstance(plan, AttentionPlan):
            raise NotImplementedError("decoding steps need a recurrent state per slot; "
                                      "extraction slots are not supported by this stack")
        cfg, t = self.cfg, x.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, hv, hv], dim=-1)
        scan = TreeScan.of(plan, t, cfg.conv_kernel, x.device)
        mixed = F.silu(scan.conv(mixed, self.conv1d.weight[:, 0])).to(x.dtype)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        # each q/k head serves hv / hk consecutive value heads
        q = l2norm(q.reshape(t, hk, dk)).repeat_interleave(hv // hk, dim=1) * dk ** -0.5
        k = l2norm(k.reshape(t, hk, dk)).repeat_interleave(hv // hk, dim=1)
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o = tree_delta_rule(plan, q, k, v.reshape(t, hv, dv).float(), g, beta)
        o = self.norm(o.to(x.dtype), z.reshape(t, hv, dv))
        return self.out_proj(o.reshape(t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3_5Config, layer: int):
        super().__init__()
        self.linear = cfg.layer_types[layer] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, layer)
        else:
            self.self_attn = GatedAttention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)

    def forward(self, x, rope, plan):
        h = self.input_layernorm(x)
        h = self.linear_attn(h, plan) if self.linear else self.self_attn(h, rope, plan)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5Model(PackedLM):
    """``forward`` returns the final-norm hidden states of every packed token;
    ``readout_logprobs`` applies the LM head to the readout rows only."""

    # the runner gives the CUDA plan the documents' spans too: the DeltaNet layers read them
    tree_spans = True

    def __init__(self, cfg: Qwen3_5Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                plan: AttentionPlan) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = rope_cos_sin_from(positions, rope_inv_freq(self.cfg.rotary_dim, self.cfg.rope),
                                 x.dtype)
        for layer in self.layers:
            x = layer(x, rope, plan)
        return self.norm(x)

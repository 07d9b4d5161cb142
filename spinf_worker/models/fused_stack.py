"""The CUDA forward of a pre-norm decoder stack with its elementwise work fused, shared by
Gemma 3 (gemma3.py) and Llama / Qwen3 (llama.py).

Per layer: one q|k|v GEMM, one kernel for qk-norm (if any) + RoPE, attention, the
o-projection, one kernel for the residual add (after Gemma's post-attention norm) and the
pre-MLP norm (+ the fp8 quantisation the next GEMM wants: per token, or by that layer's
static input scale), the gate|up GEMM with ``act(gate) * up`` in its epilogue (fp8-static:
quantised there for the down GEMM), the down GEMM, and again residual + the next layer's
pre-norm. Only the pass's real rows (``plan.rows``) are computed; attention sees the padded
pass, whose padding rows are zeros and see only themselves. Every kernel computes a row from
that row alone, so a row's bits never depend on the other rows. A decoding step's GEMMs
(``plan.decoding``) take their tiles from a table of their own
(kernels/triton_matmul.STEP_CONFIGS).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .layers import Linear

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class FusedStyle:
    """What differs between the families' blocks."""

    norm_offset: float     # RMSNorm scales by offset + w: Gemma stores w - 1 (1), others w (0)
    act: str               # gelu_tanh (Gemma) | silu (Llama, Qwen)
    qk_norm: bool          # RMSNorm per q and k head before RoPE (Gemma, Qwen3)
    sandwich: bool         # Gemma: norms after attention and after the MLP as well
    attn_scale: float


def fusable(stack: torch.nn.Module, head_dim: int) -> bool:
    """Weights the fused kernels take (bf16, fp8) and a power-of-two head width."""
    weight = next(m.weight for m in stack.modules() if isinstance(m, Linear))
    return weight.dtype in (torch.bfloat16, FP8) and head_dim & (head_dim - 1) == 0


def real_rows(plan, rows: int) -> int:
    """The rows a pass computes: its real rows (``plan.rows``), or all of a decode step's."""
    return min(getattr(plan, "rows", None) or rows, rows)


def fused_forward(layers, final_norm, x: torch.Tensor, rows: int, plan,
                  rope_of: Callable, cfg, style: FusedStyle) -> torch.Tensor:
    """``x``: the embedded real rows [m, D] of a pass of ``rows`` rows; ``rope_of(attention)``
    -> that layer's (cos, sin) [m, head_dim]. Returns the final-norm hidden states [m, D]."""
    from ..kernels.fused import gate_up_act, gelu_mul, qk_norm_rope, residual_norm

    m, eps, hd, off = x.shape[0], cfg.rms_norm_eps, cfg.head_dim, style.norm_offset
    # fp8 W8A8: the fused kernels hand the next GEMM its fp8 input (int8 is weight-only),
    # quantised per token or, fp8-static, by that GEMM's input_scale
    quant = layers[0].self_attn.qkv_proj.weight.dtype == FP8
    step = plan.decoding

    def heads(n: int) -> torch.Tensor:
        t = torch.empty(rows, n, hd, dtype=x.dtype, device=x.device)
        if m < rows:    # a pass's padding rows (a decoding step computes all of its rows)
            t[m:].zero_()
        return t

    h = residual_norm(x, None, None, layers[0].input_layernorm.weight, eps, quant=quant,
                      offset=off, static_scale=layers[0].self_attn.qkv_proj.input_scale)
    for i, layer in enumerate(layers):
        att, mlp = layer.self_attn, layer.mlp
        qkv = att.qkv_proj(*_as_args(h), step=step)
        q, k, v = heads(cfg.num_heads), heads(cfg.num_kv_heads), heads(cfg.num_kv_heads)
        norms = (att.q_norm.weight, att.k_norm.weight) if style.qk_norm else (None, None)
        qk_norm_rope(qkv, *norms, *rope_of(att), eps, q, k, v, offset=off)
        o = plan.attend(q, k, v, layer=att.layer, sliding=att.sliding, scale=style.attn_scale)
        a = att.o_proj(o[:m].reshape(m, -1), step=step)
        if style.sandwich:
            attn_out, mlp_in = layer.post_attention_layernorm, layer.pre_feedforward_layernorm
        else:
            attn_out, mlp_in = None, layer.post_attention_layernorm
        gate_up = mlp.gate_up_proj
        h = residual_norm(x, a, _weight(attn_out), mlp_in.weight, eps, quant=quant, offset=off,
                          static_scale=gate_up.input_scale)
        if gate_up.weight.dtype in (torch.bfloat16, FP8):
            act = gate_up_act(gate_up.weight, gate_up.weight_scale, *_as_args(h), act=style.act,
                              out_scale=mlp.down_proj.input_scale, step=step)
        else:   # Gemma with int8 weights (gelu_mul: GELU only)
            act = gelu_mul(gate_up(*_as_args(h), step=step), quant=quant)
        d = mlp.down_proj(*_as_args(act), step=step)
        last = i + 1 == len(layers)
        pre = final_norm if last else layers[i + 1].input_layernorm
        mlp_out = layer.post_feedforward_layernorm if style.sandwich else None
        h = residual_norm(x, d, _weight(mlp_out), pre.weight, eps, quant=quant and not last,
                          offset=off, static_scale=None if last else
                          layers[i + 1].self_attn.qkv_proj.input_scale)
    return h


def _weight(norm) -> torch.Tensor | None:
    return None if norm is None else norm.weight


def _as_args(h) -> tuple:
    """A fused kernel's output as Linear arguments: ``(x,)`` or fp8 ``(x, x_scale)``."""
    return h if isinstance(h, tuple) else (h,)

"""Fused row-wise kernels for the CUDA forward: each reads its inputs once and writes once
what the unfused torch ops would have written in several passes over memory.

- ``residual_norm``: ``x += post_norm(y)``, then the next pre-norm of ``x`` (optionally fp8
  quantised for the next linear layer: per row, or with its static scale);
- ``qk_norm_rope``: per head RMSNorm of q and k, then RoPE; v copied out, from one fused
  q|k|v projection;
- ``gate_up_act``: the gate|up GEMM (gate and up weight rows interleaved) with
  ``act(gate) * up`` (GELU or SiLU) in its epilogue, so the [rows, 2 I] gate|up activations are never
  written (fp8: each tile's row maxima go out with it, and ``quantize_tiles`` then quantises
  each row by its maximum; with a static scale for the down projection, the tile writes its
  fp8 values itself);
- ``gelu_mul``: ``gelu_tanh(gate) * up`` from a gate|up projection computed apart (optionally
  fp8), for weights the Triton GEMM does not take.

One program per row (or per row and head): a row's result never depends on the other rows.
Intermediate values are rounded to bf16 exactly where the unfused ops store bf16 tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.fp8 import FP8, INV_FP8_MAX
from .rowwise import store_quantized_row
from .triton_matmul import config, tile_of, tile_product

CHUNK = 1024   # gelu_mul: columns per step of a row too wide to hold at once
ONE_READ_MAX = 16384   # gelu_mul: rows up to this wide are held in registers and read once


@triton.jit
def _quantize_store(h, cols, mask, out_ptr, scale_ptr, row, D, INV_FP8_MAX):
    """quant/fp8.py's rule to the bit: scale = amax * fp32(1/448), then an IEEE division."""
    amax = tl.max(tl.where(mask, tl.abs(h), 0.0), axis=0)
    scale = tl.maximum(amax, 1e-12) * INV_FP8_MAX
    q = tl.minimum(tl.maximum(tl.div_rn(h, scale), -448.0), 448.0)
    tl.store(out_ptr + row * D + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _quantize_static(h, scale):
    """quant/fp8_static.py's rule: an IEEE division by the fixed scale, clamped to ±448."""
    return tl.minimum(tl.maximum(tl.div_rn(h, scale), -448.0), 448.0)


@triton.jit
def _residual_norm_kernel(x_ptr, y_ptr, w_post_ptr, w_pre_ptr, h_ptr, scale_ptr, D, eps,
                          INV_FP8_MAX, HAS_Y: tl.constexpr, POST_NORM: tl.constexpr,
                          OFFSET: tl.constexpr, QUANT: tl.constexpr, STATIC: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_Y:
        y = tl.load(y_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        if POST_NORM:
            w_post = tl.load(w_post_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = y * tl.rsqrt(tl.sum(y * y, axis=0) / D + eps) * (OFFSET + w_post)
            y = y.to(tl.bfloat16).to(tl.float32)
        x = (x + y).to(tl.bfloat16).to(tl.float32)
        tl.store(x_ptr + row * D + cols, x.to(x_ptr.dtype.element_ty), mask=mask)
    w_pre = tl.load(w_pre_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    h = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps) * (OFFSET + w_pre)
    h = h.to(tl.bfloat16).to(tl.float32)
    # fp8 stores written 8 values at a time, as the bf16 ones: left free, the compiler lays
    # a wide row (over 8 values a thread) out 16 a thread for them, and the sums of squares
    # above add in another order; the residual's bits would follow h's dtype
    out_cols = tl.max_contiguous(cols, 8)
    if STATIC:     # the next layer's fixed input scale, read from scale_ptr
        q = _quantize_static(h, tl.load(scale_ptr))
        tl.store(h_ptr + row * D + out_cols, q.to(h_ptr.dtype.element_ty), mask=mask)
    elif QUANT:
        _quantize_store(h, out_cols, mask, h_ptr, scale_ptr, row, D, INV_FP8_MAX)
    else:
        tl.store(h_ptr + row * D + cols, h.to(h_ptr.dtype.element_ty), mask=mask)


def residual_norm(x: torch.Tensor, y: torch.Tensor | None, w_post: torch.Tensor | None,
                  w_pre: torch.Tensor, eps: float, *, quant: bool, offset: float = 1.0,
                  static_scale: torch.Tensor | None = None):
    """The step between two blocks on ``[rows, D]`` bf16: ``x += norm(y) * (offset + w_post)``
    in place (Gemma's sandwich norm; ``x += y`` when ``w_post`` is None, nothing when ``y``
    is), then returns ``h = norm(x) * (offset + w_pre)``: bf16, or ``(fp8, per-row scale)``
    when ``quant`` (``(fp8, static_scale)`` with the next layer's static input scale, 0-dim).
    Gemma stores ``w - 1`` (offset 1), Llama and Qwen ``w`` (offset 0)."""
    rows, d = x.shape
    static = quant and static_scale is not None
    h = torch.empty(rows, d, dtype=FP8 if quant else x.dtype, device=x.device)
    scale = (static_scale if static else
             torch.empty(rows if quant else 1, dtype=torch.float32, device=x.device))
    if rows:
        _residual_norm_kernel[(rows,)](
            x, x if y is None else y, w_pre if w_post is None else w_post, w_pre, h, scale,
            d, eps, INV_FP8_MAX, HAS_Y=y is not None, POST_NORM=w_post is not None,
            OFFSET=offset, QUANT=quant, STATIC=static, BLOCK=triton.next_power_of_2(d))
    return (h, scale) if quant else h


@triton.jit
def _norm_rope_heads(src, w_ptr, c, s, dst, eps, H: tl.constexpr, H_BLOCK: tl.constexpr,
                     HD: tl.constexpr, NORM: tl.constexpr, OFFSET: tl.constexpr):
    """One row's H heads of HD: per head RMSNorm (``OFFSET + w``; none unless ``NORM``), then
    RoPE (``c``, ``s``: [1, HD])."""
    h = tl.arange(0, H_BLOCK)[:, None]
    j = tl.arange(0, HD)[None, :]
    half: tl.constexpr = HD // 2
    shifted = (j + half) % HD
    mask = (h < H) & (j < HD)
    n = tl.load(src + h * HD + j, mask=mask, other=0.0).to(tl.float32)
    ns = tl.load(src + h * HD + shifted, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        w = tl.load(w_ptr + j).to(tl.float32)
        ws = tl.load(w_ptr + shifted).to(tl.float32)
        rms = tl.rsqrt(tl.sum(n * n, axis=1) / HD + eps)[:, None]
        n = (n * rms * (OFFSET + w)).to(tl.bfloat16).to(tl.float32)
        ns = (ns * rms * (OFFSET + ws)).to(tl.bfloat16).to(tl.float32)
    rotated = tl.where(j < half, -ns, ns)
    out = ((n * c).to(tl.bfloat16).to(tl.float32)
           + (rotated * s).to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
    tl.store(dst + h * HD + j, out, mask=mask)


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
                         stride_qkv, eps, HQ: tl.constexpr, HKV: tl.constexpr,
                         HQ_BLOCK: tl.constexpr, HKV_BLOCK: tl.constexpr, HD: tl.constexpr,
                         NORM: tl.constexpr, OFFSET: tl.constexpr):
    row = tl.program_id(0)
    src = qkv_ptr + row * stride_qkv
    j = tl.arange(0, HD)[None, :]
    c = tl.load(cos_ptr + row * HD + j).to(tl.float32)
    s = tl.load(sin_ptr + row * HD + j).to(tl.float32)
    _norm_rope_heads(src, wq_ptr, c, s, q_ptr + row * HQ * HD, eps, HQ, HQ_BLOCK, HD, NORM,
                     OFFSET)
    _norm_rope_heads(src + HQ * HD, wk_ptr, c, s, k_ptr + row * HKV * HD, eps, HKV, HKV_BLOCK,
                     HD, NORM, OFFSET)
    h = tl.arange(0, HKV_BLOCK)[:, None]
    mask = (h < HKV) & (j < HD)
    v = tl.load(src + (HQ + HKV) * HD + h * HD + j, mask=mask)     # v: copied out as it is
    tl.store(v_ptr + row * HKV * HD + h * HD + j, v, mask=mask)


def qk_norm_rope(qkv: torch.Tensor, wq: torch.Tensor | None, wk: torch.Tensor | None,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float, q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, *, offset: float = 1.0) -> None:
    """``qkv``: [m, (HQ + 2 HKV) * HD] bf16; cos/sin: [m, HD] bf16. Writes rows [0, m) of
    ``q`` [rows, HQ, HD], ``k`` and ``v`` [rows, HKV, HD]: q and k RMS-normed per head
    (``offset + w``: Gemma's 1, Qwen's 0; no norm when ``wq`` is None, as in Llama), then
    rotated. One program per row, all its heads at once."""
    m = qkv.shape[0]
    hq, hkv, hd = q.shape[1], k.shape[1], q.shape[2]
    if m:
        _qk_norm_rope_kernel[(m,)](qkv, qkv if wq is None else wq, qkv if wk is None else wk,
                                   cos, sin, q, k, v, qkv.stride(0), eps, HQ=hq, HKV=hkv,
                                   HQ_BLOCK=triton.next_power_of_2(hq),
                                   HKV_BLOCK=triton.next_power_of_2(hkv), HD=hd,
                                   NORM=wq is not None, OFFSET=offset,
                                   num_warps=min(16, max(4, hq * hd // 512)))


@triton.jit
def _gelu_tanh(g):
    # torch's tanh-approximate GELU: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))   # 1 + tanh(inner)


@triton.jit
def _gelu_mul_chunk(gu_ptr, row, start, cols, D: tl.constexpr, STRIDE: tl.constexpr):
    mask = start + cols < D
    pair = gu_ptr + row * STRIDE + 2 * (start + cols)     # gate, up interleaved
    g = tl.load(pair, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(pair + 1, mask=mask, other=0.0).to(tl.float32)
    a = _gelu_tanh(g).to(tl.bfloat16).to(tl.float32)
    return (a * u).to(tl.bfloat16).to(tl.float32), mask


@triton.jit
def _gelu_mul_kernel(gu_ptr, out_ptr, scale_ptr, D: tl.constexpr, INV_FP8_MAX, QUANT: tl.constexpr,
                     BLOCK: tl.constexpr, ONE_READ: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    if ONE_READ:   # the whole row at once (BLOCK >= D): read once, amax from registers
        h, mask = _gelu_mul_chunk(gu_ptr, row, 0, cols, D, 2 * D)
        if QUANT:
            _quantize_store(h, cols, mask, out_ptr, scale_ptr, row, D, INV_FP8_MAX)
        else:
            tl.store(out_ptr + row * D + cols, h.to(out_ptr.dtype.element_ty), mask=mask)
    elif QUANT:   # chunk by chunk: the amax first, then the row again to quantise it
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, D, BLOCK):
            h, mask = _gelu_mul_chunk(gu_ptr, row, start, cols, D, 2 * D)
            amax = tl.maximum(amax, tl.where(mask, tl.abs(h), 0.0))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) * INV_FP8_MAX
        for start in range(0, D, BLOCK):
            h, mask = _gelu_mul_chunk(gu_ptr, row, start, cols, D, 2 * D)
            q = tl.minimum(tl.maximum(tl.div_rn(h, scale), -448.0), 448.0)
            tl.store(out_ptr + row * D + start + cols, q.to(out_ptr.dtype.element_ty),
                     mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        for start in range(0, D, BLOCK):
            h, mask = _gelu_mul_chunk(gu_ptr, row, start, cols, D, 2 * D)
            tl.store(out_ptr + row * D + start + cols, h.to(out_ptr.dtype.element_ty),
                     mask=mask)


def gelu_mul(gate_up: torch.Tensor, *, quant: bool, one_read: bool | None = None):
    """``gate_up``: [m, 2 I] bf16, gate and up columns interleaved (g0 u0 g1 u1 ...) ->
    ``gelu_tanh(gate) * up`` as bf16 [m, I], or ``(fp8, per-row scale)`` when ``quant``. ``one_read``: hold each row in
    registers (default: rows up to ONE_READ_MAX wide); the same bits either way."""
    m, width = gate_up.shape
    d = width // 2
    out = torch.empty(m, d, dtype=FP8 if quant else gate_up.dtype, device=gate_up.device)
    scale = torch.empty(m if quant else 1, dtype=torch.float32, device=gate_up.device)
    if one_read is None:
        one_read = d <= ONE_READ_MAX
    block = triton.next_power_of_2(d) if one_read else CHUNK
    if m:
        _gelu_mul_kernel[(m,)](gate_up.contiguous(), out, scale, d, INV_FP8_MAX, QUANT=quant,
                               BLOCK=block, ONE_READ=one_read,
                               num_warps=min(16, max(4, block // 1024)))
    return (out, scale) if quant else out


@triton.jit
def _gate_up_act_kernel(a_ptr, w_ptr, h_ptr, amax_ptr, a_scale_ptr, w_scale_ptr, M, N, K,
                        stride_am, stride_wn, HAS_SCALE: tl.constexpr, A_SCALAR: tl.constexpr,
                        AMAX: tl.constexpr, STATIC_OUT: tl.constexpr, ACT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr):
    """The plain GEMM's tile over the interleaved gate|up weight (N = 2 I columns), then
    act(gate) * up in the epilogue: BLOCK_N / 2 columns of ``h`` [M, I] per tile, bf16, or
    fp8 by the down projection's static scale (``STATIC_OUT``: read from ``amax_ptr``)."""
    pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tile_product(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, pid_m, pid_n, M, N, K,
                       stride_am, stride_wn, HAS_SCALE, A_SCALAR, BLOCK_M, BLOCK_N, BLOCK_K)
    # Columns alternate gate, up: each thread holds both of a pair, so the split is free.
    gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
    # Rounded where the unfused path stores bf16: the projection, act(gate), the product.
    gate = gate.to(tl.bfloat16).to(tl.float32)
    up = up.to(tl.bfloat16).to(tl.float32)
    if ACT == 0:  # noqa: SIM108 (a compile-time choice: no ternary over constexprs here)
        a = _gelu_tanh(gate)
    else:
        a = gate / (1.0 + tl.exp(-gate))      # SiLU, as torch computes it
    h = (a.to(tl.bfloat16).to(tl.float32) * up).to(tl.bfloat16)
    half: tl.constexpr = BLOCK_N // 2
    width = N // 2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = pid_n * half + tl.arange(0, half)
    mask = (offs_m[:, None] < M) & (offs_h[None, :] < width)
    if STATIC_OUT:   # the bf16 product quantised as quantize_static_fp8 would read it
        h = _quantize_static(h.to(tl.float32), tl.load(amax_ptr))
    tl.store(h_ptr + offs_m[:, None] * width + offs_h[None, :],
             h.to(h_ptr.dtype.element_ty), mask=mask)
    if AMAX:
        amax = tl.max(tl.where(mask, tl.abs(h.to(tl.float32)), 0.0), axis=1)
        tl.store(amax_ptr + offs_m * tl.cdiv(N, BLOCK_N) + pid_n, amax, mask=offs_m < M)


@triton.jit
def _quantize_tiles_kernel(h_ptr, amax_ptr, out_ptr, scale_ptr, D, TILES, INV_FP8_MAX,
                           BLOCK: tl.constexpr, TILE_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.arange(0, TILE_BLOCK)
    amax = tl.max(tl.load(amax_ptr + row * TILES + t, mask=t < TILES, other=0.0), axis=0)
    scale = tl.maximum(amax, 1e-12) * INV_FP8_MAX      # quant/fp8.py's rule, as _quantize_store
    store_quantized_row(h_ptr, out_ptr, scale_ptr, row, D, scale, BLOCK)


ACTIVATIONS = {"gelu_tanh": 0, "silu": 1}


def gate_up_act(weight: torch.Tensor, weight_scale: torch.Tensor | None, x: torch.Tensor,
                x_scale: torch.Tensor | None = None, *, act: str = "gelu_tanh",
                out_scale: torch.Tensor | None = None, step: bool = False):
    """``act(x @ gate.T) * (x @ up.T)`` (``act``: gelu_tanh for Gemma, silu for Llama and
    Qwen) for a gate|up ``weight`` [2 I, K] whose rows alternate gate, up
    (layers.FUSED_PROJECTIONS, interleaved): bf16 [m, I], or with fp8 weights (``x`` fp8
    with its ``x_scale``: per row, or 0-dim static) ``(fp8, per-row scale)`` for the down
    projection; ``out_scale`` (the down projection's static input scale, 0-dim):
    ``(fp8, out_scale)``, quantised in the GEMM's epilogue. With GELU, the same bits as the
    plain GEMM followed by ``gelu_mul`` (or ``quantize_static_fp8``). ``step``: a decoding
    step's rows (their GEMM tiles, triton_matmul.STEP_CONFIGS)."""
    m, k = x.shape
    n = weight.shape[0]
    quant = weight_scale is not None
    static_out = quant and out_scale is not None
    h = torch.empty(m, n // 2, dtype=FP8 if static_out else torch.bfloat16, device=x.device)
    bm, bn, bk, gm, warps, stages = config(x.dtype, step)
    tiles = triton.cdiv(n, bn)
    amax = (out_scale if static_out else
            torch.empty(m, tiles, dtype=torch.float32, device=x.device) if quant else h)
    if m:
        _gate_up_act_kernel[(triton.cdiv(m, bm) * tiles,)](
            x, weight, h, amax, x_scale if quant else x, weight_scale if quant else weight,
            m, n, k, x.stride(0), weight.stride(0), HAS_SCALE=quant,
            A_SCALAR=quant and x_scale.dim() == 0, AMAX=quant and not static_out,
            STATIC_OUT=static_out, ACT=ACTIVATIONS[act], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP_M=gm, num_warps=warps, num_stages=stages)
    if static_out:
        return h, out_scale
    return quantize_tiles(h, amax) if quant else h


def quantize_tiles(h: torch.Tensor, tile_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 quantisation of bf16 ``h`` [m, D] whose row maxima are already known, as
    the maxima of each row's column tiles ``tile_amax`` [m, tiles]: one read of ``h``."""
    m, d = h.shape
    out = torch.empty(m, d, dtype=FP8, device=h.device)
    scale = torch.empty(m, dtype=torch.float32, device=h.device)
    if m:
        _quantize_tiles_kernel[(m,)](h, tile_amax, out, scale, d, tile_amax.shape[1],
                                     INV_FP8_MAX, BLOCK=min(triton.next_power_of_2(d), 4096),
                                     TILE_BLOCK=triton.next_power_of_2(tile_amax.shape[1]),
                                     num_warps=8)
    return out, scale

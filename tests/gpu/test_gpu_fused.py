"""Fused CUDA kernels (kernels/fused.py) against the unfused torch ops they replace, and the
fused forward against the module-by-module forward of the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from spinf_worker.engine.layout import Branch, DocTree
    from spinf_worker.kernels.fused import gate_up_act, gelu_mul, qk_norm_rope, residual_norm
    from spinf_worker.kernels.rowwise import quantize_rows_fp8, rmsnorm
    from spinf_worker.kernels.triton_matmul import matmul
    from spinf_worker.models.layers import apply_rope, rope_cos_sin
    from spinf_worker.quant.fp8 import quantize_rows, quantize_weight

    from .test_gpu_engine import _runner, rel_err

BF16 = torch.bfloat16


def _ulp_close(a: torch.Tensor, b: torch.Tensor, share: float = 0.01,
               scale: torch.Tensor | None = None) -> None:
    """Equal but for rare last-bit flips (a different but correct rounding path) of values
    of magnitude ``scale`` (default: the reference's own)."""
    diff = (a.float() - b.float()).abs()
    scale = (b.float().abs() if scale is None else scale.float()).clamp(min=1e-3)
    assert float((diff > 0).float().mean()) <= share
    assert float((diff / scale).max()) <= 2 ** -6


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("d", [640, 3840])
def test_residual_norm_equals_unfused(d, quant):
    x = torch.randn(257, d, device="cuda", dtype=BF16)
    y = torch.randn(257, d, device="cuda", dtype=BF16) * 4
    w_post, w_pre = (torch.randn(d, device="cuda", dtype=BF16) * 0.3 for _ in range(2))
    n = rmsnorm(y, w_post, 1e-6, 1.0)
    x_ref = x + n
    h_ref = rmsnorm(x_ref, w_pre, 1e-6, 1.0)
    out = x.clone()
    h = residual_norm(out, y, w_post, w_pre, 1e-6, quant=quant)
    _ulp_close(out, x_ref, scale=x.float().abs() + n.float().abs())   # a sum may cancel
    if quant:
        q, s = h
        q_ref, s_ref = quantize_rows(h_ref)
        deq = q.float() * s[:, None]
        assert float((deq - q_ref.float() * s_ref[:, None]).norm() / deq.norm()) < 1e-2
    else:
        _ulp_close(h, h_ref)
    # a row alone gives the same bits as inside the batch
    alone = x[:3].clone()
    h3 = residual_norm(alone, y[:3], w_post, w_pre, 1e-6, quant=quant)
    assert torch.equal(alone, out[:3])
    assert torch.equal(h3[0] if quant else h3, h[0][:3] if quant else h[:3])


@pytest.mark.parametrize("hq,hkv", [(8, 4), (4, 1), (6, 3)])
def test_qk_norm_rope_equals_unfused(hq, hkv):
    m, hd = 301, 256
    qkv = torch.randn(m, (hq + 2 * hkv) * hd, device="cuda", dtype=BF16)
    wq, wk = (torch.randn(hd, device="cuda", dtype=BF16) * 0.3 for _ in range(2))
    cos, sin = rope_cos_sin(torch.arange(m, device="cuda") * 3, hd, 10_000.0, 1.0, BF16)
    q = torch.zeros(m + 128, hq, hd, device="cuda", dtype=BF16)
    k = torch.zeros(m + 128, hkv, hd, device="cuda", dtype=BF16)
    v = torch.zeros(m + 128, hkv, hd, device="cuda", dtype=BF16)
    qk_norm_rope(qkv, wq, wk, cos[:, 0].contiguous(), sin[:, 0].contiguous(), 1e-6, q, k, v)
    q_ref, k_ref, v_ref = qkv.split([hq * hd, hkv * hd, hkv * hd], dim=-1)
    q_ref = apply_rope(rmsnorm(q_ref.reshape(m, hq, hd), wq, 1e-6, 1.0), cos, sin)
    k_ref = apply_rope(rmsnorm(k_ref.reshape(m, hkv, hd), wk, 1e-6, 1.0), cos, sin)
    # x cos + rot(x) sin may cancel, so differences are judged against the normed values'
    # size, O(1); and the compiler may keep the two products in fp32 where torch rounds each
    # to bf16, so last-bit differences are common here, never larger ones.
    _ulp_close(q[:m], q_ref, share=0.5, scale=q_ref.abs() + 1)
    _ulp_close(k[:m], k_ref, share=0.5, scale=k_ref.abs() + 1)
    assert torch.equal(v[:m], v_ref.reshape(m, hkv, hd))
    assert not q[m:].any() and not k[m:].any()


@pytest.mark.parametrize("quant", [False, True])
def test_gelu_mul_close_to_unfused(quant):
    gu = torch.randn(129, 2 * 2560, device="cuda", dtype=BF16) * 2
    gate, up = gu.unflatten(-1, (-1, 2)).unbind(-1)     # interleaved
    ref = F.gelu(gate, approximate="tanh") * up
    out = gelu_mul(gu, quant=quant)
    if quant:
        q, s = out
        deq = q.float() * s[:, None]
        assert float((deq - ref.float()).norm() / ref.float().norm()) < 4e-2
        assert torch.equal(gelu_mul(gu[:7], quant=True)[0].view(torch.uint8),
                           q[:7].view(torch.uint8))
    else:
        _ulp_close(out, ref, share=0.05)


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("width", [2048, 15360])
def test_gelu_mul_reads_once_or_chunk_by_chunk_to_the_same_bits(width, quant):
    gu = torch.randn(300, 2 * width, device="cuda", dtype=BF16) * 2
    once, chunked = gelu_mul(gu, quant=quant, one_read=True), gelu_mul(gu, quant=quant,
                                                                       one_read=False)
    if quant:
        assert torch.equal(once[1], chunked[1])
        once, chunked = once[0].view(torch.uint8), chunked[0].view(torch.uint8)
    assert torch.equal(once, chunked)


@pytest.mark.parametrize("step", [False, True])   # a pass's tiles or a decoding step's
@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("rows,k,width", [(300, 640, 2048), (1000, 3840, 15360), (5, 256, 200)])
def test_gate_up_act_gelu_equals_gemm_then_gelu_mul(rows, k, width, quant, step):
    """GELU * up in the GEMM's epilogue: the bits of the plain GEMM followed by gelu_mul,
    close to the torch ops, and a row's bits whatever rows share the call."""
    torch.manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=BF16)
    w = torch.randn(2 * width, k, device="cuda", dtype=BF16) * k ** -0.5   # g0 u0 g1 u1 ...
    ref = F.gelu(x.float() @ w[0::2].float().T, approximate="tanh") * (x.float() @ w[1::2].float().T)
    if quant:
        w8, w_scale = quantize_weight(w)
        x8, x_scale = quantize_rows_fp8(x)
        fused = gate_up_act(w8, w_scale, x8, x_scale, step=step)
        plain = gelu_mul(matmul(x8, w8, a_scale=x_scale, w_scale=w_scale,
                                out_dtype=BF16, step=step), quant=True)
        head = gate_up_act(w8, w_scale, x8[:3], x_scale[:3], step=step)
        assert torch.equal(fused[1], plain[1]) and torch.equal(head[1], fused[1][:3])
        assert rel_err(fused[0].float() * fused[1][:, None], ref) < 0.1
        fused, plain, head = (t[0].view(torch.uint8) for t in (fused, plain, head))
    else:
        fused = gate_up_act(w, None, x, step=step)
        plain = gelu_mul(matmul(x, w, step=step), quant=False)
        head = gate_up_act(w, None, x[:3], step=step)
        assert rel_err(fused, ref) < 2e-2
    assert torch.equal(fused, plain)
    assert torch.equal(head, fused[:3])


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_fused_forward_close_to_module_forward(scheme):
    docs = [DocTree([2, *range(10, 200)], [Branch([7, 8, 9], [[11], [12, 13]])]).flatten(0)]
    runner = _runner("cuda", BF16, fp8=scheme == "fp8")   # fused by ModelRunner on CUDA
    fused_scores = runner.run(docs)[0]
    plain = _runner("cuda", BF16, fp8=scheme == "fp8", fuse=False)   # the same weights
    plain_scores = plain.run(docs)[0]
    for a, b in zip(fused_scores.logprobs, plain_scores.logprobs, strict=True):
        assert float((a - b).abs().max()) < 0.1

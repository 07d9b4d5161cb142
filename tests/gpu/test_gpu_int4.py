"""The W4A16 GPTQ GEMM (kernels/int4_matmul.py) against the bf16 GEMM on the dequantised
weights (the path a GPTQ checkpoint is served by today): equal bit for bit, and a row's bits
independent of the rows beside it."""

from __future__ import annotations

import pytest
import torch

from ..test_gptq import gptq_layer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from spinf_worker.kernels.int4_matmul import int4_matmul
    from spinf_worker.kernels.triton_matmul import matmul
    from spinf_worker.quant.gptq import unpack_zeros


def _layer(out: int, d_in: int, group: int, sym: bool, seed: int = 0):
    """(qweight, zeros, scales) on the GPU as the kernel takes them, and the dense weight."""
    gen = torch.Generator().manual_seed(seed)
    tensors, dense = gptq_layer(out, d_in, group, sym, v2=True, gen=gen)
    zeros = unpack_zeros(tensors["qzeros"], out, v2=True)
    return (tensors["qweight"].cuda(), zeros.cuda(), tensors["scales"].float().cuda(),
            dense.cuda())


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("m", [1, 130, 1000])
def test_int4_equals_bf16_gemm_on_dequantised(group, sym, m):
    d_in, out = 1024, 768 + 40            # N not a multiple of the 256-column tile
    qweight, zeros, scales, dense = _layer(out, d_in, group, sym)
    a = torch.randn(m, d_in, device="cuda", dtype=torch.bfloat16)
    got = int4_matmul(a, qweight, zeros, scales, group)
    want = matmul(a, dense.to(torch.bfloat16))
    assert torch.equal(got, want)


def test_int4_row_alone_equals_row_among_others():
    qweight, zeros, scales, _ = _layer(512, 2048, 128, sym=False, seed=1)
    a = torch.randn(3000, 2048, device="cuda", dtype=torch.bfloat16)
    together = int4_matmul(a, qweight, zeros, scales, 128)
    for i in (0, 129, 2999):
        alone = int4_matmul(a[i:i + 1], qweight, zeros, scales, 128)
        assert torch.equal(alone[0], together[i])


def _requests(n: int) -> list[dict]:
    from ..test_engine_parity import NEWS, QUERIES

    words = NEWS.split()
    return [{"messages": [{"role": "user", "content": " ".join(words[i % 7:]) + f" ({i})"}],
             "scoring": {"queries": QUERIES}} for i in range(n)]


def _logprobs(response) -> list[float]:
    return [o.logprob for r in response.results for q in r.queries
            for c in q.combinations for o in c.options]


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("case", [("llama", 128, True, "gptq"), ("qwen3", 32, False, "gptq_v2"),
                                  ("gemma3", 32, False, "gptq")],
                         ids=lambda c: "-".join(map(str, c)))
def test_int4_engine_equals_bf16_on_dequantised(case, graphs, tmp_path, tiny_tokenizer_dir):
    """A GPTQ checkpoint served packed (scheme int4, the default on CUDA) scores bit for bit
    as its dequantised weights in bf16 through the same module-by-module forward, and a
    document's scores are the same alone and packed."""
    from spinf_worker.engine import Engine, EngineSettings

    from ..test_gptq import write_case

    _, gptq_dir, _ = write_case(tmp_path, tiny_tokenizer_dir, *case)
    engines = {scheme: Engine.load(str(gptq_dir), device="cuda", settings=EngineSettings(
        scheme=scheme, fuse=False, cuda_graphs=graphs)) for scheme in ("auto", "bf16")}
    assert engines["auto"].scheme == "int4"
    requests = _requests(5)
    packed = {s: [_logprobs(r) for r in e.score_batch(requests)] for s, e in engines.items()}
    assert packed["auto"] == packed["bf16"]
    for i in (0, 3):
        assert _logprobs(engines["auto"].score(requests[i])) == packed["auto"][i]
    weight = next(m for m in engines["auto"].model.modules() if getattr(m, "int4", None))
    assert weight.weight.dtype == torch.int32       # the layers really are packed


def test_int4_engine_fused_gemma_alone_equals_packed(tmp_path, tiny_tokenizer_dir):
    """Gemma's fused forward takes int4 layers as it takes int8 ones (gate|up, then GELU x up)."""
    from spinf_worker.engine import Engine

    from ..test_gptq import write_case

    _, gptq_dir, _ = write_case(tmp_path, tiny_tokenizer_dir, "gemma3", 128, True, "gptq")
    engine = Engine.load(str(gptq_dir), device="cuda")
    assert engine.scheme == "int4" and engine.model.use_fused
    requests = _requests(6)
    packed = [_logprobs(r) for r in engine.score_batch(requests)]
    for i in (1, 5):
        assert _logprobs(engine.score(requests[i])) == packed[i]

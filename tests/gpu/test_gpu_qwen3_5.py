"""GPU checks of the Qwen3.5 stack (Gated DeltaNet + gated full attention; skipped without
CUDA): it runs the module forward on CUDA (no fused forward, no CUDA graphs), close to the
same weights on the CPU in fp32 and to transformers, and bit-identical alone vs packed."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    import transformers

    from spinf_worker.engine.runner import ModelRunner

    from ..media_oracle import served_weights
    from ..qwen3_5_random import body_linears, random_qwen3_5
    from .test_gpu_engine import _random_docs, rel_err

DEVICE = "cuda"


def _runner(device: str, dtype: torch.dtype, scheme: str = "bf16") -> ModelRunner:
    """The random Qwen3.5 of qwen3_5_random.CFG (the released 27B's proportions, narrower)."""
    model = random_qwen3_5().to(device=device, dtype=dtype)
    if scheme == "fp8":
        model.to_fp8()
    return ModelRunner(model.eval(), torch.device(device), dtype, 0)


def _fp8_oracle() -> torch.nn.Module:
    """The model in fp32 holding the weights CUDA serves in fp8 (bf16, then quant/fp8.py's
    per-channel rule) and rounding its linear layers' inputs per token as the scheme does."""
    return served_weights(random_qwen3_5(), "fp8", torch.bfloat16, activations=True,
                          linears=body_linears)


# fp8's per-token rounding of every linear layer's input makes this deep random model's
# scores brittle: on the CPU, inputs 1e-7 apart in fp32 round one e4m3 step apart somewhere,
# that step moves later layers' inputs across more boundaries, and after a few layers the two
# sides are two draws of the rounding (a 1e-7 nudge of the oracle's embeddings moves options
# by 0.14; the CPU's fp8 path in fp32, which equals the oracle to 2e-6 on the tiny checkpoint
# of tests/test_qwen3_5_fp8.py, is 0.19 from it here). bf16 activations start 4e-3 apart:
# the CPU's fp8 path in bf16 is 0.47-0.60 from the oracle over four document sets, and 0.45-0.59
# from one rounding the weights only (benchmarks/qwen3_5_fp8_rounding.py). So fp8's bound
# below says the GPU is as far from the oracle as the CPU's same path; that it rounds what the
# oracle rounds is test_gpu_qwen3_5_fp8_layers_round_as_the_oracle's, layer by layer.
# H100, 2026-12-06: fp8 0.384 from that oracle (0.758 from the CPU in fp32 on 2026-12-03).
@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_gpu_qwen3_5_close_to_cpu_fp32_and_invariant(scheme):
    """bf16 against the CPU in fp32; fp8 against the CPU's fp32 oracle of the fp8 scheme."""
    docs = _random_docs(8, seed=2)
    if scheme == "fp8":
        cpu = ModelRunner(_fp8_oracle(), torch.device("cpu"), torch.float32, 0).run(docs)
    else:
        cpu = _runner("cpu", torch.float32).run(docs)
    gpu_runner = _runner(DEVICE, torch.bfloat16, scheme)
    assert gpu_runner.graphs is None and not gpu_runner.model.use_fused
    gpu = gpu_runner.run(docs)
    worst = max(float(np.abs(dc.option_logprobs - dg.option_logprobs).max())
                for dc, dg in zip(cpu, gpu, strict=True))
    against = "oracle" if scheme == "fp8" else "engine"
    print(f"qwen3_5 {scheme}: max |Δlogprob| vs the CPU's fp32 {against} {worst:.4f}")
    assert worst < (0.7 if scheme == "fp8" else 0.15), worst
    for target in (0, 3, 7):
        alone = gpu_runner.run([docs[target]])[0]
        assert np.array_equal(alone.option_logprobs, gpu[target].option_logprobs), target
        # and among other documents in another order (other offsets, another pass bucket)
        others = _random_docs(12, seed=10 + target)
        packed = gpu_runner.run(others[:target] + [docs[target]] + others[target:])[target]
        assert np.array_equal(alone.option_logprobs, packed.option_logprobs), target


def test_gpu_qwen3_5_fp8_layers_round_as_the_oracle():
    """fp8 on CUDA quantises the layers the oracle rounds, and each of them, fed the bf16 of
    the input the CPU oracle's layer sees in a pass, gives the oracle layer's output to
    within bf16's rounding of it; the same weights without rounding the input are several
    times farther (no cascade: one layer at a time)."""
    docs = _random_docs(2, seed=2)
    oracle = _fp8_oracle()
    names = {m: n for n, m in oracle.named_modules()}
    inputs: dict[str, torch.Tensor] = {}

    def keep(module, args):      # before the oracle's own hook rounds it
        inputs[names[module]] = args[0].detach().to(torch.bfloat16)

    hooks = [m.register_forward_pre_hook(keep, prepend=True) for m in body_linears(oracle)]
    ModelRunner(oracle, torch.device("cpu"), torch.float32, 0).run(docs)
    for h in hooks:
        h.remove()
    model = _runner(DEVICE, torch.bfloat16, "fp8").model
    fp8 = {n for n, m in model.named_modules()
           if getattr(m, "weight", None) is not None and m.weight.dtype == torch.float8_e4m3fn}
    assert fp8 == set(inputs), fp8 ^ set(inputs)
    for name, x in inputs.items():
        layer = oracle.get_submodule(name)
        with torch.no_grad():
            want = layer(x.float())
            unrounded = torch.nn.functional.linear(x.float(), layer.weight)
            got = model.get_submodule(name)(x.to(DEVICE)).float().cpu()
        err, apart = rel_err(got, want), rel_err(unrounded, want)
        assert err < 5e-3 and apart > 3 * err, (name, err, apart)


@pytest.mark.skipif(torch.cuda.is_available()
                    and not hasattr(transformers, "Qwen3_5ForCausalLM"),
                    reason="this transformers has no Qwen3.5")
@pytest.mark.xfail(strict=False, reason="H200, 2026-12-03: against transformers on the GPU the gaps are 0.277 (bf16, bound 0.15) and 0.032 (fp32, bound 0.02); against the CPU engine in fp32 bf16 is within 0.15")
@pytest.mark.parametrize("scheme, tol", [("bf16", 0.15), ("fp32", 0.02)])
def test_gpu_qwen3_5_engine_agrees_with_transformers(tmp_path, tiny_tokenizer_dir, scheme, tol):
    """The engine on CUDA against Qwen3_5ForCausalLM in fp32 (one full sequence per option),
    on a tiny random checkpoint; fp32 here is TF32 in the Triton GEMM."""
    from spinf_worker.engine import Engine, EngineSettings

    from ..test_engine_parity import NEWS, QUERIES, score
    from ..test_qwen3_5 import LONG, tiny_qwen3_5

    path = tiny_qwen3_5(tmp_path / "tiny-qwen3_5", tiny_tokenizer_dir)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    engine = Engine.load(str(path), device="cuda", settings=EngineSettings(scheme=scheme))
    enc, bos = engine.presenter.encode, engine.checkpoint.bos_token_id
    content = NEWS * 3
    queries = [LONG, *QUERIES[:3]]
    results = score(engine, content, queries, case_insensitive=False)
    worst = 0.0
    for query, result in zip(queries, results, strict=True):
        ctx = [bos, *enc(content), *enc(query["template"].split("{?}")[0])]
        for option in result.combinations[0].options:
            ids = ctx + list(enc(option.text))
            with torch.no_grad():
                logits = oracle(torch.tensor([ids])).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            want = sum(lp[j - 1, ids[j]].item() for j in range(len(ctx), len(ids)))
            worst = max(worst, abs(option.logprob - want))
    print(f"qwen3_5 {scheme} on CUDA: max |Δlogprob| vs transformers {worst:.5f}")
    assert worst < tol, worst
    shutil.rmtree(path)

"""GPU checks of the Llama, Qwen3 and Gemma 4 stacks (skipped without CUDA): a packed pass in
bf16, int8 (bf16 activations) and fp8 close to the same weights on the CPU in fp32, and
bit-identical logprobs alone vs packed. Llama without biases and Qwen3 in bf16 and fp8 run
the fused forward (models/fused_stack.py) and CUDA graphs; the others the module forward.
Gemma 4's global layers use head dim 128 here, and 512 (the released checkpoints') in a test
of its own: at that width FlexAttention's default tiles need more shared memory than an H200
has (263,168 bytes asked, 232,448 available), so kernels/flex_tree.py names smaller ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from spinf_worker.engine.runner import ModelRunner
    from spinf_worker.models.build import init_random
    from spinf_worker.models.gemma4 import Gemma4Config, Gemma4Model
    from spinf_worker.models.layers import RMSNorm
    from spinf_worker.models.llama import LlamaConfig, LlamaModel
    from spinf_worker.models.qwen3 import Qwen3Config, Qwen3Model

    from .test_gpu_engine import _random_docs

SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_heads=4)


def _stack(family: str, global_head_dim: int = 128):
    if family == "smollm":   # Llama without biases, tied head, default RoPE
        cfg = LlamaConfig(**SHAPE, num_layers=4, num_kv_heads=2, head_dim=64,
                          rope={"rope_type": "default", "rope_theta": 10_000.0},
                          layer_types=("full_attention",) * 4)
        return LlamaModel, cfg
    if family == "llama":
        cfg = LlamaConfig(**SHAPE, num_layers=4, num_kv_heads=2, head_dim=64,
                          attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                          rope={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 256},
                          layer_types=("full_attention",) * 4)
        return LlamaModel, cfg
    if family == "qwen3":
        cfg = Qwen3Config(**SHAPE, num_layers=4, num_kv_heads=2, head_dim=64, sliding_window=64,
                          layer_types=("full_attention",) * 2 + ("sliding_attention",) * 2)
        return Qwen3Model, cfg
    cfg = Gemma4Config(**SHAPE, num_layers=6, sliding_window=64,
                       layer_types=("sliding_attention", "full_attention") * 3,
                       head_dims=(64, global_head_dim) * 3, kv_heads=(2, 1) * 3,
                       hidden_size_per_layer_input=64, vocab_size_per_layer_input=4096,
                       attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True,
                       final_logit_softcapping=30.0)
    return Gemma4Model, cfg


def _runner(family: str, device: str, dtype: torch.dtype, scheme: str = "bf16",
            global_head_dim: int = 128) -> ModelRunner:
    model_class, cfg = _stack(family, global_head_dim)
    with torch.device("meta"):
        model = model_class(cfg)
    model = model.to_empty(device="cpu").float()
    with torch.no_grad():
        init_random(model, seed=0)
        gen = torch.Generator().manual_seed(1)
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.add_(0.2 * torch.randn(m.weight.shape, generator=gen))
        # Gemma 4 attends unscaled after its q/k norms: with unit norms, random 512-wide heads
        # give one-hot attention, too brittle to compare precisions on.
        for name, m in model.named_modules():
            if family == "gemma4" and name.endswith(("q_norm", "k_norm")):
                m.weight.mul_(0.25)
    model = model.to(device=device, dtype=dtype)
    if scheme == "int8":
        model.to_int8()
    if scheme == "fp8" and device == "cuda":   # the CPU reference stays in fp32
        model.to_fp8()
    return ModelRunner(model.eval(), torch.device(device), dtype, 0)


@pytest.mark.parametrize("family", ["smollm", "llama", "qwen3", "gemma4"])
@pytest.mark.parametrize("scheme", ["bf16", "int8", "fp8"])
def test_gpu_family_close_to_cpu_fp32_and_invariant(family, scheme):
    docs = _random_docs(8, seed=2)
    cpu = _runner(family, "cpu", torch.float32, scheme).run(docs)
    gpu_runner = _runner(family, "cuda", torch.bfloat16, scheme)
    fused = family in ("smollm", "qwen3") and scheme != "int8"
    assert (gpu_runner.graphs is not None) == fused
    gpu = gpu_runner.run(docs)
    worst = max(float(np.abs(dc.option_logprobs - dg.option_logprobs).max())
                for dc, dg in zip(cpu, gpu, strict=True))
    print(f"{family} {scheme}: max |Δlogprob| vs the CPU in fp32 {worst:.4f}")
    assert worst < (0.4 if scheme == "fp8" else 0.15), worst
    for target in (0, 5):
        alone = gpu_runner.run([docs[target]])[0]
        assert np.array_equal(alone.option_logprobs, gpu[target].option_logprobs), target


def test_gpu_gemma4_global_head_dim_512():
    """The released checkpoints' width: smaller attention tiles (flex_tree.WIDE_HEAD_OPTIONS)."""
    docs = _random_docs(4, seed=3)
    cpu = _runner("gemma4", "cpu", torch.float32, global_head_dim=512).run(docs)
    gpu_runner = _runner("gemma4", "cuda", torch.bfloat16, global_head_dim=512)
    gpu = gpu_runner.run(docs)
    worst = max(float(np.abs(dc.option_logprobs - dg.option_logprobs).max())
                for dc, dg in zip(cpu, gpu, strict=True))
    assert worst < 0.15, worst
    alone = gpu_runner.run([docs[1]])[0]
    assert np.array_equal(alone.option_logprobs, gpu[1].option_logprobs)

"""Where the fp8 scheme's distance to fp32 comes from on Qwen3.5 (CPU; a few minutes): the
random 8-layer model and documents of tests/gpu/test_gpu_qwen3_5.py, and the tiny checkpoint
of tests/test_qwen3_5_fp8.py against transformers. max |Δ option logprob| (mean beside it):

- ``fp8 vs fp32``: the CPU's fp8 path (fp32 activations, and bf16 as CUDA runs it) against
  the CPU in fp32, beside bf16's;
- ``vs oracle``: against the fp32 model holding the fp8 weights and rounding every fp8 layer's
  input per token (media_oracle.served_weights; weights from bf16 for the bf16 path, as CUDA
  holds them), and against one rounding the weights only;
- ``nudge``: the oracle against itself with its embeddings scaled by 1 + 1e-7: how far apart
  two fp32 computations of the same fp8 model end once one input rounds a step apart;
- ``layer 0``: where the fp8 path and the oracle part: the inputs of layer 0's fp8 layers,
  how many elements round to another fp8 value;
- ``only X``: the oracle rounding (weights and inputs) only those layers, against fp32; ``b|a
  dense``: all but the rows of the DeltaNet gates' projections (beta, decay);
- ``layers``: each fp8 layer of the bf16 path fed the bf16 of the oracle's layer input, against
  the oracle's layer (relative L2), and the oracle's weights without rounding the input.

    python benchmarks/qwen3_5_fp8_rounding.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spinf_worker.engine import Engine, EngineSettings  # noqa: E402
from spinf_worker.engine.runner import ModelRunner  # noqa: E402
from spinf_worker.quant.fp8 import quantize_rows  # noqa: E402
from tests import media_oracle  # noqa: E402
from tests.conftest import write_tiny_tokenizer  # noqa: E402
from tests.qwen3_5_random import body_linears, random_qwen3_5  # noqa: E402
from tests.random_docs import random_docs  # noqa: E402


def run(model, docs, dtype=torch.float32):
    return ModelRunner(model.eval(), torch.device("cpu"), dtype, 0).run(docs)


def gap(a, b) -> str:
    d = np.concatenate([np.abs(x.option_logprobs - y.option_logprobs)
                        for x, y in zip(a, b, strict=True)])
    return f"{d.max():.3f} (mean {d.mean():.3f})"


def fp8_path(dtype=torch.float32):
    model = random_qwen3_5().to(dtype)
    model.to_fp8()
    return model


def oracle(dtype=torch.float32, activations=True, pick=lambda name: True, nudge=0.0,
           dense_gates=False):
    """served_weights on the random model; ``pick``: the names of the layers it rounds."""
    model = random_qwen3_5()
    with torch.no_grad():
        model.embed_tokens.weight.mul_(1 + nudge)
    served = media_oracle.served_weights(
        model, "fp8", dtype, activations=activations,
        linears=lambda m: [x for x in body_linears(m) if pick(names_of(m)[x])])
    if dense_gates:
        keep_gates_dense(served, model)
    return served


def names_of(model):
    return {m: n for n, m in model.named_modules()}


def keep_gates_dense(served, model):
    """The rows of each in_proj that make b and a (beta, the decay) from the unrounded input
    and weights, the rest as served."""
    for layer, orig in zip(served.layers, model.layers, strict=True):
        if not layer.linear:
            continue
        proj, hv = layer.linear_attn.in_proj, layer.linear_attn.cfg.linear_num_value_heads
        w = orig.linear_attn.in_proj.weight.detach()[-2 * hv:].clone()
        seen = {}
        proj.register_forward_pre_hook(lambda m, a, seen=seen: seen.update(x=a[0]),
                                       prepend=True)
        proj.register_forward_hook(
            lambda m, a, out, w=w, seen=seen: torch.cat(
                (out[:, :-w.shape[0]], torch.nn.functional.linear(seen["x"], w)), dim=-1))


def layer0_flips(docs):
    """Elements of layer 0's fp8 layers' inputs rounding to another value, path vs oracle."""
    seen: dict[str, list] = {}

    def record(model):
        names = names_of(model)
        for m in body_linears(model):
            if names[m].startswith("layers.0."):
                m.register_forward_pre_hook(
                    lambda mod, a, n=names[m]: seen.setdefault(n, []).append(a[0].detach()),
                    prepend=True)
        return model

    run(record(fp8_path()), docs)
    run(record(oracle()), docs)
    for name, (ours, theirs) in seen.items():
        (qa, sa), (qb, sb) = quantize_rows(ours), quantize_rows(theirs)
        codes = int((qa.view(torch.uint8) != qb.view(torch.uint8)).sum())
        rel = float(((ours - theirs).abs().amax(1) / theirs.abs().amax(1).clamp(min=1e-30)).max())
        print(f"  layer 0 {name}: inputs {rel:.1e} apart (row max), {codes} of {ours.numel()} "
              f"elements round to another fp8 value, {int((sa != sb).sum())} rows' scales differ")


def layer_by_layer(docs):
    theirs = oracle(torch.bfloat16)
    inputs = {}
    names = names_of(theirs)
    for m in body_linears(theirs):
        m.register_forward_pre_hook(
            lambda mod, a: inputs.__setitem__(names[mod], a[0].detach().to(torch.bfloat16)),
            prepend=True)
    run(theirs, docs)
    ours = fp8_path(torch.bfloat16)
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    errs, apart = [], []
    with torch.no_grad():
        for name, x in inputs.items():
            layer = theirs.get_submodule(name)
            want = layer(x.float())
            errs.append(rel(ours.get_submodule(name)(x).float(), want))
            apart.append(rel(torch.nn.functional.linear(x.float(), layer.weight), want))
    print(f"  layers ({len(errs)}): bf16 path vs oracle layer max {max(errs):.1e}; "
          f"unrounded input min {min(apart):.1e}")


def tiny():
    import transformers

    from tests.test_qwen3_5 import tiny_qwen3_5
    from tests.test_qwen3_5_fp8 import DOCUMENTS, rounding_oracle, worst_gap

    tmp = Path(tempfile.mkdtemp())
    (tmp / "tok").mkdir()
    path = tiny_qwen3_5(tmp / "qwen", write_tiny_tokenizer(tmp / "tok"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    engine = Engine.load(str(path), device="cpu", settings=EngineSettings(scheme="fp8"))
    rounding, weights = rounding_oracle(model), rounding_oracle(model, activations=False)
    for document in DOCUMENTS:
        print(f"  tiny, {document}: fp8 vs transformers fp32 "
              f"{worst_gap(engine, model, document):.3f}, vs the rounding oracle "
              f"{worst_gap(engine, rounding, document):.1e}, vs weights-only "
              f"{worst_gap(engine, weights, document):.3f}")


def main():
    docs = random_docs(8, seed=2)
    ref = run(random_qwen3_5(), docs)
    f32, f16 = run(fp8_path(), docs), run(fp8_path(torch.bfloat16), docs, torch.bfloat16)
    print("GPU test's setup (8 documents, seed 2), on the CPU:")
    bf16 = run(random_qwen3_5().to(torch.bfloat16), docs, torch.bfloat16)
    print(f"  fp8 vs fp32: fp32 activations {gap(f32, ref)}, bf16 {gap(f16, ref)}; "
          f"bf16 without fp8 {gap(bf16, ref)}")
    o32 = run(oracle(), docs)
    print(f"  fp8 (fp32) vs oracle {gap(f32, o32)}; vs weights-only "
          f"{gap(f32, run(oracle(activations=False), docs))}; oracle vs fp32 {gap(o32, ref)}")
    print(f"  nudge 1e-7: oracle vs itself {gap(o32, run(oracle(nudge=1e-7), docs))}")
    layer0_flips(docs)
    for part in ("in_proj", "out_proj", "self_attn", "mlp"):
        only = run(oracle(pick=lambda name, part=part: part in name), docs)
        print(f"  only {part} rounded vs fp32 {gap(only, ref)}")
    print(f"  all but the b|a rows vs fp32 {gap(run(oracle(dense_gates=True), docs), ref)}")
    layer_by_layer(random_docs(2, seed=2))
    for seed in (2, 3, 4, 5):
        docs = random_docs(8, seed=seed)
        f16 = run(fp8_path(torch.bfloat16), docs, torch.bfloat16)
        print(f"  seed {seed}: fp8 (bf16) vs fp32 {gap(f16, run(random_qwen3_5(), docs))}, "
              f"vs oracle {gap(f16, run(oracle(torch.bfloat16), docs))}, vs weights-only "
              f"{gap(f16, run(oracle(torch.bfloat16, activations=False), docs))}")
    tiny()


if __name__ == "__main__":
    main()

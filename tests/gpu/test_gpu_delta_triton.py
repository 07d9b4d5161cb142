"""GPU checks of the Triton gated delta rule over the tree (kernels/delta_triton.py; skipped
without CUDA): at the released models' head size (128) close to the torch path and to a
token-by-token reference in fp64, bit-identical alone vs packed; the Qwen3.5 stacks' scores
with it close to the torch path's, and bit-identical alone vs packed."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from spinf_worker.engine.layout import Branch, DocTree
from spinf_worker.kernels import delta_tree

from ..test_delta_triton import branch_keys, features, pass_of, random_doc, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HEADS, DIM = 6, 128


@pytest.fixture
def triton_calls(monkeypatch) -> list[int]:
    """Counts the passes' DeltaNet layers that went through the Triton kernels."""
    rule = delta_tree._triton_rule()
    assert rule is not None, "triton does not import"
    calls = []

    def counted(*args):
        calls.append(1)
        return rule(*args)

    monkeypatch.setattr(delta_tree, "_triton_rule", lambda: counted)
    return calls


def both_paths(monkeypatch, fn):
    """``fn()`` through the Triton kernels, then through the torch path."""
    monkeypatch.setattr(delta_tree, "KERNEL", "triton")
    got = fn()
    monkeypatch.setattr(delta_tree, "KERNEL", "torch")
    want = fn()
    monkeypatch.setattr(delta_tree, "KERNEL", "triton")
    return got, want


def test_close_to_torch_path_and_to_token_by_token(monkeypatch, triton_calls):
    """Roots of 1 to 301 rows, questions up to 12 tokens deep, one question 66 deep (over a
    chunk of the torch path's recurrence)."""
    rng = random.Random(0)
    docs = [random_doc(rng, n, 8, deep=12) for n in (0, 5, 63, 64, 150, 300)]
    docs.append(DocTree([2, 41, 42], [Branch([18] * 66, [[21, 22]])]).flatten(0))
    plan, ids = pass_of(docs, "cuda")
    inputs = features(ids, HEADS, DIM, DIM, "cuda")
    got, torch_path = both_paths(
        monkeypatch, lambda: delta_tree.tree_delta_rule(plan, *inputs).cpu())
    assert len(triton_calls) == 1
    want = reference(docs, *inputs)
    vs_torch = float((got - torch_path).abs().max())
    vs_ref = float((got.double() - want).abs().max())
    print(f"delta_triton on CUDA, head dims {DIM}: max |Δ| vs the torch path {vs_torch:.2e}, "
          f"vs token by token in fp64 {vs_ref:.2e} (torch path vs fp64 "
          f"{float((torch_path.double() - want).abs().max()):.2e}); outputs up to "
          f"{float(want.abs().max()):.2f}")
    assert vs_torch < 1e-4 and vs_ref < 1e-4


def test_bits_alone_vs_packed(triton_calls):
    """A document alone and among others at two offsets; a question alone under its root
    and beside other questions (some sharing its first tokens, some deeper)."""
    rng = random.Random(1)
    target = random_doc(rng, 90, 6)
    plan, ids = pass_of([target], "cuda")
    alone = delta_tree.tree_delta_rule(plan, *features(ids, HEADS, DIM, DIM, "cuda"))
    others = [random_doc(rng, rng.randint(0, 300), 8) for _ in range(12)]
    for at in (3, 12):
        docs = others[:at] + [target] + others[at:]
        plan, ids = pass_of(docs, "cuda")
        start = sum(d.length for d in docs[:at])
        packed = delta_tree.tree_delta_rule(plan, *features(ids, HEADS, DIM, DIM, "cuda"))
        assert torch.equal(packed[start:start + target.length], alone), at

    root = [2] + list(range(100, 200))
    question = Branch([17, 18, 19], [[21], [22, 23]])
    siblings = [Branch([17, 18], [[24]]), Branch([17] * 40, [[25, 26]]), Branch([19], [[21]])]
    doc = DocTree(root, [question]).flatten(0)
    plan, ids = pass_of([doc], "cuda")
    alone = delta_tree.tree_delta_rule(plan, *features(ids, HEADS, DIM, DIM, "cuda"))
    [alone_rows] = branch_keys([doc], ids)
    for at in (0, 3):
        doc = DocTree(root, siblings[:at] + [question] + siblings[at:]).flatten(0)
        plan, ids = pass_of([doc], "cuda")
        out = delta_tree.tree_delta_rule(plan, *features(ids, HEADS, DIM, DIM, "cuda"))
        [rows] = branch_keys([doc], ids)
        for key, row in alone_rows.items():
            assert torch.equal(out[rows[key]], alone[row]), (at, key)
    assert len(triton_calls) == 6


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 0.1), (torch.float32, 0.01)])
def test_qwen3_5_runner_triton_vs_torch_path(monkeypatch, triton_calls, dtype, tol):
    """The Qwen3.5 stack of the released proportions (head dims 128) on random documents:
    the option logprobs through the Triton kernels near the torch path's."""
    from .test_gpu_engine import _random_docs
    from .test_gpu_qwen3_5 import _runner

    docs = _random_docs(8, seed=2)
    runner = _runner("cuda", dtype)
    got, want = both_paths(monkeypatch, lambda: runner.run(docs))
    assert triton_calls
    worst = max(float(np.abs(a.option_logprobs - b.option_logprobs).max())
                for a, b in zip(got, want, strict=True))
    print(f"qwen3_5 {dtype}: max |Δlogprob| Triton vs torch path {worst:.2e}")
    assert worst < tol, worst


def test_tiny_qwen3_5_engine(monkeypatch, triton_calls, tmp_path, tiny_tokenizer_dir):
    """The tiny Qwen3.5 checkpoint (tests/test_qwen3_5.py; head dims 8) on CUDA: scores
    through the Triton kernels near the torch path's, and bit-identical alone vs packed."""
    from spinf_worker.engine import Engine, EngineSettings

    from ..test_batch_invariance import assert_invariant
    from ..test_engine_parity import NEWS, QUERIES, score
    from ..test_qwen3_5 import LONG, tiny_qwen3_5

    path = tiny_qwen3_5(tmp_path / "tiny-qwen3_5", tiny_tokenizer_dir)
    engine = Engine.load(str(path), device="cuda", settings=EngineSettings(scheme="fp32"))

    def logprobs():
        results = score(engine, NEWS * 3, [LONG, *QUERIES[:3]])
        return [o.logprob for q in results for c in q.combinations for o in c.options]

    got, want = both_paths(monkeypatch, logprobs)
    assert triton_calls
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    print(f"tiny qwen3_5 fp32 on CUDA: max |Δlogprob| Triton vs torch path {worst:.2e}")
    assert worst < 0.01, worst
    assert_invariant(engine, {"text": NEWS * 2, "scoring": {"queries": [*QUERIES, LONG]}},
                     seed=4)


def test_long_roots_by_chunks(monkeypatch, triton_calls):
    """Roots of 256 rows and more go by chunks: close to the same roots token by token and to
    fp64, a long document's bits alone vs packed among short and long ones."""
    from spinf_worker.kernels import delta_triton

    monkeypatch.setattr(delta_triton, "CHUNKED_ROOT", 256)      # off by default
    rng = random.Random(5)
    target = random_doc(rng, 700, 6)
    plan, ids = pass_of([target], "cuda")
    inputs = features(ids, HEADS, DIM, DIM, "cuda")
    assert delta_triton.TreeRows.of(plan, "cuda").long_roots.tolist() == [0]
    alone = delta_tree.tree_delta_rule(plan, *inputs)
    monkeypatch.setattr(delta_triton, "CHUNKED_ROOT", 1 << 30)
    plan, _ = pass_of([target], "cuda")
    token_by_token = delta_tree.tree_delta_rule(plan, *inputs)
    monkeypatch.setattr(delta_triton, "CHUNKED_ROOT", 256)
    want = reference([target], *inputs)
    vs_steps = float((alone - token_by_token).abs().max())
    vs_ref = float((alone.double().cpu() - want).abs().max())
    print(f"a 701-row root by chunks: max |Δ| vs token by token {vs_steps:.2e}, vs fp64 "
          f"{vs_ref:.2e}")
    assert vs_steps < 1e-4 and vs_ref < 1e-4
    others = [random_doc(rng, n, 4) for n in (40, 300, 3, 1000)]
    for at in (0, 2, 4):
        docs = others[:at] + [target] + others[at:]
        plan, ids = pass_of(docs, "cuda")
        start = sum(d.length for d in docs[:at])
        packed = delta_tree.tree_delta_rule(plan, *features(ids, HEADS, DIM, DIM, "cuda"))
        assert torch.equal(packed[start:start + target.length], alone), at

"""GPU checks (skipped without CUDA): kernels against references, bf16/fp8 engine passes
close to the fp32 CPU stack, and bit-identical logprobs alone vs packed at any offset."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ..random_docs import random_docs as _random_docs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from spinf_worker.engine.layout import Branch, DocTree
    from spinf_worker.engine.runner import PASS_BUCKET, ModelRunner, doc_span, pass_rows
    from spinf_worker.kernels.attention import AttentionPlan, packed_tree_attention
    from spinf_worker.kernels.flex_tree import TreeTokens, build_flex_plan, flex_tree_attention
    from spinf_worker.kernels.rowwise import quantize_rows_fp8, rmsnorm
    from spinf_worker.kernels.triton_matmul import matmul
    from spinf_worker.models.build import init_random
    from spinf_worker.models.gemma3 import Gemma3Config, Gemma3Model
    from spinf_worker.quant.fp8 import quantize_rows, quantize_weight

CFG = dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=6, num_heads=4,
           num_kv_heads=2, head_dim=64, sliding_window=64, query_pre_attn_scalar=64,
           layer_types=("sliding_attention",) * 5 + ("full_attention",))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("step", [False, True])   # a pass's tiles or a decoding step's
@pytest.mark.parametrize("m", [1, 77, 128, 1000, 4099])
def test_triton_bf16_matmul(m, step):
    a = torch.randn(m, 640, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 640, device="cuda", dtype=torch.bfloat16)
    out = matmul(a, w, step=step)
    assert rel_err(out, a.double() @ w.double().t()) < 1e-2
    # batch invariance: the first rows alone and inside a larger product, bit for bit
    big = torch.cat([a, torch.randn(3000, 640, device="cuda", dtype=torch.bfloat16)])
    assert torch.equal(matmul(big, w, step=step)[:m], out)


@pytest.mark.parametrize("step", [False, True])
def test_triton_fp8_matmul_matches_dequantised_reference(step):
    a = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, 1024, device="cuda", dtype=torch.bfloat16)
    aq, sa = quantize_rows(a)
    wq, sw = quantize_weight(w)
    out = matmul(aq, wq, a_scale=sa, w_scale=sw, out_dtype=torch.bfloat16, step=step)
    ref = (aq.double() * sa.double()[:, None]) @ (wq.double() * sw.double()[:, None]).t()
    assert rel_err(out, ref) < 1e-2
    assert rel_err(out, a.double() @ w.double().t()) < 6e-2   # fp8 quantisation error
    big = torch.cat([a, torch.randn(900, 1024, device="cuda", dtype=torch.bfloat16)])
    bq, sb = quantize_rows(big)
    assert torch.equal(matmul(bq, wq, a_scale=sb, w_scale=sw, out_dtype=torch.bfloat16,
                              step=step)[:300], out)


@pytest.mark.parametrize("shape", [(1, 640), (300, 3840), (77, 15360), (5, 1000)])
def test_fused_fp8_quantisation_equals_reference(shape):
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 3
    q, s = quantize_rows_fp8(x)
    q_ref, s_ref = quantize_rows(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_rmsnorm_rowwise():
    x = torch.randn(513, 640, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(640, device="cuda", dtype=torch.bfloat16)
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.float())
    assert rel_err(rmsnorm(x, w, 1e-6, 1.0), ref) < 1e-2
    assert torch.equal(rmsnorm(x[:5], w, 1e-6, 1.0), rmsnorm(x, w, 1e-6, 1.0)[:5])


def _flex_and_cpu_attention(docs: list, window: int, media: str = "none",
                            sliding: bool = True) -> tuple:
    """Random q, k, v over the pass of ``docs``: the pass's input rows, FlexAttention's output
    on the GPU (brought back to the CPU) and the CPU path's attention of the same rows, on a
    sliding or a full layer; ``media``: where one image's rows see each other both ways."""
    rows = sum(d.length for d in docs)
    inputs = torch.from_numpy(pass_rows(docs, -(-rows // 4096) * 4096, 0))
    torch.manual_seed(0)
    q = torch.randn(inputs.shape[1], 4, 64)
    k, v = torch.randn(2, inputs.shape[1], 2, 64).unbind(0)
    starts = [sum(d.length for d in docs[:i]) for i in range(len(docs))]
    cpu_plan = AttentionPlan([doc_span(d, s, window, torch.device("cpu"), media)
                              for d, s in zip(docs, starts, strict=True)])
    want = packed_tree_attention(q[:rows], k[:rows], v[:rows], cpu_plan, sliding=sliding,
                                 scale=0.125)
    plan = build_flex_plan(TreeTokens.of_pass(inputs.cuda()), window, media)
    got = flex_tree_attention(q.cuda(), k.cuda(), v.cuda(), plan, sliding=sliding, scale=0.125)
    return inputs, got.cpu(), want


@pytest.mark.parametrize("window", [4096, 64])
def test_flex_tree_attention_equals_cpu_tree_attention(window):
    """FlexAttention over the pass's block masks (partial and full blocks) against the CPU
    path's per-document root + own-path attention."""
    docs = _random_docs(6, seed=3)
    inputs, got, want = _flex_and_cpu_attention(docs, window)
    starts = [sum(d.length for d in docs[:i]) for i in range(len(docs))]
    real = torch.cat([torch.arange(s, s + d.tokens) for d, s in zip(docs, starts, strict=True)])
    assert rel_err(got[real], want[real]) < 1e-2


def _runner(device: str, dtype: torch.dtype, fp8: bool = False, fuse: bool = True,
            cuda_graphs: bool = True, int8: bool = False,
            input_scales: dict | None = None) -> ModelRunner:
    """The random Gemma 3 of CFG; ``input_scales``: fp8 with these static activation scales."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Gemma3Model(Gemma3Config(**CFG))
    model = model.to_empty(device="cpu").float()
    with torch.no_grad():
        init_random(model, seed=0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.2)
    model = model.to(device=device, dtype=dtype)
    if fp8 or input_scales is not None:
        model.to_fp8(input_scales)
    if int8:
        model.to_int8()
    return ModelRunner(model.eval(), torch.device(device), dtype, 0, fuse=fuse,
                       cuda_graphs=cuda_graphs)


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_gpu_pass_close_to_cpu_fp32_and_invariant(scheme):
    docs = _random_docs(12, seed=1)
    cpu = _runner("cpu", torch.float32, int8=scheme == "int8").run(docs)
    gpu_runner = _runner("cuda", torch.bfloat16, fp8=scheme == "fp8", int8=scheme == "int8")
    gpu = gpu_runner.run(docs)
    worst = max(float((a - b).abs().max()) for dc, dg in zip(cpu, gpu, strict=True)
                for a, b in zip(dc.logprobs, dg.logprobs, strict=True))
    assert worst < (0.4 if scheme == "fp8" else 0.15), worst
    # alone vs packed among the others at several offsets: bit-identical
    for target in (0, 5, 11):
        alone = gpu_runner.run([docs[target]])[0]
        for a, b in zip(alone.logprobs, gpu[target].logprobs, strict=True):
            assert torch.equal(a, b), (scheme, target)
    shuffled = docs[::-1]
    again = gpu_runner.run(shuffled)[len(docs) - 1 - 5]
    assert all(torch.equal(a, b) for a, b in zip(again.logprobs, gpu[5].logprobs, strict=True))


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_cuda_graph_passes_equal_eager_passes(scheme):
    """A replayed graph computes the whole bucket; the eager forward only the real rows:
    the same bits either way, and a replay with new rows gives those rows' own scores."""
    docs = _random_docs(12, seed=2)
    graphed = _runner("cuda", torch.bfloat16, fp8=scheme == "fp8")
    eager = _runner("cuda", torch.bfloat16, fp8=scheme == "fp8", cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    bits = lambda scores: [lp.tolist() for s in scores for lp in s.logprobs]  # noqa: E731
    want = bits(eager.run(docs))
    assert bits(graphed.run(docs)) == want
    assert bits(graphed.run(docs[::-1])) == bits(eager.run(docs[::-1]))
    # two passes of the same bucket in flight: the second's inputs wait for the first
    first, second = graphed.launch(docs), graphed.launch(docs[::-1])
    # the first one's figures are copied to the host behind its own kernels, so its
    # read-back waits for its own end alone (not for the second pass, queued after it)
    assert first.values.device.type == "cpu" and first.values.is_pinned()
    first.wait()
    assert first.events[1].query() and first.device_seconds() > 0
    assert bits(graphed.finish(first)) == want
    assert bits(graphed.finish(second)) == bits(eager.run(docs[::-1]))
    assert len(graphed.graphs.graphs) == 1
    # more passes in flight than the pinned ring has buffers (two uploads a pass): a buffer
    # is written again only once its copy has run, so every pass keeps its own rows
    orders = [docs, docs[::-1], docs[3:] + docs[:3]] * 3
    for runner in (graphed, eager):
        pending = [runner.launch(order) for order in orders]
        assert 2 * len(pending) > len(runner.staging._buffers)
        got = [bits(runner.finish(p)) for p in pending]
        assert got == [bits(eager.run(order)) for order in orders]


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_warm_up_compiles_every_pass_size_and_changes_no_bits(cuda_graphs):
    """A service compiles (and captures) each pass size before it serves: the passes after
    it reuse those graphs and give the bits a cold runner gives."""
    docs = _random_docs(12, seed=4)
    cold = _runner("cuda", torch.bfloat16, fp8=True, cuda_graphs=cuda_graphs)
    warm = _runner("cuda", torch.bfloat16, fp8=True, cuda_graphs=cuda_graphs)
    sizes = warm.warm_up(3 * PASS_BUCKET - 1)
    assert sizes == [PASS_BUCKET, 2 * PASS_BUCKET, 3 * PASS_BUCKET]
    if cuda_graphs:
        assert sorted(warm.graphs.graphs) == sizes
        captured = dict(warm.graphs.graphs)
    bits = lambda scores: [lp.tolist() for s in scores for lp in s.logprobs]  # noqa: E731
    assert bits(warm.run(docs)) == bits(cold.run(docs))
    if cuda_graphs:   # the pass replayed a graph captured by the warm-up, none new
        assert warm.graphs.graphs == captured


@pytest.mark.parametrize("cuda_graphs", [True, False])
@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_a_questions_bits_do_not_depend_on_the_other_questions(scheme, cuda_graphs):
    """Other questions of the same document, before or after it, sharing its first tokens or
    not, longer or shorter: the question's logprobs are bit-identical to it asked alone
    (its path keys never share FlexAttention's key blocks with other branches)."""
    rng = random.Random(7)
    root = [2] + [rng.randint(3, 4000) for _ in range(300)]    # longer than the window
    target = Branch([rng.randint(3, 4000) for _ in range(6)], [[11], [12, 13], [14]])
    runner = _runner("cuda", torch.bfloat16, fp8=scheme == "fp8", cuda_graphs=cuda_graphs)

    def target_bits(others: list[Branch], at: int) -> list[float]:
        doc = DocTree(root, others[:at] + [target] + others[at:]).flatten(0)
        return runner.run([doc])[0].branch(at).tolist()

    def other() -> Branch:
        shared = target.prefix[:rng.randint(0, len(target.prefix))]
        return Branch(shared + [rng.randint(3, 4000) for _ in range(rng.randint(0, 40))],
                      [[rng.choice((11, 12, 15)), rng.randint(3, 4000)][:rng.randint(1, 2)]
                       for _ in range(rng.randint(1, 3))])

    alone = target_bits([], 0)
    for _ in range(6):
        others = [other() for _ in range(rng.randint(1, 30))]
        assert target_bits(others, rng.randint(0, len(others))) == alone


@pytest.mark.parametrize("cuda_graphs", [True, False])
@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_documents_merged_under_one_root_score_as_alone(scheme, cuda_graphs):
    """Documents of one pass with the same root are read once (engine/merge.py): each one's
    figures equal its own pass, array for array; another root is never merged."""
    from spinf_worker.engine.scheduler import PassScheduler

    rng = random.Random(11)
    runner = _runner("cuda", torch.bfloat16, fp8=scheme == "fp8", cuda_graphs=cuda_graphs)
    root = [2] + [rng.randint(3, 4000) for _ in range(300)]    # longer than the window

    def doc(tokens: list[int], n: int):
        return DocTree(list(tokens), [
            Branch([rng.randint(3, 4000) for _ in range(rng.randint(0, 8))],
                   [[rng.randint(3, 4000) for _ in range(rng.randint(1, 3))]
                    for _ in range(rng.randint(1, 3))]) for _ in range(n)]).flatten(0)

    docs = [doc(root, 3), doc(root, 1), doc(root[:-1], 2), doc(root, 4)]
    docs.append(docs[1])                                    # the same questions twice
    scheduler = PassScheduler(runner, 1 << 16)
    for i, d in enumerate(docs):
        scheduler.hold(i, d)
    done = dict(item for batch in scheduler.flush() for item in batch)
    for i, d in enumerate(docs):
        alone = runner.run([d])[0]
        for name in ("option_logprobs", "residual", "branch_start"):
            assert (getattr(done[i], name) == getattr(alone, name)).all(), (i, name)


def _items(seed: int) -> list[list[int]]:
    """lm-eval-shaped prompts: per item a context (under a block, one block, several) and
    four options, one prompt each."""
    rng = random.Random(seed)
    prompts = []
    for context in (50, 128, 300):
        ctx = [2] + [rng.randrange(5, 4000) for _ in range(context - 1)]
        prompts += [ctx + [first] + [rng.randrange(5, 4000) for _ in range(rng.randint(0, 5))]
                    for first in rng.sample(range(5, 4000), 4)]
    return prompts


@pytest.mark.parametrize("window", [4096, 64])
def test_flex_prompt_blocks_equal_cpu_block_attention(window):
    """Completion prompts sharing blocks (engine/prompt_blocks.py): FlexAttention over their
    block masks against the CPU path's block-by-block attention."""
    from spinf_worker.engine.completion import prompt_doc
    from spinf_worker.engine.merge import merge, root_key

    prompts = [prompt_doc(p, 0, 1, 0) for p in _items(5)]
    docs = [flat for flat, _ in merge(prompts, [root_key(d, window) for d in prompts], 0)]
    docs.insert(1, _random_docs(1, seed=4)[0])
    rows = sum(d.length for d in docs)
    assert rows < sum(d.length for d in prompts)
    inputs, got, want = _flex_and_cpu_attention(docs, window)
    real = torch.nonzero(inputs[2, :rows] >= 0).flatten()
    assert rel_err(got[real], want[real]) < 1e-2


@pytest.mark.parametrize("cuda_graphs", [True, False])
@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_completion_prompts_sharing_blocks_score_as_alone(scheme, cuda_graphs):
    """Prompts of one pass that begin with the same blocks read them once: each prompt's
    echoed logprobs and top-N equal its own pass's, array for array, beside scoring
    documents, and stay close to the fp32 CPU stack."""
    from spinf_worker.engine.completion import prompt_doc
    from spinf_worker.engine.scheduler import PassScheduler

    runner = _runner("cuda", torch.bfloat16, fp8=scheme == "fp8", cuda_graphs=cuda_graphs)
    cpu = _runner("cpu", torch.float32)
    prompts = [prompt_doc(p, 0, 5, 0) for p in _items(6)]
    others = _random_docs(3, seed=7)
    docs = others[:1] + prompts[:6] + others[1:] + prompts[6:]
    scheduler = PassScheduler(runner, 1 << 16)
    launched = []
    launch = runner.launch
    runner.launch = lambda flats, *args: (launched.append(sum(f.length for f in flats))
                                          or launch(flats, *args))
    for i, d in enumerate(docs):
        scheduler.hold(i, d)
    done = dict(item for batch in scheduler.flush() for item in batch)
    runner.launch = launch
    assert launched[0] < sum(d.length for d in docs)       # the shared blocks once
    worst = 0.0
    for i, d in enumerate(docs):
        if d.prompts is None:
            continue
        alone = runner.run([d])[0].echo
        assert all(np.array_equal(a, b, equal_nan=True)
                   for a, b in zip(alone, done[i].echo, strict=True)), i
        reference = cpu.run([d])[0].echo[0]
        worst = max(worst, float(abs(reference[:-1] - alone[0][:-1]).max()))
    assert worst < (0.4 if scheme == "fp8" else 0.15), worst

"""Completion prompts' tails on the CUDA path, run on the CPU: FlexAttention (eager: its CPU
kernel returns no log-sum-exps) over the block masks, the tail rows' own paths merged in by
kernels/branch_paths.py under Triton's interpreter (skipped where triton does not import),
against the CPU path's block and tail attention, on full and sliding-window layers."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from spinf_worker.engine.completion import prompt_doc
from spinf_worker.engine.merge import merge, root_key
from spinf_worker.engine.pass_plan import pass_rows
from spinf_worker.engine.runner import doc_span
from spinf_worker.kernels.attention import AttentionPlan, packed_tree_attention

from .conftest import triton_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")


def _items(seed: int, n: int = 3) -> list[list[int]]:
    """lm-eval's items: a context of 30-330 tokens, then each of four options (1-6 tokens)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        ctx = [2] + [rng.randrange(5, 4000) for _ in range(rng.randint(30, 330))]
        prompts += [ctx + [first] + [rng.randrange(5, 4000) for _ in range(rng.randint(0, 5))]
                    for first in rng.sample(range(5, 4000), 4)]
    return prompts


def check_tails_on_the_cuda_path() -> None:
    from torch.nn.attention.flex_attention import flex_attention

    from spinf_worker.kernels import flex_tree

    flex_tree._compiled_flex = lambda: flex_attention
    for window in (4096, 64):
        prompts = [prompt_doc(p, 0, 1, 0) for p in _items(5)]
        docs = [flat for flat, _ in merge(prompts, [root_key(d, window) for d in prompts], 0)]
        rows = sum(d.length for d in docs)
        assert rows < sum(d.length for d in prompts) and any(d.tokens > d.root for d in docs)
        inputs = torch.from_numpy(pass_rows(docs, -(-rows // 1024) * 1024, 0))
        torch.manual_seed(0)
        q = torch.randn(inputs.shape[1], 4, 16)
        k, v = torch.randn(2, inputs.shape[1], 2, 16).unbind(0)
        starts = [sum(d.length for d in docs[:i]) for i in range(len(docs))]
        cpu = AttentionPlan([doc_span(d, s, window, torch.device("cpu"), "none")
                             for d, s in zip(docs, starts, strict=True)])
        plan = flex_tree.build_flex_plan(flex_tree.TreeTokens.of_pass(inputs), window, "none")
        real = torch.nonzero(inputs[2, :rows] >= 0).flatten()
        for sliding in (False, True):
            want = packed_tree_attention(q[:rows], k[:rows], v[:rows], cpu, sliding=sliding,
                                         scale=0.25)
            got = flex_tree.flex_tree_attention(q, k, v, plan, sliding=sliding, scale=0.25)
            err = float((got[real] - want[real]).abs().max())
            print(f"window {window} sliding {sliding}: max |delta| {err:.2e}")
            assert err < 1e-5


def test_prompt_tails_on_the_cuda_path_equal_the_cpu_attention():
    triton_interpreted(__name__, "check_tails_on_the_cuda_path", timeout=600)

"""Completion prompts that begin alike read it once (engine/prompt_blocks.py): a pass lays the
shared blocks out once (the queue and the packer count them once too) and the tokens their
tails share once, and each prompt's echoed logprobs and top-N are bit-identical to the prompt
scored alone, beside partners that share its blocks and tokens or not, at several places in a
pass; they agree with transformers. Contexts shorter than a block, exactly a block, and
several blocks."""

from __future__ import annotations

import random

import numpy as np
import pytest

from spinf_worker.completions import CompletionRequest
from spinf_worker.engine import prompt_blocks
from spinf_worker.engine.completion import prompt_doc
from spinf_worker.engine.merge import merge, root_key, split
from spinf_worker.engine.packer import pack
from spinf_worker.engine.prompt_blocks import Prompt
from spinf_worker.tiles import PROMPT_BLOCK, PassRows, padded_rows

from .service.test_completions import TOL, oracle_logprobs
from .test_batch_invariance import completion_figures, other_request

# context lengths (BOS included): under a block, exactly one, several and a part
CONTEXTS = [50, PROMPT_BLOCK, 300]


def items(engine, seed: int, context: int, n_options: int = 4) -> list[list[int]]:
    """One multiple-choice item as lm-eval sends it: the context followed by each option
    (1-6 tokens, distinct first tokens), one prompt per option."""
    rng = random.Random(seed)
    vocab = int(engine.config.vocab_size)
    bos = engine.checkpoint.bos_token_id
    ctx = [bos, *(rng.randrange(10, vocab) for _ in range(context - 1))]
    firsts = rng.sample(range(10, vocab), n_options)
    return [ctx + [first, *(rng.randrange(10, vocab) for _ in range(rng.randint(0, 5)))]
            for first in firsts]


def request(prompts: list[list[int]], **extra) -> CompletionRequest:
    return CompletionRequest.parse({"prompt": prompts, "echo": True, "logprobs": 5,
                                    "max_tokens": 0, **extra})


def shared_rows(context: int, prompts: list[list[int]]) -> int:
    """The rows an item's prompts take laid out together: the context once (its whole blocks
    and the rest of it as tail tokens), then each option's own tokens."""
    return padded_rows(context + sum(len(p) - context for p in prompts))


@pytest.mark.parametrize("context", CONTEXTS)
def test_prompts_sharing_a_context_read_it_once(tiny_engine, context):
    prompts = items(tiny_engine, 1, context)
    docs = [prompt_doc(p, 0, 5, 0) for p in prompts]
    window = tiny_engine.config.sliding_window
    keys = [root_key(d, window) for d in docs]
    merged = merge(docs, keys, 0)
    (flat, _), = merged
    assert flat.length == shared_rows(context, prompts) < sum(d.length for d in docs)
    assert flat.root == context - context % PROMPT_BLOCK
    # the packer and the queue count the same rows
    (one_pass,) = pack(docs, 1 << 20, keys)
    assert one_pass.rows == flat.length
    fill = PassRows()
    fill.add_parts(tiny_engine.row_parts(request(prompts)))
    assert fill.rows == one_pass.rows
    # a prompt with another top-N shares nothing
    other = prompt_doc(prompts[0], 0, 3, 0)
    assert one_pass.cost(other, root_key(other, window)) == other.length


def test_the_packer_counts_the_rows_prompts_take(tiny_engine):
    """Items of several context lengths, prompts that part at once or after a few shared tail
    tokens, two top-Ns: the rows the packer counts for the pass are the rows merge lays out."""
    rng = random.Random(7)
    prompts = [(p, top) for seed, context in enumerate((20, 130, 300, 300, 256))
               for top in (1, 5) for p in items(tiny_engine, seed, context, n_options=3)]
    prompts += [(p[:-1] + [99, 98, 97][:rng.randint(1, 3)], top) for p, top in prompts[:6]]
    docs = [prompt_doc(p, 0, top, 0) for p, top in prompts]
    keys = [root_key(d, tiny_engine.config.sliding_window) for d in docs]
    (one_pass,) = pack(docs, 1 << 20, keys)
    assert one_pass.rows == sum(flat.length for flat, _ in merge(docs, keys, 0))


@pytest.mark.parametrize("length", [1, 50, PROMPT_BLOCK, PROMPT_BLOCK + 1, 300, 384])
def test_a_prompt_alone_is_laid_out_as_the_tries_lay_it_out(length):
    """lay_out's shortcut for one prompt gives the FlatDoc the tries give it."""
    rng = random.Random(length)
    ids = [2, *(rng.randrange(10, 4000) for _ in range(length - 1))]
    for first in sorted({0, length // 2, length - 1}):
        prompt = Prompt(ids, first, 3)
        fast, tries = prompt_blocks._alone(prompt, 0), prompt_blocks._shared([prompt], 0)
        assert (fast.root, fast.tokens, fast.length) == (tries.root, tries.tokens, tries.length)
        for name in ("input_ids", "positions", "span_end", "readout_rows"):
            assert np.array_equal(np.asarray(getattr(fast, name)),
                                  np.asarray(getattr(tries, name))), name
        assert np.array_equal(fast.echo.next_ids, tries.echo.next_ids)
        for name in ("ids", "pos", "end", "parent"):
            assert np.array_equal(getattr(fast.block, name), getattr(tries.block, name)), name
        for name in ("parent", "depth", "anchor"):
            assert np.array_equal(getattr(fast.prompts, name),
                                  getattr(tries.prompts, name)), name
        assert np.array_equal(fast.prompts.readouts[0], tries.prompts.readouts[0])


@pytest.mark.parametrize("context", CONTEXTS)
def test_shared_prompts_keep_the_bits_they_have_alone(tiny_engine, context):
    """The runner's raw readouts of each prompt: alone, and merged with its item's other
    prompts (and an unrelated prompt) at several places in a pass of other documents."""
    rng = random.Random(context)
    prompts = items(tiny_engine, 2, context)
    docs = [prompt_doc(p, 0, 5, 0) for p in prompts]
    alone = [tiny_engine.runner.run([d])[0].echo for d in docs]
    vocab = int(tiny_engine.config.vocab_size)
    stranger = prompt_doc([2, *(rng.randrange(10, vocab) for _ in range(200))], 0, 5, 0)
    window = tiny_engine.config.sliding_window
    for before in (0, 2):
        members = [*docs, stranger]
        rng.shuffle(members)
        fillers = [prompt_doc([2, *(rng.randrange(10, vocab) for _ in range(rng.randint(5, 90)))],
                              0, 3, 0) for _ in range(before)]
        batch = fillers + members
        merged = merge(batch, [root_key(d, window) for d in batch], 0)
        scores = tiny_engine.runner.run([flat for flat, _ in merged])
        got = {}
        for (_, parts), doc_scores in zip(merged, scores, strict=True):
            for i, part in parts:
                got[id(batch[i])] = split(doc_scores, part).echo
        for doc, expected in zip(docs, alone, strict=True):
            assert all(np.array_equal(a, b, equal_nan=True)
                       for a, b in zip(expected, got[id(doc)], strict=True)), before


def _prompt_rows(engine, monkeypatch) -> list[int]:
    """The rows completion prompts take in every pass the runner launches from now on."""
    seen: list[int] = []
    launch = engine.runner.launch

    def counting(docs, *args):
        seen.append(sum(d.length for d in docs if d.prompts is not None))
        return launch(docs, *args)

    monkeypatch.setattr(engine.runner, "launch", counting)
    return seen


@pytest.mark.parametrize("context", CONTEXTS)
def test_one_request_per_option_answers_as_each_alone(tiny_engine, monkeypatch, context):
    """lm-eval's traffic through the engine: one request per option of an item, among other
    requests at several places of one pass; every figure equals the request's alone, and
    the pass holds the item's shared blocks once. A greedy token too."""
    rng = random.Random(context + 1)
    prompts = items(tiny_engine, 3, context)
    requests = [request([p], max_tokens=k % 2) for k, p in enumerate(prompts)]
    alone = [tiny_engine.complete(r) for r in requests]
    old = tiny_engine.settings.max_pass_tokens
    tiny_engine.settings.max_pass_tokens = 1 << 20      # every document in one pass
    rows = _prompt_rows(tiny_engine, monkeypatch)
    try:
        for position in (0, 3):
            others = [other_request(rng) for _ in range(4)]
            batch = others[:position] + requests + others[position:]
            rows.clear()
            out = tiny_engine.score_batch(batch)[position:position + len(requests)]
            for got, expected in zip(out, alone, strict=True):
                assert completion_figures(got) == completion_figures(expected), position
            # the first pass holds the item's context once
            assert rows[0] == shared_rows(context, prompts)
    finally:
        tiny_engine.settings.max_pass_tokens = old


@pytest.mark.parametrize("context", CONTEXTS)
def test_shared_prompts_agree_with_transformers(tiny_engine, tiny_oracle, context):
    prompts = items(tiny_engine, 4, context)
    out = tiny_engine.complete(request(prompts))
    for choice, ids in zip(out.choices, prompts, strict=True):
        reference = oracle_logprobs(tiny_oracle, ids)
        lps = choice.logprobs.token_logprobs
        assert lps[0] is None and len(lps) == len(ids)
        assert max(abs(lps[j] - reference[j - 1, ids[j]].item())
                   for j in range(1, len(ids))) <= TOL

"""A document's logprobs are bit-identical scored alone or packed with 20 others at
different offsets (CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from spinf_worker.engine.layout import Branch, DocTree

from .test_engine_parity import NEWS, QUERIES

WORDS = NEWS.replace(",", "").replace(".", "").split()


def other_request(rng: random.Random) -> dict:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120)))
    queries = rng.sample(QUERIES, rng.randint(1, len(QUERIES)))
    return {"text": text, "scoring": {"queries": queries}}


def logprob_bits(response) -> list[float]:
    return [o.logprob for q in response.queries for c in q.combinations for o in c.options]


def assert_invariant(engine, request: dict, seed: int) -> None:
    rng = random.Random(seed)
    alone = engine.score(request)
    old = engine.settings.max_pass_tokens
    engine.settings.max_pass_tokens = 1 << 20      # all 21 documents in one pass
    try:
        for position in (0, 7, 20):
            others = [other_request(rng) for _ in range(20)]
            batch = others[:position] + [request] + others[position:]
            packed = engine.score_batch(batch)[position]
            # float32 -> float equality is bit equality
            assert logprob_bits(packed) == logprob_bits(alone), f"position {position}"
            assert [c.residual for q in packed.queries for c in q.combinations] == \
                   [c.residual for q in alone.queries for c in q.combinations]
    finally:
        engine.settings.max_pass_tokens = old


def test_tiny_alone_vs_packed(tiny_engine):
    assert_invariant(tiny_engine, {"text": NEWS * 2, "scoring": {"queries": QUERIES}}, seed=1)


def test_runner_raw_tensors_equal(tiny_engine):
    """The runner's fp32 logprob tensors themselves, torch.equal, at many offsets."""
    rng = random.Random(2)
    vocab = [t for t in tiny_engine.presenter.encode(NEWS)]
    def doc(n: int) -> DocTree:
        return DocTree([2] + [rng.choice(vocab) for _ in range(n)],
                       [Branch([rng.choice(vocab) for _ in range(rng.randint(0, 9))],
                               [[rng.choice(vocab) for _ in range(rng.randint(1, 4))]
                                for _ in range(rng.randint(1, 4))]) for _ in range(6)])
    target = doc(150).flatten(0)
    alone = tiny_engine.runner.run([target])[0]
    for before in (1, 5, 20):
        others = [doc(rng.randint(1, 300)).flatten(0) for _ in range(20)]
        packed = tiny_engine.runner.run(others[:before] + [target] + others[before:])[before]
        assert all(torch.equal(a, b)
                   for a, b in zip(alone.logprobs, packed.logprobs, strict=True))


@pytest.mark.slow
def test_default_model_alone_vs_packed(default_engine):
    assert_invariant(default_engine, {"text": NEWS, "scoring": {"queries": QUERIES[:3]}}, seed=3)


def test_scheduler_returns_each_document_once_pass_by_pass(tiny_engine):
    """PassScheduler: passes start while documents are still added, the rest run at flush,
    read back one pass at a time; every document comes back once, with its own scores."""
    from spinf_worker.engine.scheduler import PassScheduler

    rng = random.Random(4)
    vocab = list(tiny_engine.presenter.encode(NEWS))
    docs = [DocTree([2] + [rng.choice(vocab) for _ in range(rng.randint(1, 200))],
                    [Branch([rng.choice(vocab)], [[rng.choice(vocab)], [rng.choice(vocab)]])
                     for _ in range(3)]).flatten(0) for _ in range(12)]
    scheduler = PassScheduler(tiny_engine.runner, max_pass_tokens=512)
    early = [done for i, doc in enumerate(docs) for done in scheduler.add(i, doc)]
    batches = list(scheduler.flush())
    assert early and len(batches) >= 2        # some passes ran before flush; flush yields each
    returned = early + [done for batch in batches for done in batch]
    assert sorted(tag for tag, _ in returned) == list(range(len(docs)))
    for tag, scores in returned:
        alone = tiny_engine.runner.run([docs[tag]])[0]
        assert all(torch.equal(a, b)
                   for a, b in zip(alone.logprobs, scores.logprobs, strict=True))

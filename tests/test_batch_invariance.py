"""A document's logprobs are bit-identical scored alone or packed with others (20 on the tiny
model, 8 on the default one) at different offsets (CPU); so are a completions prompt's token
logprobs."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
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
    return [o.logprob for r in response.results for q in r.queries for c in q.combinations
            for o in c.options]


def residuals(response) -> list[float]:
    return [c.residual for r in response.results for q in r.queries for c in q.combinations]


def assert_invariant(engine, request: dict, seed: int, positions=(0, 7, 20)) -> None:
    """At each of ``positions`` among max(positions) other documents, all in one pass."""
    rng = random.Random(seed)
    alone = engine.score(request)
    old = engine.settings.max_pass_tokens
    engine.settings.max_pass_tokens = 1 << 20      # every document in one pass
    try:
        for position in positions:
            others = [other_request(rng) for _ in range(max(positions))]
            batch = others[:position] + [request] + others[position:]
            packed = engine.score_batch(batch)[position]
            # float32 -> float equality is bit equality
            assert logprob_bits(packed) == logprob_bits(alone), f"position {position}"
            assert residuals(packed) == residuals(alone)
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
    # first, in the middle and last among 8 others (the tiny model's test: 20): last, it still
    # sits several row tiles into the pass, at under half the real model's cost per pass
    assert_invariant(default_engine, {"text": NEWS, "scoring": {"queries": QUERIES[:3]}}, seed=3,
                     positions=(0, 3, 8))


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



class _IdleWhenAllRead:
    """The tiny engine's runner, telling a pass would start at once once every pass launched
    has been read back, as a CUDA runner replaying graphs does (never on the CPU)."""

    def __init__(self, runner):
        self.runner, self.launched = runner, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def starts_at_once(self) -> bool:
        return self.runner.unread == 0

    def launch(self, docs, *args):
        self.launched.append(sum(d.length for d in docs))
        return self.runner.launch(docs, *args)


def test_an_idle_device_gets_a_pass_once_half_of_one_waits(tiny_engine):
    """The first pass goes once half a pass of rows waits (the device idle), the next ones
    once a pass and a quarter wait; every document scores as alone either way."""
    from spinf_worker.engine.scheduler import FILL_SLACK, IDLE_FILL, PassScheduler

    rng = random.Random(5)
    vocab = list(tiny_engine.presenter.encode(NEWS))
    docs = [DocTree([2] + [rng.choice(vocab) for _ in range(rng.randint(20, 120))],
                    [Branch([rng.choice(vocab)], [[rng.choice(vocab)], [rng.choice(vocab)]])
                     for _ in range(3)]).flatten(0) for _ in range(16)]
    runner = _IdleWhenAllRead(tiny_engine.runner)
    scheduler = PassScheduler(runner, max_pass_tokens=512)
    added, first_at = 0, None
    returned = []
    for i, doc in enumerate(docs):
        returned += scheduler.add(i, doc)
        added += doc.length
        if runner.launched and first_at is None:
            first_at = added
    returned += [done for batch in scheduler.flush() for done in batch]
    assert first_at is not None and 512 * IDLE_FILL <= first_at < 512 * FILL_SLACK
    assert runner.launched[0] == first_at       # everything waiting, as one pass
    assert runner.unread == 0 and len(runner.launched) >= 3
    assert sorted(tag for tag, _ in returned) == list(range(len(docs)))
    for tag, scores in returned:
        alone = tiny_engine.runner.run([docs[tag]])[0]
        assert all(torch.equal(a, b)
                   for a, b in zip(alone.logprobs, scores.logprobs, strict=True))

OWN = {"id": "own", "template": "\n\nIs this about money?\nAnswer:{?}", "options": [" yes", " no"]}


def test_each_input_scores_as_if_sent_alone(tiny_engine):
    """Every input of ``inputs[]`` is its own document: the shared queries it picks
    (``query_ids``, in that order) then its own ``queries``, scored bit for bit as a request
    of that input alone."""
    by_id = {q["id"]: q for q in QUERIES}
    inputs = [
        {"id": "all", "messages": [{"role": "user", "content": NEWS}]},
        {"id": "picked", "messages": [{"role": "user", "content": NEWS[:90]}],
         "query_ids": ["about", "tone"]},
        {"id": "own-only", "messages": [{"role": "user", "content": "Rates rose."}],
         "query_ids": [], "queries": [OWN]},
        {"id": "both", "messages": [{"role": "user", "content": NEWS[50:]}],
         "query_ids": ["bare"], "queries": [{**OWN, "options": [" no", " maybe"]}]},
        {"id": "shared-and-own", "messages": [{"role": "user", "content": NEWS[::-1]}],
         "queries": [OWN]},
    ]
    asked = [QUERIES, [by_id["about"], by_id["tone"]], [OWN],
             [by_id["bare"], {**OWN, "options": [" no", " maybe"]}], [*QUERIES, OWN]]
    response = tiny_engine.score({"inputs": inputs, "scoring": {"queries": QUERIES}})
    assert [r.input_id for r in response.results] == [i["id"] for i in inputs]
    for result, inp, queries in zip(response.results, inputs, asked, strict=True):
        alone = tiny_engine.score({"messages": inp["messages"], "scoring": {"queries": queries}})
        assert [q.id for q in result.queries] == [q["id"] for q in queries]
        # float equality is bit equality: logprobs, p, floor_p, residuals
        assert result.queries == alone.results[0].queries, inp["id"]
    assert response.usage.inputs == len(inputs)
    combinations = [len(c.combinations) for r in response.results for c in r.queries]
    assert response.usage.scoring["prompts"] == sum(combinations)
    assert response.usage.scoring["queries"] == sum(len(q) for q in asked)


def test_inputs_packed_with_other_requests_keep_their_bits(tiny_engine):
    request = {"inputs": [{"id": str(k), "messages": [{"role": "user", "content": NEWS[k:]}]}
                          for k in (0, 30, 60)], "scoring": {"queries": QUERIES[:3]}}
    alone = tiny_engine.score(request)
    rng = random.Random(5)
    others = [other_request(rng) for _ in range(6)]
    packed = tiny_engine.score_batch([*others[:2], request, *others[2:]])[2]
    assert logprob_bits(packed) == logprob_bits(alone)
    assert residuals(packed) == residuals(alone)


def test_batches_started_before_the_last_one_finished_keep_their_bits(tiny_engine):
    """start_batch: the worker starts batch N+1 before reading back batch N (two batches'
    passes in flight at once; with an empty floor cache, each batch scores its floors in
    its own passes)."""
    from spinf_worker.engine.floors import FloorCache

    rng = random.Random(6)
    requests = [other_request(rng) for _ in range(7)]
    alone = [tiny_engine.score(r).results for r in requests]
    cache = tiny_engine.floors
    tiny_engine.floors = FloorCache(1000)
    try:
        first = tiny_engine.start_batch(requests[:4])
        second = tiny_engine.start_batch(requests[4:])
        third = tiny_engine.start_batch(requests[:1])
        together = first.finish() + second.finish() + third.finish()
    finally:
        tiny_engine.floors = cache
    # float equality is bit equality: logprobs, p, floor_p, residuals
    assert [r.results for r in together] == alone + alone[:1]


def test_a_batch_read_back_then_answered_elsewhere_keeps_its_bits(tiny_engine):
    """finish split as the worker splits it: read_back takes the scores in and answers
    nothing; respond, on another thread, answers every request as finish would."""
    rng = random.Random(8)
    requests = [other_request(rng) for _ in range(5)]
    want = [r.results for r in tiny_engine.score_batch(requests)]
    batch = tiny_engine.start_batch(requests)
    batch.read_back()
    unanswered = {i for i, _, _ in batch.answerable}      # its last pass's requests at least
    assert unanswered and all(batch.results[i] is None for i in unanswered)
    with ThreadPoolExecutor(1) as responder:
        answers = responder.submit(batch.respond).result()
    assert [r.results for r in answers] == want
    assert not batch.answerable


def test_requests_prepared_ahead_score_as_fresh_ones(tiny_engine, monkeypatch):
    """row_parts_many prepares requests ahead and keeps the latest (KEPT_PREPARED); a pass
    takes a kept one as it is, prepares an evicted one again, and both score as requests
    prepared by the pass itself."""
    from spinf_worker.engine import prepare
    from spinf_worker.protocol import ScoreRequest

    monkeypatch.setattr(prepare, "KEPT_PREPARED", 2)
    preparer = tiny_engine.preparer
    preparer._kept.clear()
    rng = random.Random(9)
    raws = [other_request(rng) for _ in range(4)]
    want = [r.results for r in tiny_engine.score_batch(raws)]
    requests = [ScoreRequest.parse(r) for r in raws]
    tiny_engine.row_parts_many(requests)
    assert [entry[0] for entry in preparer._kept.values()] == requests[2:]
    assert [r.results for r in tiny_engine.score_batch(requests)] == want
    assert not preparer._kept


def completion_figures(response) -> list:
    """Every float of a completions response: token logprobs and top-N, per choice."""
    return [(c.text, c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs)
            for c in response.choices]


def test_completion_logprobs_alone_vs_packed(tiny_engine):
    """A completions prompt's token logprobs and top-N (and its greedy tokens) are
    bit-identical alone or packed with other prompts and scoring documents, at several
    offsets of one pass; the readouts' raw fp32 arrays too."""
    from spinf_worker.completions import CompletionRequest
    from spinf_worker.engine.completion import prompt_doc

    rng = random.Random(7)
    request = CompletionRequest.parse({"prompt": NEWS, "echo": True, "logprobs": 5,
                                       "max_tokens": 2})
    alone = tiny_engine.complete(request)
    old = tiny_engine.settings.max_pass_tokens
    tiny_engine.settings.max_pass_tokens = 1 << 20      # every document in one pass
    try:
        for position in (0, 3, 10):
            others = [CompletionRequest.parse({
                "prompt": [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 80)))
                           for _ in range(rng.randint(1, 3))],
                "echo": rng.random() < 0.5, "logprobs": rng.choice([None, 0, 3, 20]),
                "max_tokens": rng.randint(0, 3)}) if k % 2 else other_request(rng)
                for k in range(10)]
            batch = others[:position] + [request] + others[position:]
            packed = tiny_engine.score_batch(batch)[position]
            # float32 -> float equality is bit equality
            assert completion_figures(packed) == completion_figures(alone), position
    finally:
        tiny_engine.settings.max_pass_tokens = old

    vocab = list(tiny_engine.presenter.encode(NEWS))
    ids = [2, *vocab]
    target = prompt_doc(ids, 0, 5, 0)
    raw = tiny_engine.runner.run([target])[0].echo
    for before in (1, 4):
        others = [prompt_doc([2, *rng.sample(vocab, rng.randint(1, 60))], 0, 3, 0)
                  if k % 2 else DocTree([2, *rng.sample(vocab, 40)],
                                        [Branch([vocab[0]], [[vocab[1]], [vocab[2]]])]
                                        ).flatten(0)
                  for k in range(8)]
        packed = tiny_engine.runner.run(others[:before] + [target] + others[before:])[before]
        assert all(np.array_equal(a, b, equal_nan=True)
                   for a, b in zip(raw, packed.echo, strict=True))

"""Requests of one pass that carry the same content are read once (engine/merge.py): their
questions go under one root, and each request's scores, floors, answers and usage are bit for
bit those it gets alone, beside merging partners that ask other, overlapping or the same
questions (CPU, the default model)."""

from __future__ import annotations

import numpy as np
import pytest

from spinf_worker.engine.layout import Branch, DocTree
from spinf_worker.engine.scheduler import PassScheduler

from .test_engine_parity import NEWS, QUERIES

BY_ID = {q["id"]: q for q in QUERIES}
COUNT = {"id": "count", "template": "\n\nHow many increases this year? Answer:{n}",
         "max_tokens": 3}


def request(content: str, *ids: str) -> dict:
    queries = [COUNT if i == "count" else BY_ID[i] for i in ids]
    return {"messages": [{"role": "user", "content": content}],
            "scoring": {"queries": queries}}


# one question per request (an evaluation client's traffic), the same question twice, and
# overlapping lists; the last two have other contents
PARTNERS = [request(NEWS, "topic"), request(NEWS, "tone"), request(NEWS, "topic"),
            request(NEWS, "tone", "actor", "count"), request(NEWS, "bare", "about"),
            request(NEWS + " Rates rose.", "tone"), request(NEWS[:-1], "tone")]
TARGETS = [request(NEWS, "tone"), request(NEWS, "actor", "topic", "count")]


class PassLog:
    """The documents of every pass the runner launches."""

    def __init__(self, runner, monkeypatch):
        self.passes: list[list] = []
        launch = runner.launch

        def logged(docs):
            self.passes.append(list(docs))
            return launch(docs)

        monkeypatch.setattr(runner, "launch", logged)


def comparable(response) -> tuple:
    """Everything a response says that does not change from call to call."""
    return response.results, response.warnings, response.usage


@pytest.fixture
def one_pass(default_engine):
    old = default_engine.settings.max_pass_tokens
    default_engine.settings.max_pass_tokens = 1 << 20      # every document in one pass
    yield default_engine
    default_engine.settings.max_pass_tokens = old


def test_same_content_is_laid_out_once_in_the_pass(one_pass, monkeypatch):
    engine = one_pass
    log = PassLog(engine.runner, monkeypatch)
    responses = engine.score_batch(PARTNERS)
    assert not [r for r in responses if isinstance(r, Exception)]
    [docs] = log.passes
    prepared = [engine.preparer.prepare_batch([r])[0].docs[0].flat for r in PARTNERS]
    root = prepared[0].input_ids[:prepared[0].root].tolist()
    shared = [d for d in docs if d.root == len(root)
              and d.input_ids[:d.root].tolist() == root]
    # the five requests about NEWS: one root, then each request's questions
    [merged] = shared
    branches = sum(f.tokens - f.root for f in prepared[:5])
    assert merged.tokens == len(root) + branches
    assert merged.block.n_branches == sum(f.block.n_branches for f in prepared[:5])
    # the other contents are documents of their own, each with its own root
    for other in prepared[5:]:
        assert sum(d.input_ids[:d.root].tolist() == other.input_ids[:other.root].tolist()
                   for d in docs) == 1
    rows = sum(d.length for d in docs)
    alone = sum(f.length for f in prepared)
    assert rows < alone


@pytest.mark.parametrize("target", range(len(TARGETS)))
def test_each_request_scores_as_alone_beside_merging_partners(one_pass, target):
    engine = one_pass
    mine = TARGETS[target]
    alone = comparable(engine.score(mine))
    for at in (0, 3, len(PARTNERS)):
        batch = [*PARTNERS[:at], mine, *PARTNERS[at:]]
        together = engine.score_batch(batch)
        # float equality is bit equality: logprobs, p, floor_p, residuals, answers; usage as
        # if alone
        assert comparable(together[at]) == alone, at
    for partner, response in zip(PARTNERS, together[:-1], strict=True):
        assert comparable(response) == comparable(engine.score(partner))


def test_merged_documents_raw_scores_equal_alone(default_engine):
    """The runner's fp32 figures of documents merged under one root equal each document's
    own pass, array for array; a document with another root is never merged."""
    rng = np.random.default_rng(3)
    vocab = list(default_engine.presenter.encode(NEWS))
    root = [default_engine.checkpoint.bos_token_id, *vocab]

    def doc(tokens: list[int], n: int) -> object:
        return DocTree(list(tokens), [
            Branch([int(t) for t in rng.choice(vocab, rng.integers(0, 9))],
                   [[int(t) for t in rng.choice(vocab, rng.integers(1, 4))]
                    for _ in range(rng.integers(1, 4))]) for _ in range(n)]
        ).flatten(default_engine.pad_id)

    docs = [doc(root, 3), doc(root, 1), doc(root[:-1], 2), doc(root, 4)]
    docs.append(docs[1])                                    # the same questions twice
    log: list = []
    scheduler = PassScheduler(default_engine.runner, 1 << 20)
    launch = default_engine.runner.launch
    scheduler.runner = type("Logged", (), {
        "launch": lambda _, d: log.append(d) or launch(d), "finish": default_engine.runner.finish,
        "pad_id": default_engine.pad_id, "model": default_engine.model})()
    for i, d in enumerate(docs):
        scheduler.hold(i, d)
    done = dict(item for batch in scheduler.flush() for item in batch)
    assert [len(d) for d in log] == [2]                      # root once, root[:-1] apart
    for i, d in enumerate(docs):
        alone = default_engine.runner.run([d])[0]
        assert np.array_equal(done[i].option_logprobs, alone.option_logprobs), i
        assert np.array_equal(done[i].residual, alone.residual), i
        assert np.array_equal(done[i].branch_start, alone.branch_start), i

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

        def logged(docs, *args):
            self.passes.append(list(docs))
            return launch(docs, *args)

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


@pytest.fixture(scope="module")
def partners_alone(default_engine) -> list[tuple]:
    """Each partner scored alone, once for every target below."""
    return [comparable(default_engine.score(partner)) for partner in PARTNERS]


@pytest.mark.parametrize("target", range(len(TARGETS)))
def test_each_request_scores_as_alone_beside_merging_partners(partners_alone, one_pass,
                                                              target):
    engine = one_pass
    mine = TARGETS[target]
    alone = comparable(engine.score(mine))
    for at in (0, 3, len(PARTNERS)):
        batch = [*PARTNERS[:at], mine, *PARTNERS[at:]]
        together = engine.score_batch(batch)
        # float equality is bit equality: logprobs, p, floor_p, residuals, answers; usage as
        # if alone
        assert comparable(together[at]) == alone, at
    for alone_partner, response in zip(partners_alone, together[:-1], strict=True):
        assert comparable(response) == alone_partner


def test_merged_documents_raw_scores_equal_alone(default_engine, monkeypatch):
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
    log = PassLog(default_engine.runner, monkeypatch)
    scheduler = PassScheduler(default_engine.runner, 1 << 20)
    for i, d in enumerate(docs):
        scheduler.hold(i, d)
    done = dict(item for batch in scheduler.flush() for item in batch)
    assert [len(d) for d in log.passes] == [2]               # root once, root[:-1] apart
    for i, d in enumerate(docs):
        alone = default_engine.runner.run([d])[0]
        assert np.array_equal(done[i].option_logprobs, alone.option_logprobs), i
        assert np.array_equal(done[i].residual, alone.residual), i
        assert np.array_equal(done[i].branch_start, alone.branch_start), i


def test_the_same_image_is_merged_and_another_image_is_not(tiny_vision_engine, monkeypatch):
    """Two requests about the same text and image are read once (one document, the tower run
    once for them); a third with another image of the same size (the same root tokens, other
    pixels) stays a document of its own. Each scores as alone."""
    from .test_media_gemma3 import QUERIES as MEDIA_QUERIES
    from .test_media_gemma3 import media_request, scores_and_residuals
    from .test_media_requests import image_url

    engine = tiny_vision_engine
    same = image_url(9)
    requests = [media_request(same, queries=MEDIA_QUERIES[:1]),
                media_request(same, queries=MEDIA_QUERIES[1:]),
                media_request(image_url(10), queries=MEDIA_QUERIES[1:])]
    alone = [scores_and_residuals(engine.score(r)) for r in requests]
    log = PassLog(engine.runner, monkeypatch)
    towers = []
    features = engine.model.encode_images
    monkeypatch.setattr(engine.model, "encode_images",
                        lambda pixels: towers.append(len(pixels)) or features(pixels))
    old = engine.settings.max_pass_tokens
    engine.settings.max_pass_tokens = 1 << 20
    try:
        together = engine.score_batch(requests)
    finally:
        engine.settings.max_pass_tokens = old
    [docs] = log.passes
    with_media = [d for d in docs if d.media]
    assert len(with_media) == 2 and towers == [2]     # one tower run, two images
    roots = [d.input_ids[:d.root].tolist() for d in with_media]
    assert roots[0] == roots[1]          # the same tokens: only the pixels tell them apart
    assert [scores_and_residuals(r) for r in together] == alone


def test_documents_the_window_cuts_merge_only_with_each_other(tiny_engine, monkeypatch):
    """The CPU attention masks a document the sliding window cuts otherwise, so a root asked
    a short question (inside the window) and the same root asked a long one (past it) stay
    apart; each merges with its like, and all keep their bits."""
    window = tiny_engine.model.cfg.sliding_window
    root = [2, *range(10, 10 + window // 2)]

    def doc(prefix: int) -> object:
        return DocTree(list(root), [Branch(list(range(40, 40 + prefix)), [[7], [8, 9]])]
                       ).flatten(tiny_engine.pad_id)

    docs = [doc(1), doc(window), doc(2), doc(window + 3)]
    assert [d.max_position >= window for d in docs] == [False, True, False, True]
    log = PassLog(tiny_engine.runner, monkeypatch)
    scheduler = PassScheduler(tiny_engine.runner, 1 << 20)
    for i, d in enumerate(docs):
        scheduler.hold(i, d)
    done = dict(item for batch in scheduler.flush() for item in batch)
    [launched] = log.passes
    assert [d.block.n_branches for d in launched] == [2, 2]
    for i, d in enumerate(docs):
        alone = tiny_engine.runner.run([d])[0]
        assert np.array_equal(done[i].option_logprobs, alone.option_logprobs), i
        assert np.array_equal(done[i].residual, alone.residual), i

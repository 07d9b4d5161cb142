"""Query lists laid out once per distinct list (engine/prepare.py: QuerySet): requests that share one
still answer with their own ids, and lists that differ in anything but ids get their own
layout."""

from __future__ import annotations

import copy

import pytest

from .test_engine_parity import NEWS, QUERIES


def _options(response) -> dict:
    return {q.id: [[(o.text, o.logprob) for o in c.options] for c in q.combinations]
            for q in response.queries}


def test_requests_sharing_questions_keep_their_own_ids_and_scores(tiny_engine):
    renamed = [dict(q, id=f"other-{q['id']}") for q in QUERIES]
    first, second = tiny_engine.score_batch([
        {"text": NEWS, "scoring": {"queries": QUERIES}},
        {"text": NEWS, "scoring": {"queries": renamed}}])
    assert [q.id for q in first.queries] == [q["id"] for q in QUERIES]
    assert [q.id for q in second.queries] == [q["id"] for q in renamed]
    assert list(_options(first).values()) == list(_options(second).values())


def test_a_list_differing_in_options_gets_its_own_layout(tiny_engine):
    changed = copy.deepcopy(QUERIES)
    changed[0]["options"] = list(reversed(changed[0]["options"]))
    base, flipped = tiny_engine.score_batch([
        {"text": NEWS, "scoring": {"queries": QUERIES}},
        {"text": NEWS, "scoring": {"queries": changed}}])
    topic = dict(_options(base)["topic"][0])
    assert [text for text, _ in _options(flipped)["topic"][0]] == changed[0]["options"]
    assert dict(_options(flipped)["topic"][0]) == topic     # the same scores, in its order
    assert _options(flipped)["tone"] == _options(base)["tone"]



def test_rows_are_the_rows_the_document_takes_in_a_pass(tiny_engine):
    """Engine.rows (what the queue packs passes by) is the real layout's length: content
    plus the prefix tree of the queries, padded to the tile; scoring after it (which reuses
    the ids it tokenised) gives the same bits as scoring without it."""
    texts = ["", NEWS[:40], " ".join([NEWS] * 4)]
    requests = [{"text": text, "scoring": {"queries": QUERIES}} for text in texts]
    alone = tiny_engine.score_batch(requests)
    rows = [tiny_engine.rows(r) for r in requests]
    flats = [p.flat for p in tiny_engine.preparer.prepare_batch(requests)]
    assert rows == [f.length for f in flats]
    assert all(r % 128 == 0 for r in rows) and rows[0] < rows[2]
    for r in requests:
        tiny_engine.rows(r)
    after = tiny_engine.score_batch(requests)
    assert [_options(a) for a in after] == [_options(a) for a in alone]


def test_rows_raise_what_scoring_reports(tiny_engine):
    from spinf_worker.errors import SpinfError

    bad = {"text": NEWS, "model": "no-such-model", "scoring": {"queries": QUERIES}}
    [scored] = tiny_engine.score_batch([bad])
    with pytest.raises(SpinfError) as raised:
        tiny_engine.rows(bad)
    assert isinstance(scored, SpinfError)
    assert raised.value.to_openai() == scored.to_openai()

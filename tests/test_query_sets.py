"""Query lists laid out once per distinct list (engine._QuerySet): requests that share one
still answer with their own ids, and lists that differ in anything but ids get their own
layout."""

from __future__ import annotations

import copy

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

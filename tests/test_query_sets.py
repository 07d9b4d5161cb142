"""Query lists laid out once per distinct list (engine/prepare.py: QuerySet): requests that share one
still answer with their own ids, and lists that differ in anything but ids get their own
layout."""

from __future__ import annotations

import copy

import pytest

from spinf_worker.errors import InvalidRequestError

from .test_engine_parity import NEWS, QUERIES


def _options(response) -> dict:
    [result] = response.results
    return {q.id: [[(o.text, o.logprob) for o in c.options] for c in q.combinations]
            for q in result.queries}


def _ids(response) -> list[str]:
    return [q.id for q in response.results[0].queries]


def test_requests_sharing_questions_keep_their_own_ids_and_scores(tiny_engine):
    renamed = [dict(q, id=f"other-{q['id']}") for q in QUERIES]
    first, second = tiny_engine.score_batch([
        {"text": NEWS, "scoring": {"queries": QUERIES}},
        {"text": NEWS, "scoring": {"queries": renamed}}])
    assert _ids(first) == [q["id"] for q in QUERIES]
    assert _ids(second) == [q["id"] for q in renamed]
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


@pytest.mark.parametrize("change", [{"case_insensitive": False}, {"empty_floor": False}])
def test_a_scoring_setting_gets_its_own_layout(tiny_engine, change):
    """The same queries asked case-sensitively, or without a floor, are laid out apart from
    the defaults' (spellings and floors are part of a layout)."""
    base, changed = tiny_engine.score_batch([
        {"text": NEWS, "scoring": {"queries": QUERIES}},
        {"text": NEWS, "scoring": {"queries": QUERIES, **change}}])
    again = tiny_engine.score({"text": NEWS, "scoring": {"queries": QUERIES}})
    assert again.results == base.results
    combos = [c for q in changed.results[0].queries for c in q.combinations]
    if "empty_floor" in change:
        assert _options(changed) == _options(base)
        assert all(c.floor_residual is None and all(o.floor_p is None for o in c.options)
                   for c in combos)
    else:
        assert _options(changed) != _options(base)
        assert all(c.floor_residual is not None for c in combos)


def test_rows_are_the_rows_the_document_takes_in_a_pass(tiny_engine):
    """Engine.rows (what the queue packs passes by) is the real layout's length: content
    plus the prefix tree of the queries, padded to the tile; scoring after it (which reuses
    the ids it tokenised) gives the same bits as scoring without it."""
    texts = ["", NEWS[:40], " ".join([NEWS] * 4)]
    requests = [{"text": text, "scoring": {"queries": QUERIES}} for text in texts]
    # several inputs: the rows of each document, added up
    requests.append({"inputs": [{"id": str(k), "messages": [{"role": "user", "content": t}]}
                                for k, t in enumerate(texts)], "scoring": {"queries": QUERIES}})
    alone = tiny_engine.score_batch(requests)
    rows = [tiny_engine.rows(r) for r in requests]
    lengths = [[d.flat.length for d in p.docs]
               for p in tiny_engine.preparer.prepare_batch(requests)]
    assert rows == [sum(n) for n in lengths]
    assert lengths[3] == [n for [n] in lengths[:3]]
    assert all(r % 128 == 0 for r in rows) and rows[0] < rows[2]
    for r in requests:
        tiny_engine.rows(r)
    after = tiny_engine.score_batch(requests)
    assert [a.results for a in after] == [a.results for a in alone]


def test_rows_raise_what_scoring_reports(tiny_engine):
    from spinf_worker.errors import SpinfError

    bad = {"text": NEWS, "model": "no-such-model", "scoring": {"queries": QUERIES}}
    [scored] = tiny_engine.score_batch([bad])
    with pytest.raises(SpinfError) as raised:
        tiny_engine.rows(bad)
    assert isinstance(scored, SpinfError)
    assert raised.value.to_openai() == scored.to_openai()


def test_a_group_has_a_prefix_tree_of_its_own(tiny_engine):
    """The same question asked ungrouped and in a group: their rows are not shared (the
    group's tree starts at the content), and both score exactly the same."""
    asked = {"id": "a", "template": "\n\nQuestion: is this news?\nAnswer:{?}",
             "options": [" yes", " no"]}
    shared = tiny_engine.preparer.parse({"text": NEWS[0], "scoring": {"queries": [
        asked, {**asked, "id": "b"}], "case_insensitive": False}}).docs[0].query_set
    apart = tiny_engine.preparer.parse({"text": NEWS[0], "scoring": {"queries": [
        asked, {**asked, "id": "b", "group": "mine@1"}], "case_insensitive": False}}
        ).docs[0].query_set
    once = len(shared.block.ids)
    assert once > 0 and len(apart.block.ids) == 2 * once
    response = tiny_engine.score({"text": NEWS[0], "scoring": {"queries": [
        asked, {**asked, "id": "b", "group": "mine@1"}], "case_insensitive": False}})
    a, b = response.results[0].queries
    assert a.combinations == b.combinations


def test_a_checked_block_is_checked_again_under_limits_of_its_own(tiny_engine):
    """An input asking a scoring block's queries takes their checks as passed once another
    input of the block passed them, but only without limits of its own: under a lower query
    limit the same block is refused, and without one it is answered as before."""
    scoring = {"queries": QUERIES}
    first, limited, again = tiny_engine.score_batch([
        {"text": NEWS, "scoring": scoring},
        {"text": NEWS, "scoring": scoring, "limits": {"max_query_tokens": 2}},
        {"text": NEWS, "scoring": scoring}])
    assert isinstance(limited, InvalidRequestError)
    assert limited.code == "template_too_long"
    assert again.results == first.results

"""A request may name prompt packs (scoring.packs) and no queries of its own."""

from __future__ import annotations

import pytest

from spinf_worker.errors import InvalidRequestError
from spinf_worker.openai_compat import score_request_from_chat, score_to_chat_completion
from spinf_worker.protocol import ScoreRequest

TEXT = "I was charged twice for September and I want my money back now, or I leave."
TRIAGE = {"id": "spinf/support-triage", "include_queries": True}


def test_packs_without_queries_parse_and_nothing_at_all_is_4xx():
    request = ScoreRequest.parse({"text": TEXT, "scoring": {"packs": [TRIAGE]}})
    assert request.scoring.queries == []
    with pytest.raises(InvalidRequestError) as err:
        ScoreRequest.parse({"text": TEXT})
    assert (err.value.param, err.value.code) == ("scoring.queries", "empty_queries")
    with pytest.raises(InvalidRequestError) as chat:
        score_request_from_chat({"messages": [{"role": "user", "content": TEXT}]})
    assert chat.value.code == "scoring_required"


def test_pack_only_request_scores_the_pack(tiny_engine):
    only = tiny_engine.score({"text": TEXT, "scoring": {"packs": [TRIAGE]}})
    with_query = tiny_engine.score({"text": TEXT, "scoring": {"queries": [
        {"id": "mine", "template": "\n\nAny refund?{?}", "options": [" yes", " no"]}],
        "packs": [TRIAGE]}})
    (alone,), (beside,) = only.results, with_query.results
    pack_ids = {q.id for q in alone.queries}
    assert pack_ids and "mine" not in pack_ids          # include_queries: the pack's raw queries
    assert [q.id for q in beside.queries] == ["mine", *[q.id for q in alone.queries]]
    # the pack's answers, categories and decision do not depend on the caller's query
    assert [q.model_dump() for q in alone.queries] == [q.model_dump() for q in beside.queries[1:]]
    assert alone.packs[0].model_dump() == beside.packs[0].model_dump()
    # the chat reply's message: the pack's decision when no query is shown
    hidden = tiny_engine.score({"text": TEXT, "scoring": {"packs": [{"id": TRIAGE["id"]}]}})
    assert hidden.results[0].queries == []
    assert hidden.results[0].packs[0].model_dump() == alone.packs[0].model_dump()
    chat = score_to_chat_completion(hidden.model_dump(mode="json"))
    expected = "unsafe" if alone.packs[0].decision["unsafe"] else "safe"
    assert chat["choices"][0]["message"]["content"] == expected

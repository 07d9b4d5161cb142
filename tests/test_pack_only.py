"""A request may name prompt packs and no queries of its own."""

from __future__ import annotations

import pytest

from spinf_worker.errors import InvalidRequestError
from spinf_worker.openai_compat import score_request_from_chat, score_to_chat_completion
from spinf_worker.protocol import ScoreRequest

TEXT = "I was charged twice for September and I want my money back now, or I leave."


def test_packs_without_queries_parse_and_nothing_at_all_is_4xx():
    request = ScoreRequest.parse({"text": TEXT, "packs": [{"id": "spinf/support-triage"}]})
    assert request.scoring.queries == []
    with pytest.raises(InvalidRequestError) as err:
        ScoreRequest.parse({"text": TEXT})
    assert (err.value.param, err.value.code) == ("scoring.queries", "missing_queries")
    with pytest.raises(InvalidRequestError):
        score_request_from_chat({"messages": [{"role": "user", "content": TEXT}]})


def test_pack_only_request_scores_the_pack(tiny_engine):
    only = tiny_engine.score({"text": TEXT, "packs": [{"id": "spinf/support-triage"}]})
    with_query = tiny_engine.score({"text": TEXT, "scoring": {"queries": [
        {"id": "mine", "template": "\n\nAny refund?{?}", "options": [" yes", " no"]}]},
        "packs": [{"id": "spinf/support-triage"}]})
    assert only.queries == []
    assert only.packs[0]["questions"] == with_query.packs[0]["questions"]
    assert only.packs[0]["decision"] == with_query.packs[0]["decision"]
    chat = score_to_chat_completion(only.model_dump())
    assert chat["choices"][0]["message"]["content"] == only.packs[0]["decision"]["label"]

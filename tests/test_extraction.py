"""Extraction slots through the engine on the default model: values first, scores unchanged."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

INVOICE = ("INVOICE No. 4411\nAcme Supplies Ltd, 12 Harbour Road\nDate: 3 October 2025\n"
           "Item: 40 boxes of printer paper\nTotal due: $1,284.50\n"
           "The customer was charged twice in September and asked for a refund.")
NEWS = ("The company said on Tuesday it would cut 1,200 jobs, about 8 percent of its workforce, "
        "after quarterly revenue fell to $3.2 billion.")
SCORED = {"id": "refund", "template": "\n\nDid the customer ask for a refund?\nAnswer:{?}",
          "options": [" yes", " no"]}


def first(response, qid: str):
    query = next(q for q in response.queries if q.id == qid)
    return query.combinations[0].candidates


def test_numbers_and_amounts_come_first(default_engine):
    response = default_engine.score({"text": INVOICE, "scoring": {"queries": [
        {"id": "invoice", "template": "\n\nThe invoice number is{n}"},
        {"id": "total", "template": "\n\nThe total due is{$}"},
        {"id": "boxes", "template": "\n\nNumber of boxes ordered:{n}"}]}})
    assert first(response, "invoice")[0].value == 4411
    total = first(response, "total")[0].value
    assert total.amount == pytest.approx(1284.5) and total.currency == "USD"
    assert first(response, "boxes")[0].value == 40
    news = default_engine.score({"text": NEWS, "scoring": {"queries": [
        {"id": "jobs", "template": "\n\nHow many jobs will be cut?\nAnswer:{n}"}]}})
    assert first(news, "jobs")[0].value == 1200


def test_number_slots_only_emit_numbers(default_engine):
    response = default_engine.score({"text": NEWS, "scoring": {"queries": [
        {"id": "who", "template": "\n\nWhich company is this about?\nAnswer:{n}", "beam_width": 6,
         "candidates": 6}]}})
    for candidate in first(response, "who"):
        assert isinstance(candidate.value, int | float)


def test_span_slot_and_mixed_request_keep_scores(default_engine):
    with_slots = default_engine.score({"text": INVOICE, "scoring": {"queries": [
        SCORED,
        {"id": "month", "template": "\n\nQ: Which month was charged twice?\nA: \"{*}\""},
        {"id": "summary", "template": "\n\nSummary:{*}",
         "generate": {"max_tokens": 8, "stop": ["\n"]}}]}})
    alone = default_engine.score({"text": INVOICE, "scoring": {"queries": [SCORED]}})
    assert [o.logprob for o in with_slots.queries[0].combinations[0].options] == \
           [o.logprob for o in alone.queries[0].combinations[0].options]
    month = first(with_slots, "month")
    assert month[0].text == "September"
    assert month == sorted(month, key=lambda c: -c.p)
    assert len(first(with_slots, "summary")) == 1

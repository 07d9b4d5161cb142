"""Extraction slots in the hosted API's shapes: results built from answers found (merging,
mass, p_negative, calibration, top_k), the decoder's settings of a query, the request's
bounds, and whole requests on the default model."""

from __future__ import annotations

import json
import math

import pytest

from spinf_worker.engine.decode import Found, Sampling
from spinf_worker.engine.slots import extraction_result, slot_settings, text_key
from spinf_worker.errors import InvalidRequestError
from spinf_worker.extract_values import AMOUNT, NUMBER
from spinf_worker.protocol import ExtractedCombination, ScoreRequest


def query(**fields):
    request = ScoreRequest.parse({"text": "x", "scoring": {"queries": [{"id": "q", **fields}]}})
    return request.scoring.queries[0]


def found(*answers: tuple[str, float]) -> list[Found]:
    return [Found(text, math.log(p)) for text, p in answers]


def result(template: str, answers: list[Found], **fields) -> dict:
    out = extraction_result(query(template=template, **fields), {}, answers)
    ExtractedCombination.model_validate(out)   # the response's own shape
    return out


TEXT, NUMBER_SLOT, AMOUNT_SLOT = 'A: "{*}"', "A:{n}", "A:{$}"


# ---- results from answers found ----------------------------------------------------------


def test_text_answers_merge_over_case_punctuation_and_spaces():
    out = result(TEXT, found((" Coca-Cola", 0.3), (" Pepsi", 0.2), ("coca cola", 0.1),
                             ("COCA COLA.", 0.05), ("Coca-Cola ", 0.05)))
    assert out["answers"] == [{"text": "Coca-Cola", "p": pytest.approx(0.5)},
                              {"text": "Pepsi", "p": pytest.approx(0.2)}]
    assert out["mass"] == pytest.approx(0.7)
    assert "p_negative" not in out and "p_calibrated" not in out


def test_merged_text_shows_its_most_likely_spelling():
    out = result(TEXT, found(("september", 0.1), (" September.", 0.3), ("SEPTEMBER", 0.2)))
    assert out["answers"] == [{"text": "September.", "p": pytest.approx(0.6)}]
    assert text_key("U.S.") == text_key("us") and text_key("Bud") != text_key("Bud Light")
    assert text_key("...") == "..."   # punctuation alone is its own answer


def test_numbers_merge_by_value():
    out = result(NUMBER_SLOT, found((" 1,200", 0.3), (" 12", 0.2), (" 1200", 0.1),
                                    (" 1,200.", 0.05), (" 1.2 thousand", 0.05)))
    assert out["answers"] == [{"text": "1,200", "p": pytest.approx(0.5), "value": 1200.0},
                              {"text": "12", "p": pytest.approx(0.2), "value": 12.0}]
    assert out["mass"] == pytest.approx(0.7) and out["p_negative"] == 0.0


def test_amounts_merge_by_value_and_currency():
    out = result(AMOUNT_SLOT, found(("$5", 0.3), (" 5", 0.2), (" 5 USD", 0.1), ("€5", 0.1),
                                    (" $5.00", 0.05)))
    assert [(a["value"], a["currency"], a["p"]) for a in out["answers"]] == [
        (5.0, "USD", pytest.approx(0.45)), (5.0, None, pytest.approx(0.2)),
        (5.0, "EUR", pytest.approx(0.1))]
    assert out["answers"][0]["text"] == "$5"


def test_p_negative_is_the_top_magnitudes_share_on_its_negative():
    out = result(NUMBER_SLOT, found((" 3.5", 0.4), (" (3.5)", 0.3), (" -3.5", 0.1),
                                    (" 35", 0.1)))
    assert out["answers"][0]["value"] == 3.5
    assert out["p_negative"] == pytest.approx(0.4 / 0.8)   # 35 is another magnitude
    brackets = result(AMOUNT_SLOT, found((" ($1,284.50)", 0.6), (" $1,284.50", 0.2)))
    assert brackets["answers"][0]["value"] == -1284.5
    assert brackets["p_negative"] == pytest.approx(0.75)


def test_calibration_of_the_top_answer():
    answers = found((" 40", 0.6), (" 4", 0.2))
    out = result(NUMBER_SLOT, answers, calibration={"a": 2, "b": -1})
    assert out["p_calibrated"] == pytest.approx(1 / (1 + math.exp(-(2 * math.log(1.5) - 1))))
    identity = result(NUMBER_SLOT, answers, calibration={})
    assert identity["p_calibrated"] == pytest.approx(0.6)
    assert "p_calibrated" not in result(NUMBER_SLOT, answers)


def test_top_k_keeps_the_most_likely_and_mass_counts_all():
    many = found(*((f" {n}", 0.1 - n / 100) for n in range(8)))
    assert [a["value"] for a in result(NUMBER_SLOT, many)["answers"]] == [0, 1, 2, 3, 4]
    out = result(NUMBER_SLOT, many, top_k=2)
    assert [a["value"] for a in out["answers"]] == [0, 1]
    assert out["mass"] == pytest.approx(sum(0.1 - n / 100 for n in range(8)))


def test_blank_answers_and_none_found():
    out = result(TEXT, found(("", 0.3), ("  ", 0.1), ("Apple", 0.2)))
    assert out["answers"] == [{"text": "Apple", "p": pytest.approx(0.2)}]
    assert out["mass"] == pytest.approx(0.2)
    empty = result(NUMBER_SLOT, [])
    assert empty == {"values": {}, "answers": [], "mass": 0.0}


def test_generated_answers_have_text_and_finish():
    answers = [Found(" Sales rose.", -3.0, [1, 2], "stop", 0),
               Found("The company", -2.0, [3], "length", 1)]
    out = result(TEXT, answers, generate={"n": 2, "temperature": 0.5})
    assert out == {"values": {}, "answers": [{"text": "Sales rose.", "finish": "stop"},
                                             {"text": "The company", "finish": "length"}]}


# ---- the decoder's settings --------------------------------------------------------------


def settings(**fields) -> dict:
    q = query(**fields)
    return slot_settings(q, q.combinations_list()[0])


def test_settings_of_searched_slots():
    text = settings(template='The company is "{*}".')
    assert text["stops"] == ('".', "\u201d.", "\n") and text["grammar"] is None
    assert text["beam_width"] == text["candidates"] == 6 and text["max_tokens"] == 16
    assert settings(template="A:{n}")["grammar"] is NUMBER
    wide = settings(template="A:{$}", top_k=12, max_tokens=30)
    assert wide["grammar"] is AMOUNT and wide["beam_width"] == 12 and wide["max_tokens"] == 30
    assert settings(template="A: {*}")["stops"] == ("\n",)
    assert "sample" not in text


def test_settings_of_generated_slots():
    greedy = settings(template='Summary: "{*}"', generate=True)
    assert greedy["sample"] == Sampling() and greedy["max_tokens"] == 16
    spec = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "seed": 3, "n": 4}
    sampled = settings(template='Summary: "{*}"', generate=spec, max_tokens=100)
    assert sampled["sample"] == Sampling(**spec) and sampled["max_tokens"] == 100
    assert sampled["beam_width"] == 4


# ---- the request's bounds ----------------------------------------------------------------


@pytest.mark.parametrize("fields", [
    {"template": "A:{n}", "max_tokens": 0}, {"template": "A:{n}", "max_tokens": 65},
    {"template": "A:{*}", "max_tokens": 101, "generate": True},
    {"template": "A:{n}", "top_k": 0}, {"template": "A:{n}", "top_k": 21},
    {"template": "A:{*}", "generate": {"temperature": 2.5}},
    {"template": "A:{*}", "generate": {"temperature": -0.1}},
    {"template": "A:{*}", "generate": {"top_p": 0}}, {"template": "A:{*}", "generate": {"top_p": 1.5}},
    {"template": "A:{*}", "generate": {"top_k": 0}}, {"template": "A:{*}", "generate": {"top_k": 101}},
    {"template": "A:{*}", "generate": {"n": 0}}, {"template": "A:{*}", "generate": {"n": 7}},
    {"template": "A:{*}", "generate": {"seed": -1}},
    {"template": "A:{*}", "generate": True, "top_k": 3},
    {"template": "A:{*}", "generate": True, "calibration": {"a": 1}},
    {"template": "A:{n}", "generate": True},
])
def test_out_of_bounds_fields_are_invalid(fields):
    with pytest.raises(InvalidRequestError) as raised:
        query(**fields)
    assert raised.value.code == "invalid_field"


def test_bounds_themselves_are_valid():
    assert query(template="A:{n}", max_tokens=64, top_k=20).max_tokens == 64
    assert query(template="A:{n}", max_tokens=1, top_k=1).answers_kept == 1
    generated = query(template="A:{*}", max_tokens=100,
                      generate={"temperature": 2, "top_p": 1, "top_k": 100, "n": 6})
    assert generated.generation.n == 6


# ---- whole requests on the default model -------------------------------------------------

INVOICE = ("INVOICE No. 4411\nAcme Supplies Ltd, 12 Harbour Road\nDate: 3 October 2025\n"
           "Item: 40 boxes of printer paper\nTotal due: $1,284.50\n"
           "The customer was charged twice in September and asked for a refund.")
TABLE = ("ACME CORP, RESULTS FOR THE YEAR (in thousands)\nRevenue: 12,480\n"
         "Operating costs: 13,764\nNet income (loss): (1,284)\nRevenue growth: 12.5%\n")
NEWS = "Apple sold 3.5 million iPhones in the quarter, up from 3.1 million."
SCORED = {"id": "refund", "template": "\n\nDid the customer ask for a refund?\nAnswer:{?}",
          "options": [" yes", " no"]}
SUMMARY = '\n\nA one-sentence summary: "{*}"'


def combination(response, input_id: str, qid: str):
    result = next(r for r in response.results if r.input_id == input_id)
    return next(q for q in result.queries if q.id == qid).combinations[0]


@pytest.fixture(scope="module")
def extracted(default_engine):
    return default_engine.score({"scoring": {"queries": []}, "inputs": [
        {"id": "invoice", "messages": [{"content": INVOICE}], "queries": [
            SCORED,
            {"id": "number", "template": "\n\nThe invoice number is{n}"},
            {"id": "total", "template": "\n\nThe total due is{$}"},
            {"id": "boxes", "template": "\n\nNumber of boxes ordered:{n}", "top_k": 3},
            {"id": "month", "template": '\n\nThe customer was charged twice in the month of '
                                        '"{*}"', "calibration": {"a": 0.5, "b": 0.2}}]},
        {"id": "table", "messages": [{"content": TABLE}], "queries": [
            {"id": "net", "template": "\n\nNet income (loss):{n}"},
            {"id": "growth", "template": "\n\nQ: By what percent did revenue grow?\nA:{n}"}]},
        {"id": "news", "messages": [{"content": NEWS}], "queries": [
            {"id": "units", "template": "\n\nQ: How many iPhones were sold?\nA:{n}"}]}]})


def test_numbers_amounts_and_text_come_first(extracted):
    assert combination(extracted, "invoice", "number").answers[0].value == 4411
    total = combination(extracted, "invoice", "total").answers[0]
    assert (total.value, total.currency, total.text) == (1284.5, "USD", "$1,284.50")
    boxes = combination(extracted, "invoice", "boxes")
    assert boxes.answers[0].value == 40 and len(boxes.answers) == 3
    month = combination(extracted, "invoice", "month")
    assert month.answers[0].text == "September"
    for qid in ("number", "total", "boxes", "month"):
        c = combination(extracted, "invoice", qid)
        ps = [a.p for a in c.answers]
        assert ps == sorted(ps, reverse=True) and sum(ps) <= c.mass + 1e-9 <= 1 + 1e-9
        assert len({a.text.casefold() for a in c.answers}) == len(c.answers)   # merged


def test_scales_percentages_and_brackets(extracted):
    assert combination(extracted, "news", "units").answers[0].value == 3_500_000.0
    growth = combination(extracted, "table", "growth")
    assert (growth.answers[0].text, growth.answers[0].value) == ("12.5%", 12.5)
    net = combination(extracted, "table", "net")
    assert (net.answers[0].text, net.answers[0].value) == ("(1,284)", -1284.0)
    assert 0.5 < net.p_negative <= 1.0
    assert combination(extracted, "invoice", "number").p_negative == 0.0


def test_calibration_on_the_model(extracted):
    month = combination(extracted, "invoice", "month")
    p = month.answers[0].p
    assert month.p_calibrated == pytest.approx(
        1 / (1 + math.exp(-(0.5 * math.log(p / (1 - p)) + 0.2))))
    assert combination(extracted, "invoice", "number").p_calibrated is None


def test_slots_leave_scores_unchanged(default_engine, extracted):
    alone = default_engine.score({"inputs": [{"id": "invoice", "messages": [
        {"content": INVOICE}]}], "scoring": {"queries": [SCORED]}})
    assert [o.logprob for o in combination(extracted, "invoice", "refund").options] == \
           [o.logprob for o in combination(alone, "invoice", "refund").options]


GENERATE = {"text": NEWS, "scoring": {"queries": [
    {"id": "greedy", "template": SUMMARY, "generate": True, "max_tokens": 40},
    {"id": "short", "template": SUMMARY, "generate": True, "max_tokens": 3},
    {"id": "sampled", "template": SUMMARY, "max_tokens": 12,
     "generate": {"temperature": 1.0, "top_p": 0.9, "seed": 5, "n": 3}}]}}


@pytest.fixture(scope="module")
def generated(default_engine):
    return [default_engine.score(GENERATE) for _ in range(2)]


def test_generation_is_reproducible_and_says_why_it_finished(generated):
    first, again = generated
    for qid in ("greedy", "short", "sampled"):
        assert combination(first, "0", qid).answers == combination(again, "0", qid).answers
    query = next(q for q in first.results[0].queries if q.id == "greedy")
    assert query.generate is True and query.kind == "text"
    (greedy,) = combination(first, "0", "greedy").answers
    assert greedy.finish == "stop" and greedy.p is None and greedy.text
    assert '"' not in greedy.text   # it ended at the closing quote
    (short,) = combination(first, "0", "short").answers
    assert short.finish == "length" and greedy.text.startswith(short.text)
    sampled = combination(first, "0", "sampled").answers
    assert len(sampled) == 3 and all(a.finish in ("stop", "length") for a in sampled)
    assert len({a.text for a in sampled}) > 1


def test_another_seed_writes_other_text(default_engine, generated):
    other = {**GENERATE, "scoring": {"queries": [
        {**GENERATE["scoring"]["queries"][2],
         "generate": {"temperature": 1.0, "top_p": 0.9, "seed": 6, "n": 3}}]}}
    answers = combination(default_engine.score(other), "0", "sampled").answers
    assert [a.text for a in answers] != [a.text for a in
                                         combination(generated[0], "0", "sampled").answers]


def test_the_plain_reply_is_the_models_dump(extracted, generated):
    """Answers of every kind (values, currencies, p_negative, calibration, generated text)
    are stored as dumping the model writes them (ScoreResponse.plain)."""
    for response in (extracted, *generated):
        assert json.dumps(response.plain(), sort_keys=True) == \
               json.dumps(response.model_dump(), sort_keys=True)

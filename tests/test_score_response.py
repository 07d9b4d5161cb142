"""The score response as the engine builds it: ids and fingerprints in the hosted formats, the
model and endpoint echoed, floors on or off per call and per query, combinations listed or
"all", and usage counts that add up."""

from __future__ import annotations

import json
import math
import pickle
import re

import numpy as np
import pytest

from spinf_worker import jsonio
from spinf_worker.engine import respond
from spinf_worker.model_names import HOSTED_ALIASES
from spinf_worker.protocol import ScoredQuery, ScoreResponse

from .test_engine_parity import NEWS, QUERIES

ULID = re.compile(r"[0-9A-HJKMNP-TV-Z]{26}")   # Crockford base32: no I, L, O, U


def score(engine, **fields):
    return engine.score({"messages": [{"role": "user", "content": NEWS}],
                         "scoring": {"queries": QUERIES}, **fields})


def combos(response):
    return [c for r in response.results for q in r.queries for c in q.combinations]


def test_id_and_fingerprint_formats(tiny_engine):
    first, second = score(tiny_engine), score(tiny_engine)
    for response in (first, second):
        assert response.id.startswith("scr_") and ULID.fullmatch(response.id[4:])
        assert re.fullmatch(r"fp_[0-9a-f]{10}", response.system_fingerprint)
        assert response.object == "score"
    assert first.id != second.id                       # a new id per response
    assert first.system_fingerprint == second.system_fingerprint == tiny_engine.fingerprint
    dumped = first.model_dump(mode="json")
    assert dumped["id"] == first.id and dumped["system_fingerprint"] == first.system_fingerprint


def test_the_model_is_echoed_as_sent(tiny_engine):
    assert score(tiny_engine).model == tiny_engine.model_name          # not sent: the served
    bare = tiny_engine.model_name.rsplit("/", 1)[-1]
    alias = sorted(HOSTED_ALIASES)[0]
    for name in (tiny_engine.model_name, bare, alias):
        response = score(tiny_engine, model=name)
        assert response.model == name
        # another name of the same model: the same scores
        assert response.results == score(tiny_engine).results


def test_the_endpoint_is_echoed(tiny_engine):
    response = score(tiny_engine, endpoint="support-triage")
    assert response.endpoint == "support-triage"
    assert response.model_dump(mode="json")["endpoint"] == "support-triage"
    assert "endpoint" not in score(tiny_engine).model_dump(mode="json")


def test_a_listed_grid_scores_as_the_same_grid_asked_as_all(tiny_engine):
    about = QUERIES[3]
    listed = [{"thing": t, "place": p} for t in about["values"]["thing"]
              for p in about["values"]["place"]]
    as_list = {k: v for k, v in about.items() if k != "values"} | {"combinations": listed}
    grid, explicit = (tiny_engine.score({"text": NEWS, "scoring": {"queries": [q]}})
                      for q in (about, as_list))
    assert explicit.results == grid.results
    # a list is scored in its own order, and may pick a few of the grid's combinations
    picked = [listed[3], listed[0]]
    few = tiny_engine.score({"text": NEWS, "scoring": {"queries": [
        as_list | {"combinations": picked}]}})
    [all_combos], [few_combos] = ([q.combinations for q in r.results[0].queries]
                                  for r in (grid, few))
    assert [c.values for c in few_combos] == picked
    assert few_combos == [all_combos[3], all_combos[0]]


def test_no_floor_for_the_call(tiny_engine):
    with_floor, without = score(tiny_engine), score(tiny_engine, scoring={
        "queries": QUERIES, "empty_floor": False})
    for a, b in zip(combos(with_floor), combos(without), strict=True):
        assert b.floor_residual is None and all(o.floor_p is None for o in b.options)
        assert a.floor_residual is not None and all(o.floor_p is not None for o in a.options)
        assert [(o.logprob, o.p) for o in a.options] == [(o.logprob, o.p) for o in b.options]
        assert a.residual == b.residual
    assert without.usage.scoring["floor_prompts"] == 0
    assert without.usage.prompt_tokens_details["floor_tokens"] == 0
    assert with_floor.usage.scoring["floor_prompts"] == len(combos(with_floor))


@pytest.mark.parametrize(("call", "query", "floored"), [
    (True, False, False), (False, True, True), (None, False, False), (None, None, True)])
def test_a_querys_floor_overrides_the_calls(tiny_engine, call, query, floored):
    tone = QUERIES[1] if query is None else QUERIES[1] | {"empty_floor": query}
    scoring = {"queries": [tone, QUERIES[0]]}
    if call is not None:
        scoring["empty_floor"] = call
    response = tiny_engine.score({"text": NEWS, "scoring": scoring})
    tone_result, topic_result = response.results[0].queries
    [combo] = tone_result.combinations
    assert (combo.floor_residual is not None) is floored
    assert all((o.floor_p is not None) is floored for o in combo.options)
    # the other query follows the call
    assert (topic_result.combinations[0].floor_residual is not None) is (call is not False)
    if floored:
        reference = score(tiny_engine).results[0].queries[1].combinations[0]
        assert [o.floor_p for o in combo.options] == [o.floor_p for o in reference.options]
        assert combo.floor_residual == reference.floor_residual


def test_usage_adds_up(tiny_engine):
    extraction = {"id": "month", "template": '\n\nQ: Which month?\nA: "{*}"', "max_tokens": 4}
    inputs = [{"id": "a", "messages": [{"content": NEWS}]},
              {"id": "b", "messages": [{"content": NEWS[:60]}], "query_ids": ["tone", "about"]},
              {"id": "c", "messages": [{"content": "Short."}], "query_ids": [],
               "queries": [extraction]}]
    response = tiny_engine.score({"inputs": inputs, "scoring": {"queries": QUERIES}})
    usage = response.usage
    assert usage.inputs == 3
    scored = [q for r in response.results for q in r.queries if isinstance(q, ScoredQuery)]
    assert usage.scoring["queries"] == len(QUERIES) + 2 == len(scored)
    assert usage.scoring["prompts"] == sum(len(q.combinations) for q in scored)
    assert usage.scoring["combinations"] == usage.scoring["prompts"]
    assert usage.scoring["options"] == sum(len(q.combinations[0].options) for q in scored)
    assert usage.extraction == {"slots": 1, "text": 1, "number": 0, "currency": 0}
    details = usage.prompt_tokens_details
    assert details["content_tokens"] == usage.content["tokens"] == sum(
        len(tiny_engine.presenter.encode(tiny_engine.presenter.present(
            [{"role": "user", "content": i["messages"][0]["content"]}]))) for i in inputs)
    assert usage.prompt_tokens == (details["content_tokens"] + details["query_tokens"]
                                   + details["floor_tokens"])
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.completion_tokens <= extraction["max_tokens"] * 6   # the search's beams
    assert usage.processed_tokens >= usage.content["tokens"] + usage.completion_tokens
    assert usage.billed_tokens == 0
    # one input more, the same content: its share of every count again
    more = tiny_engine.score({"inputs": [*inputs, {**inputs[0], "id": "d"}],
                              "scoring": {"queries": QUERIES}}).usage
    alone = tiny_engine.score({"inputs": [inputs[0]], "scoring": {"queries": QUERIES}}).usage
    assert more.inputs == 4
    for key in ("queries", "prompts", "options", "floor_prompts", "query_tokens"):
        assert more.scoring[key] == usage.scoring[key] + alone.scoring[key], key
    assert more.content["tokens"] == usage.content["tokens"] + alone.content["tokens"]


def test_timing_is_whole_milliseconds(tiny_engine):
    timing = score(tiny_engine).timing
    assert all(isinstance(v, int) and v >= 0 for v in timing.model_dump().values())
    assert timing.score_ms <= timing.wall_ms


def same_json(a, b) -> bool:
    """Equal as JSON, types included (0 and 0.0 are written differently)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_a_reply_reads_the_same_before_its_results_are_built(tiny_engine):
    """The engine's replies validate their results only once read (ScoreResponse.of_engine):
    a copy and a pickled copy equal the reply whose results were read, and dump and print as
    a reply validated from its dump does, whichever is asked first."""
    request = {"inputs": [{"id": "a", "messages": [{"content": NEWS}]},
                          {"id": "b", "messages": [{"content": "Short."}]}],
               "scoring": {"queries": QUERIES}, "endpoint": "triage"}
    reply = tiny_engine.score(request)
    copied, pickled = reply.model_copy(deep=True), pickle.loads(pickle.dumps(reply))
    again = reply.model_copy(deep=True)
    assert "results" not in reply.__dict__   # held back until read
    validated = ScoreResponse.model_validate(json.loads(reply.model_dump_json()))
    assert copied == reply and reply == pickled
    assert repr(again) == repr(validated)
    assert pickled.model_dump() == validated.model_dump()
    assert [q.id for q in again.results[1].queries] == [q["id"] for q in QUERIES]
    assert list(reply.model_dump()) == list(validated.model_dump())   # the fields' order
    other = tiny_engine.score({**request, "endpoint": None})
    assert other != reply and other.results[0].input_id == "a"


def test_queue_statistics_count_a_reply_without_building_its_results(tiny_engine):
    """A worker counts every reply of a pass (documents, questions, rows) from the data it
    stores: building the results' models only to count them cost a fast worker half its
    host time."""
    from spinf_worker.queue.worker import score_counts

    reply = tiny_engine.score({"inputs": [{"id": "a", "messages": [{"content": NEWS}]},
                                          {"id": "b", "messages": [{"content": "Short."}]}],
                               "scoring": {"queries": QUERIES}})
    docs, questions, rows, padded = score_counts(reply)
    assert "results" not in reply.__dict__
    assert docs == len(reply.results) == 2
    assert questions == sum(len(q.combinations) for r in reply.results for q in r.queries)
    assert 0 < rows <= padded


def test_the_plain_reply_is_the_models_dump(tiny_engine):
    """What workers store (ScoreResponse.plain: the data the engine built the reply from) is
    what dumping the model gives, over every part of a reply: floors on and off, spellings,
    grids, extraction slots, packs, warnings, the endpoint, and the timing set afterwards."""
    extraction = {"id": "month", "template": '\n\nQ: Which month?\nA: "{*}"', "max_tokens": 4}
    request = {"inputs": [{"id": "a", "messages": [{"content": NEWS}]},
                          {"id": "b", "messages": [{"content": "Short."}],
                           "queries": [extraction, QUERIES[1] | {"id": "tone2", "empty_floor": False}]}],
               "scoring": {"queries": QUERIES, "case_insensitive": True},
               "endpoint": "triage"}
    packs = {"text": NEWS, "scoring": {"queries": QUERIES[:1],
                                       "packs": [{"id": "spinf/moderation"}]}}
    for body in (request, packs, {"messages": [{"role": "user", "content": NEWS}],
                                  "scoring": {"queries": QUERIES}}):
        response = tiny_engine.score(body)
        assert same_json(stored(response), response.model_dump())
        response.timing.queue_ms, response.timing.wall_ms = 7, 9
        assert same_json(stored(response), response.model_dump())
        assert response.plain()["timing"]["queue_ms"] == 7


def stored(response) -> dict:
    """What a worker stores of a reply, read back (an input's result may be JSON already)."""
    return jsonio.loads(jsonio.dumps(response.plain()))


# options scored as given, floors on for some queries and off for others, a grid, warnings,
# and the characters a JSON template must keep as they are ("%", quotes, NUL, non-ASCII)
AS_GIVEN = [
    QUERIES[0] | {"id": "topic %s", "options": [" business", " sports %d", ' "a"']},
    QUERIES[1] | {"empty_floor": False},
    QUERIES[3] | {"values": {"thing": ["rates\u0000", "fútbol"], "place": ["the text"]}},
    {"id": "odd", "template": "\n\nReply with a colour:{?}", "options": [" 7", " %%"]},
]


def as_data(doc, plain, scores, floors, warnings):
    """An input of a plain set answered as data, as every other input is."""
    return {"input_id": doc.input_id,
            "queries": respond._plain_results(doc, plain, scores, floors, warnings)}


@pytest.mark.parametrize("case_insensitive", [False, True])
@pytest.mark.parametrize("grid", [False, True])
def test_a_bulk_inputs_result_written_from_its_template_is_its_datas_json(
        tiny_engine, monkeypatch, grid, case_insensitive):
    """An input whose queries are all scored on their options, without packs (a bulk
    job's), is answered as JSON text filled into its query set's template: the same text,
    byte for byte, as its result's data dumped, over inputs of one set and of two."""
    queries = AS_GIVEN if grid else [AS_GIVEN[0], AS_GIVEN[1], AS_GIVEN[3]]
    if case_insensitive:   # multi-token options: none spelled otherwise, scored as given
        queries = [*queries, QUERIES[2]]
    scoring = {"queries": queries, "case_insensitive": case_insensitive}
    request = {"inputs": [{"id": "a", "messages": [{"content": NEWS}]},
                          {"id": 'b "%s"', "messages": [{"content": NEWS[:70]}]},
                          {"id": "c", "messages": [{"content": "Short."}],
                           "query_ids": ["odd"]}],
               "scoring": scoring}
    messages = {"messages": [{"role": "user", "content": NEWS}], "scoring": scoring}
    written = [tiny_engine.score(body) for body in (request, messages, request)]
    assert all(isinstance(r, jsonio.RawJSON) for w in written for r in w.plain()["results"])
    monkeypatch.setattr(respond, "_plain_result_json", as_data)
    built = [tiny_engine.score(body) for body in (request, messages)]
    for text, data in zip(written, [*built, built[0]], strict=True):
        assert not any(isinstance(r, jsonio.RawJSON) for r in data.plain()["results"])
        assert jsonio.dumps(text.plain()["results"]) == jsonio.dumps(data.plain()["results"])
        assert text.warnings == data.warnings and text.usage == data.usage
        assert text.results == data.results        # read back in-process, as models
        assert text._questions == data._questions == sum(
            len(q.combinations) for r in data.results for q in r.queries)
    assert any(w["code"] == "low_option_mass" for w in built[0].warnings)


def test_spellings_summed_for_a_whole_input_equal_those_summed_query_by_query(tiny_engine):
    """Options asked case-insensitively are summed over their spellings for all of an
    input's queries at once (a set of scored queries alone, engine/spellings.py) or one
    query's branch at a time (a set with an extraction query in it): the same bits, and
    the sums of the runner's spelled logprobs."""
    from spinf_worker.engine import spellings

    extraction = {"id": "month", "template": '\n\nQ: Which month?\nA: "{*}"', "max_tokens": 2}
    scored = [QUERIES[0], QUERIES[2], QUERIES[3]]
    alone, mixed = (tiny_engine.score({"text": NEWS, "scoring": {"queries": queries}})
                    for queries in (scored, [*scored, extraction]))
    assert isinstance(alone.plain()["results"][0], jsonio.RawJSON)
    assert not isinstance(mixed.plain()["results"][0], jsonio.RawJSON)
    assert alone.results[0].queries == mixed.results[0].queries[:3]
    # the sum itself: a branch of two options of two spellings each
    spelled = np.log(np.array([0.1, 0.2, 0.05, 0.15], dtype=np.float32))
    logprobs, probs, residual = spellings.summed(
        spelled, spellings.segments(np.array([0, 2]), 4), spellings.segments(np.array([0]), 2))
    assert logprobs.tolist() == pytest.approx([math.log(0.3), math.log(0.2)], rel=1e-6)
    assert probs.tolist() == pytest.approx([0.6, 0.4], rel=1e-6)
    assert residual.tolist() == pytest.approx([0.5], rel=1e-6)

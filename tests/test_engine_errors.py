"""Bad input raises a typed error with the hosted API's code, a clear message and the path of
the offending field; nothing is half-scored."""

from __future__ import annotations

import pytest

from spinf_worker.engine import Engine, EngineSettings
from spinf_worker.errors import (
    ContextLengthError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestTooLargeError,
)

YES_NO = [" yes", " no"]


def query(template="\n\nOK?{?}", options=YES_NO, **fields):
    return {"id": "q", "template": template, "options": options, **fields}


def request(*queries, text="Some content.", **extra):
    return {"text": text, "scoring": {"queries": list(queries) or [query()]}, **extra}


def inputs(*entries, queries=None):
    return {"inputs": [{"messages": [{"role": "user", "content": "Some content."}], **e}
                       for e in entries],
            "scoring": {"queries": [query()] if queries is None else queries}}


EXTRACT = {"id": "x", "template": 'A: "{*}"'}
Q0 = "scoring.queries.0"

BAD = [
    # (request, error class, code, param, a fragment of the message)
    (request(query(template="no slot")), InvalidRequestError, "invalid_template",
     f"{Q0}.template", "no scored slot"),
    (request(query(template="{?} and {?}")), InvalidRequestError, "invalid_template",
     f"{Q0}.template", "2 scored slots"),
    (request(query(template="Q{?} more")), InvalidRequestError, "invalid_template",
     f"{Q0}.template", "must end the template"),
    (request(query(template="Q{?", options=YES_NO)), InvalidRequestError, "invalid_template",
     f"{Q0}.template", "unclosed"),
    (request(query(template="{a}{b}{c}{d}{e}{f}{?}")), InvalidRequestError,
     "invalid_template", f"{Q0}.template", "6 placeholders"),
    (request(query(options=[])), InvalidRequestError, "too_many_options", f"{Q0}.options",
     None),
    (request(query(options=None)), InvalidRequestError, "missing_value", f"{Q0}.options",
     "needs options"),
    (request(query(options=[f" o{i}" for i in range(1001)])), InvalidRequestError,
     "too_many_options", f"{Q0}.options", "1,001 options"),
    (request(query(options=[" yes", " yes"])), InvalidRequestError, "duplicate_option",
     f"{Q0}.options.1", "same"),
    # case-insensitive (the default), " Yes" and "yes" score the same spellings
    (request(query(options=[" Yes", "yes"])), InvalidRequestError, "duplicate_option",
     f"{Q0}.options.1", "ignoring case"),
    (request(query(template="Is it {x}?{?}")), InvalidRequestError, "missing_value",
     f"{Q0}.combinations", "['x']"),
    (request(query(template="Is it {x}?{?}", combinations=[{"x": "a"}, {"y": "b"}])),
     InvalidRequestError, "unknown_placeholder", f"{Q0}.combinations.1", "'y'"),
    (request(query(template="Is it {x} {y}?{?}", combinations=[{"x": "a"}])),
     InvalidRequestError, "missing_value", f"{Q0}.combinations.0", "'y'"),
    (request(query(template="Is it {x}?{?}", combinations=[])), InvalidRequestError,
     "missing_value", f"{Q0}.combinations", "empty"),
    (request(query(template="Is it {x}?{?}", combinations="all")), InvalidRequestError,
     "missing_value", f"{Q0}.values", '"all" needs'),
    (request(query(template="Is it {x}?{?}", combinations="all", values={"x": []})),
     InvalidRequestError, "missing_value", f"{Q0}.values.x", "empty"),
    (request(query(template="Is it {x}?{?}", combinations="all",
                   values={"x": ["a"], "z": ["b"]})),
     InvalidRequestError, "unknown_placeholder", f"{Q0}.values", "'z'"),
    (request(query(template="{a} {b}?{?}", combinations="all",
                   values={"a": [str(i) for i in range(40)], "b": [str(i) for i in range(26)]})),
     InvalidRequestError, "too_many_combinations", f"{Q0}.combinations", "1,040"),
    (request(query(template="Is it {x}?{?}", combinations=[{"x": "v" * 257}])),
     InvalidRequestError, "invalid_field", f"{Q0}.combinations.0.x", "256"),
    (request(query(), query()), InvalidRequestError, "duplicate_id", "scoring.queries.1.id",
     "'q'"),
    (request(query(top_k=3)), InvalidRequestError, "invalid_field", f"{Q0}.top_k", "top_k"),
    (request(query(), {**EXTRACT, "options": YES_NO}), InvalidRequestError, "invalid_field",
     "scoring.queries.1.options", "options"),
    (request(query(), {**EXTRACT, "max_tokens": 65}), InvalidRequestError, "invalid_field",
     "scoring.queries.1.max_tokens", "between 1 and 64"),
    (request(query(), {**EXTRACT, "beam_width": 4}), InvalidRequestError, "invalid_field",
     "scoring.queries.1.beam_width", "unknown field"),
    (request(query(), {"id": "n", "template": "{n}", "generate": True}), InvalidRequestError,
     "invalid_field", "scoring.queries.1.generate", "{*}"),
    (request(*[{**EXTRACT, "id": f"x{i}"} for i in range(11)]), InvalidRequestError,
     "too_many_extractions", "scoring.queries", "11 extraction slots"),
    (request(query(template="{a}{?}", combinations="all",
                   values={"a": [str(i) for i in range(1000)]}),
             *[query(template="{a}{?}", id=f"q{k}", combinations=[{"a": str(i)}
                                                                   for i in range(1000)])
               for k in range(9)],
             {**query(), "id": "last"}),
     InvalidRequestError, "too_many_prompts", "scoring.queries", "10,001 prompts"),
    ({"scoring": {"queries": [query()]}}, InvalidRequestError, "invalid_field", "messages",
     "exactly one"),
    ({**request(), "messages": [{"content": "x"}]}, InvalidRequestError, "invalid_field",
     "messages", "exactly one"),
    ({"text": "x"}, InvalidRequestError, "empty_queries", "scoring.queries", "nothing to score"),
    (inputs({"id": "a"}, {"id": "a"}), InvalidRequestError, "duplicate_id", "inputs.1.id",
     "'a'"),
    (inputs({"id": "a"}, {"id": "b", "query_ids": ["q", "nope"]}), InvalidRequestError,
     "unknown_query_id", "inputs.1.query_ids.1", "'nope'"),
    (inputs({"id": "a", "queries": [query()]}), InvalidRequestError, "duplicate_id",
     "inputs.0.queries.0.id", "'q'"),
    (inputs({"id": "a", "query_ids": [], "queries": [query(id="own", options=["A", " a"])]}),
     InvalidRequestError, "duplicate_option", "inputs.0.queries.0.options.1", "same"),
    (inputs({"id": "a", "query_ids": []}), InvalidRequestError, "empty_queries", "inputs.0",
     "nothing to score"),
    (inputs({"id": "a"}, queries=[]), InvalidRequestError, "empty_queries", "inputs.0",
     "nothing to score"),
    (inputs({"id": ""}), InvalidRequestError, "invalid_field", "inputs.0.id", None),
    ({"inputs": [], "scoring": {"queries": [query()]}}, InvalidRequestError, "invalid_field",
     "inputs", None),
    (request(model="no-such/model"), ModelNotFoundError, "model_not_served", "model",
     "no-such/model"),
    (request(endpoint="e" * 129), InvalidRequestError, "invalid_field", "endpoint", None),
    ({"text": "x", "scoring": {"queries": [query()], "beam_width": 2}}, InvalidRequestError, "invalid_field", "scoring.beam_width", "unknown field"),
]


@pytest.mark.parametrize("bad, error, code, param, fragment", BAD,
                         ids=[f"{b[2]}-{b[3]}" for b in BAD])
def test_bad_requests(tiny_engine, bad, error, code, param, fragment):
    with pytest.raises(error) as info:
        tiny_engine.score(bad)
    assert (info.value.code, info.value.param) == (code, param), info.value.message
    if fragment is not None:
        assert fragment in info.value.message
    body = info.value.to_openai()["error"]
    assert body == {"type": "invalid_request", "code": code, "message": info.value.message,
                    "param": param}


def test_case_sensitive_options_may_differ_in_case_only(tiny_engine):
    response = tiny_engine.score({"text": "x", "scoring": {
        "case_insensitive": False, "queries": [query(options=[" Yes", " yes", "yes"])]}})
    texts = [o.text for o in response.results[0].queries[0].combinations[0].options]
    assert texts == [" Yes", " yes", "yes"]


def test_limits_at_their_edge_are_fine(tiny_engine):
    """The largest "all" grid and five placeholders are allowed."""
    grid = {"a": [str(i) for i in range(40)], "b": [str(i) for i in range(25)]}
    five = "{a}{b}{c}{d}{e}{?}"
    response = tiny_engine.score(request(
        query(template="{a} {b}?{?}", combinations="all", values=grid),
        query(id="five", template=five, combinations=[dict.fromkeys("abcde", "v")])))
    big, wide = response.results[0].queries
    assert len(big.combinations) == 1000 and big.combinations[-1].values == {"a": "39",
                                                                              "b": "24"}
    assert wide.combinations[0].values == dict.fromkeys("abcde", "v")


def test_combination_cap_is_configurable(tiny_dir):
    engine = Engine.load(str(tiny_dir), device="cpu", settings=EngineSettings(max_combinations=8))
    grid = {"a": [str(i) for i in range(3)], "b": [str(i) for i in range(3)]}
    with pytest.raises(InvalidRequestError) as info:
        engine.score(request(query(template="{a} {b}{?}", combinations="all", values=grid)))
    assert (info.value.code, info.value.param) == ("too_many_combinations", f"{Q0}.combinations")
    assert "9 combinations" in info.value.message and "at most 8" in info.value.message
    listed = [{"a": str(i)} for i in range(9)]
    with pytest.raises(InvalidRequestError) as info:
        engine.score(inputs({"id": "a", "query_ids": [], "queries": [
            query(template="{a}{?}", combinations=listed)]}))
    assert info.value.param == "inputs.0.queries.0.combinations"
    ok = engine.score(request(query(template="{a}{?}", combinations=listed[:8])))
    assert [c.values for c in ok.results[0].queries[0].combinations] == listed[:8]


def test_content_longer_than_context(tiny_engine):
    """Content within the 4,096-token limit whose questions run past the model's context."""
    limit = tiny_engine.config.max_position_embeddings
    text = "a " * (limit - 1)
    assert len(tiny_engine.presenter.encode(text)) <= 4096
    with pytest.raises(ContextLengthError) as info:
        tiny_engine.score(request(text=text))
    assert f"the model's context is {limit} tokens" in info.value.message
    assert (info.value.code, info.value.param) == ("content_too_long", "messages")


def test_content_over_the_token_limit_names_its_input(tiny_engine):
    with pytest.raises(InvalidRequestError) as info:
        tiny_engine.score({"inputs": [
            {"id": "short", "messages": [{"content": "Fine."}]},
            {"id": "long", "messages": [{"content": "word " * 60}]}],
            "scoring": {"queries": [query()]}, "limits": {"max_content_tokens": 50}})
    assert (info.value.code, info.value.param) == ("content_too_long", "inputs.1")
    assert "'long'" in info.value.message


def test_an_option_that_merges_with_the_template_end_is_option_boundary(default_engine):
    """Gemma's tokenizer writes ": yes" as ":", " yes": after a template ending in a space the
    option "yes" would be read as tokens the model never sees that way."""
    with pytest.raises(InvalidRequestError) as info:
        default_engine.score(request(query(template="\n\nRefund? Answer: {?}",
                                           options=["yes", "no"])))
    assert (info.value.code, info.value.param) == ("option_boundary", f"{Q0}.options.0")
    fine = default_engine.score(request(query(template="\n\nRefund? Answer:{?}")))
    assert [o.text for o in fine.results[0].queries[0].combinations[0].options] == YES_NO


def test_more_work_than_the_processed_token_limit_is_413(tiny_engine):
    body = inputs({"id": "a"}, {"id": "b"})
    one = tiny_engine.score({**body, "inputs": body["inputs"][:1]}).usage.processed_tokens
    with pytest.raises(RequestTooLargeError) as info:
        tiny_engine.score({**body, "limits": {"max_processed_tokens": one + 1}})
    assert (info.value.status, info.value.code) == (413, "request_too_large")
    assert tiny_engine.score({**body, "limits": {"max_processed_tokens": 2 * one}})


def test_the_server_sets_the_content_limit_and_a_request_may_only_lower_it(tiny_engine):
    long = {"text": "word " * 60, "scoring": {"queries": [query()]}}
    assert tiny_engine.score(long)                       # under the hosted 4,096
    strict = Engine(tiny_engine.checkpoint, device="cpu",
                    settings=EngineSettings(max_content_tokens=20))
    with pytest.raises(InvalidRequestError) as info:
        strict.score(long)
    assert info.value.code == "content_too_long" and "limit is 20" in info.value.message
    with pytest.raises(InvalidRequestError):             # a request's limits never raise it
        strict.score({**long, "limits": {"max_content_tokens": 4096}})
    assert strict.score({**long, "text": "word " * 5})


def test_batch_keeps_good_requests(tiny_engine):
    results = tiny_engine.score_batch([request(), request(query(options=[])),
                                       request(text="Other.")])
    assert isinstance(results[1], InvalidRequestError)
    assert results[0].results[0].queries[0].id == "q"
    assert results[2].results[0].queries[0].id == "q"


def test_a_bad_input_fails_its_whole_request(tiny_engine):
    bad = inputs({"id": "good"}, {"id": "bad", "query_ids": ["missing"]})
    good, failed = tiny_engine.score_batch([request(), bad])
    assert isinstance(failed, InvalidRequestError) and failed.param == "inputs.1.query_ids.0"
    assert [r.input_id for r in good.results] == ["0"]


def test_unknown_model_offline_is_clear(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as info:
        Engine.load("someone/not-a-real-model")
    assert "someone/not-a-real-model" in info.value.message

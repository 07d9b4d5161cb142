"""The request and response models: the hosted API's shapes, every validation failure an
InvalidRequestError with the hosted code and the dotted path of the offending field."""

import copy

import pytest

from spinf_worker.errors import InvalidRequestError
from spinf_worker.protocol import (
    MAX_QUERIES,
    Answer,
    ErrorResponse,
    ExtractedCombination,
    ExtractedQuery,
    GenerateSpec,
    InputResult,
    Message,
    OptionScore,
    ScoredCombination,
    ScoredQuery,
    ScoreRequest,
    ScoreResponse,
    TextPart,
    Usage,
)
from spinf_worker.templates import Placeholder, Slot

TOPIC = {"id": "topic",
         "template": "\n\nTopic (billing, technical, account, shipping, or cancellation):{?}",
         "options": [" billing", " technical", " account", " shipping", " cancellation"]}
REFUND = {"id": "refund", "template": "\n\nIs the customer asking for a refund?\nAnswer:{?}",
          "options": [" yes", " no"]}
MONTH = {"id": "month", "template": "\n\nQ: Which month was charged twice?\nA: \"{*}\""}

HOSTED_EXAMPLE = {
    "model": "google/gemma-3-270m",
    "messages": [{"role": "user", "content": "Customer support message:\nI was charged twice "
                                             "for September, please refund one of the charges."}],
    "scoring": {"queries": [TOPIC, REFUND, MONTH], "packs": [{"id": "spinf/moderation"}]},
    "endpoint": "support-triage",
}


def minimal(**changes):
    data = {"text": "doc", "scoring": {"queries": [copy.deepcopy(REFUND)]}}
    data.update(changes)
    return data


def with_query(**fields):
    return minimal(scoring={"queries": [{**REFUND, **fields}]})


def parse_error(data) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        ScoreRequest.parse(data)
    return caught.value


def many(inputs, queries=(REFUND, TOPIC)):
    return {"inputs": [{"messages": [{"content": "doc"}], **i} for i in inputs],
            "scoring": {"queries": [copy.deepcopy(q) for q in queries]}}


# ---- the hosted example ---------------------------------------------------------------------


def test_hosted_example_parses():
    request = ScoreRequest.parse(HOSTED_EXAMPLE)
    assert request.model == "google/gemma-3-270m"
    assert request.endpoint == "support-triage"
    assert [q.id for q in request.scoring.queries] == ["topic", "refund", "month"]
    assert request.scoring.queries[1].options == [" yes", " no"]
    assert request.scoring.packs[0].id == "spinf/moderation"
    assert request.scoring.packs[0].version is None
    [document] = request.documents()
    assert document.input_id == "0"
    assert [q.id for q in document.queries] == ["topic", "refund", "month"]
    assert document.messages[0].text().startswith("Customer support message:\nI was")
    month = request.scoring.queries[2]
    assert (month.slot_kind, month.kind, month.options) == ("*", "text", None)


def test_scoring_defaults():
    scoring = ScoreRequest.parse(minimal()).scoring
    assert (scoring.empty_floor, scoring.ignores_case, scoring.packs) == (True, True, None)
    assert scoring.case_insensitive is None   # unset: true, or the packs' rule
    query = scoring.queries[0]
    assert (query.empty_floor, query.combinations, query.values, query.group) == (
        None, None, None, None)


def test_parsed_template_is_kept_on_the_query():
    request = ScoreRequest.parse(with_query(template="Is {x} ok?{?}",
                                            combinations=[{"x": "a"}]))
    parts = request.scoring.queries[0].parsed_template.parts
    assert Placeholder("x") in parts and Slot("?") in parts


def test_parse_returns_an_already_parsed_request_unchanged():
    request = ScoreRequest.parse(minimal())
    assert ScoreRequest.parse(request) is request


# ---- content ---------------------------------------------------------------------------


def test_text_is_shorthand_for_one_user_message():
    [document] = ScoreRequest.parse(minimal(text="hello")).documents()
    assert [(m.role, m.text()) for m in document.messages] == [("user", "hello")]
    assert document.input_id == "0"


def test_messages_are_kept_in_order():
    request = ScoreRequest.parse(minimal(text=None, messages=[
        {"role": "system", "content": "be brief"}, {"content": "hi"}]))
    [document] = request.documents()
    assert [(m.role, m.text()) for m in document.messages] == [
        ("system", "be brief"), ("user", "hi")]


@pytest.mark.parametrize("content", [
    {"scoring": {"queries": [REFUND]}},
    minimal(messages=[{"role": "user", "content": "x"}]),
    minimal(text=None, messages=[{"content": "x"}], inputs=[{"id": "a", "messages": [
        {"content": "y"}]}]),
])
def test_exactly_one_content(content):
    error = parse_error(content)
    assert (error.param, error.code) == ("messages", "invalid_field")
    assert "exactly one of messages" in error.message


@pytest.mark.parametrize("field", ["messages", "inputs"])
def test_empty_content_lists(field):
    error = parse_error(minimal(text=None, **{field: []}))
    assert (error.param, error.code) == (field, "invalid_field")


def test_text_parts_are_joined():
    message = Message(role="user", content=[{"type": "text", "text": "a"},
                                            {"type": "text", "text": "b"}])
    assert isinstance(message.content[0], TextPart)
    assert message.text() == "ab"


@pytest.mark.parametrize(("part", "field"), [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
     "image_url.url"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
     "input_audio.data"),
])
def test_media_parts_that_are_no_media_are_refused_at_parse_time(part, field):
    """(Whether the served model reads media is the engine's to say: tests/test_media_*.)"""
    error = parse_error(minimal(text=None, messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, part]}]))
    assert (error.param, error.code) == (f"messages.0.content.1.{field}", "invalid_media")


def test_unknown_content_part_type_points_at_the_part():
    error = parse_error(minimal(text=None, messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "sound"}]}]))
    assert (error.param, error.code) == ("messages.0.content.1", "unsupported_content")
    assert "content part type" in error.message


def test_bad_text_part_points_at_its_field_without_union_labels():
    error = parse_error(minimal(text=None, messages=[
        {"role": "user", "content": [{"type": "text", "text": 5}]}]))
    assert error.param == "messages.0.content.0.text"


def test_bad_role():
    error = parse_error(minimal(text=None, messages=[{"role": "tool", "content": "x"}]))
    assert error.param == "messages.0.role"


@pytest.mark.parametrize(("endpoint", "ok"), [("e" * 128, True), ("e" * 129, False),
                                              ("", False)])
def test_endpoint_length(endpoint, ok):
    if ok:
        assert ScoreRequest.parse(minimal(endpoint=endpoint)).endpoint == endpoint
    else:
        assert parse_error(minimal(endpoint=endpoint)).param == "endpoint"


# ---- inputs ----------------------------------------------------------------------------


def test_each_input_asks_every_shared_query_by_default():
    documents = ScoreRequest.parse(many([{"id": "a"}, {"id": "b"}])).documents()
    assert [d.input_id for d in documents] == ["a", "b"]
    assert [[q.id for q in d.queries] for d in documents] == [["refund", "topic"]] * 2
    # the same list: one layout key for both
    assert documents[0].layout_key == documents[1].layout_key


def test_query_ids_pick_shared_queries_in_their_order_then_the_inputs_own():
    own = {**REFUND, "id": "own", "options": [" maybe", " no"]}
    documents = ScoreRequest.parse(many([
        {"id": "a", "query_ids": ["topic"]},
        {"id": "b", "query_ids": ["topic", "refund"], "queries": [own]},
        {"id": "c", "query_ids": [], "queries": [own]},
        {"id": "d", "queries": [own]}])).documents()
    assert [[q.id for q in d.queries] for d in documents] == [
        ["topic"], ["topic", "refund", "own"], ["own"], ["refund", "topic", "own"]]
    assert documents[2].queries[0].options == [" maybe", " no"]
    assert len({d.layout_key for d in documents}) == 4


def test_inputs_keep_their_parameters():
    [document] = ScoreRequest.parse(many([{"id": "a", "parameters": {
        "site": "forum", "age": 3, "strict": True}}])).documents()
    assert document.parameters == {"site": "forum", "age": 3, "strict": True}


@pytest.mark.parametrize(("inputs", "queries", "param", "code"), [
    ([{"id": "a"}, {"id": "a"}], (REFUND,), "inputs.1.id", "duplicate_id"),
    ([{"id": "a", "query_ids": ["refund", "nope"]}], (REFUND,), "inputs.0.query_ids.1",
     "unknown_query_id"),
    ([{"id": "a", "queries": [REFUND]}], (REFUND,), "inputs.0.queries.0.id", "duplicate_id"),
    ([{"id": "a", "query_ids": [], "queries": [REFUND, REFUND]}], (REFUND,),
     "inputs.0.queries.1.id", "duplicate_id"),
    ([{"id": "a", "query_ids": []}], (REFUND,), "inputs.0", "empty_queries"),
    ([{"id": "a"}], (), "inputs.0", "empty_queries"),
    ([{"id": "a", "query_ids": [], "queries": [{**REFUND, "options": [" no", "No"]}]}],
     (REFUND,), "inputs.0.queries.0.options.1", "duplicate_option"),
    ([{"id": "a", "queries": [{**REFUND, "id": "own", "options": []}]}], (REFUND,),
     "inputs.0.queries.0.options", "too_many_options"),
    ([{"id": ""}], (REFUND,), "inputs.0.id", "invalid_field"),
    ([{"id": "x" * 129}], (REFUND,), "inputs.0.id", "invalid_field"),
    ([{"id": "a", "messages": []}], (REFUND,), "inputs.0.messages", "invalid_field"),
    ([{"id": "a", "text": "doc"}], (REFUND,), "inputs.0.text", "invalid_field"),
    ([{"id": "a", "parameters": {"k": [1]}}], (REFUND,), "inputs.0.parameters.k",
     "invalid_field"),
])
def test_input_errors(inputs, queries, param, code):
    error = parse_error(many(inputs, queries))
    assert (error.param, error.code) == (param, code), error.message


def test_an_input_id_of_128_chars_is_fine():
    assert ScoreRequest.parse(many([{"id": "x" * 128}])).documents()[0].input_id == "x" * 128


def test_input_limits_count_each_inputs_queries():
    extraction = [{"id": f"x{i}", "template": "{n}"} for i in range(10)]
    request = many([{"id": "a", "query_ids": ["x0"], "queries": extraction[1:]},
                    {"id": "b"}], extraction)
    assert [len(d.queries) for d in ScoreRequest.parse(request).documents()] == [10, 10]
    over = many([{"id": "a"}, {"id": "b", "queries": [{"id": "more", "template": "{n}"}]}],
                extraction)
    error = parse_error(over)
    assert (error.param, error.code) == ("inputs.1", "too_many_extractions")


def test_a_request_may_lower_its_limits_never_raise_them():
    lowered = ScoreRequest.parse(minimal(limits={"max_options": 2}))
    assert lowered.effective_limits.max_options == 2
    raised = ScoreRequest.parse(minimal(limits={"max_prompts_per_input": 10**9}))
    assert raised.effective_limits.max_prompts_per_input == 10_000
    error = parse_error(many([{"id": "a", "query_ids": [], "queries": [TOPIC]}]) | {
        "limits": {"max_options": 2}})
    assert (error.param, error.code) == ("inputs.0.queries.0.options", "too_many_options")


# ---- queries ---------------------------------------------------------------------------


def test_duplicate_query_ids():
    error = parse_error(minimal(scoring={"queries": [REFUND, TOPIC, REFUND]}))
    assert error.param == "scoring.queries.2.id"
    assert "'refund' is used twice (queries 0 and 2)" in error.message
    assert error.code == "duplicate_id"


@pytest.mark.parametrize("query_id", ["", "x" * 129])
def test_query_id_length(query_id):
    assert parse_error(with_query(id=query_id)).param == "scoring.queries.0.id"


def test_query_id_of_128_chars_is_fine():
    ScoreRequest.parse(with_query(id="x" * 128))


@pytest.mark.parametrize("scoring", [{"queries": []}, {}, None])
def test_nothing_to_score(scoring):
    data = minimal(scoring=scoring) if scoring is not None else {"text": "doc"}
    error = parse_error(data)
    assert error.code == "empty_queries"
    assert "nothing to score" in error.message


def test_too_many_queries():
    queries = [{**REFUND, "id": f"q{i}"} for i in range(MAX_QUERIES + 1)]
    assert parse_error(minimal(scoring={"queries": queries})).param == "scoring.queries"


def test_scored_query_without_options():
    query = {k: v for k, v in REFUND.items() if k != "options"}
    error = parse_error(minimal(scoring={"queries": [query]}))
    assert (error.param, error.code) == ("scoring.queries.0.options", "missing_value")
    assert "needs options" in error.message


def test_empty_options():
    error = parse_error(with_query(options=[]))
    assert (error.param, error.code) == ("scoring.queries.0.options", "too_many_options")


def test_a_thousand_options_at_most():
    ScoreRequest.parse(with_query(options=[f" o{i}" for i in range(1000)]))
    error = parse_error(with_query(options=[f" o{i}" for i in range(1001)]))
    assert (error.param, error.code) == ("scoring.queries.0.options", "too_many_options")


def test_empty_option_text():
    error = parse_error(with_query(options=[" yes", ""]))
    assert error.param == "scoring.queries.0.options.1"
    assert "empty" in error.message


def test_duplicate_options():
    error = parse_error(with_query(options=[" yes", " no", " yes"]))
    assert error.message == "options 0 and 2 of query 'refund' are the same ignoring case"
    assert (error.param, error.code) == ("scoring.queries.0.options.2", "duplicate_option")


@pytest.mark.parametrize("options", [["yes", " yes"], [" yes", " Yes"], ["YES", "yes"]])
def test_options_differing_in_case_or_leading_space(options):
    """They score the same spellings case-insensitively (the default), so they are the same
    option there; case-sensitively they are distinct."""
    error = parse_error(with_query(options=options))
    assert (error.param, error.code) == ("scoring.queries.0.options.1", "duplicate_option")
    ScoreRequest.parse(minimal(scoring={"queries": [{**REFUND, "options": options}],
                                        "case_insensitive": False}))


def test_misspelt_query_field_fails_loudly():
    error = parse_error(with_query(option=[" yes"]))
    assert (error.param, error.code) == ("scoring.queries.0.option", "invalid_field")
    assert "unknown field" in error.message


@pytest.mark.parametrize("field", ["beam_width", "candidates"])
def test_the_old_search_fields_are_unknown(field):
    error = parse_error(minimal(scoring={"queries": [REFUND, {**MONTH, field: 4}]}))
    assert (error.param, error.code) == (f"scoring.queries.1.{field}", "invalid_field")


def test_misspelt_scoring_field_fails_loudly():
    error = parse_error(minimal(scoring={"queries": [REFUND], "empty_flor": False}))
    assert error.param == "scoring.empty_flor"


def test_unknown_top_level_fields_are_ignored():
    request = ScoreRequest.parse(minimal(user="u-1", temperature=0.0, custom_id="doc-7"))
    assert request.custom_id == "doc-7"
    assert not hasattr(request, "temperature")


def test_bad_template_fails_at_parse_time_with_its_path():
    error = parse_error(with_query(template="Answer: {x"))
    assert (error.param, error.code) == ("scoring.queries.0.template", "invalid_template")
    assert "unclosed '{' at offset 8" in error.message


def test_messages_quoting_braces_are_reported_verbatim():
    # pydantic fills "{key}" from an error's context into its copy of the message
    error = parse_error(with_query(template="{spinf_error}{?}",
                                   combinations=[{"spinf_error": "a", "other": "b"}]))
    assert error.message == "['other'] not in the template"


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"template": "In {region}?{?}"}, "combinations", "missing_value"),
    ({"template": "In {region}?{?}", "combinations": [{"regoin": "EU"}]}, "combinations.0",
     "unknown_placeholder"),
    ({"template": "In {region}?{?}", "combinations": "all", "values": {"regoin": ["EU"]}},
     "values", "unknown_placeholder"),
    ({"template": "In {region}?{?}", "combinations": "all"}, "values", "missing_value"),
    ({"template": "In {region}?{?}", "combinations": "all", "values": {"region": []}},
     "values.region", "missing_value"),
    ({"template": "In {region}?{?}", "values": {"region": ["EU"]}}, "values", "invalid_field"),
    ({"template": "In {region}?{?}", "combinations": "some"}, "combinations", "invalid_field"),
    ({"template": "In {region}?{?}", "combinations": {"region": "EU"}}, "combinations",
     "invalid_field"),
    ({"template": "In {region}?{?}", "combinations": [{"region": 3}]}, "combinations.0.region",
     "invalid_field"),
    ({"template": "{x}{?}", "combinations": "all",
      "values": {"x": [str(i) for i in range(1001)]}}, "combinations", "too_many_combinations"),
])
def test_combination_errors_point_into_the_query(fields, param, code):
    error = parse_error(with_query(**fields))
    assert (error.param, error.code) == (f"scoring.queries.0.{param}", code), error.message


def test_combinations_as_a_list_and_as_all():
    listed = ScoreRequest.parse(with_query(template="{a}-{b}{?}", combinations=[
        {"b": "2", "a": "1"}])).scoring.queries[0]
    assert [c.values for c in listed.combinations_list()] == [{"a": "1", "b": "2"}]
    grid = ScoreRequest.parse(with_query(template="{a}-{b}{?}", combinations="all", values={
        "a": ["1", "2"], "b": ["x"]})).scoring.queries[0]
    assert [c.prefix for c in grid.combinations_list()] == ["1-x", "2-x"]


def test_too_many_prompts_for_one_input():
    values = {"x": [str(i) for i in range(1000)]}
    queries = [{**REFUND, "id": f"q{k}", "template": "{x}{?}", "combinations": "all",
                "values": values} for k in range(10)]
    ScoreRequest.parse(minimal(scoring={"queries": queries}))
    error = parse_error(minimal(scoring={"queries": [*queries, REFUND]}))
    assert error.code == "too_many_prompts"
    assert "10,001 prompts" in error.message


def test_empty_floor_per_query():
    request = ScoreRequest.parse(minimal(scoring={"queries": [
        {**REFUND, "empty_floor": False}, TOPIC], "empty_floor": True}))
    assert [q.empty_floor for q in request.scoring.queries] == [False, None]


def test_body_that_is_not_an_object():
    error = parse_error(["not", "an", "object"])
    assert error.param is None
    assert "JSON object" in error.message


def test_packs_are_parsed_not_judged():
    request = ScoreRequest.parse(minimal(scoring={"queries": [REFUND], "packs": [
        {"id": "spinf/moderation", "version": "1.2", "context": "forum",
         "decision": {"mode": "max"}, "include_queries": True}]}))
    ref = request.scoring.packs[0]
    assert (ref.id, ref.version, ref.context, ref.include_queries) == (
        "spinf/moderation", "1.2", "forum", True)


def test_pack_errors():
    assert parse_error(minimal(scoring={"queries": [REFUND], "packs": [{"version": "1"}]})
                       ).param == "scoring.packs.0.id"
    error = parse_error(minimal(scoring={"queries": [REFUND], "packs": [
        {"id": "spinf/moderation"}, {"id": "spinf/moderation"}]}))
    assert (error.param, error.code) == ("scoring.packs.1.id", "duplicate_id")


def test_several_problems_report_the_first_and_count_the_rest():
    error = parse_error({"text": 5, "scoring": {"queries": [{"id": "a"}]}})
    assert error.param == "text"
    assert "more problem" in error.message


# ---- extraction queries ------------------------------------------------------------------


def extraction(template='\n\nQ: Which month?\nA: "{*}"', **fields):
    query = {"id": "x", "template": template, **fields}
    return minimal(scoring={"queries": [REFUND, query]})


def extraction_query(template='A: "{*}"', **fields) -> object:
    return ScoreRequest.parse(extraction(template, **fields)).scoring.queries[1]


@pytest.mark.parametrize(("template", "kind"), [('A: "{*}"', "text"), ("Total: {n}", "number"),
                                                ("Amount: {$}", "currency")])
def test_extraction_defaults(template, kind):
    query = extraction_query(template)
    assert (query.max_tokens, query.top_k, query.answers_kept) == (16, None, 5)
    assert query.options is None and query.generation is None and query.calibration is None
    assert query.kind == kind


def test_extraction_limits_are_inclusive():
    query = extraction_query("{$}", max_tokens=64, top_k=20)
    assert (query.max_tokens, query.answers_kept) == (64, 20)
    query = extraction_query("{$}", max_tokens=1, top_k=1)
    assert (query.max_tokens, query.answers_kept) == (1, 1)


@pytest.mark.parametrize(("fields", "param", "fragment"), [
    ({"max_tokens": 65}, "max_tokens", "max_tokens of query 'x' must be between 1 and 64"),
    ({"max_tokens": 0}, "max_tokens", "between 1 and 64"),
    ({"top_k": 21}, "top_k", "top_k must be between 1 and 20, got 21"),
    ({"top_k": 0}, "top_k", "between 1 and 20"),
])
def test_extraction_limits(fields, param, fragment):
    error = parse_error(extraction(**fields))
    assert (error.param, error.code) == (f"scoring.queries.1.{param}", "invalid_field")
    assert fragment in error.message


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", True), ("max_tokens", 3.0), ("max_tokens", "3"), ("top_k", "4"),
    ("top_k", 1.5),
])
def test_extraction_integers_are_strict(field, value):
    error = parse_error(extraction(**{field: value}))
    assert error.param == f"scoring.queries.1.{field}"
    assert "valid integer" in error.message


def test_calibration():
    query = extraction_query("{n}", calibration={"a": 2, "b": -0.5})
    assert (query.calibration.a, query.calibration.b) == (2, -0.5)
    assert extraction_query("{n}", calibration={}).calibration.a == 1.0
    error = parse_error(extraction("{n}", calibration={"c": 1}))
    assert error.param == "scoring.queries.1.calibration.c"
    error = parse_error(extraction("{n}", calibration={"a": "2"}))
    assert (error.param, error.code) == ("scoring.queries.1.calibration.a", "invalid_field")
    assert "(and" not in error.message   # one problem, not one per union branch


@pytest.mark.parametrize("template", ['A: "{*}"', "{n}", "{$}"])
def test_options_are_forbidden_for_extraction(template):
    error = parse_error(extraction(template, options=[" a", " b"]))
    assert (error.param, error.code) == ("scoring.queries.1.options", "invalid_field")
    assert "query 'x'" in error.message
    assert "'options' applies only to the scored slot {?}" in error.message


def test_empty_options_are_forbidden_for_extraction_too():
    assert parse_error(extraction(options=[])).param == "scoring.queries.1.options"


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 8), ("top_k", 2), ("calibration", {}), ("generate", True),
])
def test_extraction_fields_are_forbidden_for_scored_queries(field, value):
    error = parse_error(with_query(**{field: value}))
    assert (error.param, error.code) == (f"scoring.queries.0.{field}", "invalid_field")
    assert f"query 'refund' has the scored slot {{?}}; {field!r} applies only to " \
           "extraction slots" in error.message


def test_scored_queries_keep_extraction_fields_unset():
    query = ScoreRequest.parse(minimal()).scoring.queries[0]
    assert (query.max_tokens, query.top_k, query.calibration, query.generate) == (
        None, None, None, None)
    assert query.slot_kind == "?"


def test_extraction_query_with_combinations():
    query = extraction_query('Who paid {what}? "{*}"', combinations="all",
                             values={"what": ["rent", "tax"]})
    assert [c.values for c in query.combinations_list()] == [{"what": "rent"},
                                                               {"what": "tax"}]


@pytest.mark.parametrize(("template", "fragment"), [
    ("no slot", "template has no slot"), ("{n} or {$}", "template has 2 slots"),
    ('A: "{*}" {x}', "literal text"), ("{n} units", "must end the template")])
def test_template_errors_of_extraction_queries_at_parse_time(template, fragment):
    error = parse_error(extraction(template))
    assert (error.param, error.code) == ("scoring.queries.1.template", "invalid_template")
    assert fragment in error.message


def test_eleven_extraction_slots_are_too_many():
    queries = [{"id": f"x{i}", "template": "{n}"} for i in range(10)]
    ScoreRequest.parse(minimal(scoring={"queries": queries}))
    error = parse_error(minimal(scoring={"queries": [*queries, {"id": "y", "template": "{$}",
                                                                "combinations": None}]}))
    assert error.code == "too_many_extractions"
    grid = {"id": "g", "template": "{a} {n}", "combinations": "all",
            "values": {"a": [str(i) for i in range(11)]}}
    assert parse_error(minimal(scoring={"queries": [grid]})).code == "too_many_extractions"


def test_parsed_extraction_request_survives_a_dump_and_parse():
    # the API queues model_dump(mode="json", exclude_none=True) and the worker parses it again
    request = ScoreRequest.parse(minimal(scoring={"queries": [
        REFUND, {"id": "m", "template": "{n}", "top_k": 2, "calibration": {"a": 2}},
        {"id": "g", "template": "{*}", "generate": {"temperature": 0.5, "seed": 7}},
        {"id": "c", "template": "{a}{?}", "combinations": "all", "values": {"a": ["1"]},
         "options": [" x"], "empty_floor": False}]}))
    payload = request.model_dump(mode="json", exclude_none=True)
    assert payload["scoring"]["queries"][0] == REFUND  # no new keys
    again = ScoreRequest.parse(payload)
    assert again.scoring.queries == request.scoring.queries


# ---- generated slots ---------------------------------------------------------------------


def test_generate_true_is_the_defaults():
    query = extraction_query("{*}", generate=True)
    assert query.generation == GenerateSpec(temperature=0.0, top_p=1.0, top_k=None, seed=0, n=1)
    assert query.max_tokens == 16
    assert extraction_query("{*}", generate=False).generation is None


def test_generate_fields():
    query = extraction_query("{*}", max_tokens=100, generate={
        "temperature": 2, "top_p": 0.5, "top_k": 100, "seed": 3, "n": 6})
    spec = query.generation
    assert (query.max_tokens, spec.temperature, spec.top_p, spec.top_k, spec.seed, spec.n) == (
        100, 2, 0.5, 100, 3, 6)


@pytest.mark.parametrize("template", ["{n}", "{$}"])
def test_generate_only_with_the_text_slot(template):
    error = parse_error(extraction(template, generate=True))
    assert (error.param, error.code) == ("scoring.queries.1.generate", "invalid_field")
    assert "applies only to the text slot {*}" in error.message


@pytest.mark.parametrize("field, value", [("top_k", 2), ("calibration", {"a": 1})])
def test_search_fields_do_not_apply_to_generated_slots(field, value):
    error = parse_error(extraction("{*}", generate=True, **{field: value}))
    assert (error.param, error.code) == (f"scoring.queries.1.{field}", "invalid_field")
    assert "generated slot" in error.message


def test_a_generated_slot_may_decode_100_tokens():
    assert extraction_query("{*}", generate=True, max_tokens=100).max_tokens == 100
    error = parse_error(extraction("{*}", generate=True, max_tokens=101))
    assert (error.param, error.code) == ("scoring.queries.1.max_tokens", "invalid_field")


@pytest.mark.parametrize(("generate", "param", "fragment"), [
    ({"temperature": 2.01}, "temperature", "temperature must be between 0.0 and 2.0"),
    ({"temperature": -0.1}, "temperature", "between 0.0 and 2.0"),
    ({"temperature": float("nan")}, "temperature", "between 0.0 and 2.0"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_k": 0}, "top_k", "between 1 and 100"),
    ({"top_k": 101}, "top_k", "between 1 and 100"),
    ({"n": 7}, "n", "n must be between 1 and 6"),
    ({"n": 0}, "n", "between 1 and 6"),
    ({"seed": -1}, "seed", "seed must be between 0 and"),
    ({"seed": 2**31}, "seed", "seed must be between 0 and"),
    ({"stop": ["\n"]}, "stop", "unknown field"),
    ({"max_tokens": 8}, "max_tokens", "unknown field"),
    ({"n": "2"}, "n", "valid integer"),
    ({"temperature": True}, "temperature", "valid number"),
])
def test_generate_limits(generate, param, fragment):
    error = parse_error(extraction("{*}", generate=generate))
    assert error.param == f"scoring.queries.1.generate.{param}"
    assert error.code == "invalid_field"
    assert fragment in error.message


def test_a_repeated_scoring_block_is_validated_once_and_shared():
    scoring = {"queries": [{"id": "q", "template": "Is it news? {?}", "options": [" Yes", " No"]}]}
    first = ScoreRequest.parse({"text": "one", "scoring": scoring})
    second = ScoreRequest.parse({"text": "two", "scoring": copy.deepcopy(scoring)})
    assert second.scoring is first.scoring and second.text == "two"
    with pytest.raises(InvalidRequestError) as caught:   # the rest is still checked
        ScoreRequest.parse({"scoring": scoring})
    assert caught.value.param == "messages"
    changed = copy.deepcopy(scoring)
    changed["queries"][0]["options"] = []
    with pytest.raises(InvalidRequestError) as caught:   # another block is checked anew
        ScoreRequest.parse({"text": "three", "scoring": changed})
    assert caught.value.param == "scoring.queries.0.options"


# ---- responses -------------------------------------------------------------------------


def scored_combination(floor=True):
    return ScoredCombination(values={}, residual=0.44, floor_residual=0.5 if floor else None,
                             options=[
        OptionScore(text=" yes", logprob=-0.9, p=0.72, floor_p=0.6 if floor else None),
        OptionScore(text=" no", logprob=-1.86, p=0.28, floor_p=0.4 if floor else None)])


def extracted_combination():
    return ExtractedCombination(values={"who": "Ann"}, mass=0.95, answers=[
        Answer(text="$1,284.50", p=0.7, value=1284.5, currency="USD"),
        Answer(text="12", p=0.1, value=12.0), Answer(text="September", p=0.05)])


def usage():
    return Usage(prompt_tokens=10, completion_tokens=2, total_tokens=12,
                 prompt_tokens_details={"content_tokens": 6}, inputs=1,
                 content={"tokens": 6}, scoring={"queries": 1}, processed_tokens=12)


def response(*queries, endpoint=None):
    return ScoreResponse(
        id="scr_01KBE6Z4X1M8P9QRSTVWXYZ012", created=1764500000, model="m",
        endpoint=endpoint, system_fingerprint="fp_0123456789", usage=usage(),
        results=[InputResult(input_id="0", queries=list(queries))])


def test_response_serialises_in_the_hosted_shape():
    dumped = response(ScoredQuery(id="refund", combinations=[scored_combination()]),
                      endpoint="triage").model_dump(mode="json")
    assert list(dumped) == ["id", "object", "created", "model", "endpoint",
                            "system_fingerprint", "results", "warnings", "usage", "timing"]
    assert dumped["object"] == "score" and dumped["warnings"] == []
    assert dumped["results"] == [{"input_id": "0", "queries": [{"id": "refund", "combinations": [
        {"values": {}, "options": [
            {"text": " yes", "logprob": -0.9, "p": 0.72, "floor_p": 0.6},
            {"text": " no", "logprob": -1.86, "p": 0.28, "floor_p": 0.4}],
         "residual": 0.44, "floor_residual": 0.5}]}]}]
    assert dumped["usage"]["billed_tokens"] == 0
    assert set(dumped["timing"]) >= {"wall_ms", "queue_ms", "compile_ms", "score_ms",
                                     "gpu_busy_ms"}


def test_without_a_floor_the_floor_fields_are_null_not_absent():
    dumped = scored_combination(floor=False).model_dump(mode="json")
    assert dumped["floor_residual"] is None
    assert [o["floor_p"] for o in dumped["options"]] == [None, None]


def test_endpoint_is_left_out_when_not_sent():
    assert "endpoint" not in response().model_dump(mode="json")


def test_extraction_results_drop_unset_fields():
    query = ExtractedQuery(id="x", kind="currency", combinations=[extracted_combination()])
    assert query.model_dump(mode="json") == {"id": "x", "kind": "currency", "combinations": [
        {"values": {"who": "Ann"}, "answers": [
            {"text": "$1,284.50", "p": 0.7, "value": 1284.5, "currency": "USD"},
            {"text": "12", "p": 0.1, "value": 12.0}, {"text": "September", "p": 0.05}],
         "mass": 0.95}]}
    generated = ExtractedQuery(id="g", kind="text", generate=True, combinations=[
        ExtractedCombination(values={}, answers=[Answer(text="Sept", finish="stop")])])
    assert generated.model_dump(mode="json") == {"id": "g", "kind": "text", "generate": True,
                                                 "combinations": [{"values": {}, "answers": [
                                                     {"text": "Sept", "finish": "stop"}]}]}


def test_responses_round_trip_through_json():
    original = response(ScoredQuery(id="q", combinations=[scored_combination()]),
                        ExtractedQuery(id="x", kind="currency",
                                       combinations=[extracted_combination()]))
    again = ScoreResponse.model_validate_json(original.model_dump_json())
    assert again == original
    scored, extracted = again.results[0].queries
    assert isinstance(scored, ScoredQuery) and isinstance(extracted, ExtractedQuery)


def test_error_response_matches_the_hosted_shape():
    error = InvalidRequestError("bad", param="scoring.queries.0.options", code="duplicate_option")
    assert ErrorResponse.from_error(error).model_dump() == error.to_openai()


def test_ulids_sort_by_time_and_differ_in_a_forked_child():
    """Response and request ids: 26 Crockford digits, later ones sorting after earlier ones
    (by the millisecond), and a forked process (uvicorn's workers) making its own, not its
    parent's next ones."""
    import os
    import time

    from spinf_worker.ids import new_ulid

    first = new_ulid()
    time.sleep(0.002)
    made = [new_ulid() for _ in range(1000)]
    assert len(set(made)) == 1000 and all(len(u) == 26 for u in made)
    assert first < min(made)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, "".join(new_ulid() for _ in range(4)).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(write)
    child = os.read(read, 26 * 4).decode()
    os.close(read)
    parent = "".join(new_ulid() for _ in range(4))
    # the random 80 bits: the last 16 digits (the time's may differ by a millisecond alone)
    assert {child[k + 10:k + 26] for k in range(0, 104, 26)}.isdisjoint(
        {parent[k + 10:k + 26] for k in range(0, 104, 26)})


def test_a_block_read_by_orjson_is_keyed_by_orjson_text_with_the_same_request():
    """A body the API read with orjson keys its scoring block by orjson's text (faster than
    the json module's); the request is the one a plain parse gives, and a bad block fails
    the same way."""
    import orjson

    body = orjson.loads(orjson.dumps(extraction("{*}", generate={"temperature": 0.7})))
    body["scoring"]["queries"][0]["template"] = "Q: ¿Qué? 日本 {?}"
    assert ScoreRequest.parse(body, read_by_orjson=True) == ScoreRequest.parse(
        copy.deepcopy(body))
    bad = orjson.loads(orjson.dumps(extraction("{*}", generate={"temperature": 2.5})))
    for flag in (True, False):
        with pytest.raises(InvalidRequestError) as caught:
            ScoreRequest.parse(copy.deepcopy(bad), read_by_orjson=flag)
        assert caught.value.param == "scoring.queries.1.generate.temperature"
    # deeper than orjson writes (255 levels) or json can (its recursion limit): validation
    # names the field, as without the flag
    deep = orjson.loads('{"text": "x", "scoring": {"queries": ' + "[" * 1000 + "]" * 1000 + "}}")
    with pytest.raises(InvalidRequestError):
        ScoreRequest.parse(deep, read_by_orjson=True)

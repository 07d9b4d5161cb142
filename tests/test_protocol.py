import copy

import pytest

from spinf_worker.errors import InvalidRequestError
from spinf_worker.protocol import (
    DEFAULT_MAX_COMBINATIONS,
    MAX_QUERIES,
    AmountValue,
    Candidate,
    CombinationScore,
    ErrorResponse,
    GenerateSpec,
    Message,
    OptionScore,
    QueryScore,
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

SPEC_EXAMPLE = {
    "model": "google/gemma-3-270m",
    "messages": [{"role": "user", "content": "Customer support message:\nI was charged twice "
                                             "for September, please refund one of the charges."}],
    "scoring": {"queries": [TOPIC, REFUND, MONTH]},
    "packs": [{"id": "spinf/moderation"}],
}


def spec_request_without_extraction():
    data = copy.deepcopy(SPEC_EXAMPLE)
    data["scoring"]["queries"] = data["scoring"]["queries"][:2]
    return data


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


# ---- the SPEC example ------------------------------------------------------------------


def test_spec_example_parses_without_the_extraction_query():
    request = ScoreRequest.parse(spec_request_without_extraction())
    assert request.model == "google/gemma-3-270m"
    assert [q.id for q in request.scoring.queries] == ["topic", "refund"]
    assert request.scoring.queries[1].options == [" yes", " no"]
    assert request.packs[0].id == "spinf/moderation"
    assert request.packs[0].version is None
    assert request.content_messages()[0].text().startswith("Customer support message:\nI was")


def test_spec_example_parses_with_its_extraction_query():
    request = ScoreRequest.parse(SPEC_EXAMPLE)
    month = request.scoring.queries[2]
    assert month.id == "month"
    assert month.options is None
    assert month.slot_kind == "*"
    assert (month.max_tokens, month.beam_width, month.candidates, month.generate) == (
        32, 4, 4, None)


def test_parsed_template_is_kept_on_the_query():
    request = ScoreRequest.parse(with_query(template="Is {x} ok?{?}", values={"x": ["a"]}))
    parts = request.scoring.queries[0].parsed_template.parts
    assert Placeholder("x") in parts and Slot("?") in parts


def test_parse_returns_an_already_parsed_request_unchanged():
    request = ScoreRequest.parse(minimal())
    assert ScoreRequest.parse(request) is request


# ---- content ---------------------------------------------------------------------------


def test_text_is_shorthand_for_one_user_message():
    messages = ScoreRequest.parse(minimal(text="hello")).content_messages()
    assert [(m.role, m.text()) for m in messages] == [("user", "hello")]


def test_messages_are_returned_in_order():
    request = ScoreRequest.parse(minimal(text=None, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]))
    assert [(m.role, m.text()) for m in request.content_messages()] == [
        ("system", "be brief"), ("user", "hi")]


def test_neither_messages_nor_text():
    error = parse_error({"scoring": minimal()["scoring"]})
    assert error.param == "messages"
    assert "'messages' or 'text'" in error.message


def test_both_messages_and_text():
    error = parse_error(minimal(messages=[{"role": "user", "content": "x"}]))
    assert error.param == "text"
    assert "not both" in error.message


def test_empty_messages():
    error = parse_error(minimal(text=None, messages=[]))
    assert error.param == "messages"
    assert error.message == "messages must not be empty"


def test_text_parts_are_joined():
    message = Message(role="user", content=[{"type": "text", "text": "a"},
                                            {"type": "text", "text": "b"}])
    assert isinstance(message.content[0], TextPart)
    assert message.text() == "ab"


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
])
def test_media_parts_parse_but_are_not_readable_as_text(part):
    message = Message(role="user", content=[{"type": "text", "text": "a"}, part])
    with pytest.raises(InvalidRequestError) as caught:
        message.text(param="messages.0.content")
    assert caught.value.message == "this model reads text only"
    assert caught.value.code == "unsupported_content"
    assert caught.value.param == "messages.0.content"


def test_unknown_content_part_type_points_at_the_part():
    error = parse_error(minimal(text=None, messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "video"}]}]))
    assert error.param == "messages.0.content.1"
    assert "content part type" in error.message


def test_bad_text_part_points_at_its_field_without_union_labels():
    error = parse_error(minimal(text=None, messages=[
        {"role": "user", "content": [{"type": "text", "text": 5}]}]))
    assert error.param == "messages.0.content.0.text"


def test_bad_role():
    error = parse_error(minimal(text=None, messages=[{"role": "tool", "content": "x"}]))
    assert error.param == "messages.0.role"


# ---- queries ---------------------------------------------------------------------------


def test_duplicate_query_ids():
    error = parse_error(minimal(scoring={"queries": [REFUND, TOPIC, REFUND]}))
    assert error.param == "scoring.queries.2.id"
    assert "duplicate query id 'refund'" in error.message
    assert error.code == "duplicate_query_id"


@pytest.mark.parametrize("query_id", ["", "x" * 129])
def test_query_id_length(query_id):
    assert parse_error(with_query(id=query_id)).param == "scoring.queries.0.id"


def test_query_id_of_128_chars_is_fine():
    ScoreRequest.parse(with_query(id="x" * 128))


def test_no_queries():
    assert parse_error(minimal(scoring={"queries": []})).param == "scoring.queries"


def test_too_many_queries():
    queries = [{**REFUND, "id": f"q{i}"} for i in range(MAX_QUERIES + 1)]
    assert parse_error(minimal(scoring={"queries": queries})).param == "scoring.queries"


def test_scored_query_without_options():
    query = {k: v for k, v in REFUND.items() if k != "options"}
    error = parse_error(minimal(scoring={"queries": [query]}))
    assert error.param == "scoring.queries.0.options"
    assert "needs options" in error.message


def test_empty_options():
    assert parse_error(with_query(options=[])).param == "scoring.queries.0.options"


def test_empty_option_text():
    error = parse_error(with_query(options=[" yes", ""]))
    assert error.param == "scoring.queries.0.options.1"
    assert "empty" in error.message


def test_duplicate_options():
    error = parse_error(with_query(options=[" yes", " no", " yes"]))
    assert error.message == "duplicate option ' yes' in query 'refund'"
    assert error.param == "scoring.queries.0.options.2"


def test_options_differing_only_in_whitespace_are_distinct():
    ScoreRequest.parse(with_query(options=["yes", " yes"]))


def test_misspelt_query_field_fails_loudly():
    error = parse_error(with_query(option=[" yes"]))
    assert error.param == "scoring.queries.0.option"
    assert "unknown field" in error.message


def test_unknown_top_level_fields_are_ignored():
    request = ScoreRequest.parse(minimal(user="u-1", temperature=0.0, custom_id="doc-7"))
    assert request.custom_id == "doc-7"
    assert not hasattr(request, "temperature")


def test_bad_template_fails_at_parse_time_with_its_path():
    error = parse_error(with_query(template="Answer: {x"))
    assert error.param == "scoring.queries.0.template"
    assert "unclosed '{' at offset 8" in error.message


def test_messages_quoting_braces_are_reported_verbatim():
    # pydantic fills "{key}" from an error's context into its copy of the message
    error = parse_error(with_query(template="{spinf_error}{?}"))
    assert error.message == "placeholder {spinf_error} has no values"


def test_values_errors_point_into_values():
    error = parse_error(with_query(template="In {region}?{?}", values={"regoin": ["EU"]}))
    assert error.param == "scoring.queries.0.values.regoin"
    error = parse_error(with_query(template="In {region}?{?}"))
    assert error.param == "scoring.queries.0.values.region"
    assert error.message == "placeholder {region} has no values"


def test_grid_cap_applies_at_parse_time():
    many = [str(i) for i in range(DEFAULT_MAX_COMBINATIONS + 1)]
    error = parse_error(with_query(template="{x}{?}", values={"x": many}))
    assert error.code == "grid_too_large"
    assert error.param == "scoring.queries.0.values"


def test_missing_scoring():
    error = parse_error({"text": "doc"})
    assert error.param == "scoring.queries"
    assert "nothing to score" in error.message


def test_body_that_is_not_an_object():
    error = parse_error(["not", "an", "object"])
    assert error.param is None
    assert "JSON object" in error.message


def test_packs_are_parsed_not_judged():
    request = ScoreRequest.parse(minimal(packs=[
        {"id": "spinf/moderation", "version": "1.2", "categories": ["spam"]}]))
    assert request.packs[0].categories == ["spam"]


def test_pack_without_id():
    assert parse_error(minimal(packs=[{"version": "1"}])).param == "packs.0.id"


def test_several_problems_report_the_first_and_count_the_rest():
    error = parse_error({"text": 5, "scoring": {"queries": [{"id": "a"}]}})
    assert error.param == "text"
    assert "more problem" in error.message


# ---- responses -------------------------------------------------------------------------


def test_response_serialises_in_the_spec_shape():
    response = ScoreResponse(
        id="score-1", created=1764500000, model="m", system_fingerprint="fp",
        usage=Usage(prompt_tokens=10, scored_tokens=4, total_tokens=14),
        queries=[QueryScore(id="refund", combinations=[CombinationScore(
            values={}, residual=0.44, options=[
                OptionScore(text=" yes", logprob=-0.9, p=0.72, floor_p=0.6),
                OptionScore(text=" no", logprob=-1.86, p=0.28, floor_p=0.4)])])])
    dumped = response.model_dump()
    assert dumped["object"] == "score"
    assert dumped["packs"] == []
    assert dumped["queries"][0]["combinations"][0]["options"][0] == {
        "text": " yes", "logprob": -0.9, "p": 0.72, "floor_p": 0.6}


def test_error_response_matches_the_openai_shape():
    error = InvalidRequestError("bad", param="scoring.queries.0.options", code="duplicate_option")
    assert ErrorResponse.from_error(error).model_dump() == error.to_openai()


def scored_combination():
    return CombinationScore(values={}, residual=0.44, options=[
        OptionScore(text=" yes", logprob=-0.9, p=0.72, floor_p=0.6),
        OptionScore(text=" no", logprob=-1.86, p=0.28, floor_p=0.4)])


def extraction_combination():
    return CombinationScore(values={"who": "Ann"}, candidates=[
        Candidate(text="$1,284.50", logprob=-0.4, p=0.7,
                  value=AmountValue(amount=1284.5, currency="USD")),
        Candidate(text="1,284", logprob=-1.6, p=0.2, value=AmountValue(amount=1284.0,
                                                                        currency=None)),
        Candidate(text="12", logprob=-2.0, p=0.1, value=12),
        Candidate(text="September", logprob=-2.5, p=0.05)])


def full_response(*combinations):
    return ScoreResponse(
        id="score-1", created=1764500000, model="m", system_fingerprint="fp",
        usage=Usage(prompt_tokens=10, scored_tokens=4, total_tokens=14),
        queries=[QueryScore(id="q", combinations=list(combinations))])


@pytest.mark.parametrize("exclude_none", [False, True])
def test_scored_combinations_keep_exactly_their_keys(exclude_none):
    dumped = scored_combination().model_dump(exclude_none=exclude_none)
    assert dumped == {"values": {}, "residual": 0.44, "options": [
        {"text": " yes", "logprob": -0.9, "p": 0.72, "floor_p": 0.6},
        {"text": " no", "logprob": -1.86, "p": 0.28, "floor_p": 0.4}]}
    assert list(dumped) == ["values", "options", "residual"]


def test_scored_response_json_is_unchanged():
    response = full_response(scored_combination())
    assert response.model_dump_json() == (
        '{"id":"score-1","object":"score","created":1764500000,"model":"m",'
        '"system_fingerprint":"fp","usage":{"prompt_tokens":10,"scored_tokens":4,'
        '"total_tokens":14},"queries":[{"id":"q","combinations":[{"values":{},"options":['
        '{"text":" yes","logprob":-0.9,"p":0.72,"floor_p":0.6},'
        '{"text":" no","logprob":-1.86,"p":0.28,"floor_p":0.4}],"residual":0.44}]}],'
        '"packs":[]}')
    assert response.model_dump(mode="json") == response.model_dump(mode="json",
                                                                    exclude_none=True)


@pytest.mark.parametrize("exclude_none", [False, True])
def test_extraction_combination_shape(exclude_none):
    dumped = extraction_combination().model_dump(mode="json", exclude_none=exclude_none)
    assert dumped == {"values": {"who": "Ann"}, "options": [], "candidates": [
        {"text": "$1,284.50", "logprob": -0.4, "p": 0.7,
         "value": {"amount": 1284.5, "currency": "USD"}},
        {"text": "1,284", "logprob": -1.6, "p": 0.2,
         "value": {"amount": 1284.0, "currency": None}},
        {"text": "12", "logprob": -2.0, "p": 0.1, "value": 12},
        {"text": "September", "logprob": -2.5, "p": 0.05}]}


def test_responses_round_trip_through_json():
    response = full_response(scored_combination(), extraction_combination())
    again = ScoreResponse.model_validate_json(response.model_dump_json())
    assert again == response
    candidates = again.queries[0].combinations[1].candidates
    assert isinstance(candidates[0].value, AmountValue)
    assert type(candidates[2].value) is int
    assert again.queries[0].combinations[0].candidates is None


# ---- extraction queries ------------------------------------------------------------------


def extraction(template='\n\nQ: Which month?\nA: "{*}"', **fields):
    query = {"id": "x", "template": template, **fields}
    return minimal(scoring={"queries": [REFUND, query]})


def extraction_query(template='A: "{*}"', **fields) -> object:
    return ScoreRequest.parse(extraction(template, **fields)).scoring.queries[1]


@pytest.mark.parametrize("template", ['A: "{*}"', "Total: {n}\n", "Amount: {$}"])
def test_extraction_defaults(template):
    query = extraction_query(template)
    assert (query.max_tokens, query.beam_width, query.candidates) == (32, 4, 4)
    assert query.options is None and query.generate is None


def test_candidates_default_to_the_beam_width():
    query = extraction_query("{n}", beam_width=8)
    assert (query.beam_width, query.candidates) == (8, 8)


def test_extraction_limits_are_inclusive():
    query = extraction_query("{$}", max_tokens=256, beam_width=16, candidates=16)
    assert (query.max_tokens, query.beam_width, query.candidates) == (256, 16, 16)
    query = extraction_query("{$}", max_tokens=1, beam_width=1, candidates=1)
    assert (query.max_tokens, query.beam_width, query.candidates) == (1, 1, 1)


@pytest.mark.parametrize(("fields", "param", "fragment"), [
    ({"max_tokens": 257}, "max_tokens", "max_tokens of query 'x' must be between 1 and 256, "
                                        "got 257"),
    ({"max_tokens": 0}, "max_tokens", "between 1 and 256"),
    ({"beam_width": 17}, "beam_width", "beam_width of query 'x' must be between 1 and 16"),
    ({"beam_width": 0}, "beam_width", "between 1 and 16"),
    ({"candidates": 5}, "candidates", "between 1 and beam_width (4), got 5"),
    ({"beam_width": 2, "candidates": 3}, "candidates", "beam_width (2), got 3"),
    ({"candidates": 0}, "candidates", "got 0"),
])
def test_extraction_limits(fields, param, fragment):
    error = parse_error(extraction(**fields))
    assert error.param == f"scoring.queries.1.{param}"
    assert fragment in error.message
    assert error.code == "value_out_of_range"


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", True), ("max_tokens", 3.0), ("max_tokens", "3"), ("beam_width", "4"),
    ("candidates", 1.5),
])
def test_extraction_integers_are_strict(field, value):
    error = parse_error(extraction(**{field: value}))
    assert error.param == f"scoring.queries.1.{field}"
    assert "valid integer" in error.message


@pytest.mark.parametrize("template", ['A: "{*}"', "{n}", "{$}"])
def test_options_are_forbidden_for_extraction(template):
    error = parse_error(extraction(template, options=[" a", " b"]))
    assert error.param == "scoring.queries.1.options"
    assert error.code == "field_not_allowed"
    assert "query 'x'" in error.message
    assert "'options' applies only to the scored slot {?}" in error.message


def test_empty_options_are_forbidden_for_extraction_too():
    assert parse_error(extraction(options=[])).param == "scoring.queries.1.options"


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 8), ("beam_width", 2), ("candidates", 1), ("generate", {}),
])
def test_extraction_fields_are_forbidden_for_scored_queries(field, value):
    error = parse_error(with_query(**{field: value}))
    assert error.param == f"scoring.queries.0.{field}"
    assert error.code == "field_not_allowed"
    assert f"query 'refund' has the scored slot {{?}}; {field!r} applies only to " \
           "extraction slots" in error.message


def test_scored_queries_keep_extraction_fields_unset():
    query = ScoreRequest.parse(minimal()).scoring.queries[0]
    assert (query.max_tokens, query.beam_width, query.candidates, query.generate) == (
        None, None, None, None)
    assert query.slot_kind == "?"


def test_extraction_query_with_values():
    query = extraction_query('Who paid {what}? "{*}"', values={"what": ["rent", "tax"]})
    assert query.values == {"what": ["rent", "tax"]}


def test_placeholder_after_extraction_slot_fails_at_parse_time():
    error = parse_error(extraction('A: "{*}" {x}', values={"x": ["a"]}))
    assert error.param == "scoring.queries.1.template"
    assert error.code == "invalid_template"


@pytest.mark.parametrize(("template", "fragment"), [
    ("no slot", "template has no slot"), ("{n} or {$}", "template has 2 slots")])
def test_slot_count_errors_at_parse_time(template, fragment):
    error = parse_error(extraction(template))
    assert error.param == "scoring.queries.1.template"
    assert fragment in error.message


def test_parsed_extraction_request_survives_a_dump_and_parse():
    # the API queues model_dump(mode="json", exclude_none=True) and the worker parses it again
    request = ScoreRequest.parse(minimal(scoring={"queries": [
        REFUND, {"id": "m", "template": "{n}", "beam_width": 2},
        {"id": "g", "template": "{*}", "generate": {"stop": ["\n"], "seed": 7}}]}))
    payload = request.model_dump(mode="json", exclude_none=True)
    assert payload["scoring"]["queries"][0] == {**REFUND, "values": {}}  # no new keys
    again = ScoreRequest.parse(payload)
    assert again.scoring.queries == request.scoring.queries


# ---- generated slots ---------------------------------------------------------------------


def test_generate_defaults():
    query = extraction_query("{*}", generate={})
    assert query.generate == GenerateSpec(max_tokens=64, stop=[], temperature=0.0, seed=None)
    assert (query.max_tokens, query.beam_width, query.candidates) == (None, None, None)


def test_generate_fields():
    spec = extraction_query("{*}", generate={"max_tokens": 512, "stop": ["\n", "."],
                                              "temperature": 2, "seed": 0}).generate
    assert (spec.max_tokens, spec.stop, spec.temperature, spec.seed) == (512, ["\n", "."],
                                                                         2.0, 0)


@pytest.mark.parametrize("template", ["{n}", "{$}"])
def test_generate_only_with_span_slots(template):
    error = parse_error(extraction(template, generate={}))
    assert error.param == "scoring.queries.1.generate"
    assert error.code == "field_not_allowed"
    assert "applies only to the span slot {*}" in error.message


@pytest.mark.parametrize("field", ["max_tokens", "beam_width", "candidates"])
def test_search_fields_do_not_apply_to_generated_slots(field):
    error = parse_error(extraction("{*}", generate={}, **{field: 1}))
    assert error.param == f"scoring.queries.1.{field}"
    assert error.code == "field_not_allowed"
    assert "generated slot" in error.message


@pytest.mark.parametrize(("generate", "param", "fragment"), [
    ({"max_tokens": 513}, "max_tokens", "max_tokens must be between 1 and 512, got 513"),
    ({"max_tokens": 0}, "max_tokens", "between 1 and 512"),
    ({"temperature": 2.01}, "temperature", "temperature must be between 0.0 and 2.0"),
    ({"temperature": -0.1}, "temperature", "between 0.0 and 2.0"),
    ({"temperature": float("nan")}, "temperature", "between 0.0 and 2.0"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "stop has 5 strings; at most 4"),
    ({"stop": ["a", ""]}, "stop.1", "stop string 1 is empty"),
    ({"seed": -1}, "seed", "seed must be between 0 and"),
    ({"seed": 2**63}, "seed", "seed must be between 0 and"),
    ({"top_p": 0.9}, "top_p", "unknown field"),
    ({"max_tokens": "8"}, "max_tokens", "valid integer"),
    ({"temperature": True}, "temperature", "valid number"),
])
def test_generate_limits(generate, param, fragment):
    error = parse_error(extraction("{*}", generate=generate))
    assert error.param == f"scoring.queries.1.generate.{param}"
    assert fragment in error.message


def test_generate_limits_are_inclusive():
    spec = extraction_query("{*}", generate={"max_tokens": 1, "stop": ["a", "b", "c", "d"],
                                              "temperature": 0, "seed": 2**63 - 1}).generate
    assert (spec.max_tokens, len(spec.stop), spec.temperature) == (1, 4, 0.0)


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

import pytest

from spinf_worker.errors import InvalidRequestError
from spinf_worker.templates import (
    Combination,
    Literal,
    Placeholder,
    Slot,
    check_scored_template,
    check_template,
    expand_grid,
    parse_template,
    scored_prefix_combinations,
)


def grid(source, values=None, cap=4096):
    return scored_prefix_combinations(source, values or {}, max_combinations=cap)


# ---- parsing ---------------------------------------------------------------------------


def test_parses_literals_placeholders_and_slots():
    template = parse_template("Is {item} about {topic}?{?} then {*}{n}{$}")
    assert template.parts == (
        Literal("Is "), Placeholder("item"), Literal(" about "), Placeholder("topic"),
        Literal("?"), Slot("?"), Literal(" then "), Slot("*"), Slot("n"), Slot("$"),
    )
    assert template.source == "Is {item} about {topic}?{?} then {*}{n}{$}"


def test_plain_text_is_one_literal():
    assert parse_template("no braces here").parts == (Literal("no braces here"),)
    assert parse_template("").parts == ()


def test_escaped_braces_become_literal_text_merged_with_neighbours():
    template = parse_template('JSON {{"a": 1}} and {{?}}:{?}')
    assert template.parts == (Literal('JSON {"a": 1} and {?}:'), Slot("?"))


def test_placeholders_are_distinct_in_order_of_first_appearance():
    template = parse_template("{b} {a} {b} {_c1}{?}")
    assert template.placeholders == ("b", "a", "_c1")


def test_slots_in_order():
    assert parse_template("{$} x {?} {*}").slots == (Slot("$"), Slot("?"), Slot("*"))


@pytest.mark.parametrize(("source", "quoted", "offset"), [
    ("Answer: {x", "unclosed '{'", 8),
    ("a {b {c}", "unclosed '{'", 2),
    ("Answer {}", "empty '{}'", 7),
    ("Q {1abc}{?}", "invalid placeholder '{1abc}'", 2),
    ("Q { x }{?}", "invalid placeholder '{ x }'", 2),
    ("Q {a-b}{?}", "invalid placeholder '{a-b}'", 2),
    ("stray } here", "unexpected '}'", 6),
    ("x }}} y", "unexpected '}'", 4),
])
def test_malformed_braces_name_the_problem_and_offset(source, quoted, offset):
    with pytest.raises(InvalidRequestError) as caught:
        parse_template(source, param="scoring.queries.3.template")
    error = caught.value
    assert quoted in error.message
    assert f"at offset {offset}" in error.message
    assert error.param == "scoring.queries.3.template"
    assert error.code == "invalid_template"


def test_parse_error_param_defaults_to_template():
    with pytest.raises(InvalidRequestError) as caught:
        parse_template("{")
    assert caught.value.param == "template"


# ---- scored-query rules ------------------------------------------------------------------


def test_missing_slot():
    with pytest.raises(InvalidRequestError) as caught:
        grid("no slot here")
    assert caught.value.message.startswith("template has no slot")
    assert "no scored slot {?}" in caught.value.message  # the engine's tests look for this
    assert caught.value.param == "template"
    assert caught.value.code == "invalid_template"


def test_two_scored_slots():
    with pytest.raises(InvalidRequestError) as caught:
        grid("a{?} b{?}")
    assert caught.value.message == (
        "template has 2 slots (2 scored slots {?}); exactly one is allowed")
    assert caught.value.code == "invalid_template"


@pytest.mark.parametrize(("source", "count", "kinds"), [
    ("a{?} b{n}", 2, "1 scored slot {?}, 1 number slot {n}"),
    ("{*} {$} {*}", 3, "2 span slots {*}, 1 amount slot {$}"),
])
def test_several_slots_of_any_kind_name_each_kind(source, count, kinds):
    with pytest.raises(InvalidRequestError) as caught:
        check_template(parse_template(source), param="scoring.queries.1.template")
    assert caught.value.message == f"template has {count} slots ({kinds}); exactly one is allowed"
    assert caught.value.param == "scoring.queries.1.template"
    assert caught.value.code == "invalid_template"


@pytest.mark.parametrize("source, kind", [("Q{?}", "?"), ("A: {*}.", "*"), ("{n}", "n"),
                                          ("x {$}", "$")])
def test_the_one_slot(source, kind):
    template = parse_template(source)
    assert template.slot == Slot(kind)
    assert check_template(template) == Slot(kind)


@pytest.mark.parametrize(("source", "fragment"), [("none", "no slot"), ("{*}{n}", "2 slots")])
def test_slot_property_raises_without_exactly_one_slot(source, fragment):
    with pytest.raises(InvalidRequestError) as caught:
        parse_template(source).slot  # noqa: B018
    assert fragment in caught.value.message
    assert caught.value.param == "template"
    assert caught.value.code == "invalid_template"


@pytest.mark.parametrize("slot", ["{*}", "{n}", "{$}"])
def test_scored_helper_rejects_extraction_slots(slot):
    with pytest.raises(InvalidRequestError) as caught:
        scored_prefix_combinations(f"Q: {slot}", {}, max_combinations=10,
                                   template_param="scoring.queries.2.template")
    assert caught.value.code == "invalid_template"
    assert "{?}" in caught.value.message
    assert caught.value.param == "scoring.queries.2.template"


@pytest.mark.parametrize("slot", ["{*}", "{n}", "{$}"])
def test_expand_grid_expands_extraction_slots(slot):
    combos = expand_grid(parse_template(f"Q: {slot}"), {}, max_combinations=10)
    assert combos == [Combination(values={}, prefix="Q: ", stop=None)]


def test_check_scored_template():
    check_scored_template(parse_template("Q{?}"))
    with pytest.raises(InvalidRequestError) as caught:
        check_scored_template(parse_template("Q {$}"))
    assert caught.value.code == "invalid_template"


def test_extraction_slot_next_to_a_scored_slot_is_an_invalid_template():
    with pytest.raises(InvalidRequestError) as caught:
        grid("a{?} b{n}")
    assert caught.value.code == "invalid_template"


def test_placeholder_only_after_scored_slot_is_rejected():
    with pytest.raises(InvalidRequestError) as caught:
        check_scored_template(parse_template("Q{?} about {x}"))
    assert "{x}" in caught.value.message
    assert "only after {?}" in caught.value.message


def test_placeholder_repeated_after_scored_slot_is_fine():
    combos = grid("Is {x} ok?{?} ({x})", {"x": ["a"]})
    assert [c.prefix for c in combos] == ["Is a ok?"]


# ---- grid ------------------------------------------------------------------------------


def test_no_placeholders_gives_one_combination_with_empty_values():
    assert grid("\n\nAnswer:{?}") == [Combination(values={}, prefix="\n\nAnswer:")]


def test_text_after_scored_slot_is_ignored():
    assert grid("Q:{?} trailing {{text}}")[0].prefix == "Q:"


def test_escapes_are_resolved_in_prefix():
    assert grid("{{{x}}}:{?}", {"x": ["v"]})[0].prefix == "{v}:"


def test_grid_is_cartesian_product_first_placeholder_slowest():
    combos = grid("{size} {colour} {size}?{?}", {"colour": ["red", "blue"], "size": ["S", "M", "L"]})
    assert [c.values for c in combos] == [
        {"size": "S", "colour": "red"}, {"size": "S", "colour": "blue"},
        {"size": "M", "colour": "red"}, {"size": "M", "colour": "blue"},
        {"size": "L", "colour": "red"}, {"size": "L", "colour": "blue"},
    ]
    assert combos[3].prefix == "M blue M?"


def test_values_are_inserted_verbatim_not_parsed():
    assert grid("x={x}{?}", {"x": ["{?} {{"]})[0].prefix == "x={?} {{"


def test_grid_at_the_cap_is_allowed():
    assert len(grid("{a}{b}{?}", {"a": ["1", "2"], "b": ["1", "2", "3"]}, cap=6)) == 6


def test_grid_over_the_cap_names_size_and_cap():
    with pytest.raises(InvalidRequestError) as caught:
        grid("{a}{b}{?}", {"a": ["1", "2"], "b": ["1", "2", "3"]}, cap=5)
    error = caught.value
    assert error.code == "grid_too_large"
    assert "6 combinations" in error.message
    assert "at most 5" in error.message
    assert error.param == "values"


def test_cap_is_checked_before_the_grid_is_built(monkeypatch):
    from spinf_worker import templates

    def no_product(*iterables):
        raise AssertionError("the grid was built before its size was checked")

    # Building 10**9 combinations would take minutes and run out of memory.
    monkeypatch.setattr(templates, "product", no_product)
    thousand = [str(i) for i in range(1000)]
    with pytest.raises(InvalidRequestError) as caught:
        grid("{a}{b}{c}{?}", {"a": thousand, "b": thousand, "c": thousand}, cap=100)
    assert "1000000000 combinations" in caught.value.message


def test_placeholder_without_values():
    with pytest.raises(InvalidRequestError) as caught:
        grid("{x} {y}{?}", {"x": ["a"]})
    assert caught.value.message == "placeholder {y} has no values"
    assert caught.value.param == "values.y"


def test_placeholder_with_empty_list():
    with pytest.raises(InvalidRequestError) as caught:
        grid("{x}{?}", {"x": []})
    assert caught.value.message == "placeholder {x} has no values"


def test_unused_values_key_is_an_error():
    with pytest.raises(InvalidRequestError) as caught:
        grid("{region}{?}", {"region": ["EU"], "regoin": ["US"]})
    assert "'regoin'" in caught.value.message
    assert caught.value.param == "values.regoin"


def test_values_without_any_placeholder_is_an_error():
    with pytest.raises(InvalidRequestError):
        grid("Q{?}", {"x": ["a"]})


def test_duplicate_values_in_one_list():
    with pytest.raises(InvalidRequestError) as caught:
        expand_grid(parse_template("{x}{?}"), {"x": ["a", "b", "a"]}, max_combinations=10,
                    param="scoring.queries.0.values")
    assert "duplicate value 'a'" in caught.value.message
    assert caught.value.param == "scoring.queries.0.values.x.2"


def test_same_value_in_different_lists_is_fine():
    assert len(grid("{x}{y}{?}", {"x": ["a"], "y": ["a"]})) == 1


# ---- extraction slots: prefix and stop ----------------------------------------------------


def extraction_grid(source, values=None, cap=4096):
    return expand_grid(parse_template(source), values or {}, max_combinations=cap)


@pytest.mark.parametrize(("source", "prefix", "stop"), [
    ('\n\nQ: Which month?\nA: "{*}"', '\n\nQ: Which month?\nA: "', '"'),
    ("Total: {$}\n", "Total: ", "\n"),
    ("Amount: {n}", "Amount: ", None),
    ("{n}", "", None),
    ("A: {*} (end)", "A: ", " (end)"),
    ("JSON: {{\"v\": {n}}}", 'JSON: {"v": ', "}"),
])
def test_prefix_and_stop_of_extraction_slots(source, prefix, stop):
    assert extraction_grid(source) == [Combination(values={}, prefix=prefix, stop=stop)]


def test_scored_slot_has_no_stop():
    assert extraction_grid("Q:{?} trailing")[0].stop is None
    assert grid("Q:{?} trailing")[0].stop is None


def test_extraction_grid_fills_placeholders_before_the_slot():
    combos = extraction_grid('When did {who} {act}? "{*}"', {"who": ["Ann", "Bo"], "act": ["go"]})
    assert [(c.values, c.prefix, c.stop) for c in combos] == [
        ({"who": "Ann", "act": "go"}, 'When did Ann go? "', '"'),
        ({"who": "Bo", "act": "go"}, 'When did Bo go? "', '"'),
    ]


@pytest.mark.parametrize("source", ['A: "{*}" {x}', "Total {x}: {n}{x}", "{$}{x}"])
def test_placeholder_after_an_extraction_slot_is_an_error(source):
    with pytest.raises(InvalidRequestError) as caught:
        extraction_grid(source, {"x": ["a"]})
    assert caught.value.code == "invalid_template"
    assert "{x} appears after the extraction slot" in caught.value.message
    assert caught.value.param == "template"


def test_placeholder_after_extraction_slot_fails_before_the_support_check():
    template = parse_template("A {*} {x}")
    with pytest.raises(InvalidRequestError) as caught:
        expand_grid(template, {"x": ["a"]}, max_combinations=10)
    assert caught.value.code == "invalid_template"


def test_extraction_grid_checks_values():
    with pytest.raises(InvalidRequestError) as caught:
        extraction_grid("{a}{b}{n}", {"a": ["1", "2"], "b": ["1", "2", "3"]}, cap=5)
    assert caught.value.code == "grid_too_large"

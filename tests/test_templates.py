import pytest

from spinf_worker.errors import InvalidRequestError
from spinf_worker.templates import (
    MAX_ALL_COMBINATIONS,
    Combination,
    Literal,
    Placeholder,
    Slot,
    check_combinations,
    check_scored_template,
    check_template,
    expand,
    parse_template,
)


def prompts(source, combinations=None, values=None):
    return expand(parse_template(source), combinations, values)


def error_of(source, combinations=None, values=None, param="") -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        expand(parse_template(source), combinations, values, param=param)
    return caught.value


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


def test_placeholder_names_are_letters_digits_and_underscores():
    assert parse_template("{1abc}{_}{Z9}{?}").placeholders == ("1abc", "_", "Z9")


def test_placeholders_are_distinct_in_order_of_first_appearance():
    template = parse_template("{b} {a} {b} {_c1}{?}")
    assert template.placeholders == ("b", "a", "_c1")


def test_slots_in_order():
    assert parse_template("{$} x {?} {*}").slots == (Slot("$"), Slot("?"), Slot("*"))


@pytest.mark.parametrize(("source", "quoted", "offset"), [
    ("Answer: {x", "unclosed '{'", 8),
    ("a {b {c}", "unclosed '{'", 2),
    ("Answer {}", "empty '{}'", 7),
    ("Q {a.b}{?}", "invalid placeholder '{a.b}'", 2),
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



# ---- the template rules ------------------------------------------------------------------


def test_missing_slot():
    error = error_of("no slot here")
    assert error.message.startswith("template has no slot")
    assert "no scored slot {?}" in error.message  # the engine's tests look for this
    assert (error.param, error.code) == ("template", "invalid_template")


def test_two_scored_slots():
    error = error_of("a{?} b{?}")
    assert error.message == "template has 2 slots (2 scored slots {?}); exactly one is allowed"
    assert error.code == "invalid_template"


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


@pytest.mark.parametrize("source, kind", [("Q{?}", "?"), ('A: "{*}"', "*"), ("{n}", "n"),
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


def test_check_scored_template():
    check_scored_template(parse_template("Q{?}"))
    for slot in ("{*}", "{n}", "{$}"):
        with pytest.raises(InvalidRequestError) as caught:
            check_scored_template(parse_template(f"Q {slot}"), param="scoring.queries.2.template")
        assert caught.value.code == "invalid_template"
        assert "{?}" in caught.value.message
        assert caught.value.param == "scoring.queries.2.template"


@pytest.mark.parametrize(("source", "slot"), [
    ("Q{?} trailing", "{?}"), ("Q{?}\n", "{?}"), ("Amount: {n} dollars", "{n}"),
    ("Total: {$}\n", "{$}"), ("{?}{x}", "{?}"),
])
def test_scored_number_and_amount_slots_end_the_template(source, slot):
    error = error_of(source, [{"x": "a"}] if "{x}" in source else None)
    assert error.code == "invalid_template"
    assert f"{slot} must end the template" in error.message
    assert error.param == "template"


@pytest.mark.parametrize("source", ['A: "{*}" {x}', "A: {*}\n", 'A: "{*}"\nmore', "{*}{n}x"])
def test_text_after_the_span_slot_is_literal_and_has_no_newline(source):
    error = error_of(source, [{"x": "a"}] if "{x}" in source else None)
    assert error.code == "invalid_template"


def test_five_placeholders_at_most():
    assert len(prompts("{a}{b}{c}{d}{e}{?}", [dict.fromkeys("abcde", "v")])) == 1
    error = error_of("{a}{b}{c}{d}{e}{f}{?}", [dict.fromkeys("abcdef", "v")])
    assert error.message == "template has 6 placeholders; at most 5 are allowed"
    assert error.code == "invalid_template"


def test_a_placeholder_repeated_counts_once():
    combos = prompts("{x} and {x} again {x}{?}", [{"x": "a"}])
    assert [c.prefix for c in combos] == ["a and a again a"]


# ---- combinations: a list ------------------------------------------------------------------


def test_no_placeholders_gives_one_combination_with_empty_values():
    assert prompts("\n\nAnswer:{?}") == [Combination(values={}, prefix="\n\nAnswer:")]


def test_escapes_are_resolved_in_prefix():
    assert prompts("{{{x}}}:{?}", [{"x": "v"}])[0].prefix == "{v}:"


def test_a_list_gives_one_prompt_per_entry_in_its_order():
    combos = prompts("{size} {colour}?{?}", [{"colour": "red", "size": "M"},
                                             {"size": "S", "colour": "blue"}])
    assert [c.prefix for c in combos] == ["M red?", "S blue?"]
    # values are keyed in the template's order, whatever the order sent
    assert [list(c.values) for c in combos] == [["size", "colour"], ["size", "colour"]]
    assert combos[1].values == {"size": "S", "colour": "blue"}


def test_a_list_may_repeat_an_entry():
    assert len(prompts("{x}{?}", [{"x": "a"}, {"x": "a"}])) == 2


def test_values_are_inserted_verbatim_not_parsed():
    assert prompts("x={x}{?}", [{"x": "{?} {{"}])[0].prefix == "x={?} {{"


def test_placeholders_without_combinations():
    error = error_of("{x} {y}{?}")
    assert error.message == "the template has placeholders ['x', 'y']: send `combinations`"
    assert (error.param, error.code) == (".combinations", "missing_value")
    assert error_of("{x}{?}", param="scoring.queries.0").param == \
        "scoring.queries.0.combinations"


def test_an_empty_list():
    error = error_of("{x}{?}", [])
    assert (error.param, error.code) == (".combinations", "missing_value")


def test_an_entry_without_a_placeholder():
    error = error_of("{x} {y}{?}", [{"x": "a", "y": "b"}, {"x": "a"}], param="q")
    assert (error.param, error.code) == ("q.combinations.1", "missing_value")
    assert "['y']" in error.message


def test_an_entry_with_a_name_not_in_the_template():
    error = error_of("{region}{?}", [{"region": "EU", "regoin": "US"}], param="q")
    assert (error.param, error.code) == ("q.combinations.0", "unknown_placeholder")
    assert "'regoin'" in error.message


def test_combinations_without_placeholders_name_the_stray_key():
    error = error_of("Q{?}", [{"x": "a"}], param="q")
    assert error.code == "unknown_placeholder"


def test_a_value_of_256_characters_is_the_longest():
    assert prompts("{x}{?}", [{"x": "v" * 256}])[0].prefix == "v" * 256
    error = error_of("{x}{?}", [{"x": "v" * 257}], param="q")
    assert (error.param, error.code) == ("q.combinations.0.x", "invalid_field")


# ---- combinations: "all" with values -------------------------------------------------------


def test_all_is_the_cartesian_product_first_placeholder_slowest():
    combos = prompts("{size} {colour} {size}?{?}", "all",
                     {"colour": ["red", "blue"], "size": ["S", "M", "L"]})
    assert [c.values for c in combos] == [
        {"size": "S", "colour": "red"}, {"size": "S", "colour": "blue"},
        {"size": "M", "colour": "red"}, {"size": "M", "colour": "blue"},
        {"size": "L", "colour": "red"}, {"size": "L", "colour": "blue"},
    ]
    assert combos[3].prefix == "M blue M?"


def test_all_equals_the_same_grid_listed():
    values = {"a": ["1", "2"], "b": ["x", "y", "z"]}
    listed = [{"a": a, "b": b} for a in values["a"] for b in values["b"]]
    assert prompts("{a}-{b}{?}", "all", values) == prompts("{a}-{b}{?}", listed)


def test_all_at_the_cap_is_allowed():
    values = {"a": [str(i) for i in range(40)], "b": [str(i) for i in range(25)]}
    assert MAX_ALL_COMBINATIONS == 40 * 25
    assert check_combinations(parse_template("{a}{b}{?}"), "all", values, param="") == 1000
    assert len(prompts("{a}{b}{?}", "all", values)) == 1000


def test_all_over_the_cap_names_size_and_cap():
    values = {"a": [str(i) for i in range(41)], "b": [str(i) for i in range(25)]}
    error = error_of("{a}{b}{?}", "all", values, param="scoring.queries.0")
    assert error.code == "too_many_combinations"
    assert "1,025 combinations" in error.message and "1,000" in error.message
    assert error.param == "scoring.queries.0.combinations"


def test_the_cap_is_checked_before_the_grid_is_built(monkeypatch):
    from spinf_worker import templates

    def no_product(*iterables):
        raise AssertionError("the grid was built before its size was checked")

    # Building 10**9 combinations would take minutes and run out of memory.
    monkeypatch.setattr(templates, "product", no_product)
    thousand = [str(i) for i in range(1000)]
    error = error_of("{a}{b}{c}{?}", "all", {"a": thousand, "b": thousand, "c": thousand})
    assert "1,000,000,000 combinations" in error.message


def test_all_without_values():
    error = error_of("{x}{?}", "all", param="q")
    assert (error.param, error.code) == ("q.values", "missing_value")
    assert error_of("{x}{?}", "all", {}, param="q").code == "missing_value"


def test_all_with_a_placeholder_without_values():
    error = error_of("{x} {y}{?}", "all", {"x": ["a"]}, param="q")
    assert (error.param, error.code) == ("q.values", "missing_value")
    assert "['y']" in error.message


def test_all_with_an_empty_list():
    error = error_of("{x}{?}", "all", {"x": []}, param="q")
    assert (error.param, error.code) == ("q.values.x", "missing_value")


def test_all_with_values_for_a_name_not_in_the_template():
    error = error_of("{region}{?}", "all", {"region": ["EU"], "regoin": ["US"]}, param="q")
    assert (error.param, error.code) == ("q.values", "unknown_placeholder")
    assert "'regoin'" in error.message


def test_all_checks_the_length_of_each_value():
    error = error_of("{x}{?}", "all", {"x": ["ok", "v" * 257]}, param="q")
    assert (error.param, error.code) == ("q.values.x.1", "invalid_field")


# ---- extraction slots: prefix and stop ----------------------------------------------------


@pytest.mark.parametrize(("source", "prefix", "stop"), [
    ('\n\nQ: Which month?\nA: "{*}"', '\n\nQ: Which month?\nA: "', '"'),
    ("Amount: {n}", "Amount: ", None),
    ("{n}", "", None),
    ("Total: {$}", "Total: ", None),
    ("A: {*} (end)", "A: ", " (end)"),
    ("Name: '{*}'.", "Name: '", "'."),
])
def test_prefix_and_stop_of_extraction_slots(source, prefix, stop):
    assert prompts(source) == [Combination(values={}, prefix=prefix, stop=stop)]


def test_scored_slot_has_no_stop():
    assert prompts("Q:{?}")[0].stop is None


def test_extraction_prompts_fill_placeholders_before_the_slot():
    combos = prompts('When did {who} {act}? "{*}"', "all", {"who": ["Ann", "Bo"], "act": ["go"]})
    assert [(c.values, c.prefix, c.stop) for c in combos] == [
        ({"who": "Ann", "act": "go"}, 'When did Ann go? "', '"'),
        ({"who": "Bo", "act": "go"}, 'When did Bo go? "', '"'),
    ]


@pytest.mark.parametrize("combinations", [None, [{"x": "a"}]])
def test_values_without_all_are_an_error_not_ignored(combinations):
    error = error_of("{x}{?}" if combinations else "Q{?}", combinations, {"x": ["a", "b"]},
                     param="q")
    assert (error.param, error.code) == ("q.values", "invalid_field")
    assert '"all"' in error.message

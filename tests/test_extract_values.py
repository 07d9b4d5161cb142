import itertools
import random
import subprocess
import sys

import pytest

from spinf_worker.extract_values import (
    AMOUNT,
    NUMBER,
    ValueGrammar,
    amount_complete,
    amount_prefix_ok,
    grammar_for,
    number_complete,
    number_prefix_ok,
    parse_amount,
    parse_number,
    parse_value,
)
from spinf_worker.protocol import Answer

NUMBERS = {
    "0": 0, "7": 7, "42": 42, " 3": 3, "-3": -3, "+3": 3, "\u22123": -3, " -1,234.50": -1234.5,
    "1,234": 1234, "12,345,678": 12345678, "1234567": 1234567, "0042": 42, "1.5": 1.5,
    "1,284.50": 1284.5, "0.001": 0.001, "\u00a012": 12, "\u202f-0.5": -0.5,
    # scale words, percentages, accounting brackets, a full stop
    " 3.5 million": 3500000.0, "12 Million": 12000000, "2 BILLION": 2000000000,
    "1.25 trillion": 1.25e12, "7thousand": 7000, "12%": 12, " 12.5%": 12.5, "12 %": 12,
    "(1,284)": -1284, " (3.5)": -3.5, "(12%)": -12, "(2 million)": -2000000, "3.": 3,
    " 1,234.": 1234, "-7.": -7,
}
# Could still become a number, but are not one yet.
NUMBER_PREFIXES = ["", " ", "-", " +", "1,", "1,2", "1,23", "1,234,", "1,234,5", "(", " (3",
                   "(3.5", "(1,2", "3 ", "3.5 mil", "12 Bil", "(3.5 million", "(12%"]
NOT_NUMBERS = ["abc", "1..2", "1,2,,3", "1,2345", "1234,567", ",1", ".5", "1.2.3", "1.2,3",
               "  3", "- 3", "--3", "3-", "1e6", "1 000", "$3", "١٢", "1,,2",
               "\t3", "1.,5", "+-3", "(-3)", "-(3)", "(3.)", "3)", "(3))", "3.5 mn", "3 k",
               "12%%", "12.%", "3. million", "12% million", "( 3)", "12.5.", "3 million."]

AMOUNTS = {
    "$1,284.50": (1284.5, "USD"), "USD 1,284.50": (1284.5, "USD"),
    "1,284.50 USD": (1284.5, "USD"), "€3.2 million": (3200000.0, "EUR"),
    "£ 12": (12.0, "GBP"), "12.5bn": (12.5e9, None), "1.2 billion": (1.2e9, None),
    "EUR 40k": (40000.0, "EUR"), "¥500": (500.0, "JPY"), " $12": (12.0, "USD"),
    "12": (12.0, None), "-$5": (-5.0, "USD"), "$-5": (-5.0, "USD"), "USD -12": (-12.0, "USD"),
    "-12 USD": (-12.0, "USD"), "12 €": (12.0, "EUR"), "12€": (12.0, "EUR"),
    "USD12": (12.0, "USD"), "12USD": (12.0, "USD"), "$3.2 Million": (3.2e6, "USD"),
    "$3.2 MILLION": (3.2e6, "USD"), "$1.5 Trillion": (1.5e12, "USD"), "5 thousand": (5000.0, None),
    "$4.5B": (4.5e9, "USD"), "$2T": (2e12, "USD"), "7mn": (7e6, None), "7 MM": (7e6, None),
    "$12 m": (12e6, "USD"), "8 tn": (8e12, None), "40K EUR": (40000.0, "EUR"),
    "12 MNT": (12.0, "MNT"), "12 MMK": (12.0, "MMK"), "12 BTN": (12.0, "BTN"),
    "3m MXN": (3e6, "MXN"), "\u221212.5 GBP": (-12.5, "GBP"), "$\u00a012": (12.0, "USD"),
    "0.1 million": (100000.0, None), "1,234,567.891": (1234567.891, None),
    "12 b": (12e9, None), "12 T": (12e12, None), "12 M": (12e6, None), "12 MN": (12e6, None),
    # accounting brackets and a full stop
    "($1,284.50)": (-1284.5, "USD"), " (1,284.50)": (-1284.5, None), "$(12)": (-12.0, "USD"),
    "$ (12)": (-12.0, "USD"), "(12 USD)": (-12.0, "USD"), "(€3.2 million)": (-3.2e6, "EUR"),
    "$40.": (40.0, "USD"), "12.": (12.0, None), "-$5.": (-5.0, "USD"), "USD -12.": (-12.0, "USD"),
}
AMOUNT_PREFIXES = ["", " ", "$", "-", "-$", "$ ", "U", "US", "USD", "USD ", "€3.2 ", "€3.2 mil",
                   "12 bi", "12 Tr", "1,", "12 Mi", "12 MX", "12 bn U", "12 M ", "(", "($1",
                   "$(1", "(12 US", "$ (", "(3.2 million"]
NOT_AMOUNTS = ["abc", "$$", "1..2", "1,2,,3", "$5 USD", "-$-5", "--5", "$ $5", "usd 5", "5 usd",
               "US 5", "USDD 5", "$.5", "12 bnbn", "12 kilo", "12  USD", "12 ml", "12..",
               "$12 $", "€€", "12 USDX", "5 quadrillion", "£-£5", "(-5)", "-(5)", "($5 USD)",
               "$(5 USD)", "(5))", "12.5.", "$12. million", "12. USD", "(12.)", "12%"]


def prefixes(text):
    return [text[:i] for i in range(len(text) + 1)]


# ---- numbers ------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "value"), NUMBERS.items())
def test_valid_numbers_parse_and_every_prefix_is_ok(text, value):
    assert number_complete(text)
    parsed = parse_number(text)
    assert parsed == value
    assert type(parsed) is type(value)
    for prefix in prefixes(text):
        assert number_prefix_ok(prefix), prefix


@pytest.mark.parametrize("text", NUMBER_PREFIXES)
def test_number_prefixes_are_ok_but_not_complete(text):
    assert number_prefix_ok(text)
    assert not number_complete(text)
    with pytest.raises(ValueError, match="not a number"):
        parse_number(text)


@pytest.mark.parametrize("text", NOT_NUMBERS)
def test_not_numbers(text):
    assert not number_prefix_ok(text)
    assert not number_complete(text)
    with pytest.raises(ValueError):
        parse_number(text)


def test_int_without_decimal_point_float_with_one():
    assert type(parse_number("1,000")) is int
    assert type(parse_number("1.0")) is float
    assert parse_number("-0.0") == 0.0


def test_number_that_overflows_a_float():
    with pytest.raises(ValueError, match="out of range"):
        parse_number("1" + "0" * 400 + ".5")
    assert parse_number("1" + "0" * 400) == 10**400  # an int is exact


def test_number_grammar_against_brute_force():
    """Over a small alphabet: ``prefix_ok`` holds exactly for the prefixes of the complete
    strings (every prefix of two characters completes within six)."""
    alphabet = ["1", "0", ",", ".", "-", " ", "(", ")", "%"]
    complete = set()
    for length in range(7):
        for chars in itertools.product(alphabet, repeat=length):
            text = "".join(chars)
            if number_complete(text):
                complete.add(text)
    assert {"1", "-1,000", " 1.01", "10,000", "(1)", " (10%)", "1.", "-1%"} <= complete
    assert all(parse_number(text) is not None for text in complete)
    prefix_set = {prefix for text in complete for prefix in prefixes(text)}
    for length in range(3):
        for chars in itertools.product(alphabet, repeat=length):
            text = "".join(chars)
            assert number_prefix_ok(text) == (text in prefix_set), text


# ---- amounts ------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), AMOUNTS.items())
def test_valid_amounts_parse_and_every_prefix_is_ok(text, expected):
    amount, currency = expected
    assert amount_complete(text)
    parsed = parse_amount(text)
    assert parsed == {"amount": pytest.approx(amount, rel=1e-15), "currency": currency}
    assert type(parsed["amount"]) is float
    for prefix in prefixes(text):
        assert amount_prefix_ok(prefix), prefix


def test_scaled_amounts_are_exact():
    assert parse_amount("€3.2 million")["amount"] == 3200000.0
    assert parse_amount("$0.3bn")["amount"] == 300000000.0
    assert parse_amount("1.1 k")["amount"] == 1100.0


@pytest.mark.parametrize("text", AMOUNT_PREFIXES)
def test_amount_prefixes_are_ok_but_not_complete(text):
    assert amount_prefix_ok(text)
    assert not amount_complete(text)
    with pytest.raises(ValueError, match="not an amount"):
        parse_amount(text)


@pytest.mark.parametrize("text", NOT_AMOUNTS)
def test_not_amounts(text):
    assert not amount_complete(text)
    with pytest.raises(ValueError):
        parse_amount(text)


@pytest.mark.parametrize("text", ["abc", "$$", "1..2", "1,2,,3", "$5 USD", "-$-5", "--5",
                                  "usd", "12 kilo", "12.,", "€€", "12 USDX", "£-£"])
def test_dead_amount_prefixes(text):
    assert not amount_prefix_ok(text)


def test_amount_that_overflows_a_float():
    with pytest.raises(ValueError, match="out of range"):
        parse_amount("$" + "9" * 300 + " trillion")


def _oracle_amount_pattern():
    """The amount grammar restated as one regex, independently of the module's."""
    sp, sign = "[ \u00a0\u202f]", "[-+\u2212]"
    integer = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)"
    body = integer + r"(?:\.[0-9]+)?"
    scale = r"(?i:thousand|million|billion|trillion|k|m|mm|mn|b|bn|t|tn)"
    value = f"{body}(?:{sp}?{scale})?"
    end = f"(?:{value}|{integer}\\.)"
    currency = "(?:[$€£¥]|[A-Z]{3})"
    unsigned = f"(?:{currency}{sp}?{value}|{value}(?:{sp}?{currency})?)"
    return (f"{sp}?(?:{sign}?{currency}{sp}?{end}|{currency}{sp}?{sign}{end}|{sign}?{end}"
            f"|{sign}?{value}{sp}?{currency}|\\({unsigned}\\)|{currency}{sp}?\\({value}\\))")


def _random_amount_like(rng):
    pieces = [" ", "\u00a0", "-", "+", "$", "€", "£", "¥", "USD", "EU", "R", "1", "23", "456",
              "7", ",", ",000", ".", ".5", "k", "m", "mn", "B", "bn", "T", "tn", "mil", "lion",
              "thousand", "Billion", "x", "%", "(", ")"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))


def test_amount_grammar_against_an_oracle_regex():
    regex = pytest.importorskip("regex")  # partial matching: "could this still match?"
    pattern = regex.compile(_oracle_amount_pattern())
    rng = random.Random(1234)
    seen_complete = seen_prefix = seen_dead = 0
    for _ in range(20000):
        text = _random_amount_like(rng)
        full = pattern.fullmatch(text) is not None
        partial = pattern.fullmatch(text, partial=True) is not None
        assert amount_complete(text) == full, text
        assert amount_prefix_ok(text) == partial, text
        if full:
            parse_amount(text)
        seen_complete += full
        seen_prefix += partial and not full
        seen_dead += not partial
    assert min(seen_complete, seen_prefix, seen_dead) > 500  # the sample covers all three


def test_number_grammar_against_an_oracle_regex():
    regex = pytest.importorskip("regex")
    integer = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)"
    quantity = integer + r"(?:\.[0-9]+)?(?:[ \u00a0\u202f]?(?:(?i:thousand|million|billion|trillion)|%))?"
    pattern = regex.compile(rf"[ \u00a0\u202f]?(?:[-+\u2212]?(?:{quantity}|{integer}\.)"
                            rf"|\({quantity}\))")
    rng = random.Random(99)
    pieces = ["1", "23", "456", ",", ",000", ".", "5", "-", " ", "+", "a", "(", ")", "%",
              " million", "Billion", "thou", "sand", "m"]
    for _ in range(20000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 7)))
        assert number_complete(text) == (pattern.fullmatch(text) is not None), text
        assert number_prefix_ok(text) == (pattern.fullmatch(text, partial=True) is not None), text


# ---- the automaton API --------------------------------------------------------------------


@pytest.mark.parametrize("grammar", [NUMBER, AMOUNT])
def test_feeding_in_pieces_equals_feeding_at_once(grammar):
    rng = random.Random(7)
    for text in [*NUMBERS, *AMOUNTS, *NOT_AMOUNTS, *NOT_NUMBERS]:
        cut = rng.randint(0, len(text))
        state = grammar.feed(grammar.start, text[:cut])
        assert grammar.feed(state, text[cut:]) == grammar.feed(grammar.start, text)


def test_dead_stays_dead():
    assert NUMBER.feed(NUMBER.start, "x") == ValueGrammar.DEAD
    assert NUMBER.feed(ValueGrammar.DEAD, "1") == ValueGrammar.DEAD
    assert not NUMBER.accepts(ValueGrammar.DEAD)
    assert not NUMBER.can_extend(ValueGrammar.DEAD)


def test_can_extend_says_when_a_value_is_finished():
    assert NUMBER.can_extend(NUMBER.feed(NUMBER.start, "12"))  # more digits may follow
    finished = AMOUNT.feed(AMOUNT.start, "12 USD")
    assert AMOUNT.accepts(finished) and not AMOUNT.can_extend(finished)
    trillion = AMOUNT.feed(AMOUNT.start, "$1 trillion")
    assert AMOUNT.accepts(trillion) and not AMOUNT.can_extend(trillion)
    assert AMOUNT.can_extend(AMOUNT.feed(AMOUNT.start, "1 trillion"))  # a code may follow


def test_every_live_state_can_still_complete():
    for grammar in (NUMBER, AMOUNT):
        transitions = grammar._transitions
        for state in range(grammar.states):
            seen, todo = {state}, [state]
            while todo:
                current = todo.pop()
                for target in transitions[current].values():
                    if target not in seen:
                        seen.add(target)
                        todo.append(target)
            assert any(grammar.accepts(s) for s in seen), (grammar.name, state)


def test_checks_take_linear_time(monkeypatch):
    """One transition lookup a character at most, counted (not timed): 800k characters."""
    lookups = [0]

    class CountingRow(dict):
        def get(self, key, default=None):
            lookups[0] += 1
            return super().get(key, default)

    for grammar in (NUMBER, AMOUNT):
        monkeypatch.setattr(grammar, "_transitions",
                            [CountingRow(row) for row in grammar._transitions])
    long_number = "1" + ",234" * 50_000
    long_amount = "$" + long_number
    assert number_prefix_ok(long_number) and number_complete(long_number)
    assert amount_prefix_ok(long_amount) and amount_complete(long_amount)
    assert not number_prefix_ok("x" + long_number)
    read = 2 * len(long_number) + 2 * len(long_amount) + 1
    assert len(long_number) <= lookups[0] <= read


def test_grammar_for_and_parse_value():
    assert grammar_for("n") is NUMBER and grammar_for("$") is AMOUNT and grammar_for("*") is None
    assert parse_value("n", "1,234") == 1234
    assert parse_value("$", "$5") == {"amount": 5.0, "currency": "USD"}
    assert parse_value("*", "September") is None
    for bad in ("?", "x"):
        with pytest.raises(ValueError):
            grammar_for(bad)
        with pytest.raises(ValueError):
            parse_value(bad, "1")


def test_parsed_values_fit_the_response_answer():
    amount = parse_amount("($5)")
    answer = Answer(text="($5)", p=0.9, value=amount["amount"], currency=amount["currency"])
    assert answer.model_dump() == {"text": "($5)", "p": 0.9, "value": -5.0, "currency": "USD"}
    assert Answer(text="3.5 million", p=0.5, value=parse_number("3.5 million")).value == 3.5e6


def test_brackets_percent_scales_and_full_stops():
    assert parse_number(" (3.5)") == -parse_number(" 3.5")
    assert parse_number("12.5%") == 12.5            # the number as written
    assert parse_number("3.5 million") == 3_500_000.0 and type(parse_number("3 million")) is int
    assert parse_number("3.") == 3 and type(parse_number("3.")) is int
    assert parse_amount("($1,284.50)") == {"amount": -1284.5, "currency": "USD"}
    assert parse_amount("$(3.2 million)") == {"amount": -3.2e6, "currency": "USD"}
    # a full stop is complete yet may go on: "3." can still become "3.5"
    state = NUMBER.feed(NUMBER.start, "3.")
    assert NUMBER.accepts(state) and NUMBER.next_chars(state) == tuple("0123456789")
    # a number's scales are words: "3 k" is no number, but an amount
    assert not number_prefix_ok("3 k") and amount_complete("3 k")


def test_alphabet_and_next_chars():
    assert set("0123456789 ,.-+()%") <= NUMBER.alphabet and "$" not in NUMBER.alphabet
    assert {"$", "€", "U", "S", "D"} <= AMOUNT.alphabet
    assert NUMBER.next_chars(ValueGrammar.DEAD) == ()
    closed = NUMBER.feed(NUMBER.start, "(12)")
    assert NUMBER.accepts(closed) and NUMBER.next_chars(closed) == ()


def test_module_does_not_import_torch():
    code = ("import sys, spinf_worker.extract_values; "
            "sys.exit('torch' in sys.modules or 'pydantic' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0

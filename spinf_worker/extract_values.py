"""Grammars and parsers for the values of extraction slots: ``{n}`` numbers, ``{$}`` amounts.

The decoder uses the grammars to keep only tokens that can still lead to a valid answer (and to
tell when the next token cannot continue one: the answer ends there), and the parsers to turn a
finished answer into its ``value``. Pure Python.

Number (``{n}``)::

    number   = [space] ( [sign] quantity                    3.5 million  -12  12.5%
                       | [sign] integer "."                 3.  (a full stop: the number 3)
                       | "(" quantity ")" )                 (1,284)  accounting brackets: negative
    quantity = integer [fraction] [[space] (scale | "%")]
    integer  = digit+  |  digit{1,3} ("," digit{3})+         1234, 1,234, 12,345,678
    fraction = "." digit+                                   1.5, 1,284.50
    scale    = thousand | million | billion | trillion      any letter case
    space    = " " | U+00A0 | U+202F                        one, as tokenizers glue it on
    sign     = "-" | "+" | U+2212 (minus sign)

Digits are ASCII 0-9. "," only separates thousands and "." is the decimal point (or a full
stop after a whole number). A percentage is the number as written (12.5% is 12.5). Not
numbers: ".5", "1,2", "1e6", "1 000", "3.5 mn", "(-3)".

Amount (``{$}``)::

    amount   = [space] ( [sign] currency [space] end        $1,284.50  -$5  USD 12  $40.
                       | currency [space] sign end          $-5  USD -12
                       | [sign] end                         12.5bn  12.
                       | [sign] value [space] currency      1,284.50 USD  12 €
                       | "(" unsigned ")"                   ($1,284.50)  (12 USD): negative
                       | currency [space] "(" value ")" )   $(1,284.50): negative
    unsigned = currency [space] value | value [[space] currency]
    end      = value | integer "."                          a full stop after a whole amount
    value    = integer [fraction] [[space] scale]           €3.2 million  EUR 40k
    currency = "$" | "€" | "£" | "¥"  |  three letters A-Z      ISO 4217 style, not checked
    scale    = thousand | million | billion | trillion          any letter case
             | k | m | mm | mn | b | bn | t | tn               any letter case

At most one sign and one currency. Symbols map to USD, EUR, GBP and JPY; a code is kept as
written; no currency gives ``None``. ``m``/``mm``/``mn`` are millions, ``b``/``bn`` billions,
``t``/``tn`` trillions, ``k`` thousands.

Both grammars are deterministic automata over characters (``ValueGrammar``), built once at
import: a check costs one dict lookup per character, and a decoder can keep the state after
the text so far and feed only a candidate token's characters (``feed``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from decimal import Decimal
from itertools import pairwise

__all__ = [
    "AMOUNT",
    "CURRENCY_SYMBOLS",
    "NUMBER",
    "ValueGrammar",
    "amount_complete",
    "amount_prefix_ok",
    "grammar_for",
    "number_complete",
    "number_prefix_ok",
    "parse_amount",
    "parse_number",
    "parse_value",
]

CURRENCY_SYMBOLS = {"$": "USD", "€": "EUR", "£": "GBP", "¥": "JPY"}
NUMBER_SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}
SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12,
          "k": 10**3, "m": 10**6, "mm": 10**6, "mn": 10**6,
          "b": 10**9, "bn": 10**9, "t": 10**12, "tn": 10**12}

_SPACES = " \u00a0\u202f"
_SIGNS = "-+\u2212"
_DIGITS = "0123456789"
_UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


class ValueGrammar:
    """A deterministic automaton: states are ints, ``DEAD`` (-1) once no valid value can
    follow. Every live state can still reach a complete value."""

    DEAD = -1
    start = 0

    def __init__(self, name: str, transitions: list[dict[str, int]], accepting: list[bool]):
        self.name = name
        self._transitions = transitions
        self._accepting = accepting

    @property
    def states(self) -> int:
        return len(self._transitions)

    @property
    def alphabet(self) -> frozenset[str]:
        """Every character that can appear in a value."""
        return frozenset(char for row in self._transitions for char in row)

    def feed(self, state: int, text: str) -> int:
        """The state after reading ``text`` from ``state`` (``DEAD`` stays ``DEAD``)."""
        transitions = self._transitions
        for char in text:
            if state < 0:
                break
            state = transitions[state].get(char, -1)
        return state

    def next_chars(self, state: int) -> tuple[str, ...]:
        """The characters that can follow the text that led to ``state``."""
        return tuple(self._transitions[state]) if state >= 0 else ()

    def accepts(self, state: int) -> bool:
        """Whether the text that led to ``state`` is a complete value."""
        return state >= 0 and self._accepting[state]

    def can_extend(self, state: int) -> bool:
        """Whether some character can follow (False: the value is finished)."""
        return state >= 0 and bool(self._transitions[state])

    def prefix_ok(self, text: str) -> bool:
        """Whether ``text`` is a complete value or can be extended into one."""
        return self.feed(self.start, text) >= 0

    def complete(self, text: str) -> bool:
        return self.accepts(self.feed(self.start, text))


# ---- building the automata ----------------------------------------------------------------
# Thompson construction: a fragment is (entry state, exit state) of a small NFA whose edges
# carry a set of characters or None (an empty move); the subset construction turns it into a
# ValueGrammar. A grammar piece is a function of the builder so that each use gets fresh
# states.

_Fragment = tuple[int, int]
_Piece = Callable[["_Nfa"], _Fragment]


class _Nfa:
    def __init__(self) -> None:
        self.edges: list[list[tuple[frozenset[str] | None, int]]] = []

    def state(self) -> int:
        self.edges.append([])
        return len(self.edges) - 1

    def link(self, source: int, target: int, chars: Iterable[str] | None = None) -> None:
        self.edges[source].append((None if chars is None else frozenset(chars), target))


def _chars(chars: str) -> _Piece:
    def build(nfa: _Nfa) -> _Fragment:
        entry, exit_ = nfa.state(), nfa.state()
        nfa.link(entry, exit_, chars)
        return entry, exit_
    return build


def _seq(*pieces: _Piece) -> _Piece:
    def build(nfa: _Nfa) -> _Fragment:
        fragments = [piece(nfa) for piece in pieces]
        for (_, exit_), (entry, _) in pairwise(fragments):
            nfa.link(exit_, entry)
        return fragments[0][0], fragments[-1][1]
    return build


def _alt(*pieces: _Piece) -> _Piece:
    def build(nfa: _Nfa) -> _Fragment:
        entry, exit_ = nfa.state(), nfa.state()
        for piece in pieces:
            first, last = piece(nfa)
            nfa.link(entry, first)
            nfa.link(last, exit_)
        return entry, exit_
    return build


# _opt and _plus wrap the piece in fresh entry and exit states: adding the skip or the loop
# to the piece's own states would let a loop inside it be entered by the skip.


def _opt(piece: _Piece) -> _Piece:
    def build(nfa: _Nfa) -> _Fragment:
        entry, exit_ = nfa.state(), nfa.state()
        first, last = piece(nfa)
        nfa.link(entry, first)
        nfa.link(last, exit_)
        nfa.link(entry, exit_)
        return entry, exit_
    return build


def _plus(piece: _Piece) -> _Piece:
    def build(nfa: _Nfa) -> _Fragment:
        entry, exit_ = nfa.state(), nfa.state()
        first, last = piece(nfa)
        nfa.link(entry, first)
        nfa.link(last, exit_)
        nfa.link(last, first)
        return entry, exit_
    return build


def _word(word: str) -> _Piece:
    """``word`` in any letter case."""
    return _seq(*(_chars(char.lower() + char.upper()) for char in word))


def _compile(name: str, piece: _Piece) -> ValueGrammar:
    nfa = _Nfa()
    entry, accept = piece(nfa)
    alphabet = sorted({char for edges in nfa.edges for chars, _ in edges if chars for char in chars})

    def closure(states: Iterable[int]) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:
            for chars, target in nfa.edges[todo.pop()]:
                if chars is None and target not in seen:
                    seen.add(target)
                    todo.append(target)
        return frozenset(seen)

    first = closure([entry])
    ids = {first: 0}
    sets = [first]
    moves: list[dict[str, frozenset[int]]] = []
    for current in sets:  # grows while it is walked
        out: dict[str, frozenset[int]] = {}
        for char in alphabet:
            targets = [t for s in current for chars, t in nfa.edges[s] if chars and char in chars]
            if targets:
                following = closure(targets)
                out[char] = following
                if following not in ids:
                    ids[following] = len(sets)
                    sets.append(following)
        moves.append(out)
    accepting = [accept in states for states in sets]
    # Keep only states that can still reach a complete value (all of them, for the grammars
    # above; kept as a guard so that a live state always means "can still be completed").
    live = {i for i, ok in enumerate(accepting) if ok}
    grew = True
    while grew:
        grew = False
        for i, out in enumerate(moves):
            if i not in live and any(ids[target] in live for target in out.values()):
                live.add(i)
                grew = True
    if 0 not in live:
        raise ValueError(f"grammar {name} accepts nothing")
    renumber = {old: new for new, old in enumerate(sorted(live))}
    transitions = [{char: renumber[ids[target]] for char, target in moves[old].items()
                    if ids[target] in live} for old in sorted(live)]
    return ValueGrammar(name, transitions, [accepting[old] for old in sorted(live)])


_space = _chars(_SPACES)
_sign = _chars(_SIGNS)
_digit = _chars(_DIGITS)
_integer = _alt(
    _plus(_digit),
    _seq(_digit, _opt(_digit), _opt(_digit), _plus(_seq(_chars(","), _digit, _digit, _digit))),
)
_body = _seq(_integer, _opt(_seq(_chars("."), _plus(_digit))))
_full_stop = _seq(_integer, _chars("."))   # "3." ends a sentence: the value is 3
_currency = _alt(_chars("".join(CURRENCY_SYMBOLS)), _seq(*([_chars(_UPPER)] * 3)))

_number_scale = _alt(*(_word(word) for word in NUMBER_SCALES))
_quantity = _seq(_body, _opt(_seq(_opt(_space), _alt(_number_scale, _chars("%")))))
NUMBER = _compile("number", _seq(_opt(_space), _alt(
    _seq(_opt(_sign), _alt(_quantity, _full_stop)),
    _seq(_chars("("), _quantity, _chars(")")),
)))

_scale = _alt(*(_word(word) for word in SCALES))
_value = _seq(_body, _opt(_seq(_opt(_space), _scale)))
_end = _alt(_value, _full_stop)
_unsigned = _alt(_seq(_currency, _opt(_space), _value),
                 _seq(_value, _opt(_seq(_opt(_space), _currency))))
AMOUNT = _compile("amount", _seq(_opt(_space), _alt(
    _seq(_opt(_sign), _currency, _opt(_space), _end),
    _seq(_currency, _opt(_space), _sign, _end),
    _seq(_opt(_sign), _end),
    _seq(_opt(_sign), _value, _opt(_space), _currency),
    _seq(_chars("("), _unsigned, _chars(")")),
    _seq(_currency, _opt(_space), _chars("("), _value, _chars(")")),
)))


def number_prefix_ok(text: str) -> bool:
    """Whether ``text`` is a number or can be extended into one ("", " ", "-", "1,2", "12.")."""
    return NUMBER.prefix_ok(text)


def number_complete(text: str) -> bool:
    return NUMBER.complete(text)


def amount_prefix_ok(text: str) -> bool:
    """Whether ``text`` is an amount or can be extended into one ("$", "USD ", "3.2 mil")."""
    return AMOUNT.prefix_ok(text)


def amount_complete(text: str) -> bool:
    return AMOUNT.complete(text)


# ---- parsing ------------------------------------------------------------------------------
# A complete value is taken apart in two steps: its leading space, accounting brackets and full
# stop come off, and what is left matches one of the regular expressions below (the grammars
# without those). The automaton says first whether the text is a complete value at all.

_SP = f"[{_SPACES}]"
_SIGN = f"[{_SIGNS}]"
_BODY = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?"
_CURRENCY = "[" + re.escape("".join(CURRENCY_SYMBOLS)) + "]|[A-Z]{3}"
_SCALE = "(?i:" + "|".join(sorted(SCALES, key=len, reverse=True)) + ")"
_NUMBER_SCALE = "(?i:" + "|".join(NUMBER_SCALES) + ")"

_NUMBER_PARTS = re.compile(
    f"(?P<sign>{_SIGN})?(?P<body>{_BODY})(?:{_SP}?(?:(?P<scale>{_NUMBER_SCALE})|%))?")
# One sign and one currency at most: the automaton has already rejected the others.
_AMOUNT_PARTS = re.compile(
    f"(?P<sign>{_SIGN})?(?:(?P<before>{_CURRENCY}){_SP}?(?P<sign2>{_SIGN})?)?"
    f"(?P<body>{_BODY})(?:{_SP}?(?P<scale>{_SCALE}))?(?:{_SP}?(?P<after>{_CURRENCY}))?")


def _unwrap(text: str) -> tuple[str, bool]:
    """A complete value without its leading space, full stop and brackets; and whether it
    was in brackets (negative). "(1,284)" -> ("1,284", True); "$(12)" -> ("$12", True)."""
    if text[:1] in _SPACES:
        text = text[1:]
    if text.endswith("."):   # in a complete value, only a full stop can end it
        text = text[:-1]
    opening = text.find("(")
    if opening < 0:
        return text, False
    return text[:opening] + text[opening + 1:-1], True


def _negative(sign: str | None) -> bool:
    return sign is not None and sign != "+"


def _scaled(body: str, scale: int) -> int | float:
    """``body`` (digits, maybe a decimal point) times ``scale``: an int when it has no decimal
    point, else a float rounded once (``Decimal`` keeps 3.2 million exact)."""
    if "." not in body:
        return int(body) * scale
    value = float(Decimal(body) * scale)
    if not math.isfinite(value):
        raise ValueError(f"value out of range: {body!r}")
    return value


def parse_number(text: str) -> int | float:
    """The value of a complete number: an int when it has no decimal point, else a float.
    Brackets and minus signs make it negative; a scale word multiplies; a percentage is the
    number as written (12.5% is 12.5).

    ``ValueError`` when ``text`` is not a complete number or does not fit a float."""
    if not NUMBER.complete(text):
        raise ValueError(f"not a number: {text!r}")
    core, bracketed = _unwrap(text)
    match = _NUMBER_PARTS.fullmatch(core)
    scale = NUMBER_SCALES[match["scale"].lower()] if match["scale"] else 1
    try:
        value = _scaled(match["body"].replace(",", ""), scale)
    except ValueError:
        raise ValueError(f"number out of range: {text!r}") from None
    return -value if bracketed or _negative(match["sign"]) else value


def parse_amount(text: str) -> dict:
    """The value of a complete amount: ``{"amount": float, "currency": str | None}``.

    ``ValueError`` when ``text`` is not a complete amount or does not fit a float."""
    if not AMOUNT.complete(text):
        raise ValueError(f"not an amount: {text!r}")
    core, bracketed = _unwrap(text)
    match = _AMOUNT_PARTS.fullmatch(core)
    amount = Decimal(match["body"].replace(",", ""))
    if match["scale"]:
        amount *= SCALES[match["scale"].lower()]
    value = float(amount)
    if not math.isfinite(value):
        raise ValueError(f"amount out of range: {text!r}")
    if bracketed or _negative(match["sign"] or match["sign2"]):
        value = -value
    currency = match["before"] or match["after"]
    return {"amount": value, "currency": CURRENCY_SYMBOLS.get(currency, currency)}


def grammar_for(kind: str) -> ValueGrammar | None:
    """The grammar constraining an extraction slot (``"n"``, ``"$"``); None for ``"*"``."""
    if kind not in ("*", "n", "$"):
        raise ValueError(f"not an extraction slot kind: {kind!r}")
    return {"n": NUMBER, "$": AMOUNT}.get(kind)


def parse_value(kind: str, text: str) -> int | float | dict | None:
    """A candidate's ``value``: None for a span, else ``parse_number`` / ``parse_amount``."""
    if kind == "n":
        return parse_number(text)
    if kind == "$":
        return parse_amount(text)
    if kind == "*":
        return None
    raise ValueError(f"not an extraction slot kind: {kind!r}")

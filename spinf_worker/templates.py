"""The query template language (the hosted API's rules), parsed into parts and expanded into
one prompt per combination.

A template is text appended after the presented content:

- ``{?}`` is the scored slot: options are scored as continuations of the text before it.
- ``{name}`` (letters, digits, ``_``; at most five) is a placeholder filled from the query's
  ``combinations``: a list of {name: value}, or ``"all"`` with ``values`` (every mix).
- ``{*}``, ``{n}`` and ``{$}`` are extraction slots (text, number, money amount): the answer
  is decoded after the text before the slot. ``{?}``, ``{n}`` and ``{$}`` end the template;
  the literal text after ``{*}`` (no newline) is where its answer ends (``'A: "{*}"'``).
- ``{{`` and ``}}`` stand for literal braces. Any other brace is an error.

A template has exactly one slot. Because ``{n}`` is a slot, no placeholder can be called ``n``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from itertools import product

from spinf_worker.errors import InvalidRequestError

SCORED = "?"
EXTRACTION_KINDS = ("*", "n", "$")
SLOT_KINDS = (SCORED, *EXTRACTION_KINDS)
_NAME = re.compile(r"[A-Za-z0-9_]+")
SLOT_NAMES = {SCORED: "scored slot", "*": "span slot", "n": "number slot", "$": "amount slot"}


@dataclass(frozen=True)
class Literal:
    text: str


@dataclass(frozen=True)
class Placeholder:
    name: str


@dataclass(frozen=True)
class Slot:
    kind: str  # one of SLOT_KINDS


Part = Literal | Placeholder | Slot


@dataclass(frozen=True)
class Template:
    source: str
    parts: tuple[Part, ...]

    @property
    def placeholders(self) -> tuple[str, ...]:
        """Distinct placeholder names, in order of first appearance."""
        names = (part.name for part in self.parts if isinstance(part, Placeholder))
        return tuple(dict.fromkeys(names))

    @property
    def slots(self) -> tuple[Slot, ...]:
        return tuple(part for part in self.parts if isinstance(part, Slot))

    @property
    def slot(self) -> Slot:
        """The template's one slot; ``InvalidRequestError`` (``invalid_template``, param
        ``template``) when it has none or several. ``check_template`` names the param."""
        return _one_slot(self, "template")


@dataclass(frozen=True)
class Combination:
    values: dict[str, str]  # placeholder name -> chosen value ({} when the template has none)
    prefix: str  # the template text before the slot, placeholders filled, escapes resolved
    # Extraction slots: the literal text after the slot (decoding ends where it appears), or
    # None when the slot ends the template. Always None for {?}.
    stop: str | None = None


def parse_template(source: str, *, param: str = "template") -> Template:
    """Split ``source`` into literal text, placeholders and slots.

    Adjacent literal text (including resolved ``{{``/``}}``) is merged into one ``Literal``.
    Bulk jobs ask the same questions of every document, so parses are cached (errors are not).
    """
    return _parse_cached(source, param)


@lru_cache(maxsize=16384)
def _parse_cached(source: str, param: str) -> Template:
    parts: list[Part] = []
    text: list[str] = []  # literal text not yet flushed into a Literal part

    def flush() -> None:
        if text:
            parts.append(Literal("".join(text)))
            text.clear()

    i = 0
    while i < len(source):
        char = source[i]
        if char == "{" and source.startswith("{{", i):
            text.append("{")
            i += 2
        elif char == "}" and source.startswith("}}", i):
            text.append("}")
            i += 2
        elif char == "}":
            raise _template_error(
                f"unexpected '}}' at offset {i}; write '}}}}' for a literal brace", param)
        elif char == "{":
            end = _closing_brace(source, i)
            if end is None:
                raise _template_error(
                    f"unclosed '{{' at offset {i}; write '{{{{' for a literal brace", param)
            flush()
            parts.append(_field(source[i + 1:end], offset=i, param=param))
            i = end + 1
        else:
            text.append(char)
            i += 1
    flush()
    return Template(source=source, parts=tuple(parts))


def _closing_brace(source: str, start: int) -> int | None:
    """Offset of the '}' closing the '{' at ``start``, or None when another '{' or the end
    comes first (braces do not nest)."""
    for j in range(start + 1, len(source)):
        if source[j] == "}":
            return j
        if source[j] == "{":
            return None
    return None


def _field(inner: str, *, offset: int, param: str) -> Placeholder | Slot:
    if inner in SLOT_KINDS:
        return Slot(inner)
    if _NAME.fullmatch(inner):
        return Placeholder(inner)
    problem = "empty '{}'" if inner == "" else f"invalid placeholder '{{{inner}}}'"
    raise _template_error(
        f"{problem} at offset {offset}; use {{?}}, {{*}}, {{n}}, {{$}}, {{name}} with a name of "
        "letters, digits and _, or '{{' and '}}' for literal braces", param)


def _template_error(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"template: {message}", param=param, code="invalid_template")


def _one_slot(template: Template, param: str) -> Slot:
    slots = template.slots
    if len(slots) == 1:
        return slots[0]
    if not slots:
        raise InvalidRequestError(
            "template has no slot (no scored slot {?} and no extraction slot {*}, {n} or "
            "{$}); exactly one is required", param=param, code="invalid_template")
    counts = {kind: sum(1 for slot in slots if slot.kind == kind)
              for kind in dict.fromkeys(slot.kind for slot in slots)}
    kinds = ", ".join(f"{count} {SLOT_NAMES[kind]}{'s' if count > 1 else ''} {{{kind}}}"
                      for kind, count in counts.items())
    raise InvalidRequestError(
        f"template has {len(slots)} slots ({kinds}); exactly one is allowed", param=param,
        code="invalid_template")


MAX_PLACEHOLDERS = 5
MAX_ALL_COMBINATIONS = 1000   # a grid asked as "all"
MAX_VALUE_CHARS = 256


@lru_cache(maxsize=16384)
def check_template(template: Template, *, param: str = "template") -> Slot:
    """Check the rules every query template follows and return its one slot (cached like
    ``parse_template``; errors are raised each time).

    - exactly one slot (``{?}``, ``{*}``, ``{n}`` or ``{$}``) and at most five placeholders;
    - ``{?}``, ``{n}`` and ``{$}`` end the template;
    - ``{*}`` may be followed by literal text without a newline: where the answer ends (a
      closing quote).
    """
    slot = _one_slot(template, param)
    if len(template.placeholders) > MAX_PLACEHOLDERS:
        raise InvalidRequestError(
            f"template has {len(template.placeholders)} placeholders; at most "
            f"{MAX_PLACEHOLDERS} are allowed", param=param, code="invalid_template")
    after = template.parts[_slot_index(template) + 1:]
    if slot.kind != "*" and after:
        raise InvalidRequestError(
            f"the {SLOT_NAMES[slot.kind]} {{{slot.kind}}} must end the template",
            param=param, code="invalid_template")
    if after and (len(after) > 1 or not isinstance(after[0], Literal) or "\n" in after[0].text):
        raise InvalidRequestError(
            "the text after {*} is where the answer ends: literal text without placeholders "
            "or newlines", param=param, code="invalid_template")
    return slot


def check_scored_template(template: Template, *, param: str = "template") -> None:
    """Require exactly one slot and that it is ``{?}`` (``check_template``'s rules)."""
    if check_template(template, param=param).kind != SCORED:
        raise InvalidRequestError("this template needs the scored slot {?}", param=param,
                                  code="invalid_template")


def check_combinations(template: Template, combinations: list[dict[str, str]] | str | None,
                       values: dict[str, list[str]] | None, *, param: str) -> int:
    """Check a query's ``combinations`` (a list of {name: value}, or ``"all"`` with
    ``values``) against the template's placeholders; returns how many there are. The size of
    "all" is computed from the list lengths, so an oversized grid fails unbuilt."""
    names = template.placeholders
    if values is not None and combinations != "all":
        # the old grid shape: silently ignoring it would score other prompts than meant
        raise InvalidRequestError('`values` is read only with `combinations: "all"`',
                                  param=f"{param}.values", code="invalid_field")
    if combinations == "all":
        if not values:
            raise InvalidRequestError('"all" needs `values`: {name: [value, ...]}',
                                      param=f"{param}.values", code="missing_value")
        _same_names(set(values), names, f"{param}.values")
        for name in names:
            if not values[name]:
                raise InvalidRequestError(f"values.{name} is empty",
                                          param=f"{param}.values.{name}", code="missing_value")
            for index, value in enumerate(values[name]):
                _check_value(value, f"{param}.values.{name}.{index}")
        size = math.prod(len(values[name]) for name in names)
        if size > MAX_ALL_COMBINATIONS:
            raise InvalidRequestError(
                f'"all" gives {size:,} combinations; the limit is {MAX_ALL_COMBINATIONS:,}',
                param=f"{param}.combinations", code="too_many_combinations")
        return size
    if combinations is None:
        if names:
            raise InvalidRequestError(
                f"the template has placeholders {sorted(names)}: send `combinations`",
                param=f"{param}.combinations", code="missing_value")
        return 1
    if not combinations:
        raise InvalidRequestError("`combinations` is empty", param=f"{param}.combinations",
                                  code="missing_value")
    for index, combination in enumerate(combinations):
        where = f"{param}.combinations.{index}"
        _same_names(set(combination), names, where)
        for name, value in combination.items():
            _check_value(value, f"{where}.{name}")
    return len(combinations)


def _same_names(got: set[str], names: tuple[str, ...], param: str) -> None:
    if got - set(names):
        raise InvalidRequestError(f"{sorted(got - set(names))} not in the template",
                                  param=param, code="unknown_placeholder")
    if set(names) - got:
        raise InvalidRequestError(f"no value for {sorted(set(names) - got)}", param=param,
                                  code="missing_value")


def _check_value(value: str, param: str) -> None:
    if len(value) > MAX_VALUE_CHARS:
        raise InvalidRequestError(f"a value is over {MAX_VALUE_CHARS} characters",
                                  param=param, code="invalid_field")


def expand(template: Template, combinations: list[dict[str, str]] | str | None,
           values: dict[str, list[str]] | None, *, param: str = "") -> list[Combination]:
    """The prompts of a query: per combination, the text before the slot and, for ``{*}``,
    the stop string after it. ``"all"`` is the cartesian product of ``values`` in order of
    first appearance (the first placeholder varies slowest)."""
    slot = check_template(template, param=f"{param}.template" if param else "template")
    check_combinations(template, combinations, values, param=param)
    names = template.placeholders
    if combinations == "all":
        chosen = [dict(zip(names, picked, strict=True))
                  for picked in product(*(values[name] for name in names))]
    else:
        chosen = combinations or [{}]
    before = _parts_before_slot(template)
    stop = _stop_string(template) if slot.kind in EXTRACTION_KINDS else None
    return [Combination(values={name: filled[name] for name in names},
                        prefix="".join(filled[part.name] if isinstance(part, Placeholder)
                                       else part.text for part in before),
                        stop=stop)
            for filled in chosen]


def _slot_index(template: Template) -> int:
    """Index in ``parts`` of the first slot (the only one once the template is checked)."""
    return next(i for i, part in enumerate(template.parts) if isinstance(part, Slot))


def _parts_before_slot(template: Template) -> list[Literal | Placeholder]:
    return list(template.parts[:_slot_index(template)])


def _stop_string(template: Template) -> str | None:
    """The literal text right after the slot (None when the slot ends the template)."""
    after = template.parts[_slot_index(template) + 1:]
    if after and isinstance(after[0], Literal):
        return after[0].text
    return None

"""The query template language, parsed into parts and expanded into a grid of prompts.

A template is text appended after the presented content:

- ``{?}`` is the scored slot: options are scored as continuations of the text before it.
- ``{name}`` is a placeholder (``name`` an identifier) filled from the query's ``values``.
- ``{*}``, ``{n}`` and ``{$}`` are extraction slots (span, number, money amount): the answer
  is decoded after the text before the slot. The literal text right after an extraction slot
  is its stop string (``'A: "{*}"'`` stops at ``'"'``); no placeholder may follow the slot.
- ``{{`` and ``}}`` stand for literal braces. Any other brace is an error.

A template has exactly one slot. Because ``{n}`` is a slot, no placeholder can be called ``n``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import product

from spinf_worker.errors import InvalidRequestError

SCORED = "?"
EXTRACTION_KINDS = ("*", "n", "$")
SLOT_KINDS = (SCORED, *EXTRACTION_KINDS)
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
    if inner.isidentifier():
        return Placeholder(inner)
    problem = "empty '{}'" if inner == "" else f"invalid placeholder '{{{inner}}}'"
    raise _template_error(
        f"{problem} at offset {offset}; use {{?}}, {{*}}, {{n}}, {{$}}, {{name}} with an "
        "identifier name, or '{{' and '}}' for literal braces", param)


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


@lru_cache(maxsize=16384)
def check_template(template: Template, *, param: str = "template") -> Slot:
    """Check the rules every query template follows and return its one slot (cached like
    ``parse_template``; errors are raised each time).

    - exactly one slot (``{?}``, ``{*}``, ``{n}`` or ``{$}``);
    - ``{?}``: no placeholder used only after the slot (text after the scored slot is ignored,
      so such a placeholder would only repeat the same question);
    - extraction slots: no placeholder after the slot (the text after it is the literal stop
      string, the same for every combination).
    """
    slot = _one_slot(template, param)
    after = _placeholders_after_slot(template)
    if slot.kind == SCORED:
        before = set(_placeholders_before_slot(template))
        for name in after:
            if name not in before:
                raise InvalidRequestError(
                    f"placeholder {{{name}}} appears only after {{?}}; text after the scored "
                    "slot is ignored", param=param, code="invalid_template")
    elif after:
        raise InvalidRequestError(
            f"placeholder {{{after[0]}}} appears after the extraction slot {{{slot.kind}}}; "
            "the text after an extraction slot is its stop string and must be literal",
            param=param, code="invalid_template")
    return slot


def check_scored_template(template: Template, *, param: str = "template") -> None:
    """Require exactly one slot and that it is ``{?}`` (``check_template``'s rules)."""
    if check_template(template, param=param).kind != SCORED:
        raise InvalidRequestError("this template needs the scored slot {?}", param=param,
                                  code="invalid_template")


def check_grid(template: Template, values: dict[str, list[str]], *, max_combinations: int,
               param: str = "values") -> int:
    """Check ``values`` against the template's placeholders and return the grid size.

    The size is computed from the list lengths, so an oversized grid fails without being built.
    """
    names = template.placeholders
    for key in values:
        if key not in names:
            raise InvalidRequestError(
                f"values has {key!r} but the template has no placeholder {{{key}}}",
                param=f"{param}.{key}", code="unknown_placeholder")
    for name in names:
        choices = values.get(name)
        if not choices:
            raise InvalidRequestError(f"placeholder {{{name}}} has no values",
                                      param=f"{param}.{name}", code="missing_values")
        seen: set[str] = set()
        for index, choice in enumerate(choices):
            if not isinstance(choice, str):
                raise InvalidRequestError(f"values for {{{name}}} must be strings",
                                          param=f"{param}.{name}.{index}")
            if choice in seen:
                raise InvalidRequestError(
                    f"duplicate value {choice!r} for placeholder {{{name}}}",
                    param=f"{param}.{name}.{index}", code="duplicate_value")
            seen.add(choice)
    size = math.prod(len(values[name]) for name in names)
    if size > max_combinations:
        raise InvalidRequestError(
            f"values expand to {size} combinations; at most {max_combinations} are allowed",
            param=param, code="grid_too_large")
    return size


def expand_grid(template: Template, values: dict[str, list[str]], *, max_combinations: int,
                param: str = "values", template_param: str = "template") -> list[Combination]:
    """Every combination of placeholder values, with the text before the slot and, for an
    extraction slot, the stop string after it.

    Enforces ``check_template`` and the values rules (``check_grid``) first. Text after
    ``{?}`` is ignored; the literal text after an extraction slot is ``Combination.stop``.
    The grid is the cartesian product in order of first appearance: the first placeholder
    varies slowest.
    """
    slot = check_template(template, param=template_param)
    check_grid(template, values, max_combinations=max_combinations, param=param)
    names = template.placeholders
    before = _parts_before_slot(template)
    stop = _stop_string(template) if slot.kind in EXTRACTION_KINDS else None
    combinations = []
    for chosen in product(*(values[name] for name in names)):
        filled = dict(zip(names, chosen, strict=True))
        prefix = "".join(
            filled[part.name] if isinstance(part, Placeholder) else part.text for part in before)
        combinations.append(Combination(values=filled, prefix=prefix, stop=stop))
    return combinations


def scored_prefix_combinations(template_source: str, values: dict[str, list[str]], *,
                               max_combinations: int, param: str = "values",
                               template_param: str = "template") -> list[Combination]:
    """Parse a scored query's template and expand it (see ``expand_grid``)."""
    template = parse_template(template_source, param=template_param)
    check_scored_template(template, param=template_param)
    return expand_grid(template, values, max_combinations=max_combinations, param=param,
                       template_param=template_param)


def _slot_index(template: Template) -> int:
    """Index in ``parts`` of the first slot (the only one once the template is checked)."""
    return next(i for i, part in enumerate(template.parts) if isinstance(part, Slot))


def _parts_before_slot(template: Template) -> list[Literal | Placeholder]:
    return list(template.parts[:_slot_index(template)])


def _placeholders_before_slot(template: Template) -> list[str]:
    return [part.name for part in _parts_before_slot(template) if isinstance(part, Placeholder)]


def _placeholders_after_slot(template: Template) -> list[str]:
    after = template.parts[_slot_index(template) + 1:]
    return list(dict.fromkeys(part.name for part in after if isinstance(part, Placeholder)))


def _stop_string(template: Template) -> str | None:
    """The literal text right after the slot, up to the next placeholder, slot or the end."""
    after = template.parts[_slot_index(template) + 1:]
    if after and isinstance(after[0], Literal):
        return after[0].text
    return None

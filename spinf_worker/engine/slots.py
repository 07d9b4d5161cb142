"""Extraction slots ({*} {n} {$}) between a query and the decoder: the decoder's settings of
one slot, and the hosted result of what it found.

A result's answers are merged over spellings: text answers by case, punctuation and spaces
(" Coca-Cola", "coca cola." and "COCA COLA" are one answer, shown in its most likely
spelling), numbers and amounts by value (and currency: "$5" and "5 USD" are one answer, "5"
another). ``mass`` is the probability on every answer found; ``p_negative`` (numbers,
amounts) the share of the top value's magnitude that is on its negative, as accounting
brackets make the sign ambiguous; ``p_calibrated`` the top answer's p through the query's
calibration, sigmoid(a * logit(p) + b).
"""

from __future__ import annotations

import math
import unicodedata

from ..extract_values import grammar_for, parse_value
from ..protocol import Query
from ..templates import Combination
from .decode import Found, Sampling

SEARCH_BEAMS = 6   # beams of a searched slot (more when top_k asks for more answers)
# A closing quote also ends at its typographic twin (a model writes either).
QUOTE_TWINS = {'"': "\u201d", "'": "\u2019"}


def search_beams(q: Query) -> int:
    """Beams a searched slot runs side by side."""
    return max(SEARCH_BEAMS, q.answers_kept)


def slot_settings(q: Query, combo: Combination) -> dict:
    """SlotJob settings of an extraction query (engine/decode.py)."""
    stops = _stops(combo.stop)
    generation = q.generation
    if generation is not None:
        sampling = Sampling(temperature=float(generation.temperature),
                            top_p=float(generation.top_p), top_k=generation.top_k,
                            seed=generation.seed, n=generation.n)
        return dict(stops=stops, max_tokens=q.max_tokens, beam_width=generation.n,
                    candidates=generation.n, sample=sampling)
    beams = max(SEARCH_BEAMS, q.answers_kept)
    return dict(stops=stops, max_tokens=q.max_tokens, beam_width=beams, candidates=beams,
                grammar=grammar_for(q.slot_kind))


def _stops(stop: str | None) -> tuple[str, ...]:
    """Where a text answer ends: the template's text after the slot (and its typographic
    twin when it opens with a quote), and a newline."""
    if not stop:
        return ("\n",)
    twin = QUOTE_TWINS.get(stop[0])
    return (stop, twin + stop[1:], "\n") if twin else (stop, "\n")


def extraction_result(q: Query, values: dict[str, str], found: list[Found]) -> dict:
    """One combination's result (an ExtractedCombination's data)."""
    if q.generation is not None:   # no probability: a free text's is far too small to mean much
        return {"values": values,
                "answers": [{"text": f.text.strip(), "finish": f.finish} for f in found]}
    answers = _merged(q.slot_kind, found)
    out = {"values": values, "answers": answers[:q.answers_kept],
           "mass": min(1.0, sum(a["p"] for a in answers))}
    if q.slot_kind in ("n", "$") and answers and "value" in answers[0]:
        out["p_negative"] = _p_negative(answers)
    if q.calibration is not None and answers:
        out["p_calibrated"] = _calibrated(answers[0]["p"], q.calibration.a, q.calibration.b)
    return out


def _merged(kind: str, found: list[Found]) -> list[dict]:
    """The answers found, one per meaning, most likely first; each shown in its most likely
    spelling (without surrounding spaces) with the summed p of all its spellings."""
    groups: dict[object, dict] = {}
    for f in sorted(found, key=lambda f: -f.logprob):
        text = f.text.strip()
        if not text:
            continue
        answer = {"text": text, "p": 0.0}
        value = _value(kind, text)
        if value is None:
            key = ("text", text_key(text))
        elif kind == "$":
            key = ("value", value["amount"], value["currency"])
            answer.update(value=value["amount"], currency=value["currency"])
        else:
            key = ("value", float(value))
            answer["value"] = float(value)
        group = groups.setdefault(key, answer)
        group["p"] += math.exp(f.logprob)
    for answer in groups.values():
        answer["p"] = min(1.0, answer["p"])
    return sorted(groups.values(), key=lambda a: -a["p"])


def text_key(text: str) -> str:
    """What two spellings of one text answer share: its letters and digits, lower case, with
    punctuation and spaces left out ("Coca-Cola", " coca cola." -> "cocacola"). A text of
    punctuation alone is its own key."""
    kept = "".join(ch for ch in text.casefold()
                   if not ch.isspace() and not unicodedata.category(ch).startswith("P"))
    return kept or text.strip()


def _p_negative(answers: list[dict]) -> float | None:
    """The share of p on the negative among the answers of the top answer's magnitude
    (" (3.5)" against " 3.5"; any currency)."""
    magnitude = abs(answers[0]["value"])
    tolerance = 1e-9 * max(1.0, magnitude)
    same = [a for a in answers if "value" in a and abs(abs(a["value"]) - magnitude) <= tolerance]
    total = sum(a["p"] for a in same)
    if total <= 0:
        return None
    return sum(a["p"] for a in same if a["value"] < 0) / total


def _calibrated(p: float, a: float, b: float) -> float:
    p = min(max(p, 1e-12), 1 - 1e-12)
    z = a * math.log(p / (1 - p)) + b
    return 1 / (1 + math.exp(-z)) if z >= 0 else math.exp(z) / (1 + math.exp(z))


def _value(kind: str, text: str):
    """A number's or amount's parsed value; None for text, or a number too large for a float
    (the text still stands as an answer)."""
    try:
        return parse_value(kind, text)
    except ValueError:
        return None

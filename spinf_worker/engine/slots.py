"""Extraction slots ({*} {n} {$}) between a query and the decoder: the decoder's settings of
one slot, and the hosted result of what it found (answers, mass, p_negative, p_calibrated)."""

from __future__ import annotations

import math

from ..extract_values import grammar_for, parse_value
from ..protocol import Query
from ..templates import Combination

SEARCH_BEAMS = 6   # beams of a searched slot (more when top_k asks for more answers)


def slot_settings(q: Query, combo: Combination) -> dict:
    """SlotJob settings of an extraction query (engine/decode.py)."""
    stops = (combo.stop, "\n") if combo.stop else ("\n",)
    generation = q.generation
    if generation is not None:
        return dict(stops=stops, max_tokens=q.max_tokens, beam_width=1, candidates=1,
                    sample=(float(generation.temperature), generation.seed))
    beams = max(SEARCH_BEAMS, q.answers_kept)
    settings = dict(stops=stops, max_tokens=q.max_tokens, beam_width=beams, candidates=beams)
    grammar = grammar_for(q.slot_kind)
    if grammar is not None:
        settings.update(allowed=grammar.prefix_ok, complete=grammar.complete)
    return settings


def extraction_result(q: Query, values: dict[str, str], found: list) -> dict:
    """One combination's result: its answers, best first, merged over spellings."""
    if q.generation is not None:
        return {"values": values,
                "answers": [{"text": f.text, "finish": "stop"} for f in found]}
    merged = _merge_same_text(found)
    answers = []
    for text, logprob in merged[:q.answers_kept]:
        answer = {"text": text, "p": math.exp(logprob)}
        value = _value(q.slot_kind, text)
        if isinstance(value, dict):   # an amount
            answer.update(value=value["amount"], currency=value["currency"])
        elif value is not None:
            answer["value"] = float(value)
        answers.append(answer)
    out = {"values": values, "answers": answers,
           "mass": sum(math.exp(lp) for _, lp in merged)}
    if q.calibration is not None and answers:
        out["p_calibrated"] = _calibrated(answers[0]["p"], q.calibration.a, q.calibration.b)
    return out


def _calibrated(p: float, a: float, b: float) -> float:
    p = min(max(p, 1e-12), 1 - 1e-12)
    z = a * math.log(p / (1 - p)) + b
    return 1 / (1 + math.exp(-z)) if z >= 0 else math.exp(z) / (1 + math.exp(z))


def _value(kind: str, text: str):
    try:
        return parse_value(kind, text)
    except ValueError:   # e.g. a number too large for a float: the text still stands
        return None


def _merge_same_text(found: list) -> list[tuple[str, float]]:
    """Answers with the same text (other tokenisations, other stop tokens) are one answer
    whose probability is their sum; most likely first."""
    merged: dict[str, float] = {}
    for f in found:
        if f.text in merged:   # log(exp(a) + exp(b)) in float64, without overflow
            a, b = sorted((merged[f.text], f.logprob))
            merged[f.text] = b + math.log1p(math.exp(a - b))
        else:
            merged[f.text] = f.logprob
    return sorted(merged.items(), key=lambda item: -item[1])

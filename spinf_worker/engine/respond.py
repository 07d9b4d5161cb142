"""DocScores -> ScoreResponse: options with floor_p and residual, extraction candidates, and
the categories and decision of each pack asked for."""

from __future__ import annotations

import math
import time
import uuid

from ..extract_values import parse_value
from ..packs import Pack, PackQuestion, category_scores, decide
from ..protocol import Candidate, Query, ScoreResponse
from ..templates import Combination
from .prepare import Prepared
from .runner import DocScores


def build_response(p: Prepared, scores: DocScores, floors: dict[tuple, DocScores], *,
                   model: str, fingerprint: str) -> ScoreResponse:
    """The response of one prepared request, from its scores and its queries' floor scores
    (by floor key)."""
    # Built as plain data and validated once: a bulk job answers thousands of options a
    # second, and one validation of the whole response costs ~40% less than a model per option.
    query_scores, b, decoded = [], 0, 0
    for q, grid, fkey in zip(p.queries, p.query_set.grids, p.query_set.floor_keys, strict=True):
        combos = []
        for ci, combo in enumerate(grid):
            if fkey is None:       # an extraction slot
                found = scores.found.get(b, [])
                decoded += sum(len(f.tokens) for f in found)
                combos.append({"values": combo.values, "candidates": [
                    Candidate(text=text, logprob=lp, p=math.exp(lp),
                              value=_value(q.slot_kind, text))
                    for text, lp in _merge_same_text(found)]})
            else:
                combos.append(_option_scores(q, combo, scores, b, floors[fkey], ci))
            b += 1
        query_scores.append({"id": q.id, "combinations": combos})
    scored = p.query_set.block.n_scored + decoded
    n_own = len(p.request.scoring.queries)
    return ScoreResponse.model_validate({
        "id": f"score-{uuid.uuid4().hex}", "created": int(time.time()),
        "model": model, "system_fingerprint": fingerprint,
        "usage": {"prompt_tokens": p.flat.tokens, "scored_tokens": scored,
                  "total_tokens": p.flat.tokens + scored},
        "queries": query_scores[:n_own],
        "packs": _pack_results(p.packs, query_scores[n_own:])})


def _option_scores(q: Query, combo: Combination, scores: DocScores, b: int, floor: DocScores,
                   floor_b: int) -> dict:
    """Branch b's options: logprobs, probabilities over the options, floor probabilities
    (branch floor_b of the floor's DocTree), as a CombinationScore's data."""
    own, empty = scores.lists, floor.lists
    at, floor_at = own.branch_start[b], empty.branch_start[floor_b]
    return {"values": combo.values,
            "options": [{"text": o, "logprob": own.logprobs[at + k], "p": own.probs[at + k],
                         "floor_p": empty.probs[floor_at + k]} for k, o in enumerate(q.options)],
            "residual": own.residual[b]}


def _pack_results(packs: list[tuple[Pack, list[PackQuestion]]], scored: list[dict]) -> list[dict]:
    """Per requested pack: its questions' positive-option scores, categories, decision."""
    out, it = [], iter(scored)
    for named, chosen in packs:
        questions = []
        for question, score in zip(chosen, it, strict=False):   # `it` runs on to the next pack
            positive = next(o for o in score["combinations"][0]["options"]
                            if o["text"] == question.positive)
            questions.append({"id": question.id, "category": question.category,
                              "p": positive["p"], "floor_p": positive["floor_p"]})
        categories = category_scores(named, {q["id"]: (q["p"], q["floor_p"]) for q in questions})
        out.append({"id": named.id, "version": named.version, "questions": questions,
                    "categories": categories, "decision": decide(named, categories)})
    return out


def _value(kind: str, text: str):
    try:
        return parse_value(kind, text)
    except ValueError:   # e.g. a number too large for a float: the text still stands
        return None


def _merge_same_text(found: list) -> list[tuple[str, float]]:
    """Answers with the same text (other tokenisations, other stop tokens) are one candidate
    whose probability is their sum; most likely first."""
    merged: dict[str, float] = {}
    for f in found:
        if f.text in merged:   # log(exp(a) + exp(b)) in float64, without overflow
            a, b = sorted((merged[f.text], f.logprob))
            merged[f.text] = b + math.log1p(math.exp(a - b))
        else:
            merged[f.text] = f.logprob
    return sorted(merged.items(), key=lambda item: -item[1])

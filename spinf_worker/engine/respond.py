"""Scores -> the hosted API's response: per input its queries (options with floor_p, residual
and floor_residual; extraction answers), its packs' categories and decision; usage, timing
and warnings.

A bulk job's input (its queries all scored on their options, as given or summed over their
spellings; no packs) is answered as its result's JSON text, written from a template of its query set (``ResultTemplate``):
its figures go in as orjson writes them, the same text as its data's dump, bit for bit."""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from itertools import accumulate, pairwise

import numpy as np
import orjson

from ..ids import new_ulid
from ..jsonio import RawJSON
from ..protocol import Query, ScoreResponse
from ..templates import Combination
from .prepare import Prepared, PreparedRequest, QuerySet
from .runner import DocScores, ScoreLists
from .slots import extraction_result
from .spellings import SetSpellings, branch_figures

# the mean residual over which a query's one-token options probably do not fit its template
LOW_OPTION_MASS = 0.9
# result templates kept per query set (one per list of query ids asking it)
MAX_TEMPLATES = 64


def build_response(p: PreparedRequest, scores: list[DocScores], floors: dict[tuple, DocScores],
                   *, model: str, fingerprint: str, started: float) -> ScoreResponse:
    """The response of one prepared request, from its inputs' scores and their queries' floor
    scores (by floor key)."""
    # Built as plain data, its results validated only when read (ScoreResponse.of_engine): a
    # bulk job answers thousands of options a second, and a worker stores the data as it is.
    results, warnings = [], []
    counts = {"queries": 0, "combinations": 0, "options": 0, "prompts": 0, "floor_prompts": 0}
    extraction = {"slots": 0, "text": 0, "number": 0, "currency": 0}
    generation = {"slots": 0, "sequences": 0, "max_tokens": 0}
    content_tokens = query_tokens = floor_tokens = decoded = rows = padded = questions = 0
    # media: per image its soft tokens and the two markers around them
    media = {"images": 0, "image_tokens": 0, "video_frames": 0, "video_tokens": 0,
             "audio_seconds": 0, "audio_tokens": 0}
    for doc, doc_scores in zip(p.docs, scores, strict=True):
        if not p.packs and (plain := PlainSet.of(doc)) is not None:
            results.append(_plain_result_json(doc, plain, doc_scores, floors, warnings))
            questions += len(plain.values)
        else:
            result = _input_result(p, doc, doc_scores, floors, warnings)
            results.append(result)
            questions += sum(len(q["combinations"]) for q in result["queries"])
        qs = doc.query_set
        content_tokens += doc.flat.root - 1
        for image in doc.flat.media:
            if image.kind == "audio":
                media["audio_tokens"] += image.end - image.start + 2
                media["audio_seconds"] += image.seconds
                continue
            kind = "video" if image.frame else "image"
            media["video_frames" if image.frame else "images"] += 1
            media[f"{kind}_tokens"] += image.end - image.start + 2
        query_tokens += qs.query_tokens
        floor_tokens += qs.floor_tokens
        rows += doc.flat.tokens
        padded += doc.flat.length
        for total, mine in zip((counts, extraction, generation), _query_counts(doc),
                               strict=True):
            for name, n in mine.items():
                total[name] += n
        decoded += _decoded_tokens(doc, doc_scores)
    prompt_tokens = content_tokens + query_tokens + floor_tokens
    text_tokens = (content_tokens - media["image_tokens"] - media["video_tokens"]
                   - media["audio_tokens"])
    usage = {
        "prompt_tokens": prompt_tokens, "completion_tokens": decoded,
        "total_tokens": prompt_tokens + decoded,
        "prompt_tokens_details": {"content_tokens": content_tokens,
                                  "text_tokens": text_tokens,
                                  "image_tokens": media["image_tokens"],
                                  "video_tokens": media["video_tokens"],
                                  "audio_tokens": media["audio_tokens"],
                                  "query_tokens": query_tokens, "floor_tokens": floor_tokens},
        "inputs": len(p.docs),
        "content": {"tokens": content_tokens, "text_tokens": text_tokens, **media},
        "scoring": {**counts, "query_tokens": query_tokens, "floor_tokens": floor_tokens},
        "processed_tokens": rows + decoded,
        "billed_tokens": 0,
    }
    if extraction["slots"]:
        usage["extraction"] = extraction
    if generation["slots"]:
        usage["generation"] = generation
    if p.packs:
        usage["packs"] = {"count": len(p.packs)}
    elapsed_ms = int(round((time.perf_counter() - started) * 1000))
    # in the shape model_dump gives (defaults written, unset optional fields left out):
    # ScoreResponse.plain() hands it to the queue as it is, instead of dumping the model
    data = {"id": "scr_" + new_ulid(), "object": "score", "created": int(time.time()),
            "model": p.request.model or model}
    if p.request.endpoint is not None:
        data["endpoint"] = p.request.endpoint
    data.update(system_fingerprint=fingerprint, results=results, warnings=warnings,
                usage=usage)
    response = ScoreResponse.of_engine(data, {"wall_ms": elapsed_ms, "score_ms": elapsed_ms})
    response._rows, response._padded_rows, response._questions = rows, padded, questions
    return response


def _input_result(p: PreparedRequest, doc: Prepared, scores: DocScores,
                  floors: dict[tuple, DocScores], warnings: list[dict]) -> dict:
    """One input's result as data: its queries, then its packs' categories and decisions
    (the queries a pack shows among them)."""
    queries = _query_results(doc, scores, floors, warnings)
    result = {"input_id": doc.input_id, "queries": queries[:doc.n_own]}
    if p.packs:
        result["packs"] = []
        by_id = {q["id"]: q for q in queries[doc.n_own:]}
        for run in p.packs:
            mine = [by_id[qid] for qid in by_id if qid in run.query_ids]
            result["packs"].append({"id": run.pack.id, "version": run.pack.version,
                                    "context": run.context,
                                    **run.pack.evaluate(mine, run.decision)})
            if run.include_queries:
                result["queries"] += mine
    return result


def _query_counts(doc: Prepared) -> tuple[dict, dict, dict]:
    """An input's scoring, extraction and generation counts (usage): its query set's, the
    same for every input that asks it, so counted once per set."""
    qs = doc.query_set
    if qs.counts is not None:
        return qs.counts
    counts = {"queries": 0, "combinations": 0, "options": 0, "prompts": 0, "floor_prompts": 0}
    extraction = {"slots": 0, "text": 0, "number": 0, "currency": 0}
    generation = {"slots": 0, "sequences": 0, "max_tokens": 0}
    for q, grid, fkey, kind in zip(doc.queries, qs.grids, qs.floor_keys, qs.kinds, strict=True):
        if kind == "?":
            counts["queries"] += 1
            counts["combinations"] += len(grid)
            counts["options"] += len(q.options)
            counts["prompts"] += len(grid)
            counts["floor_prompts"] += len(grid) if fkey is not None else 0
        elif q.generation is not None:
            generation["slots"] += len(grid)
            generation["sequences"] += len(grid) * q.generation.n
            generation["max_tokens"] += len(grid) * q.max_tokens
        else:
            extraction["slots"] += len(grid)
            extraction[q.kind] += len(grid)
    qs.counts = (counts, extraction, generation)
    return qs.counts


def _decoded_tokens(doc: Prepared, scores: DocScores) -> int:
    """Tokens decoded for an input's slots: every generated sequence's, and for a searched
    slot the decoding steps it ran (its longest answer; its beams ran side by side)."""
    if not scores.found:   # nothing decoded (no slots)
        return 0
    total, b = 0, 0
    qs = doc.query_set
    for q, grid, kind in zip(doc.queries, qs.grids, qs.kinds, strict=True):
        if kind == "?":
            b += len(grid)
            continue
        for k in range(len(grid)):
            found = scores.found.get(b + k, [])
            if q.generation is not None:
                total += sum(len(f.tokens) for f in found)
            elif found:
                total += max(len(f.tokens) for f in found)
        b += len(grid)
    return total


@dataclass
class PlainSet:
    """A query set whose queries are all scored on their options (a bulk job's), as given
    or summed over their spellings, flattened once: its inputs are answered from flat
    arrays (option after option, branch after branch), not a loop per query and
    combination."""

    texts: list[str]              # per option (FlatDoc order): its text
    values: list[dict[str, str]]  # per branch: its combination's values
    query_start: list[int]        # per query + 1: its first branch
    option_count: list[int]       # per query: its options over all its combinations
    branch_options: list[slice]   # per branch: its options among the input's
    spellings: SetSpellings | None   # None: every option scored as given
    # per query its branches among the input's; None: one branch a query (a bulk job's
    # usual set), answered in one comprehension
    query_branches: list[slice] | None
    # the floors last read (per query, None: no floor) and their figures per option and per
    # branch: the same for every input asking the set while its floors are the same
    floors: tuple[list[DocScores | None], list, list] | None = None
    # for those floors, by the queries' ids: requests whose queries differ in their ids
    # alone share a set
    templates: dict[tuple[str, ...], ResultTemplate] = field(default_factory=dict)

    @classmethod
    def of(cls, doc: Prepared) -> PlainSet | None:
        """The input's query set flattened (None: some query is not plain), worked out
        once per set: every input asking it has the same options and combinations."""
        qs = doc.query_set
        if qs.plain is None and not all(kind == "?" for kind in qs.kinds):
            qs.plain = False
        if qs.plain is None:
            query_start = [0, *accumulate(len(grid) for grid in qs.grids)]
            options = [len(q.options) for q in doc.queries]
            grids = [len(grid) for grid in qs.grids]
            option_start = [0, *accumulate(n for n, g in zip(options, grids, strict=True)
                                           for _ in range(g))]
            spelled = any(starts is not None for starts in qs.spellings)
            qs.plain = cls(
                [o for q, grid in zip(doc.queries, qs.grids, strict=True)
                 for _ in grid for o in q.options],
                [c.values for grid in qs.grids for c in grid],
                query_start,
                [n * g for n, g in zip(options, grids, strict=True)],
                [slice(at, end) for at, end in pairwise(option_start)],
                SetSpellings.of(qs.block.option_start.tolist(), option_start, qs.spellings,
                                grids) if spelled else None,
                None if all(g == 1 for g in grids) else
                [slice(at, end) for at, end in pairwise(query_start)],
            )
        return qs.plain or None

    def figures(self, scores: DocScores) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """An input's per-option logprobs and probabilities, per-branch residuals."""
        if self.spellings is None:   # the runner's own
            return scores.option_logprobs, scores.option_probs, scores.residual
        return self.spellings.figures(scores)


def _plain_results(doc: Prepared, plain: PlainSet, scores: DocScores,
                   floors: dict[tuple, DocScores], warnings: list[dict]) -> list[dict]:
    """``_query_results`` of a plain query set: the same figures, bit for bit, read from
    its flat figures in one pass each for options, combinations and queries."""
    figures = plain.figures(scores)
    if plain.spellings is None:   # the runner's lists, converted once
        logprobs, probs, _, residual = scores.lists
    else:
        logprobs, probs, residual = (a.tolist() for a in figures)
    floor_p, floor_residual = _plain_floors(plain, doc.query_set, floors)
    _plain_warnings(doc, plain, figures[2], warnings)
    return _plain_queries(doc, plain, logprobs, probs, residual, floor_p, floor_residual)


def _plain_queries(doc: Prepared, plain: PlainSet, logprobs: list, probs: list,
                   residual: list, floor_p: list, floor_residual: list) -> list[dict]:
    """A plain set's queries in the hosted shape, from its figures option after option
    (logprobs, probs, floor_p) and branch after branch (residual, floor_residual)."""
    options = [{"text": t, "logprob": lp, "p": p, "floor_p": fp}
               for t, lp, p, fp in zip(plain.texts, logprobs, probs, floor_p, strict=True)]
    if plain.query_branches is None:   # one branch a query: its combination built in place
        return [{"id": q.id, "combinations": [{"values": v, "options": options[own],
                                                "residual": r, "floor_residual": fr}]}
                for q, v, own, r, fr in zip(doc.queries, plain.values, plain.branch_options,
                                            residual, floor_residual, strict=True)]
    combos = [{"values": v, "options": options[own], "residual": r, "floor_residual": fr}
              for v, own, r, fr in zip(plain.values, plain.branch_options, residual,
                                       floor_residual, strict=True)]
    return [{"id": q.id, "combinations": combos[own]}
            for q, own in zip(doc.queries, plain.query_branches, strict=True)]


def _plain_warnings(doc: Prepared, plain: PlainSet, residual: np.ndarray,
                    warnings: list[dict]) -> None:
    """The low-option-mass warnings of an input of a plain set (``residual``: per branch)."""
    qs = doc.query_set
    if plain.query_branches is None:
        # one combination a query (a bulk job's usual set): its mean residual is its
        # branch's own, so only the branches past the mark are looked at
        past = np.flatnonzero(residual > LOW_OPTION_MASS).tolist()
        for j, mean_residual in zip(past, residual[past].tolist(), strict=True):
            if qs.one_token[j]:
                _low_mass(warnings, doc, doc.queries[j], mean_residual)
        return
    bounds = plain.query_start
    for j in range(len(bounds) - 1):
        at, end = bounds[j], bounds[j + 1]
        mean_residual = sum(residual[at:end].tolist()) / (end - at)
        if mean_residual > LOW_OPTION_MASS and qs.one_token[j]:
            _low_mass(warnings, doc, doc.queries[j], mean_residual)


def _plain_result_json(doc: Prepared, plain: PlainSet, scores: DocScores,
                       floors: dict[tuple, DocScores], warnings: list[dict]) -> RawJSON:
    """An input of a plain set without packs: its result's JSON text, the text its data
    (``_plain_results``) dumps to."""
    floor_p, floor_residual = _plain_floors(plain, doc.query_set, floors)
    ids = tuple([q.id for q in doc.queries])
    if (template := plain.templates.get(ids)) is None:
        if len(plain.templates) >= MAX_TEMPLATES:
            plain.templates.clear()
        template = plain.templates[ids] = ResultTemplate.of(doc, plain, floor_p,
                                                            floor_residual)
    logprobs, probs, residual = plain.figures(scores)
    _plain_warnings(doc, plain, residual, warnings)
    return template.fill(doc.input_id, logprobs, probs, residual)


class _Figure:
    """Where one of an input's own figures goes in a ResultTemplate: ``at`` among its
    figures [option logprobs | option probabilities | branch residuals]; -1: its input id."""

    __slots__ = ("at",)

    def __init__(self, at: int):
        self.at = at


@dataclass
class ResultTemplate:
    """A plain set's result JSON less its input's own figures, for floors as they were: an
    input's result is one printf of it with the figures as orjson writes them (a bulk job
    answers thousands of options a second; a dict for each one costs more than its pass)."""

    text: bytes          # "%s" for the input id, then for each figure in order; "%" doubled
    order: np.ndarray    # per figure in the text: its index among the input's figures

    @classmethod
    def of(cls, doc: Prepared, plain: PlainSet, floor_p: list, floor_residual: list
           ) -> ResultTemplate:
        n_options, n_branches = len(plain.texts), len(plain.values)
        figures = [_Figure(k) for k in range(2 * n_options + n_branches)]
        queries = _plain_queries(doc, plain, figures[:n_options],
                                 figures[n_options:2 * n_options], figures[2 * n_options:],
                                 floor_p, floor_residual)
        order = []

        def place(figure: _Figure) -> orjson.Fragment:
            order.append(figure.at)
            return orjson.Fragment(b"\0")   # orjson writes a string's NUL as \u0000

        text = orjson.dumps({"input_id": _Figure(-1), "queries": queries}, default=place)
        if order[0] != -1:
            raise AssertionError("the input id is the template's first field")
        return cls(text.replace(b"%", b"%%").replace(b"\0", b"%s"),
                   np.array(order[1:], dtype=np.intp))

    def fill(self, input_id: str | None, logprobs: np.ndarray, probs: np.ndarray,
             residual: np.ndarray) -> RawJSON:
        figures = np.concatenate((logprobs, probs, residual), dtype=np.float64)
        digits = (orjson.dumps(figures[self.order], option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]
                  .split(b",") if len(self.order) else [])
        return RawJSON(self.text % (orjson.dumps(input_id), *digits))


def _plain_floors(plain: PlainSet, qs: QuerySet, floors: dict[tuple, DocScores]
                  ) -> tuple[list[float | None], list[float | None]]:
    """The floor figures of a plain set's inputs, per option and per branch (None where a
    query has no floor), worked out again only when its floors change."""
    used = [None if key is None else floors[key] for key in qs.floor_keys]
    if plain.floors is None or not all(map(operator.is_, plain.floors[0], used)):
        floor_p: list[float | None] = []
        floor_residual: list[float | None] = []
        for floor, grid, count, starts in zip(used, qs.grids, plain.option_count,
                                              qs.spellings, strict=True):
            if floor is None:
                floor_p += [None] * count
                floor_residual += [None] * len(grid)
            elif starts is None:   # the floor's tree is this query's combinations alone
                lists = floor.lists
                floor_p += lists.probs[:lists.branch_start[len(grid)]]
                floor_residual += lists.residual[:len(grid)]
            else:
                for k in range(len(grid)):
                    _, probs, residual = _floor_read(floor, k, starts)
                    floor_p += probs
                    floor_residual.append(residual)
        plain.floors = (used, floor_p, floor_residual)
        plain.templates.clear()
    return plain.floors[1], plain.floors[2]


def _low_mass(warnings: list[dict], doc: Prepared, q: Query, mean_residual: float) -> None:
    warnings.append({
        "code": "low_option_mass", "input_id": doc.input_id, "query_id": q.id,
        "message": f"the options take {1 - mean_residual:.1%} of the next-token mass "
                   "on average: the template or the options probably do not fit."})


def _query_results(doc: Prepared, scores: DocScores, floors: dict[tuple, DocScores],
                   warnings: list[dict]) -> list[dict]:
    """Every query of one input (the caller's, then its packs'), in the hosted shape."""
    if (plain := PlainSet.of(doc)) is not None:
        return _plain_results(doc, plain, scores, floors, warnings)
    out, b = [], 0
    qs = doc.query_set
    lists = scores.lists
    for q, grid, fkey, starts, kind in zip(doc.queries, qs.grids, qs.floor_keys, qs.spellings,
                                           qs.kinds, strict=True):
        if kind != "?":
            combos = [extraction_result(q, c.values, scores.found.get(b + k, []))
                      for k, c in enumerate(grid)]
            entry = {"id": q.id, "kind": q.kind, "combinations": combos}
            if q.generation is not None:
                entry["generate"] = True
            out.append(entry)
            b += len(grid)
            continue
        floor = floors[fkey] if fkey is not None else None
        if starts is None:   # the options themselves: the runner's figures, bit for bit
            combos = _plain_options(q.options, grid, lists, b, floor)
        else:
            combos = [_option_scores(q, c, scores, b + k, floor, k, starts)
                      for k, c in enumerate(grid)]
        b += len(grid)
        out.append({"id": q.id, "combinations": combos})
        mean_residual = sum(c["residual"] for c in combos) / len(combos)
        if mean_residual > LOW_OPTION_MASS and qs.one_token[len(out) - 1]:
            _low_mass(warnings, doc, q, mean_residual)
    return out


def _plain_options(options: list[str], grid: list[Combination], lists: ScoreLists, b: int,
                   floor: DocScores | None) -> list[dict]:
    """``_option_scores`` of a query's combinations (branches b, b + 1, ...) whose options
    are scored as given, in one loop: a bulk job answers thousands of them a second."""
    logprobs, probs, starts, residual = lists
    floor_lists = floor.lists if floor is not None else None
    combos = []
    for k, combo in enumerate(grid):
        at, end = starts[b + k], starts[b + k + 1]
        if floor_lists is None:
            floor_probs, floor_residual = [None] * (end - at), None
        else:
            f_at, f_end = floor_lists.branch_start[k], floor_lists.branch_start[k + 1]
            floor_probs, floor_residual = floor_lists.probs[f_at:f_end], floor_lists.residual[k]
        combos.append({"values": combo.values,
                       "options": [{"text": o, "logprob": lp, "p": p, "floor_p": fp}
                                   for o, lp, p, fp in zip(options, logprobs[at:end],
                                                           probs[at:end], floor_probs,
                                                           strict=True)],
                       "residual": residual[b + k], "floor_residual": floor_residual})
    return combos


def _option_scores(q: Query, combo: Combination, scores: DocScores, b: int,
                   floor: DocScores | None, floor_b: int, starts: list[int] | None) -> dict:
    """Branch b's options: logprobs, probabilities over the options, floor probabilities
    (branch floor_b of the floor's DocTree), as a ScoredCombination's data."""
    logprobs, probs, residual = _read(scores, b, starts)
    if floor is not None:
        _, floor_probs, floor_residual = _floor_read(floor, floor_b, starts)
    else:
        floor_probs, floor_residual = [None] * len(q.options), None
    return {"values": combo.values,
            "options": [{"text": o, "logprob": logprobs[k], "p": probs[k],
                         "floor_p": floor_probs[k]} for k, o in enumerate(q.options)],
            "residual": residual, "floor_residual": floor_residual}


def _floor_read(floor: DocScores, b: int, starts: list[int] | None
                ) -> tuple[list[float], list[float], float]:
    """``_read`` of a floor's branch b: the same floor in every input that asks its query,
    so its spellings are summed once."""
    key = (b, tuple(starts) if starts is not None else None)
    if (read := floor.reads.get(key)) is None:
        read = floor.reads[key] = _read(floor, b, starts)
    return read


def _read(scores: DocScores, b: int, starts: list[int] | None
          ) -> tuple[list[float], list[float], float]:
    """Branch b's per-option logprobs, probabilities over the options and residual. With
    spellings (``starts``), an option's logprob sums its spellings' probabilities."""
    if starts is None:   # the runner's own figures, bit for bit
        lists = scores.lists
        at, end = lists.branch_start[b], lists.branch_start[b + 1]
        return lists.logprobs[at:end], lists.probs[at:end], lists.residual[b]
    return branch_figures(scores, b, starts)

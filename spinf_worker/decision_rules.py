"""What a decision model refuses (no torch: the engine and the API both check), and what a
model whose stack cannot decode slots refuses (``check_slots``).

A decision model is served as it is: a request's queries are options read out over its code
tokens, inside its own prompt format; extraction and generation slots, options that are not
codes, and completions are refused before anything is laid out or queued (the hosted codes
``extraction_disabled`` and ``generation_disabled``; this server's ``completions_not_supported``).
"""

from __future__ import annotations

from .errors import InvalidRequestError
from .manifest import Decision
from .protocol import Query, ScoreRequest


class DecisionModelError(InvalidRequestError):
    """What a decision model does not do (it scores options over its codes only)."""


def check_queries(decision: Decision, model: str, queries: list[Query],
                  params: list[str | None]) -> None:
    """Options only, each one of the model's codes (the hosted errors: extraction_disabled,
    generation_disabled); a pack's queries (param None) are held to the same rule."""
    codes = set(decision.codes)
    for q, param in zip(queries, params, strict=True):
        where = param or f"packs.{q.group}"
        if q.generate is not None:
            raise DecisionModelError(
                f"{where}: generation is not available: {model} is a decision model that "
                "scores options over its codes only", param=f"{where}.generate",
                code="generation_disabled")
        if q.slot_kind != "?":
            raise DecisionModelError(
                f"{where}: extraction slots are not available: {model} is a decision model "
                "that scores options over its codes only", param=f"{where}.template",
                code="extraction_disabled")
        for k, option in enumerate(q.options or ()):
            if option not in codes:
                raise DecisionModelError(
                    f"{where}: option {option!r} is not one of {model}'s decision codes "
                    f"({', '.join(repr(c) for c in decision.codes[:8])}"
                    f"{', ...' if len(codes) > 8 else ''})", param=f"{where}.options.{k}",
                    code="invalid_field")


def check_slots(capabilities: list[str], model: str, queries: list[Query],
                params: list[str | None]) -> None:
    """A model served without ``extract`` / ``generate`` (a stack with no slot decoding: the
    recurrent state of a Gated DeltaNet is not kept per slot) answers options only."""
    for q, param in zip(queries, params, strict=True):
        where = param or f"packs.{q.group}"
        if q.generate is not None and "generate" not in capabilities:
            raise InvalidRequestError(
                f"{where}: generation is not available for {model}", param=f"{where}.generate",
                code="generation_disabled")
        if q.slot_kind != "?" and "extract" not in capabilities:
            raise InvalidRequestError(
                f"{where}: extraction slots are not available for {model}; it scores options",
                param=f"{where}.template", code="extraction_disabled")


def refuse_completion(model: str, decision: bool = True) -> DecisionModelError:
    """A completion asked of a model that does not complete text (its manifest has no
    ``complete``): a decision model, or a stack with recurrent layers."""
    what = ("is a decision model: it scores options over its codes" if decision else
            "scores options only")
    return DecisionModelError(f"{model} {what} (POST /v1/score), it does not complete text",
                              param="model", code="completions_not_supported")


def request_queries(request: ScoreRequest) -> tuple[list, list[str | None]]:
    """A request's own queries (the shared ones and each input's) and each one's param."""
    queries = list(request.scoring.queries)
    params: list[str | None] = [f"scoring.queries.{k}" for k in range(len(queries))]
    for i, inp in enumerate(request.inputs or ()):
        own = list(inp.queries or ())
        queries += own
        params += [f"inputs.{i}.queries.{k}" for k in range(len(own))]
    return queries, params


def check_request(decision: Decision, model: str, request: ScoreRequest) -> None:
    """check_queries over a request's own queries."""
    check_queries(decision, model, *request_queries(request))


def check_request_slots(capabilities: list[str], model: str, request: ScoreRequest) -> None:
    """check_slots over a request's own queries."""
    check_slots(capabilities, model, *request_queries(request))

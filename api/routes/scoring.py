"""Synchronous scoring: POST /v1/score and the OpenAI-compatible POST /v1/chat/completions.

Both validate everything first (nothing is queued for a request answered 4xx: the limits
the worker enforces are checked here first, check_limits), submit one
interactive job and answer 200 with its result, as the hosted API does. ``Prefer:
respond-async`` answers 202 with the job to poll at once; a result not ready within the sync
timeout is a 503 (the job goes on: its id is in ``X-Job-Id``)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse

from spinf_worker.completions import CompletionRequest
from spinf_worker.decision_rules import check_request as check_decision
from spinf_worker.decision_rules import check_request_slots, refuse_completion
from spinf_worker.errors import InvalidRequestError, ModelNotFoundError
from spinf_worker.openai_compat import (
    ChatScoreResponse,
    score_request_from_chat,
    score_to_chat_completion,
)
from spinf_worker.protocol import ScoreRequest, ScoreResponse
from spinf_worker.queue.batches import RequestCheck
from spinf_worker.queue.producer import IdempotencyKeyReused, Submission, new_job_id
from spinf_worker.queue.results import JobResult
from spinf_worker.request_limits import check_completion, check_request

from ..auth import V1_AUTH, Caller, CallerDep
from ..errors import (
    IdempotencyKeyReusedError,
    RateLimitError,
    ServiceUnavailableError,
    request_id_of,
)
from ..media import NOT_FETCHED, check_kinds, check_media, served_kinds
from ..models import ChatCompletionRequest, JobAccepted, error_responses, json_body
from ..services import ResultResponse, Services, ServicesDep, Workers, read_json
from .catalog import names_of
from .packs import loaded_packs

router = APIRouter(prefix="/v1", tags=["scoring"], dependencies=V1_AUTH)

RETRY_AFTER_S = 5  # when the backlog is full: long enough for workers to drain some of it
_ERRORS = error_responses(400, 401, 413, 422, 429, 500, 503)


async def check_model(services: Services, model: str | None,
                      request: ScoreRequest | CompletionRequest | None = None,
                      workers: Workers | None = None) -> None:
    """404 for a model no worker serves. Known = the models of live workers, or of the
    registered ones when none is live (a restarting fleet); with no worker at all the job
    waits for one, and the worker judges the name. With ``request``: what the model's
    manifest says it does not do (a decision model: options over its codes only) is the
    400 its worker would answer. ``workers``: what ``services.workers()`` read for this
    request already."""
    live, registered = workers or await services.workers()
    workers = live or registered
    served = {w.model for w in workers}
    if model is not None and served and not any(
            model in names_of(name, workers) for name in served):
        raise ModelNotFoundError(
            f"model {model!r} is not served here; served: {', '.join(sorted(served))}",
            param="model")
    target = [w for w in workers if w.manifest is not None
              and (model in w.manifest.names if model is not None else len(served) == 1)]
    manifest = target[0].manifest if target else None
    if manifest is None or request is None:
        return
    if isinstance(request, CompletionRequest):
        if "complete" not in manifest.capabilities:
            raise refuse_completion(manifest.id, manifest.decision is not None)
    elif manifest.decision is not None:
        check_decision(manifest.decision, manifest.id, request)
    elif not {"extract", "generate"} <= set(manifest.capabilities):
        check_request_slots(list(manifest.capabilities), manifest.id, request)


async def limits_check(services: Services, workers: Workers | None = None) -> RequestCheck:
    """What ``check_limits`` runs, as a function of the request (batch queueing runs it on
    each line): the packs a request names (they exist here, with its context, decision,
    parameters, case rule, and their ids and groups are theirs), the combinations per query
    and, with the served model's tokenizer (api/tokens.py), each filled template's and
    option's tokens, option boundaries, each content's tokens, the model's context and the
    processed tokens (request_limits.check_request: the engine's own checks, in its order).
    Without a tokenizer (none here, or no single served model) the token limits are the
    worker's alone. The function may load a pack source: run it on a thread."""
    tokens = await services.served_tokens(workers)
    sources = tuple(services.settings.packs)
    served = await served_kinds(services, None, workers)
    remote = (NOT_FETCHED if not services.settings.fetch_media else
              "remote image URLs are fetched for /v1/score, /v1/chat/completions and /v1/jobs; "
              "send the image as a data: URL here")

    def check(request: ScoreRequest | CompletionRequest) -> None:
        if isinstance(request, CompletionRequest):   # a batch's /v1/completions line
            check_completion(request, tokens)
            return
        # media the served model reads; an https:// image is left only where not fetched
        check_kinds(request, served, remote=remote)
        packs = loaded_packs(sources) if request.scoring.packs else {}
        check_request(request, packs, tokens=tokens,
                      max_content_tokens=services.settings.max_content_tokens,
                      pack_cache=services.pack_queries)

    return check


async def check_limits(services: Services, request: ScoreRequest,
                       workers: Workers | None = None) -> None:
    """Refuse here what the worker would refuse, with its error (``limits_check``). On a
    thread: the first call may load the tokenizer or fetch a pack source."""
    await asyncio.to_thread(await limits_check(services, workers), request)


def check_backlog(services: Services, backlog: int) -> None:
    """429 when more than ``max_backlog`` entries wait (``backlog``: Services.admission's)."""
    if backlog > services.settings.max_backlog:
        raise RateLimitError(
            f"the queue is full ({backlog} requests waiting); retry later",
            headers={"Retry-After": str(RETRY_AFTER_S)})


def sync_timeout(services: Services, header: str | None) -> float:
    """X-Sync-Timeout (seconds) may shorten the wait, never lengthen it past the setting."""
    limit = services.settings.sync_timeout_s
    if header is None:
        return limit
    try:
        seconds = float(header)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidRequestError("X-Sync-Timeout must be a number of seconds >= 0",
                                  param="X-Sync-Timeout")
    return min(seconds, limit)


async def submit(services: Services, caller: Caller, submission: Submission
                 ) -> tuple[str, bool]:
    """Queue the caller's job: its id, and whether it was created now. The Idempotency-Key is
    the caller's tenant's own: the same key with the same body names the same job, with
    another body it is a 422."""
    try:
        return await services.producer.submit(
            dataclasses.replace(submission, tenant=caller.tenant))
    except IdempotencyKeyReused:
        raise IdempotencyKeyReusedError(
            "this Idempotency-Key was already used with a different request; send a new key "
            "for a new request", param="Idempotency-Key") from None


async def submit_and_wait_for(services: Services, caller: Caller, submission: Submission,
                              timeout: float) -> tuple[str, JobResult | None]:
    """Queue an interactive job and wait up to ``timeout`` for its result: (job id, result
    or None). Its reply is expected before its entry exists, so a job created now is not
    looked up before the wait."""
    job_id = new_job_id()
    with services.listener.expecting(job_id):
        job_id, created = await submit(services, caller, dataclasses.replace(
            submission, job_id=job_id, reply_to=services.listener.instance_id))
        return job_id, await services.listener.wait(job_id, timeout, fresh=created)


def accepted(job_id: str, status: str = "queued") -> JSONResponse:
    url = f"/v1/jobs/{job_id}"
    return JSONResponse(JobAccepted(id=job_id, status=status, url=url).model_dump(),
                        status_code=202, headers={"Location": url})


async def submit_and_wait(services: Services, caller: Caller, request: ScoreRequest, *,
                          idempotency_key: str | None, timeout: float
                          ) -> tuple[str, JobResult | None]:
    """(job id, its result or None when not finished within ``timeout``)."""
    workers, backlog = await services.admission()
    await services.check_serving(workers)
    await check_model(services, request.model, request, workers)
    await check_media(services, request, workers)
    await check_limits(services, request, workers)
    check_backlog(services, backlog)
    payload = request.model_dump(mode="json", exclude_none=True)
    return await submit_and_wait_for(services, caller, Submission(
        request=payload, priority="interactive", idempotency_key=idempotency_key), timeout)


def failed(result: JobResult, job_id: str, request_id: str | None) -> JSONResponse:
    """A job the worker refused or failed, in the envelope of every error reply."""
    return JSONResponse({"error": result.openai_error, "request_id": request_id},
                        status_code=result.status_code or 500, headers={"X-Job-Id": job_id})


def prefers_async(header: str | None) -> bool:
    """RFC 7240 ``Prefer: respond-async`` (among other preferences)."""
    return header is not None and any(
        part.strip().split("=", 1)[0].strip().lower() == "respond-async"
        for part in header.split(","))


async def answer(services, caller: Caller, score_request: ScoreRequest,
                 idempotency_key: str | None, x_sync_timeout: str | None, prefer: str | None,
                 *, shape, request_id: str | None) -> JSONResponse:
    """Queue the request and answer its result in ``shape`` (200), its error, or the job
    (202) when the caller prefers to poll."""
    respond_async = prefers_async(prefer)
    timeout = 0.0 if respond_async else sync_timeout(services, x_sync_timeout)
    job_id, result = await submit_and_wait(services, caller, score_request,
                                           idempotency_key=idempotency_key, timeout=timeout)
    return await reply(services, job_id, result, respond_async=respond_async, timeout=timeout,
                       shape=shape, request_id=request_id)


async def reply(services, job_id: str, result: JobResult | None, *, respond_async: bool,
                timeout: float, shape, request_id: str | None) -> JSONResponse:
    """A queued job's answer: its result in ``shape`` (200), its error, the job (202) when
    the caller prefers to poll, or 503 when it was not ready in time."""
    if result is None:
        if respond_async:
            job = await services.producer.get_job(job_id)
            return accepted(job_id, job["status"] if job else "queued")
        raise ServiceUnavailableError(
            f"the result was not ready within {timeout:g} s; the job goes on: GET "
            f"/v1/jobs/{job_id} (or send Prefer: respond-async to poll)",
            code="model_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_S), "X-Job-Id": job_id,
                     "Location": f"/v1/jobs/{job_id}"})
    if not result.succeeded:
        return failed(result, job_id, request_id)
    return ResultResponse(shape(result.body), headers={"X-Job-Id": job_id})


IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", max_length=256)]
SyncTimeout = Annotated[str | None, Header(alias="X-Sync-Timeout")]
Prefer = Annotated[str | None, Header(alias="Prefer")]


@router.post("/score", response_model=ScoreResponse, openapi_extra=json_body(ScoreRequest),
             responses={202: {"model": JobAccepted}, **_ERRORS},
             summary="Score and extract: one content (messages) or many (inputs), read once")
async def score(request: Request, services: ServicesDep, caller: CallerDep,
                idempotency_key: IdempotencyKey = None,
                x_sync_timeout: SyncTimeout = None, prefer: Prefer = None) -> JSONResponse:
    score_request = ScoreRequest.parse(await read_json(request), read_by_orjson=True)
    return await answer(services, caller, score_request, idempotency_key, x_sync_timeout,
                        prefer, shape=lambda body: body, request_id=request_id_of(request))


@router.post("/chat/completions", response_model=ChatScoreResponse,
             openapi_extra=json_body(ChatCompletionRequest),
             responses={202: {"model": JobAccepted}, **_ERRORS},
             summary="The same body as /v1/score (SDK: extra_body); the reply adds choices")
async def chat_completions(request: Request, services: ServicesDep, caller: CallerDep,
                           idempotency_key: IdempotencyKey = None,
                           x_sync_timeout: SyncTimeout = None,
                           prefer: Prefer = None) -> JSONResponse:
    score_request = score_request_from_chat(await read_json(request), read_by_orjson=True)
    return await answer(services, caller, score_request, idempotency_key, x_sync_timeout,
                        prefer, shape=score_to_chat_completion,
                        request_id=request_id_of(request))

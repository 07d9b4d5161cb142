"""POST /v1/completions: OpenAI's legacy completions with ``echo`` and ``logprobs``, the
request evaluation tools send to read a text's log-likelihood (spinf_worker/completions.py).

Validated here (a field this server cannot honour is a 400 naming it; with the served
model's tokenizer, a prompt past the model's context too), then queued as one interactive
job and answered like /v1/score: 200 with the result, ``Prefer: respond-async`` 202."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from spinf_worker.completions import CompletionRequest, CompletionResponse
from spinf_worker.queue.producer import Submission
from spinf_worker.request_limits import check_completion, within_context

from ..auth import V1_AUTH, CallerDep
from ..errors import request_id_of
from ..models import CompletionBody, JobAccepted, error_responses, json_body
from ..services import Services, ServicesDep, Workers, read_json
from .scoring import (
    IdempotencyKey,
    Prefer,
    SyncTimeout,
    check_backlog,
    check_model,
    prefers_async,
    reply,
    submit_and_wait_for,
    sync_timeout,
)

router = APIRouter(prefix="/v1", tags=["scoring"], dependencies=V1_AUTH)


async def check_context(services: Services, request: CompletionRequest,
                        workers: Workers | None = None) -> None:
    """A prompt (BOS + its tokens, or its ids) plus ``max_tokens`` past the served model's
    context is the 400 the worker would answer; without the tokenizer here, the worker's.
    Prompts whose bounds fit need no count, nor a thread to count on."""
    tokens = await services.served_tokens(workers)
    if tokens is not None and tokens.context is not None and within_context(
            request, tokens.context):
        return
    await asyncio.to_thread(check_completion, request, tokens)


@router.post("/completions", response_model=CompletionResponse,
             openapi_extra=json_body(CompletionBody),
             responses={202: {"model": JobAccepted},
                        **error_responses(400, 401, 413, 422, 429, 500, 503)},
             summary="OpenAI legacy completions: echo + logprobs (log-likelihoods), greedy "
                     "max_tokens up to 16")
async def completions(request: Request, services: ServicesDep, caller: CallerDep,
                      idempotency_key: IdempotencyKey = None,
                      x_sync_timeout: SyncTimeout = None, prefer: Prefer = None
                      ) -> JSONResponse:
    completion = CompletionRequest.parse(await read_json(request))
    respond_async = prefers_async(prefer)
    timeout = 0.0 if respond_async else sync_timeout(services, x_sync_timeout)
    workers, backlog = await services.admission()     # read once for the checks below
    await services.check_serving(workers)
    await check_model(services, completion.model, completion, workers)
    await check_context(services, completion, workers)
    check_backlog(services, backlog)
    payload = {"model": completion.model, "completion": completion.model_dump(mode="json")}
    job_id, result = await submit_and_wait_for(services, caller, Submission(
        request=payload, priority="interactive", idempotency_key=idempotency_key), timeout)
    return await reply(services, job_id, result, respond_async=respond_async, timeout=timeout,
                       shape=lambda body: body, request_id=request_id_of(request))

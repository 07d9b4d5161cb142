"""Bulk scoring in the shape of the OpenAI Batch API (spinf_worker/queue/batches.py has the
life cycle, the line formats and what cancelling does)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from spinf_worker.errors import InvalidRequestError
from spinf_worker.queue import batches, files

from ..auth import V1_AUTH, Caller, CallerDep
from ..errors import NotFoundError, validation_error
from ..models import Batch, BatchCreate, BatchList, error_responses, json_body
from ..services import Services, ServicesDep, read_json
from .files import check_owner
from .scoring import check_backlog, limits_check

router = APIRouter(prefix="/v1/batches", tags=["batches"], dependencies=V1_AUTH)


def _not_found(batch_id: str) -> NotFoundError:
    return NotFoundError(f"no batch {batch_id!r} (unknown, or expired)", param="batch_id",
                         code="batch_not_found")


async def _check_owner(services: Services, caller: Caller, batch_id: str) -> None:
    # another tenant's batch is as unknown as a missing one: its existence is not told
    if not caller.owns(await batches.tenant_of(services.redis, services.keys, batch_id)):
        raise _not_found(batch_id)


def _batch_create(data: object) -> BatchCreate:
    try:
        return BatchCreate.model_validate(data)
    except ValidationError as err:
        raise validation_error(RequestValidationError(err.errors(include_url=False))) from None


# The body is read in the route, not declared as a parameter: FastAPI parses a declared body
# before any dependency runs, so invalid JSON without a key was a 400, not the 401.
@router.post("", response_model=Batch, responses=error_responses(400, 401, 404, 429),
             openapi_extra=json_body(BatchCreate),
             summary="Start a batch over an uploaded JSONL file")
async def create_batch(request: Request, services: ServicesDep, caller: CallerDep) -> dict:
    body = _batch_create(await read_json(request))
    await check_owner(services, caller, body.input_file_id, param="input_file_id")
    meta = await files.get_file(services.redis, services.keys, body.input_file_id)
    if meta is None:
        raise NotFoundError(f"no file {body.input_file_id!r} (unknown, or expired)",
                            param="input_file_id", code="file_not_found")
    if meta.get("purpose") != "batch":
        raise InvalidRequestError(f"file {body.input_file_id!r} has purpose "
                                  f"{meta.get('purpose')!r}; upload it with purpose 'batch'",
                                  param="input_file_id")
    check_backlog(services, await services.producer.backlog())
    batch = await batches.create_batch(
        services.redis, services.keys, input_file_id=body.input_file_id,
        endpoint=body.endpoint, completion_window=body.completion_window,
        metadata=body.metadata, ttl_s=services.settings.result_ttl_s, tenant=caller.tenant)
    # Reading and queueing a large file takes a while: after the response, in the background.
    # Each line gets the checks of the synchronous routes: one over a limit is an error line.
    services.spawn(batches.enqueue_batch(services.redis, services.keys, services.producer,
                                         batch["id"], checks=lambda: limits_check(services)),
                   name=f"enqueue-{batch['id']}")
    return batch


@router.get("", response_model=BatchList, responses=error_responses(400, 401),
            summary="Batches, newest first")
async def list_batches(services: ServicesDep, caller: CallerDep,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20,
                       after: str | None = None) -> BatchList:
    tenant = None if caller.reads_all else caller.tenant
    found, has_more = await batches.list_batches(services.redis, services.keys, limit=limit,
                                                 after=after, tenant=tenant)
    return BatchList(data=found, has_more=has_more,
                     first_id=found[0]["id"] if found else None,
                     last_id=found[-1]["id"] if found else None)


@router.get("/{batch_id}", response_model=Batch, responses=error_responses(401, 404))
async def get_batch(batch_id: str, services: ServicesDep, caller: CallerDep) -> dict:
    await _check_owner(services, caller, batch_id)
    batch = await batches.get_batch(services.redis, services.keys, batch_id)
    if batch is None:
        raise _not_found(batch_id)
    return batch


@router.post("/{batch_id}/cancel", response_model=Batch,
             responses=error_responses(400, 401, 404),
             summary="Cancel: requests not answered yet get a batch_cancelled error line")
async def cancel_batch(batch_id: str, services: ServicesDep, caller: CallerDep) -> dict:
    await _check_owner(services, caller, batch_id)
    outcome, drain = await batches.cancel_batch(services.redis, services.keys, batch_id)
    if outcome == "missing":
        raise _not_found(batch_id)
    batch = await batches.get_batch(services.redis, services.keys, batch_id)
    if outcome == "not_cancellable":
        raise InvalidRequestError(
            f"batch {batch_id!r} is {batch['status'] if batch else 'gone'}; only a validating "
            "or in-progress batch can be cancelled", param="batch_id",
            code="batch_not_cancellable")
    if drain:
        services.spawn(batches.drain_cancelled(services.redis, services.keys, batch_id),
                       name=f"cancel-{batch_id}")
    return batch

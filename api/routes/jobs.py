"""Fire-and-forget scoring: POST /v1/jobs (optionally with a webhook callback), GET /v1/jobs/{id}.

The job body is a ScoreRequest with two more top-level fields: ``callback`` (an http(s) URL the
dispatcher POSTs the signed result to) and ``deadline_s`` (drop the job unscored after it)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from spinf_worker.queue import batches
from spinf_worker.queue.producer import Submission
from spinf_worker.queue.results import normalize_error

from ..auth import V1_AUTH, Caller, CallerDep
from ..errors import NotFoundError
from ..media import check_media
from ..models import Job, JobAccepted, JobRequest, error_responses, json_body
from ..services import ResultResponse, Services, ServicesDep, read_json
from .scoring import IdempotencyKey, accepted, check_backlog, check_limits, check_model, submit

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=V1_AUTH)

FINISHED = ("succeeded", "failed", "expired")


async def _visible(services: Services, caller: Caller, job: dict) -> bool:
    """Whether the caller may see the job: its tenant's, or (a job of a batch) its batch's."""
    tenant = job.get("tenant")
    if tenant is None and job.get("batch_id"):
        tenant = await batches.tenant_of(services.redis, services.keys, job["batch_id"])
    return caller.owns(tenant)


@router.post("", response_model=JobAccepted, status_code=202,
             openapi_extra=json_body(JobRequest),
             responses=error_responses(400, 401, 404, 413, 422, 429),
             summary="Queue a scoring job; poll it or get a webhook")
async def create_job(request: Request, services: ServicesDep, caller: CallerDep,
                     idempotency_key: IdempotencyKey = None) -> JSONResponse:
    job_request = JobRequest.parse(await read_json(request))
    workers, backlog = await services.admission()     # read once for the checks below
    await check_model(services, job_request.model, job_request, workers)
    await check_media(services, job_request, workers)
    await check_limits(services, job_request, workers)
    check_backlog(services, backlog)
    job_id, _created = await submit(services, caller, Submission(
        request=job_request.score_request(), priority="interactive",
        callback=job_request.callback, idempotency_key=idempotency_key,
        deadline_s=job_request.deadline_s))
    job = await services.producer.get_job(job_id)
    return accepted(job_id, job["status"] if job else "queued")


@router.get("/{job_id}", response_model=Job, response_model_exclude_none=False,
            responses=error_responses(401, 404), summary="A job's status and, when done, result")
async def get_job(job_id: str, services: ServicesDep, caller: CallerDep) -> JSONResponse:
    job = await services.producer.get_job(job_id)
    # another tenant's job is as unknown as a missing one: its existence is not told
    if job is None or not await _visible(services, caller, job):
        raise NotFoundError(f"no job {job_id!r} (unknown, or its record expired)",
                            param="job_id", code="job_not_found")
    # every field of the Job shape, null when unknown or not yet there
    shown = {name: job.get(name) for name in Job.model_fields}
    shown.update(object="score.job", status_code=None, response=None, error=None)
    if job.get("status") in FINISHED:
        result = await services.producer.get_result(job_id)
        if result is not None:
            shown.update(status_code=result.status_code,
                         response=result.body if result.succeeded else None,
                         error=result.openai_error)
        elif job.get("error"):
            shown["error"] = normalize_error(job["error"])
    return ResultResponse(shown)

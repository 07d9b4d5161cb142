"""API-only shapes: jobs, chat completions, models, files and batches (OpenAI-compatible).

Response models document /openapi.json; the routes return plain dicts built by the queue
modules, validated against these in the tests."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from spinf_worker.protocol import (
    ErrorBody,
    ErrorResponse,
    ScoreRequest,
    ScoreResponse,
)

# ---- jobs ------------------------------------------------------------------------------

MAX_DEADLINE_S = 365 * 24 * 3600   # a job's deadline: at most a year (results live 7 days)


class JobRequest(ScoreRequest):
    """A ScoreRequest answered later: poll GET /v1/jobs/{id}, or receive a signed webhook at
    ``callback``. Both extra fields sit next to the request's own fields."""

    callback: str | None = Field(default=None, description="https URL to POST the result to")
    deadline_s: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_S,
                                     description="drop the job unscored after this many seconds")

    @field_validator("callback")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("https://", "http://")):
            raise ValueError("callback must be an http(s) URL")
        return url

    def score_request(self) -> dict:
        """The request the worker scores, without the job's own fields."""
        return self.model_dump(mode="json", exclude_none=True,
                               exclude={"callback", "deadline_s"})


JobStatus = Literal["queued", "running", "succeeded", "failed", "expired"]


class JobAccepted(BaseModel):
    id: str
    object: Literal["score.job"] = "score.job"
    status: JobStatus
    url: str


class Job(BaseModel):
    id: str
    object: Literal["score.job"] = "score.job"
    status: JobStatus
    created_at: int | None = None
    started_at: int | None = None
    finished_at: int | None = None
    model: str | None = None
    batch_id: str | None = None
    custom_id: str | None = None
    callback: str | None = None
    callback_status: str | None = None
    callback_attempts: int | None = None
    status_code: int | None = Field(default=None, description="HTTP status of the result")
    response: ScoreResponse | None = Field(default=None, description="the scores, when done")
    error: ErrorBody | None = None


# ---- chat completions -------------------------------------------------------------------


class ChatCompletionRequest(ScoreRequest):
    """The body of /v1/score (the OpenAI SDK sends ``scoring`` through ``extra_body``, and a
    scoring block is required); other OpenAI fields (temperature, ...) are ignored."""

    stream: Literal[False] = False


class CompletionBody(BaseModel):
    """The body of /v1/completions: OpenAI's legacy completions request. Only greedy decoding
    of up to 16 tokens (``max_tokens`` 0 scores the prompt only); the other OpenAI fields are
    taken at their neutral values only, any other field is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int = Field(16, ge=0, le=16)
    stop: str | list[str] | None = None
    n: Literal[1] = 1
    best_of: Literal[1] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    user: str | None = None
    stream: Literal[False] = False
    presence_penalty: Literal[0] | None = None
    frequency_penalty: Literal[0] | None = None
    logit_bias: dict | None = None
    suffix: str | None = None


# ---- models ------------------------------------------------------------------------------

ModelStatus = Literal["available", "loading", "error"]


class ModelFeatures(BaseModel):
    media: list[str] = Field(default_factory=list)
    extraction: bool = True
    generation: bool = False


class ModelObject(BaseModel):
    """One served model: the hosted API's entry and the OpenAI model object in one."""

    # OpenAI
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "spinf-serve"
    # the hosted API
    name: str
    status: ModelStatus
    base_model: str
    aliases: list[str] = Field(default_factory=list, description="other names requests may use")
    family: str | None = None
    capabilities: list[str] = Field(default_factory=list)
    media: list[str] = Field(default_factory=list, description="content kinds besides text")
    limits: dict[str, int] = Field(default_factory=dict)
    features: ModelFeatures = Field(default_factory=ModelFeatures)
    # this server
    fingerprints: list[str] = Field(default_factory=list)
    workers: int = 0


class ModelList(BaseModel):
    """The hosted shape (``models``) and the OpenAI list (``object``, ``data``) together."""

    models: list[ModelObject]
    object: Literal["list"] = "list"
    data: list[ModelObject]


# ---- files -------------------------------------------------------------------------------


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int | None = None
    status: str = "processed"


# ---- batches -----------------------------------------------------------------------------


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: Literal["/v1/score", "/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed",
                      "expired", "cancelling", "cancelled"]


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


# ---- operations --------------------------------------------------------------------------


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Ready(BaseModel):
    status: Literal["ready"] = "ready"
    workers: int
    models: list[str]


class Healthz(BaseModel):
    ok: Literal[True] = True


class WorkerBoot(BaseModel):
    worker: str
    model: str
    status: ModelStatus
    started_ms: int | None = None
    loaded_ms: int | None = None
    load_s: float | None = None


class Boot(BaseModel):
    api_started_ms: int
    loaded_ms: int | None = Field(default=None,
                                  description="when the first live worker's model loaded")
    workers: list[WorkerBoot]


class Readyz(BaseModel):
    """200 ``{"ready": true, "boot"}``; 503 ``{"ready": false}`` with one of ``error``,
    ``degraded``, ``draining`` when there is a reason to give."""

    ready: bool
    boot: Boot | None = None
    error: str | None = None
    degraded: str | None = None
    draining: bool | None = None


class Livez(BaseModel):
    live: bool


class EngineWorker(BaseModel):
    worker: str
    model: str
    family: str | None = None
    fingerprint: str | None = None
    device: str | None = None
    host: str | None = None
    pid: int | None = None
    status: ModelStatus
    passes: int = 0


class EngineInfo(BaseModel):
    version: str
    models: list[str]
    fingerprints: list[str]
    workers: list[EngineWorker]


class ApiProcess(BaseModel):
    """The API process that answered: one of several behind a port (``api --workers N``) or
    a load balancer."""

    host: str
    pid: int
    instance: str = Field(description="its reply stream's id (`<prefix>:{q}:reply:<instance>`)")


class Info(BaseModel):
    engine: EngineInfo
    boot: Boot
    api: ApiProcess


class Drain(BaseModel):
    draining: bool


# ---- OpenAPI -------------------------------------------------------------------------------

# Bodies the routes read themselves (so every problem gets our error with its exact param);
# create_app adds their schemas to /openapi.json.
DOCUMENTED_BODIES: tuple[type[BaseModel], ...] = (ScoreRequest, JobRequest,
                                                  ChatCompletionRequest, CompletionBody,
                                                  BatchCreate)


def json_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` declaring ``model`` as a route's JSON request body."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


class ErrorEnvelope(ErrorResponse):
    """Every error reply: ``{"error": {type, code, message, param}, "request_id"}``; the
    request id is also the reply's X-Request-Id."""

    request_id: str | None = None


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """``responses=`` entries documenting errors in the envelope."""
    return {status: {"model": ErrorEnvelope} for status in statuses}

"""A job's result: what a worker stores under ``keys.result(id)`` and every reader reads back
(the API routes, batch lines, callbacks, ingest). Torch-free.

Stored as JSON (compact, written by orjson: ``to_bytes``), one of two shapes (docs/QUEUE.md):
``{"status_code": 200, "body": <ScoreResponse>}`` or
``{"status_code": 4xx/5xx, "error": {"type", "code", "message", "param"}}`` (the inner object
of the API's error envelope; results stored before it have OpenAI's types, read back as the
status's hosted type).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from .. import jsonio
from ..errors import ERROR_TYPES, SpinfError, error_type
from ..protocol import ScoreResponse

EXPIRED_ERROR = {"message": "deadline passed before the job was scored",
                 "type": "timeout_error", "param": None, "code": "deadline_exceeded"}
_HOSTED_TYPES = {*ERROR_TYPES.values(), "invalid_request", "api_error"}


def normalize_error(error: Any, status: int | None = None) -> dict:
    """``{"type", "code", "message", "param"}`` from a stored error, however it was written
    (the bare error, the ``{"error": {...}}`` envelope, a string). Given the HTTP status, a
    missing type, or one of the OpenAI shape stored before (``invalid_request_error``), is
    the status's hosted type."""
    error = error or {}
    if isinstance(error, dict) and isinstance(error.get("error"), dict):
        error = error["error"]
    if not isinstance(error, dict):
        error = {"message": str(error)}
    type_ = error.get("type")
    if status is not None and type_ not in _HOSTED_TYPES:
        type_ = error_type(status)
    return {"type": type_ or "api_error", "code": error.get("code"),
            "message": error.get("message") or "the request failed",
            "param": error.get("param")}


class JobResult(BaseModel):
    """The outcome of one job: the ScoreResponse (``body``) or an error, with the HTTP status
    a synchronous caller gets."""

    model_config = ConfigDict(frozen=True)

    status_code: int
    body: dict | None = None       # the ScoreResponse as plain data, when scored
    error: dict | None = None      # the error as stored (see openai_error)

    # ---- made by workers -----------------------------------------------------------------

    @classmethod
    def ok(cls, response: ScoreResponse | dict) -> JobResult:
        """``response``: a ScoreResponse or its plain data."""
        body = response if isinstance(response, dict) else response.plain()
        return cls(status_code=200, body=body)

    @classmethod
    def failed(cls, error: SpinfError) -> JobResult:
        """The request's own fault (or the engine's verdict on it): a final answer."""
        return cls(status_code=error.status, error=error.to_openai()["error"])

    @classmethod
    def expired(cls) -> JobResult:
        return cls(status_code=408, error=dict(EXPIRED_ERROR))

    @classmethod
    def dead_letter(cls, deliveries: int) -> JobResult:
        return cls(status_code=500, error={
            "message": f"the job could not be processed ({deliveries} attempts) and was set "
                       "aside", "type": "server_error", "param": None, "code": "dead_letter"})

    # ---- read back -----------------------------------------------------------------------

    @property
    def succeeded(self) -> bool:
        return self.status_code == 200 and self.body is not None

    @property
    def openai_error(self) -> dict | None:
        """The error as the envelope's inner object ``{"type", "code", "message", "param"}``
        (always all four; OpenAI readers take the same keys); None when it succeeded."""
        return None if self.succeeded else normalize_error(self.error, self.status_code)

    @property
    def error_code(self) -> str | None:
        """The error's code, else its type (what a batch error line names); None when it
        succeeded."""
        error = self.openai_error
        return None if error is None else error["code"] or error["type"]

    # ---- storage -------------------------------------------------------------------------

    def _stored(self) -> dict[str, Any]:
        """The key of the outcome only, never a null one."""
        data: dict[str, Any] = {"status_code": self.status_code}
        if self.body is not None:
            data["body"] = self.body
        if self.error is not None:
            data["error"] = self.error
        return data

    def body_json(self) -> bytes | None:
        """The body as ``to_bytes`` writes it (None: no body): written once, a batch job's
        result goes to its key and its output line alike."""
        return None if self.body is None else jsonio.dumps(self.body)

    def to_bytes(self, body_json: bytes | None = None) -> bytes:
        """The stored text (what workers write): compact JSON, by orjson (queue/jsonio.py);
        ``body_json``: the body's, ``body_json()``, when written already."""
        data = self._stored()
        if body_json is not None and "body" in data:
            data["body"] = jsonio.RawJSON(body_json)
        return jsonio.dumps(data)

    def to_json(self) -> str:
        """The same value as the json module writes it."""
        return json.dumps(self._stored(), default=jsonio.as_read)

    @classmethod
    def from_json(cls, raw: str | bytes) -> JobResult:
        # what either writer wrote (the json module's NaN and infinities included); a
        # result's integers are counts and times, never past 64 bits
        return cls.model_validate(jsonio.loads(raw, long_integers=False))

"""Typed errors. Each maps to one HTTP status and to the hosted API's error object
``{"type", "code", "message", "param"}``, answered as ``{"error": {...}, "request_id"}``, so
the API tier can answer 4xx without guessing. OpenAI readers (the SDK, batch lines) take the
same keys: message, code, param, type."""

from __future__ import annotations

# The hosted API's error types, by HTTP status (any other 4xx: invalid_request; 5xx: api_error)
ERROR_TYPES = {400: "invalid_request", 401: "authentication_error", 404: "not_found",
               413: "invalid_request", 429: "rate_limited", 503: "unavailable"}


def error_type(status: int) -> str:
    """The hosted error type of an HTTP status."""
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request")


def error_object(status: int, message: str, *, code: str | None = None,
                 param: str | None = None) -> dict:
    """The inner error object, in the hosted key order."""
    return {"type": error_type(status), "code": code, "message": message, "param": param}


class SpinfError(Exception):
    status = 500
    code: str | None = "engine_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    @property
    def type(self) -> str:
        return error_type(self.status)

    def to_error(self) -> dict:
        """``{"type", "code", "message", "param"}``: the envelope's inner object, as a failed
        job stores it."""
        return error_object(self.status, self.message, code=self.code, param=self.param)

    def to_envelope(self, request_id: str | None) -> dict:
        """The whole error reply: ``{"error": {...}, "request_id"}``."""
        return {"error": self.to_error(), "request_id": request_id}

    def to_openai(self) -> dict:
        """``{"error": {...}}`` without a request id (batch and offline error lines)."""
        return {"error": self.to_error()}


class InvalidRequestError(SpinfError):
    """The request is malformed or asks for something this server will not do."""

    status = 400
    code = "invalid_field"   # when nothing more specific names the problem


class ContextLengthError(InvalidRequestError):
    code = "content_too_long"


class RequestTooLargeError(InvalidRequestError):
    """More work in one call than its limit (``limits.max_processed_tokens``): split it."""

    status = 413
    code = "request_too_large"


class ModelNotFoundError(InvalidRequestError):
    """The model name is not one this server serves, or resolves to nothing it can load
    (unknown, offline, unsupported)."""

    code = "model_not_served"


class UnsupportedModelError(ModelNotFoundError):
    """The checkpoint loads, but its architecture (or a variant of it) has no stack here."""

    code = "model_not_supported"

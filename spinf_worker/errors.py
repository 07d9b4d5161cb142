"""Typed errors. Each maps to one HTTP status and to the OpenAI error shape
``{"error": {"message", "type", "param", "code"}}`` so the API tier can answer 4xx without guessing."""

from __future__ import annotations


class SpinfError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


class InvalidRequestError(SpinfError):
    """The request is malformed or asks for something this server will not do."""

    status = 400
    type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    code = "context_length_exceeded"


class ModelNotFoundError(SpinfError):
    """The model name resolves to nothing we can load (unknown, offline, unsupported)."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class UnsupportedModelError(ModelNotFoundError):
    """The checkpoint loads, but its architecture (or a variant of it) has no stack here."""

    code = "model_not_supported"

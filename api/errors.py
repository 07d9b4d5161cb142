"""Every error leaves the API in the OpenAI shape ``{"error": {message, type, param, code}}``:
our typed errors, FastAPI's own 404/405/422, and anything unexpected (never a traceback)."""

from __future__ import annotations

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from spinf_worker.errors import InvalidRequestError, SpinfError


class ApiError(SpinfError):
    """A SpinfError that may carry response headers (Retry-After, WWW-Authenticate)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message, param=param, code=code)
        self.headers = headers or {}


class NotFoundError(ApiError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class AuthenticationError(ApiError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class RateLimitError(ApiError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class ServiceUnavailableError(ApiError):
    status = 503
    type = "server_error"
    code = "not_ready"


class InternalError(ApiError):
    status = 500
    type = "server_error"
    code = "internal_error"


class BodyTooLarge(HTTPException):
    """Raised while the body is read, so also from inside FastAPI's form parsing (which
    re-raises HTTPExceptions and turns anything else into a 400)."""

    def __init__(self, limit: int):
        super().__init__(status_code=413,
                         detail=f"the request body is larger than {limit} bytes")


# status -> (type, code) for HTTPExceptions raised by FastAPI, Starlette or us
_HTTP_ERRORS = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "forbidden"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "payload_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
}


def error_body(message: str, type_: str, *, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(error: SpinfError) -> JSONResponse:
    return JSONResponse(error.to_openai(), status_code=error.status,
                        headers=getattr(error, "headers", None) or None)


async def _spinf_error(_request: Request, error: SpinfError) -> JSONResponse:
    return error_response(error)


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    type_, code = _HTTP_ERRORS.get(
        error.status_code, ("server_error" if error.status_code >= 500 else
                            "invalid_request_error", None))
    message = error.detail if isinstance(error.detail, str) else str(error.detail)
    if error.status_code == 404 and message == "Not Found":
        message = f"no route {request.method} {request.url.path}"
    elif error.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    return JSONResponse(error_body(message, type_, code=code), status_code=error.status_code,
                        headers=getattr(error, "headers", None))


def validation_error(error: RequestValidationError) -> InvalidRequestError:
    """FastAPI's 422 as our 400: ``param`` is the field's path without its location
    (``body``, ``query``, ``path``, ``header``)."""
    problems = error.errors()
    first = problems[0]
    location = [str(step) for step in first.get("loc", ())]
    where = location[0] if location else ""
    path = location[1:] if where in ("body", "query", "path", "header", "cookie") else location
    param = ".".join(path) or None
    if first.get("type") == "json_invalid":
        return InvalidRequestError(f"the request body is not valid JSON: "
                                   f"{first.get('ctx', {}).get('error', first['msg'])}",
                                   code="invalid_json")
    message = f"{param}: {first['msg']}" if param else first["msg"]
    if where == "header":
        message = f"header {param}: {first['msg']}"
    if len(problems) > 1:
        message += f" (and {len(problems) - 1} more)"
    return InvalidRequestError(message, param=param)


async def _request_validation_error(_request: Request,
                                    error: RequestValidationError) -> JSONResponse:
    return error_response(validation_error(error))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(SpinfError, _spinf_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _request_validation_error)

"""Every error leaves the API in the hosted envelope
``{"error": {"type", "code", "message", "param"}, "request_id"}``: our typed errors, FastAPI's
own 404/405/422, and anything unexpected (never a traceback). ``request_id`` is the reply's
X-Request-Id (middleware.py). A Redis that cannot be reached is a 503 ``redis_unavailable``
with Retry-After, never a 500."""

from __future__ import annotations

import structlog
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from spinf_worker.errors import InvalidRequestError, SpinfError, error_object

log = structlog.get_logger("spinf.api")

WARMING_UP_RETRY_S = 10     # a model still loading: ask again soon
UNAVAILABLE_RETRY_S = 60    # no worker could load the model: someone has to act first
REDIS_RETRY_S = 5           # a restarting or failing-over Redis is back within seconds
# what redis-py raises when Redis cannot be reached or answered in time (its retries spent):
# refused or dropped connections, timeouts, LOADING after a restart, an exhausted pool
REDIS_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError)


class ApiError(SpinfError):
    """A SpinfError that may carry response headers (Retry-After, WWW-Authenticate)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message, param=param, code=code)
        self.headers = headers or {}


class NotFoundError(ApiError):
    status = 404
    code = "not_found"


class AuthenticationError(ApiError):
    status = 401
    code = "invalid_token"


class IdempotencyKeyReusedError(ApiError):
    """An Idempotency-Key sent again with another body (as Stripe answers it)."""

    status = 422
    code = "idempotency_key_reused"


class RateLimitError(ApiError):
    status = 429
    code = "concurrency_limit"


class ServiceUnavailableError(ApiError):
    status = 503
    code = "model_unavailable"


class WarmingUpError(ServiceUnavailableError):
    """The only live workers are still loading their model."""

    code = "warming_up"

    def __init__(self, message: str = "the model is loading; retry shortly", **kwargs):
        kwargs.setdefault("headers", {"Retry-After": str(WARMING_UP_RETRY_S)})
        super().__init__(message, **kwargs)


class RedisUnavailableError(ServiceUnavailableError):
    """Redis (the queue and every record) could not be reached, or did not answer in time,
    after the client's own retries (redis_client.connect)."""

    code = "redis_unavailable"

    def __init__(self, message: str = "the queue is unavailable (Redis does not answer); "
                                      "retry shortly", **kwargs):
        kwargs.setdefault("headers", {"Retry-After": str(REDIS_RETRY_S)})
        super().__init__(message, **kwargs)


class InternalError(ApiError):
    status = 500
    code = "engine_error"


class BodyTooLarge(HTTPException):
    """Raised while the body is read, so also from inside FastAPI's form parsing (which
    re-raises HTTPExceptions and turns anything else into a 400)."""

    def __init__(self, limit: int):
        super().__init__(status_code=413,
                         detail=f"the request body is larger than {limit} bytes")


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")

# status -> code for HTTPExceptions raised by FastAPI, Starlette or us
_HTTP_CODES = {
    400: "invalid_field",
    401: "invalid_token",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
}


def request_id_of(request: Request) -> str | None:
    """The id RequestContextMiddleware gave this request (None outside it)."""
    return request.scope.get("state", {}).get("request_id")


def envelope(status: int, message: str, request_id: str | None, *, code: str | None = None,
             param: str | None = None) -> dict:
    return {"error": error_object(status, message, code=code, param=param),
            "request_id": request_id}


def error_response(error: SpinfError, request_id: str | None) -> JSONResponse:
    return JSONResponse(error.to_envelope(request_id), status_code=error.status,
                        headers=getattr(error, "headers", None) or None)


async def _spinf_error(request: Request, error: SpinfError) -> JSONResponse:
    return error_response(error, request_id_of(request))


async def _redis_unavailable(request: Request, error: Exception) -> JSONResponse:
    # a warning, not a traceback per request: an outage is expected to pass
    log.warning("redis unavailable", method=request.method, path=request.url.path,
                error=f"{type(error).__name__}: {error}")
    return error_response(RedisUnavailableError(), request_id_of(request))


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    status = error.status_code
    code = _HTTP_CODES.get(status, "engine_error" if status >= 500 else None)
    message = error.detail if isinstance(error.detail, str) else str(error.detail)
    if status == 404 and message == "Not Found":
        message = f"no route {request.method} {request.url.path}"
    headers = getattr(error, "headers", None)
    if status == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
        headers = {**(headers or {}), "Allow": _allowed_methods(request)}
    return JSONResponse(envelope(status, message, request_id_of(request), code=code),
                        status_code=status, headers=headers)


def _allowed_methods(request: Request) -> str:
    """Every method the request's path takes: the router's 405 names those of the first route
    on the path only (GET and POST /v1/batches are two routes). Each method is asked of the
    routes as the router asks them, so included routers and path converters count."""
    allowed = [method for method in HTTP_METHODS if any(
        route.matches(_with_method(request.scope, method))[0] is Match.FULL
        for route in request.app.router.routes)]
    return ", ".join(allowed)


def _with_method(scope: dict, method: str) -> dict:
    # one level copied: matching may note its progress in a dict of the scope
    return {**{k: dict(v) if isinstance(v, dict) else v for k, v in scope.items()},
            "method": method}


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
    return InvalidRequestError(message, param=param, code="invalid_field")


async def _request_validation_error(request: Request,
                                    error: RequestValidationError) -> JSONResponse:
    return error_response(validation_error(error), request_id_of(request))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(SpinfError, _spinf_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _request_validation_error)
    for redis_error in REDIS_UNAVAILABLE:
        app.add_exception_handler(redis_error, _redis_unavailable)

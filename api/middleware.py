"""Pure ASGI middleware (no BaseHTTPMiddleware: it buffers streaming responses and hides
exceptions): request ids and timing around everything, body size limits inside."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable

import structlog
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import BodyTooLarge, InternalError, error_body
from .metrics import ApiMetrics

log = structlog.get_logger("spinf.api")

REQUEST_ID_HEADER = "x-request-id"
# A caller's id is echoed into logs and headers: accept only short, plain tokens.
_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class RequestContextMiddleware:
    """X-Request-Id in and out, bound into structlog's context; request duration by route
    template; any unhandled exception becomes a 500 in the OpenAI shape, with the id."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, REQUEST_ID_HEADER.encode())
        request_id = given if given and _SAFE_REQUEST_ID.match(given) else (
            "req_" + uuid.uuid4().hex)
        status = 500
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                message["headers"] = [*message.get("headers", []),
                                      (REQUEST_ID_HEADER.encode(), request_id.encode())]
            await send(message)

        start = time.perf_counter()
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                await self.app(scope, receive, send_with_id)
            except Exception:
                log.exception("unhandled error", method=scope["method"], path=scope["path"])
                if started:
                    raise  # the status line is out; the server closes the connection
                error = InternalError(f"internal server error (request id {request_id})")
                await JSONResponse(error.to_openai(), status_code=500)(
                    scope, receive, send_with_id)
            finally:
                route = scope.get("route")
                self.metrics.observe(scope["method"], getattr(route, "path", "unmatched"),
                                     status, time.perf_counter() - start)


class BodyLimitMiddleware:
    """413 for a body over the route's limit: at once from Content-Length, or while it is
    read (chunked uploads) by raising BodyTooLarge from ``receive``."""

    def __init__(self, app: ASGIApp, limit_for_path: Callable[[str], int]):
        self.app = app
        self.limit_for_path = limit_for_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for_path(scope["path"])
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            error = BodyTooLarge(limit)
            response = JSONResponse(error_body(error.detail, "invalid_request_error",
                                               code="payload_too_large"), status_code=413)
            await response(scope, receive, send)
            return
        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, receive_limited, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None

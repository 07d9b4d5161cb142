"""Pure ASGI middleware (no BaseHTTPMiddleware: it buffers streaming responses and hides
exceptions): request ids and timing around everything, body size limits inside."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import structlog
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from spinf_worker.ids import new_ulid

from .errors import BodyTooLarge, InternalError, envelope
from .metrics import ApiMetrics

log = structlog.get_logger("spinf.api")

REQUEST_ID_HEADER = b"x-request-id"


class RequestContextMiddleware:
    """A new X-Request-Id on every reply (a caller's own is never read: ids are the server's,
    so control characters, non-ASCII or over-long values the HTTP parser lets through never
    reach a reply or a log line),
    kept in ``scope["state"]["request_id"]`` for the error handlers and bound into structlog's
    context; the id added to any error envelope a route built without it; request duration
    by route template; any unhandled exception becomes a 500 ``engine_error`` in the
    envelope."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_ulid()
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500
        started = False
        held: Message | None = None     # the start of a JSON error reply, until its body
        body = b""

        async def send_with_id(message: Message) -> None:
            nonlocal status, started, held, body
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != REQUEST_ID_HEADER]
                message["headers"] = [*headers, (REQUEST_ID_HEADER, request_id.encode())]
                if status >= 400 and _is_json(headers):
                    held = message
                    return
            elif message["type"] == "http.response.body" and held is not None:
                body += message.get("body", b"")
                if message.get("more_body", False):
                    return
                body = _with_request_id(body, request_id)
                start, held = held, None
                start["headers"] = [(k, v) for k, v in start["headers"]
                                    if k.lower() != b"content-length"]
                start["headers"].append((b"content-length", str(len(body)).encode()))
                await send(start)
                message = {"type": "http.response.body", "body": body}
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
                await JSONResponse(error.to_envelope(request_id), status_code=500)(
                    scope, receive, send_with_id)
            finally:
                route = scope.get("route")
                self.metrics.observe(scope["method"], getattr(route, "path", "unmatched"),
                                     status, time.perf_counter() - start)


def _is_json(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"application/json")
               for k, v in headers)


def _with_request_id(body: bytes, request_id: str) -> bytes:
    """An error envelope built by a route (a failed job's stored error) gets the reply's id."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict) or not isinstance(data.get("error"), dict) \
            or data.get("request_id") == request_id:
        return body
    data["request_id"] = request_id
    return json.dumps(data).encode()


class BodyLimitMiddleware:
    """413 ``body_too_large`` for a body over the route's limit: at once from Content-Length,
    or while it is read (chunked uploads) by raising BodyTooLarge from ``receive``."""

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
            request_id = scope.get("state", {}).get("request_id")
            response = JSONResponse(envelope(413, error.detail, request_id,
                                             code="body_too_large"), status_code=413)
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

"""uvicorn's HTTP/1.1 protocol with its one reply of its own in the error envelope: a
request the parser refuses (a malformed request line or header, a header holding NUL, CR, LF
or another control character) never reaches the app, and uvicorn would answer it a plain-text
400 with no X-Request-Id. Here that 400 is ``invalid_request`` / ``malformed_request`` in the
envelope, with a fresh server ULID as X-Request-Id and ``request_id``, like every other reply
(middleware.py).

``EnvelopeHttpToolsProtocol`` is what ``uvicorn.Config(http=...)`` takes: httptools' parser
(llhttp, in C; uvicorn's own pick where it is installed) costs the API less CPU per request
than h11's in Python. It refuses every control character but HTAB in a header value (RFC
9110, 5.5), and, as h11 does, a request head (request line and headers) still incomplete past
16 KiB: httptools itself would buffer a header of any length."""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from spinf_worker.ids import new_ulid

from .errors import envelope

MALFORMED_CODE = "malformed_request"
MALFORMED_MESSAGE = ("the request is not valid HTTP/1.1: a malformed request line or header, "
                     "or a header holding NUL, CR, LF or another control character")
MAX_INCOMPLETE_HEAD = 16 * 1024    # bytes: h11's default limit


def malformed_reply(default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The whole 400 reply to a request the parser refused (the connection then closes)."""
    request_id = new_ulid()
    body = json.dumps(envelope(400, MALFORMED_MESSAGE, request_id,
                               code=MALFORMED_CODE)).encode()
    headers = [*default_headers,
               (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()),
               (b"x-request-id", request_id.encode()),
               (b"connection", b"close")]
    head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    return b"HTTP/1.1 400 Bad Request\r\n" + head + b"\r\n" + body


class EnvelopeHttpToolsProtocol(HttpToolsProtocol):
    # bytes received since the request began while its head is incomplete (None: complete).
    # Counted after the parser has taken a read: while the head is incomplete, every byte
    # read since the request began is head
    head_bytes: int | None = 0

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.head_bytes = 0

    def on_headers_complete(self) -> None:
        self.head_bytes = None
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.head_bytes is None or self.transport.is_closing():
            return
        self.head_bytes += len(data)
        if self.head_bytes > MAX_INCOMPLETE_HEAD:
            self.send_400_response("request head too large")

    def send_400_response(self, msg: str) -> None:
        # the request is unparseable and the connection closes right after
        self.transport.write(malformed_reply(self.server_state.default_headers))
        self.transport.close()

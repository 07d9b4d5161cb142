"""uvicorn's HTTP/1.1 protocol with its one reply of its own in the error envelope: a request
its parser refuses (a malformed request line or header, a header holding NUL, CR, LF or
another control character h11 rejects) never reaches the app, and uvicorn would answer it a
plain-text 400 with no X-Request-Id. Here that 400 is ``invalid_request`` /
``malformed_request`` in the envelope, with a fresh server ULID as X-Request-Id and
``request_id``, like every other reply (middleware.py).

``EnvelopeH11Protocol`` is what ``uvicorn.Config(http=...)`` takes; h11 is the parser
``http="auto"`` picks without httptools, and naming it keeps that choice whatever else is
installed."""

from __future__ import annotations

import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from spinf_worker.ids import new_ulid

from .errors import envelope

MALFORMED_CODE = "malformed_request"
MALFORMED_MESSAGE = ("the request is not valid HTTP/1.1: a malformed request line or header, "
                     "or a header holding NUL, CR, LF or another control character")


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


class EnvelopeH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        # written past h11's state machine: the request is unparseable and the connection
        # closes right after, so there is no exchange left for h11 to keep in order
        self.transport.write(malformed_reply(self.server_state.default_headers))
        self.transport.close()

"""``spinf-serve api`` as a real process (no torch), as deployed: a request its HTTP parser
refuses is answered in the error envelope with a fresh X-Request-Id, over a raw socket so
the bytes go out exactly as written; a bad API keys file stops the start in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ..conftest import WAIT_S
from .live import api_process, free_port, raw_http
from .test_api import ULID

ROOT = Path(__file__).resolve().parents[2]


def _environ(**more: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SPINF_")},
            "PYTHONPATH": str(ROOT), **more}


def _api_args(settings, port: int) -> list[str]:
    return [sys.executable, "-m", "spinf_worker.cli", "api", "--redis", settings.redis_url,
            "--prefix", settings.prefix, "--port", str(port)]


def get(headers: bytes) -> bytes:
    return (b"GET /healthz HTTP/1.1\r\nHost: spinf\r\n" + headers
            + b"Connection: close\r\n\r\n")


MALFORMED = {
    "nul in x-request-id": get(b"X-Request-Id: a\x00b\r\n"),
    "vt in x-request-id": get(b"X-Request-Id: a\x0bb\r\n"),
    "form feed in another header": get(b"X-Note: a\x0cb\r\n"),
    "cr in a header value": get(b"X-Request-Id: a\rb\r\n"),
    "control char in a header name": get(b"X-Re\x01quest-Id: abc\r\n"),
    "header without a colon": get(b"Not a header line\r\n"),
    "bad request line": b"GET\x00/healthz HTTP/1.1\r\nHost: spinf\r\n\r\n",
    "not http at all": b"hello there\r\n\r\n",
}


@pytest.fixture
def api_port(settings, tmp_path) -> Iterator[int]:
    with api_process(settings, tmp_path / "api.log") as (_, url):
        yield httpx.URL(url).port


@pytest.mark.parametrize("request_bytes", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_request_the_parser_refuses_gets_the_envelope(api_port, request_bytes):
    status, headers, body = raw_http(api_port, request_bytes)
    assert status == 400, body
    assert headers[b"content-type"] == b"application/json"
    assert int(headers[b"content-length"]) == len(body)
    request_id = headers[b"x-request-id"].decode("ascii")
    assert ULID.match(request_id)
    error = json.loads(body)
    assert error["request_id"] == request_id
    assert error["error"]["type"] == "invalid_request"
    assert error["error"]["code"] == "malformed_request"
    assert set(error["error"]) == {"type", "code", "message", "param"}


def test_each_refused_request_gets_its_own_id(api_port):
    ids = {raw_http(api_port, MALFORMED["nul in x-request-id"])[1][b"x-request-id"]
           for _ in range(3)}
    assert len(ids) == 3
    # and the server goes on answering well-formed requests
    status, headers, _ = raw_http(api_port, get(b""))
    assert status == 200 and ULID.match(headers[b"x-request-id"].decode("ascii"))


@pytest.mark.parametrize(("content", "line", "fragment"), [
    ("good-key tenant-a\nkey-b two spaces\n", 2, "expected '<key>' or '<key> <tenant>'"),
    ("# comment\n\nkey-a :bad\n", 3, "tenant ':bad'"),
    ("key-a tenant-a\nkey-a tenant-b\n", 2, "already listed for another tenant"),
], ids=["three fields", "bad tenant", "key of two tenants"])
@pytest.mark.parametrize("command", ["api", "serve"])
def test_a_bad_keys_file_is_one_line_naming_the_file_and_line(settings, tmp_path, command,
                                                              content, line, fragment):
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(content)
    args = _api_args(settings, free_port())
    args[3] = command
    if command == "serve":
        args += ["--state-dir", str(tmp_path / "state")]
    proc = subprocess.run(args, cwd=ROOT, env=_environ(SPINF_API_KEYS_FILE=str(keys_file)),
                          capture_output=True, text=True, timeout=WAIT_S * 2)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [text for text in proc.stderr.splitlines() if text.startswith("spinf-serve:")]
    assert len(errors) == 1, proc.stderr
    assert f"{keys_file}:{line}" in errors[0] and fragment in errors[0], proc.stderr


@pytest.mark.parametrize("make", [lambda path: None,
                                  lambda path: path.write_bytes(b"key-a \xff\xfe\n")],
                         ids=["missing", "not utf-8"])
def test_an_unreadable_keys_file_is_one_line_naming_it(settings, tmp_path, make):
    keys_file = tmp_path / "keys.txt"
    make(keys_file)
    proc = subprocess.run(_api_args(settings, free_port()), cwd=ROOT,
                          env=_environ(SPINF_API_KEYS_FILE=str(keys_file)),
                          capture_output=True, text=True, timeout=WAIT_S * 2)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [text for text in proc.stderr.splitlines() if text.startswith("spinf-serve:")]
    assert len(errors) == 1 and str(keys_file) in errors[0], proc.stderr

"""The [api] tier imports and serves with nothing that only [server] installs.

A subprocess in which torch, numpy, tokenizers, ... cannot be imported (tests/without_extras.py)
builds ``api.app.create_app`` on the real Redis (a key prefix of its own) and serves it with
uvicorn on a free loopback port; this process talks to it over HTTP. No worker runs, so a valid
/v1/score with Prefer: respond-async is queued (202 with its job) and a bad one is answered 400
by the API itself. At the end the subprocess reports which of the blocked packages anything
even tried to import."""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import httpx
import pytest

from . import without_extras

REDIS_URL = "redis://127.0.0.1:6379/0"
HTTP_TIMEOUT_S = 60.0     # the machine may be loaded
START_TIMEOUT_S = 120.0

SERVER = '''
import asyncio, json, socket, sys

from api.app import create_app
from api.http_protocol import EnvelopeHttpToolsProtocol
from spinf_worker.queue.settings import ServiceSettings
import uvicorn

settings = ServiceSettings(redis_url={redis_url!r}, prefix={prefix!r}, sync_timeout_s=1.0)
app = create_app(settings)
sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", 0))
server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                      http=EnvelopeHttpToolsProtocol))


async def main():
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    print(json.dumps({{"port": sock.getsockname()[1]}}), flush=True)
    stop = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(
        None, sys.stdin.readline))
    await asyncio.wait([serving, stop], return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    await serving


asyncio.run(main())
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in _Missing.blocked)
print(json.dumps({{"tried": sorted(_Missing.tried), "loaded": loaded,
                   "torch": "torch" in sys.modules}}), flush=True)
'''

# The blocker of without_extras, also noting what was asked for.
RECORDING = '''
_Missing.tried = set()
_find = _Missing.find_spec

def _recording(self, name, path=None, target=None):
    if name.partition(".")[0] in self.blocked:
        _Missing.tried.add(name)
    return _find(self, name, path, target)

_Missing.find_spec = _recording
'''

QUERY = {"id": "refund", "template": "\n\nIs the customer asking for a refund?\nAnswer:{?}",
         "options": [" yes", " no"]}


@pytest.fixture
def prefix():
    import redis

    name = f"spinf-test-notorch-{uuid.uuid4().hex[:12]}"
    yield name
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for key in client.scan_iter(match=f"{name}*", count=1000):
            client.delete(key)
    finally:
        client.close()


@pytest.fixture
def api_server(prefix):
    """(base URL, the subprocess): the [api] app served without the [server] packages."""
    proc = without_extras.popen(RECORDING + SERVER.format(redis_url=REDIS_URL, prefix=prefix),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()       # the port, once the socket is bound
        if not line:
            proc.wait(timeout=HTTP_TIMEOUT_S)
            pytest.fail(f"the API subprocess exited ({proc.returncode}) before serving:\n"
                        + proc.stderr.read())
        base = f"http://127.0.0.1:{json.loads(line)['port']}"
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()


def wait_until_healthy(client: httpx.Client, proc: subprocess.Popen) -> httpx.Response:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the API subprocess exited ({proc.returncode}):\n{proc.stderr.read()}")
        try:
            response = client.get("/health")
            if response.status_code == 200:
                return response
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"/health did not answer 200 within {START_TIMEOUT_S} s")
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> dict:
    """Ask the subprocess to stop; its last line: what it tried to import and holds."""
    out, err = proc.communicate("stop\n", timeout=HTTP_TIMEOUT_S)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_api_serves_without_server_packages(api_server):
    base, proc = api_server
    with httpx.Client(base_url=base, timeout=HTTP_TIMEOUT_S) as client:
        assert wait_until_healthy(client, proc).status_code == 200

        queued = client.post("/v1/score", headers={"Prefer": "respond-async"},
                             json={"text": "I was charged twice, please refund one.",
                                   "scoring": {"queries": [QUERY]}})
        assert queued.status_code == 202, queued.text
        job = queued.json()
        assert job["id"] and job["status"] == "queued"
        assert queued.headers["Location"] == f"/v1/jobs/{job['id']}"
        polled = client.get(f"/v1/jobs/{job['id']}")
        assert polled.status_code == 200, polled.text
        assert polled.json()["status"] == "queued"

        bad = client.post("/v1/score", json={
            "text": "x", "scoring": {"queries": [{**QUERY, "template": "no slot"}]}})
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert set(error) >= {"type", "code", "message", "param"}
        assert error["type"] == "invalid_request"
        assert error["code"] == "invalid_template"
        assert error["param"] == "scoring.queries.0.template"

        not_json = client.post("/v1/score", content=b"{", headers={"content-type":
                                                                   "application/json"})
        assert not_json.status_code == 400
        assert set(not_json.json()["error"]) >= {"type", "code", "message", "param"}

    report = stop(proc)
    assert report["torch"] is False
    assert report["loaded"] == []
    assert report["tried"] == [], f"the API tier tried to import {report['tried']}"


def test_the_apis_audio_checks_decode_without_server_packages():
    """An mp3 part's length (its token count and max_audio_seconds) is decoded by PyAV in
    the API's own checks, with no numpy, soxr or torch."""
    import base64

    from .test_media_audio_formats import encode, tones

    data = base64.b64encode(encode(tones(16_000, 0.5), 16_000, "mp3")).decode()
    body = {"messages": [{"content": [{"type": "input_audio",
                                       "input_audio": {"data": data, "format": "mp3"}}]}],
            "scoring": {"queries": [{"id": "a", "template": "Q {?}", "options": ["yes", "no"]}]}}
    code = ("from spinf_worker.protocol import ScoreRequest\n"
            "from spinf_worker.request_limits import check_request\n"
            f"request = ScoreRequest.parse({body!r})\n"
            "check_request(request, {}, tokens=None)\n"
            "print(request.documents()[0].messages[0].content[0].input_audio._length)\n")
    done = without_extras.run(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(8000, 16000)"

"""The hosted API's operations and errors against the real app (uvicorn on loopback, real
Redis): X-Request-Id on every reply and in every error envelope, /healthz /readyz /livez,
/v0 behind the trusted token, draining, workers that are still loading, /v1/models in both
shapes, and ``spinf-serve serve``'s command line."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time

import httpx
import pytest
import redis as redis_sync
from fastapi.responses import JSONResponse

from api.models import Info, ModelList, Readyz
from spinf_worker import cli
from spinf_worker.errors import ModelNotFoundError, SpinfError, error_type
from spinf_worker.model_names import HOSTED_ALIASES, aliases, is_default, served_names
from spinf_worker.protocol import DEFAULT_LIMITS
from spinf_worker.queue.keys import Keys

from ..conftest import WAIT_S
from . import live
from .live import InProcessWorker, LiveServer
from .test_api import ULID, assert_error

api_server = live.api_server  # the fixture, for pytest to find

MESSAGES = [{"role": "user", "content": "I was charged twice, please refund me."}]
SCORING = {"queries": [{"id": "refund", "template": "\nRefund?{?}", "options": [" yes", " no"]}]}


def register(settings, name: str, **entry) -> None:
    """A worker's registration as serve.py and the Worker write it."""
    client = redis_sync.Redis.from_url(settings.redis_url)
    try:
        client.hset(Keys(settings.prefix).workers, name, json.dumps(
            {"model": "org/some-model", "heartbeat_ms": int(time.time() * 1000), **entry}))
    finally:
        client.close()


# ---- the process --------------------------------------------------------------------------


@pytest.mark.parametrize("interval_ms", [0.25, None])
def test_the_api_sets_its_switch_interval_while_it_serves(settings, interval_ms):
    """``api_switch_interval_ms``: the process's interpreter switch interval while the API
    serves (a request's steps wait at most that long for the lock a thread validating a
    batch holds), as it was once it stops; None leaves it alone."""
    before = sys.getswitchinterval()
    update = {"api_switch_interval_ms": interval_ms}
    with LiveServer(settings.model_copy(update=update)) as server:
        assert httpx.get(f"{server.url}/healthz", timeout=WAIT_S).status_code == 200
        expected = before if interval_ms is None else interval_ms / 1000
        assert sys.getswitchinterval() == pytest.approx(expected)
    assert sys.getswitchinterval() == before


# ---- names -----------------------------------------------------------------------------------


def test_hosted_aliases_name_the_served_model():
    names = served_names("google/gemma-3-270m")
    assert {"google/gemma-3-270m", "gemma-3-270m", "spinf-12b", "spinf-31b"} <= names
    assert aliases("google/gemma-3-270m") == ["gemma-3-270m", "spinf-12b", "spinf-31b"]
    assert all(is_default(alias) for alias in HOSTED_ALIASES)


def test_error_classes_carry_the_hosted_types_and_codes():
    served = ModelNotFoundError("not here", param="model")
    assert (served.status, served.type, served.code) == (400, "invalid_request",
                                                          "model_not_served")
    assert served.to_envelope("01ABC") == {"error": {
        "type": "invalid_request", "code": "model_not_served", "message": "not here",
        "param": "model"}, "request_id": "01ABC"}
    assert SpinfError("boom").to_error()["type"] == "api_error"
    assert [error_type(s) for s in (400, 401, 404, 413, 429, 500, 503)] == [
        "invalid_request", "authentication_error", "not_found", "invalid_request",
        "rate_limited", "api_error", "unavailable"]


# ---- request ids and the envelope -----------------------------------------------------------


def test_every_reply_has_a_new_server_request_id(settings):
    server = LiveServer(settings)

    @server.app.get("/v1/route-built-error")
    async def route_built_error():   # like a failed job's stored error: no request id in it
        return JSONResponse({"error": {"type": "invalid_request", "code": "invalid_field",
                                       "message": "m", "param": None}}, status_code=400)

    with server:
        client = httpx.Client(base_url=server.url, timeout=WAIT_S,
                              headers={"X-Request-Id": "caller-id"})
        replies = [client.get(path) for path in (
            "/healthz", "/health", "/readyz", "/livez", "/ready", "/metrics", "/openapi.json",
            "/v1/models", "/v1/packs", "/v0/info", "/nowhere")]
        replies.append(client.post("/v1/score", content=b"{"))
        replies.append(client.get("/v1/route-built-error"))
        ids = [reply.headers["x-request-id"] for reply in replies]
        assert all(ULID.match(request_id) for request_id in ids), ids
        assert len(set(ids)) == len(ids)      # one per reply, never the caller's
        for reply in replies:   # every envelope (not /readyz's {"ready": false, "error"})
            if reply.status_code >= 400 and isinstance(reply.json().get("error"), dict):
                assert reply.json()["request_id"] == reply.headers["x-request-id"]
        assert_error(replies[-3], 404, "not_found")
        assert_error(replies[-2], 400, "invalid_json")
        built = assert_error(replies[-1], 400, "invalid_field")
        assert built["message"] == "m"
        assert int(replies[-1].headers["content-length"]) == len(replies[-1].content)


def raw_get(port: int, path: bytes, request_id: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    """GET with these X-Request-Id bytes, exactly as given."""
    return live.raw_http(port, b"GET " + path + b" HTTP/1.1\r\nHost: spinf\r\nX-Request-Id: "
                         + request_id + b"\r\nConnection: close\r\n\r\n")


# A field value may hold HTAB, visible characters and bytes over 0x7f (RFC 9110, 5.5): the
# HTTP parser lets these through to the app...
ODD_IDS = [b"a\tb", "\u00e9".encode(), "\u00e9".encode("latin-1"), b"\xff\xfe", b"x" * 8000,
           b"01ARZ3NDEKTSV4RRFFQ69G5FAV"]
# ...and refuses the other control characters before the app: the served protocol answers
# them in the envelope (api/http_protocol.py; more kinds against a spinf-serve api process:
# test_api_process.py)
REFUSED_IDS = [b"a\x00b", b"a\rb", b"a\x0bb", b"a\x0cb", b"a\x01b", b"a\x1bb", b"a\x7fb"]


def short_repr(value: bytes) -> str:
    return repr(value) if len(value) < 32 else f"{value[:8]!r}*{len(value)}"


@pytest.mark.parametrize("request_id", ODD_IDS, ids=short_repr)
def test_an_odd_x_request_id_gets_a_fresh_one(api_server, request_id):
    for path, status in ((b"/healthz", 200), (b"/nowhere", 404)):
        got, headers, body = raw_get(api_server.port, path, request_id)
        assert got == status, body
        fresh = headers[b"x-request-id"].decode("ascii")
        assert ULID.match(fresh) and fresh.encode() != request_id
        assert request_id not in body
        if status >= 400:
            assert json.loads(body)["request_id"] == fresh


@pytest.mark.parametrize("request_id", REFUSED_IDS, ids=short_repr)
def test_what_the_parser_refuses_gets_the_envelope_and_a_fresh_id(api_server, request_id):
    got, headers, body = raw_get(api_server.port, b"/healthz", request_id)
    assert got == 400 and headers[b"content-type"] == b"application/json", body
    fresh = headers[b"x-request-id"].decode("ascii")
    assert ULID.match(fresh) and json.loads(body)["request_id"] == fresh
    assert json.loads(body)["error"]["code"] == "malformed_request"


def test_a_request_head_still_incomplete_past_16_kib_gets_the_envelope(api_server):
    """The parser would buffer a header of any length; the served protocol refuses a request
    head still incomplete past 16 KiB, however it arrives, and answers in the envelope."""
    with socket.create_connection(("127.0.0.1", api_server.port), timeout=WAIT_S) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: spinf\r\nX-Note: ")
        # 16 KiB more in pieces, the last one past the limit: nothing is left unread when
        # the server answers and closes (bytes it never reads would reset the connection)
        for _ in range(16):
            conn.sendall(b"x" * 1024)
        got, headers, body = live.read_reply(conn)
    assert got == 400 and json.loads(body)["error"]["code"] == "malformed_request", body
    assert ULID.match(headers[b"x-request-id"].decode("ascii"))
    # a long head that is whole is read
    got, _, body = raw_get(api_server.port, b"/healthz", b"x" * 15000)
    assert got == 200, body


def test_envelope_codes(settings):
    settings = settings.model_copy(update={"api_keys": ["key-a"], "max_body_bytes": 1024,
                                           "max_backlog": 0})
    with LiveServer(settings) as server:
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S,
                              headers={"Authorization": "Bearer key-a"})
        missing = httpx.post(f"{server.v1}/score", json={}, timeout=WAIT_S)
        assert_error(missing, 401, "invalid_token")
        assert missing.headers["www-authenticate"] == "Bearer"
        assert_error(httpx.get(f"{server.v1}/models", timeout=WAIT_S,
                                  headers={"Authorization": "Bearer key-b"}), 401,
                        "invalid_token")
        assert_error(client.post("/score", content=b"not json"), 400, "invalid_json")
        assert_error(client.post("/score", content=b"x" * 2048), 413, "body_too_large")
        field = assert_error(client.get("/batches", params={"limit": 0}), 400,
                                "invalid_field")
        assert field["param"] == "limit"
        assert_error(client.get("/models/no/such/model"), 404, "model_not_found")
        # the backlog (0 allowed) is full once one job waits: 429 with Retry-After
        body = {"messages": MESSAGES, "scoring": SCORING}
        first = client.post("/score", json=body, headers={"Prefer": "respond-async"})
        assert first.status_code == 202, first.text
        full = client.post("/score", json=body)
        assert_error(full, 429, "concurrency_limit")
        assert int(full.headers["retry-after"]) > 0


# ---- health, readiness, liveness, draining --------------------------------------------------


def test_healthz_readyz_livez_and_draining(tiny_engine, settings):
    with LiveServer(settings) as server:
        client = httpx.Client(base_url=server.url, timeout=WAIT_S)
        assert client.get("/healthz").json() == {"ok": True}
        no_worker = client.get("/readyz")
        assert no_worker.status_code == 503
        assert no_worker.json()["ready"] is False and "no worker" in no_worker.json()["error"]
        assert client.get("/livez").status_code == 503
        assert client.get("/livez").json() == {"live": False}

        with InProcessWorker(tiny_engine, settings) as worker:
            ready = client.get("/readyz")
            assert ready.status_code == 200, ready.text
            body = Readyz.model_validate(ready.json())
            assert body.ready and body.boot.loaded_ms is not None
            (boot,) = body.boot.workers
            assert boot.worker == worker.name and boot.status == "available"
            assert boot.started_ms <= boot.loaded_ms
            assert client.get("/livez").json() == {"live": True}

            assert client.post("/v0/drain").json() == {"draining": True}
            draining = client.get("/readyz")
            assert draining.status_code == 503
            assert draining.json() == {"ready": False, "draining": True}
            live_while_draining = client.get("/livez")    # liveness ignores the drain
            assert live_while_draining.status_code == 200
            assert live_while_draining.json() == {"live": True}
            # draining moves traffic away; what still comes is scored
            scored = client.post("/v1/score", json={"messages": MESSAGES, "scoring": SCORING},
                                 headers={"Prefer": "respond-async"})
            assert scored.status_code == 202, scored.text

            assert client.delete("/v0/drain").json() == {"draining": False}
            assert client.get("/readyz").status_code == 200
        # a worker that stopped deregisters
        assert client.get("/readyz").status_code == 503


def test_workers_still_loading(api_server, settings):
    client = httpx.Client(base_url=api_server.url, timeout=WAIT_S)
    register(settings, "loader", status="loading", started_ms=int(time.time() * 1000))

    assert client.get("/readyz").status_code == 503
    assert client.get("/readyz").json() == {"ready": False}
    assert client.get("/livez").json() == {"live": False}
    warming = client.get("/v0/info")
    assert_error(warming, 503, "warming_up")
    assert int(warming.headers["retry-after"]) > 0
    assert_error(client.get("/ready"), 503, "warming_up")
    models = ModelList.model_validate(client.get("/v1/models").json())
    assert [(m.id, m.status) for m in models.models] == [("org/some-model", "loading")]

    register(settings, "loader", status="error", error="OSError: no weights")
    failed = client.get("/readyz")
    assert failed.status_code == 503
    assert failed.json() == {"ready": False, "error": "the model failed to load: OSError: "
                                                      "no weights"}
    assert client.get("/v1/models").json()["models"][0]["status"] == "error"
    assert_error(client.get("/v0/info"), 503, "model_unavailable")


def test_score_answers_warming_up_while_the_only_workers_load(api_server, settings):
    register(settings, "loader", status="loading", started_ms=int(time.time() * 1000))
    reply = httpx.post(f"{api_server.v1}/score", json={"messages": MESSAGES, "scoring": SCORING},
                       headers={"Prefer": "respond-async"}, timeout=WAIT_S)
    assert_error(reply, 503, "warming_up")
    assert int(reply.headers["retry-after"]) > 0


# ---- /v0: the trusted token -----------------------------------------------------------------


def test_v0_needs_the_trusted_token(tiny_engine, settings):
    settings = settings.model_copy(update={"token": "op-token"})
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings):
        url = f"{server.url}/v0/info"
        assert_error(httpx.get(url, timeout=WAIT_S), 401, "invalid_token")
        assert_error(httpx.get(url, timeout=WAIT_S,
                                  headers={"Authorization": "Bearer other"}), 401,
                        "invalid_token")
        assert_error(httpx.post(f"{server.url}/v0/drain", timeout=WAIT_S), 401,
                        "invalid_token")
        trusted = {"Authorization": "Bearer op-token"}
        info = httpx.get(url, timeout=WAIT_S, headers=trusted)
        assert info.status_code == 200, info.text
        body = Info.model_validate(info.json())
        assert body.engine.models == [tiny_engine.model_name]
        assert body.engine.fingerprints == [tiny_engine.fingerprint]
        (engine,) = body.engine.workers
        assert engine.device == str(tiny_engine.device) and engine.status == "available"
        assert body.boot.workers[0].loaded_ms is not None
        # the token is also a bearer token for /v1; the operations routes stay open
        assert_error(httpx.get(f"{server.v1}/models", timeout=WAIT_S), 401, "invalid_token")
        assert httpx.get(f"{server.v1}/models", timeout=WAIT_S,
                         headers=trusted).status_code == 200
        assert httpx.get(f"{server.url}/readyz", timeout=WAIT_S).status_code == 200


def test_v0_without_a_token_is_for_local_callers_only(api_server):
    assert httpx.post(f"{api_server.url}/v0/drain", timeout=WAIT_S).status_code == 200

    async def from_elsewhere() -> httpx.Response:
        # the same app, reached as from another host; refused before anything is read
        transport = httpx.ASGITransport(app=api_server.app, client=("203.0.113.7", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://spinf") as client:
            return await client.delete("/v0/drain")

    assert_error(asyncio.run(from_elsewhere()), 401, "invalid_token")
    assert httpx.delete(f"{api_server.url}/v0/drain", timeout=WAIT_S).json() == {
        "draining": False}


# ---- /v1/models -----------------------------------------------------------------------------


def test_models_in_the_hosted_and_openai_shapes(tiny_engine, api_server, settings):
    from openai import OpenAI

    with InProcessWorker(tiny_engine, settings):
        reply = httpx.get(f"{api_server.v1}/models", timeout=WAIT_S).json()
        models = ModelList.model_validate(reply)
        assert reply["object"] == "list" and reply["data"] == reply["models"]
        (model,) = models.models
        name = tiny_engine.model_name
        assert (model.id, model.status, model.base_model) == (name, "available", name)
        assert model.name == name.rsplit("/", 1)[-1]
        assert set(model.aliases) == served_names(name) - {name}
        assert {"spinf-12b", "spinf-31b"} <= set(model.aliases)
        assert model.family == tiny_engine.checkpoint.config.get("model_type")
        assert "score" in model.capabilities and model.features.extraction
        assert model.limits == DEFAULT_LIMITS.model_dump()
        assert set(reply["models"][0]) >= {"id", "name", "status", "base_model", "aliases",
                                           "family", "capabilities", "media", "limits",
                                           "features"}
        for alias in ("spinf-12b", "spinf-31b", name.rsplit("/", 1)[-1]):
            found = httpx.get(f"{api_server.v1}/models/{alias}", timeout=WAIT_S)
            assert found.status_code == 200 and found.json()["id"] == name
        openai = OpenAI(base_url=api_server.v1, api_key="unused", max_retries=0,
                        timeout=WAIT_S)
        assert [m.id for m in openai.models.list().data] == [name]
        # the hosted client's default name reaches the served model (queued, not refused)
        queued = httpx.post(f"{api_server.v1}/score", timeout=WAIT_S,
                            headers={"Prefer": "respond-async"},
                            json={"model": "spinf-12b", "messages": MESSAGES,
                                  "scoring": SCORING})
        assert queued.status_code == 202, queued.text
        refused = httpx.post(f"{api_server.v1}/score", timeout=WAIT_S,
                             json={"model": "spinf-99b", "messages": MESSAGES,
                                   "scoring": SCORING})
        assert assert_error(refused, 400, "model_not_served")["param"] == "model"


# ---- the worker's registration while it loads (serve.py) ------------------------------------


async def _registration(redis, keys: Keys, name: str) -> dict | None:
    raw = await redis.hget(keys.workers, name)
    return None if raw is None else json.loads(raw)


async def _until(condition, what: str):
    deadline = time.monotonic() + WAIT_S
    while not (value := await condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return value


@pytest.mark.asyncio
async def test_serve_registers_loading_then_available(tiny_engine, redis, keys, settings,
                                                      monkeypatch):
    from spinf_worker import serve
    from spinf_worker.serve import WorkerSpec

    release = threading.Event()

    def slow_load(spec, settings):     # runs on the engine thread; returns when released
        assert release.wait(WAIT_S)
        return tiny_engine

    monkeypatch.setattr(serve, "load_engine", slow_load)
    stop = asyncio.Event()
    task = asyncio.create_task(serve._run_worker(WorkerSpec(model="m", name="w1"), settings,
                                                 redis, keys, stop))
    try:
        loading = await _until(lambda: _registration(redis, keys, "w1"), "the registration")
        assert loading["status"] == "loading" and loading["model"] == "m"
        assert loading["started_ms"] <= loading["heartbeat_ms"]
        release.set()

        async def available():
            entry = await _registration(redis, keys, "w1")
            return entry if entry and entry["status"] == "available" else None

        entry = await _until(available, "the worker to register as available")
        assert entry["model"] == tiny_engine.model_name
        assert entry["fingerprint"] == tiny_engine.fingerprint
        assert entry["started_ms"] == loading["started_ms"] <= entry["loaded_ms"]
    finally:
        release.set()
        stop.set()
        await asyncio.wait_for(task, WAIT_S)
    assert await _registration(redis, keys, "w1") is None   # a stopped worker leaves


@pytest.mark.asyncio
async def test_serve_registers_a_failed_load(redis, keys, settings, monkeypatch):
    from spinf_worker import serve
    from spinf_worker.serve import WorkerSpec

    def failing_load(spec, settings):
        raise OSError("no weights here")

    monkeypatch.setattr(serve, "load_engine", failing_load)
    # the load's own error: a timeout (also an OSError) would mean the worker hung after it
    with pytest.raises(OSError, match="no weights here"):
        await asyncio.wait_for(serve._run_worker(WorkerSpec(model="m", name="w2"), settings,
                                                 redis, keys, asyncio.Event()), WAIT_S)
    entry = await _registration(redis, keys, "w2")
    assert entry["status"] == "error" and entry["error"] == "OSError: no weights here"


# ---- spinf-serve serve ------------------------------------------------------------------------


def test_serve_takes_the_model_as_an_argument_and_a_token():
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "org/model", "--token", "T", "--port", "9000"])
    assert (args.model_arg, args.model, args.token, args.port) == ("org/model", None, "T", 9000)
    args = parser.parse_args(["serve", "--model", "org/other"])
    assert (args.model_arg, args.model, args.token) == (None, "org/other", None)
    assert parser.parse_args(["api", "--token", "T"]).token == "T"
    both = parser.parse_args(["serve", "org/model", "--model", "org/other"])
    assert cli.cmd_serve(both) == 2


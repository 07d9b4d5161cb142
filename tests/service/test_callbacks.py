"""Webhook callbacks against a real receiver on 127.0.0.1 and the real Redis.

The tests write what a worker leaves behind for a finished job with a callback — the job hash
(`callback`, `status`, `custom_id`, `finished_at`), the result key (JSON `{status_code, body}`
or `{status_code, error}`) and an entry `{job}` on the callbacks stream — so no model is needed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.server
import ipaddress
import json
import socket
import threading
import time
import uuid

import httpx
import pytest
import pytest_asyncio
import standardwebhooks
from redis.asyncio import Redis

from spinf_worker.queue.callbacks import CallbackDispatcher
from spinf_worker.queue.keys import DISPATCHERS
from spinf_worker.webhooks import (
    CallbackRefused,
    TargetGuard,
    backoff_s,
    new_secret,
    parse_retry_after,
    sign,
    verify,
)

from ..conftest import WAIT_S
from .live import InProcessWorker, LiveServer

SECRET = new_secret()


class Receiver:
    """A webhook endpoint: answers each path from a script of (status, headers), then 200,
    and keeps every request it got."""

    def __init__(self):
        self.scripts: dict[str, list[tuple[int, dict]]] = {}
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with receiver.lock:
                    receiver.requests.append({"path": self.path, "headers": dict(self.headers),
                                              "body": body, "at": time.monotonic()})
                    script = receiver.scripts.get(self.path) or []
                    status, headers = script.pop(0) if script else (200, {})
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str, *script: tuple[int, dict]) -> str:
        self.scripts[path] = list(script)
        return f"http://127.0.0.1:{self.port}{path}"

    def got(self, path: str) -> list[dict]:
        with self.lock:
            return [r for r in self.requests if r["path"] == path]


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.server.shutdown()


@pytest_asyncio.fixture
async def redis(redis_url):
    client = Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
def cb_settings(settings):
    return settings.model_copy(update={"webhook_secret": SECRET, "callback_allow": ["127.0.0.1"],
                                       "callback_timeout_s": WAIT_S / 2})


RESPONSE = {"id": "score-1", "object": "score", "queries": []}


async def finished_job(redis, keys, url, *, result=None, custom_id="doc-1") -> str:
    """What a worker writes for a finished job with a callback, then the callbacks entry."""
    job_id = f"job_{uuid.uuid4().hex}"
    result = result or {"status_code": 200, "body": RESPONSE}
    status = "succeeded" if result["status_code"] < 400 else "failed"
    await redis.hset(keys.job(job_id), mapping={"status": status, "callback": url,
                                                "custom_id": custom_id,
                                                "finished_at": int(time.time())})
    await redis.expire(keys.job(job_id), 600)
    await redis.set(keys.result(job_id), json.dumps(result), ex=600)
    await redis.xadd(keys.callbacks, {"job": job_id})
    return job_id


@contextlib.asynccontextmanager
async def dispatching(redis, keys, settings, name="d1", **options):
    stop = asyncio.Event()
    dispatcher = CallbackDispatcher(redis, keys, settings, name=name, **options)
    task = asyncio.create_task(dispatcher.run(stop))
    try:
        yield dispatcher
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)


async def settled(redis, keys, job_id, timeout=WAIT_S) -> dict:
    """The job hash once its callback reached a final state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = await redis.hgetall(keys.job(job_id))
        if job.get("callback_status") in ("delivered", "failed", "refused"):
            return job
        await asyncio.sleep(0.05)
    raise AssertionError(f"callback of {job_id} not settled: {job}")


# --- signatures -------------------------------------------------------------------------------


def test_sign_verify_round_trip():
    body = b'{"type":"score.succeeded","data":{"id":"job_1"}}'
    now = int(time.time())
    headers = {"Webhook-Id": "msg_job_1", "Webhook-Timestamp": str(now),
               "Webhook-Signature": sign(SECRET, "msg_job_1", now, body)}
    assert headers["Webhook-Signature"].startswith("v1,")
    assert verify(SECRET, headers, body)
    assert not verify(SECRET, headers, body.replace(b"job_1", b"job_2"))          # tampered
    assert not verify(new_secret(), headers, body)                                # other key
    assert not verify(SECRET, {**headers, "Webhook-Id": "msg_other"}, body)
    assert not verify(SECRET, headers, body, now=now + 301)                      # too old
    assert not verify(SECRET, headers, body, now=now - 301)                      # from the future
    assert verify(SECRET, headers, body, tolerance_s=600, now=now + 301)
    old = now - 3600                                                              # replayed
    assert not verify(SECRET, {**headers, "Webhook-Timestamp": str(old),
                               "Webhook-Signature": sign(SECRET, "msg_job_1", old, body)}, body)
    # key rotation: several signatures, one of them valid
    rotated = f"v1,{base64.b64encode(b'x' * 32).decode()} {headers['Webhook-Signature']}"
    assert verify(SECRET, {**headers, "Webhook-Signature": rotated}, body)
    for bad in ("", "v1", "v1,", "v2," + headers["Webhook-Signature"][3:], "garbage ,,"):
        assert not verify(SECRET, {**headers, "Webhook-Signature": bad}, body)
    assert not verify(SECRET, {**headers, "Webhook-Timestamp": "soon"}, body)
    assert not verify(SECRET, {}, body)


def test_signature_matches_the_spec_example():
    # the Standard Webhooks spec's worked example
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"test": 2432232314}'
    assert sign(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body) == \
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_secret_format():
    secret = new_secret()
    assert secret.startswith("whsec_") and len(base64.b64decode(secret[6:])) == 32
    with pytest.raises(ValueError):
        sign("whsec_not base64!", "id", 1, b"")


def test_interop_with_the_reference_library():
    body = b'{"a":1}'
    now = int(time.time())
    headers = {"webhook-id": "msg_x", "webhook-timestamp": str(now),
               "webhook-signature": sign(SECRET, "msg_x", now, body)}
    assert standardwebhooks.Webhook(SECRET).verify(body, headers) == {"a": 1}


def test_retry_after_and_backoff():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert all(0 <= backoff_s(n, 0.5) <= 0.5 * 2 ** (n - 1) for n in range(1, 8) for _ in range(20))


# --- the SSRF guard ---------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/", "http://[::1]:8080/hook", "http://127.0.0.1/",
    "http://localhost:9/", "http://10.1.2.3/", "http://192.168.0.10/", "http://[fe80::1]/",
    "http://[::ffff:127.0.0.1]/", "http://0.0.0.0/", "http://224.0.0.1/", "http://100.64.0.1/",
    "ftp://example.com/", "file:///etc/passwd", "http://user:pw@93.184.215.14/",
    "http://no-such-host.invalid/"])
async def test_guard_refuses(url):
    with pytest.raises(CallbackRefused):
        await TargetGuard().resolve(url)


@pytest.mark.asyncio
async def test_guard_allows_listed_and_public_targets():
    target = await TargetGuard().resolve("https://93.184.215.14:8443/hook?x=1")
    assert target.address == "93.184.215.14"
    assert await TargetGuard(["127.0.0.1"]).resolve("http://127.0.0.1:9/")
    assert (await TargetGuard(["10.0.0.0/8"]).resolve("http://10.9.8.7/")).address == "10.9.8.7"
    assert (await TargetGuard(["::1"]).resolve("http://[::1]:9/")).address == "::1"
    assert (await TargetGuard(["LocalHost"]).resolve("http://localhost:9/")).address
    with pytest.raises(CallbackRefused):
        await TargetGuard(["10.0.0.0/8"]).resolve("http://169.254.169.254/")
    # the request goes to the checked address, with the original Host
    pinned = await TargetGuard(["localhost"]).resolve("http://localhost:9/a")
    assert pinned.request_url().host == pinned.address and pinned.url.host == "localhost"


# IPv6 forms that carry an internal IPv4 address (a relay or translator would reach it): the
# URL, the form and the embedded address the refusal names
EMBEDDED = [
    ("http://[2002:7f00:1::]/", "6to4", "127.0.0.1"),
    ("http://[2002:a00:1::]:8080/hook", "6to4", "10.0.0.1"),
    ("http://[2002:a9fe:a9fe::]/latest/meta-data/", "6to4", "169.254.169.254"),
    ("http://[64:ff9b::7f00:1]/", "NAT64", "127.0.0.1"),
    ("http://[64:ff9b::a9fe:a9fe]/", "NAT64", "169.254.169.254"),
    ("http://[64:ff9b::c0a8:1]/", "NAT64", "192.168.0.1"),
    ("http://[::ffff:127.0.0.1]/", "IPv4-mapped", "127.0.0.1"),
    ("http://[::ffff:10.1.2.3]/", "IPv4-mapped", "10.1.2.3"),
    ("http://[::127.0.0.1]/", "IPv4-compatible", "127.0.0.1"),
    ("http://[::a9fe:a9fe]/", "IPv4-compatible", "169.254.169.254"),
    # Teredo stores its client's address inverted: 80ff:fffe is 127.0.0.1, f5ff:fffe 10.0.0.1
    ("http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/", "Teredo client", "127.0.0.1"),
    ("http://[2001:0:4136:e378:8000:63bf:f5ff:fffe]/", "Teredo client", "10.0.0.1"),
    ("http://[2001:0:a00:1:8000:63bf:a2ff:fff1]/", "Teredo server", "10.0.0.1"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("url", "form", "inner"), EMBEDDED, ids=[e[0] for e in EMBEDDED])
async def test_guard_refuses_an_internal_ipv4_inside_ipv6(url, form, inner):
    with pytest.raises(CallbackRefused) as refused:
        await TargetGuard().resolve(url)
    assert f"the {form} address {inner}" in str(refused.value)
    # allowing the IPv4 address allows only itself (and its IPv4-mapped spelling, the same
    # socket address), never a relay's way to it
    if form == "IPv4-mapped":
        allowed = await TargetGuard([inner]).resolve(url)
        assert ipaddress.ip_address(allowed.address).ipv4_mapped == ipaddress.ip_address(inner)
    else:
        with pytest.raises(CallbackRefused):
            await TargetGuard([inner]).resolve(url)


@pytest.mark.asyncio
async def test_guard_refuses_local_use_nat64_and_allows_public_embedded_ipv4():
    with pytest.raises(CallbackRefused, match="local-use NAT64"):
        await TargetGuard().resolve("http://[64:ff9b:1::5db8:d70e]/")
    # a public IPv4 host as an IPv6-only network's DNS64 names it, and its mapped spelling
    for url, address in (("http://[64:ff9b::5db8:d70e]/", "64:ff9b::5db8:d70e"),
                         ("https://[::ffff:93.184.215.14]/", "::ffff:5db8:d70e")):
        assert (await TargetGuard().resolve(url)).address == address

# --- the dispatcher ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_retries_until_delivered(redis, keys, cb_settings, receiver):
    url = receiver.url("/flaky", (500, {}), (503, {}))
    job_id = await finished_job(redis, keys, url)
    async with dispatching(redis, keys, cb_settings):
        job = await settled(redis, keys, job_id)
    assert job["callback_status"] == "delivered"
    assert job["callback_attempts"] == "3" and job["callback_last_status"] == "200"
    assert "callback_last_error" not in job
    got = receiver.got("/flaky")
    assert len(got) == 3
    assert len({r["headers"]["webhook-id"] for r in got}) == 1      # receivers can dedupe
    for r in got:
        assert verify(SECRET, r["headers"], r["body"])
        assert r["headers"]["content-type"] == "application/json"
    event = json.loads(got[-1]["body"])
    assert event["type"] == "score.succeeded"
    assert event["data"] == {"id": job_id, "custom_id": "doc-1", "status": "succeeded",
                             "response": RESPONSE, "error": None}
    stats = await redis.hgetall(keys.stats)
    assert stats["callbacks_delivered"] == "1"
    assert stats["callback_attempts_5xx"] == "2" and stats["callback_attempts_2xx"] == "1"
    assert await redis.xlen(keys.callbacks) == 0
    assert await redis.zcard(keys.callback_retry) == 0


@pytest.mark.asyncio
async def test_gone_and_redirect_give_up_at_once(redis, keys, cb_settings, receiver):
    gone = await finished_job(redis, keys, receiver.url("/gone", (410, {})))
    moved = await finished_job(redis, keys, receiver.url("/moved", (302, {"location": "/x"})))
    bad = await finished_job(redis, keys, receiver.url("/bad", (400, {})))
    async with dispatching(redis, keys, cb_settings):
        jobs = [await settled(redis, keys, j) for j in (gone, moved, bad)]
    for job in jobs:
        assert job["callback_status"] == "failed" and job["callback_attempts"] == "1"
    assert jobs[0]["callback_last_status"] == "410" and "gone" in jobs[0]["callback_last_error"]
    assert "redirect" in jobs[1]["callback_last_error"]
    assert len(receiver.got("/gone")) == len(receiver.got("/moved")) == 1
    assert not receiver.got("/x")
    stats = await redis.hgetall(keys.stats)
    assert stats["callbacks_failed"] == "3"


@pytest.mark.asyncio
async def test_failed_job_and_attempt_limit(redis, keys, cb_settings, receiver):
    settings = cb_settings.model_copy(update={"callback_max_attempts": 2})
    error = {"message": "no slot", "type": "invalid_request_error"}
    job_id = await finished_job(redis, keys, receiver.url("/down", (500, {}), (500, {})),
                                result={"status_code": 400, "error": error})
    async with dispatching(redis, keys, settings):
        job = await settled(redis, keys, job_id)
    assert job["callback_status"] == "failed" and job["callback_attempts"] == "2"
    assert job["callback_last_error"] == "HTTP 500"
    event = json.loads(receiver.got("/down")[0]["body"])
    assert event["type"] == "score.failed"
    assert event["data"]["error"] == error and event["data"]["response"] is None


@pytest.mark.asyncio
async def test_private_target_refused_without_allow_list(redis, keys, cb_settings, receiver):
    settings = cb_settings.model_copy(update={"callback_allow": []})
    job_id = await finished_job(redis, keys, receiver.url("/private"))
    async with dispatching(redis, keys, settings):
        job = await settled(redis, keys, job_id)
    assert job["callback_status"] == "refused"
    assert "loopback" in job["callback_last_error"]
    assert job.get("callback_attempts", "0") == "0"
    assert receiver.got("/private") == []
    assert (await redis.hgetall(keys.stats))["callbacks_refused"] == "1"


@pytest.mark.asyncio
async def test_retry_is_scheduled_in_redis_and_survives_a_restart(redis, keys, cb_settings,
                                                                  receiver):
    """A delivery waiting on Retry-After blocks nobody, and a new dispatcher finishes it."""
    retry_after = 2 * WAIT_S     # longer than the test may take: the retry waits, whatever speed
    slow = await finished_job(redis, keys, receiver.url(
        "/busy", (429, {"retry-after": str(int(retry_after))})))
    before = time.time()
    async with dispatching(redis, keys, cb_settings, name="first"):
        deadline = time.monotonic() + WAIT_S
        while (await redis.hget(keys.job(slow), "callback_status")) != "pending":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        quick = await finished_job(redis, keys, receiver.url("/quick"))
        assert (await settled(redis, keys, quick))["callback_status"] == "delivered"
        assert (await redis.hget(keys.job(slow), "callback_status")) == "pending"
    due_ms = await redis.zscore(keys.callback_retry, slow)
    assert due_ms / 1000 >= before + retry_after - 1                  # Retry-After honoured
    assert int((await redis.hgetall(keys.job(slow)))["callback_next_at"]) == due_ms
    # bring the due time forward rather than wait for it
    await redis.zadd(keys.callback_retry, {slow: int(time.time() * 1000)})
    async with dispatching(redis, keys, cb_settings, name="second"):
        job = await settled(redis, keys, slow)
    assert job["callback_status"] == "delivered" and job["callback_attempts"] == "2"
    first, second = receiver.got("/busy")
    assert second["headers"]["webhook-id"] == first["headers"]["webhook-id"]


@pytest.mark.asyncio
async def test_delivered_job_is_not_sent_again(redis, keys, cb_settings, receiver):
    """At-least-once upstream: a repeated callbacks entry for a settled job is dropped."""
    job_id = await finished_job(redis, keys, receiver.url("/once"))
    async with dispatching(redis, keys, cb_settings):
        await settled(redis, keys, job_id)
        await redis.xadd(keys.callbacks, {"job": job_id})
        deadline = time.monotonic() + WAIT_S
        while await redis.xlen(keys.callbacks):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
    assert len(receiver.got("/once")) == 1


@pytest.mark.asyncio
async def test_network_errors_are_retried(redis, keys, cb_settings):
    settings = cb_settings.model_copy(update={"callback_max_attempts": 2})
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    job_id = await finished_job(redis, keys, f"http://127.0.0.1:{closed}/hook")
    async with dispatching(redis, keys, settings):
        job = await settled(redis, keys, job_id)
    assert job["callback_status"] == "failed" and job["callback_attempts"] == "2"
    assert "ConnectError" in job["callback_last_error"] and "callback_last_status" not in job
    assert (await redis.hgetall(keys.stats))["callback_attempts_error"] == "2"


@pytest.mark.asyncio
async def test_entries_of_a_crashed_dispatcher_are_delivered(redis, keys, cb_settings, receiver):
    """Read but never acknowledged: the same name re-reads it on start, another takes it over
    once it has been idle long enough."""
    mine = await finished_job(redis, keys, receiver.url("/mine"))
    theirs = await finished_job(redis, keys, receiver.url("/theirs"))
    await CallbackDispatcher(redis, keys, cb_settings).ensure_group()
    await redis.xreadgroup(DISPATCHERS, "restarted", {keys.callbacks: ">"}, count=1)  # mine
    await redis.xreadgroup(DISPATCHERS, "crashed", {keys.callbacks: ">"}, count=1)    # theirs
    async with dispatching(redis, keys, cb_settings, name="restarted"):
        assert (await settled(redis, keys, mine))["callback_status"] == "delivered"
    assert (await redis.hget(keys.job(theirs), "callback_status")) is None
    async with dispatching(redis, keys, cb_settings, name="other", claim_idle_ms=100):
        assert (await settled(redis, keys, theirs))["callback_status"] == "delivered"
    assert len(receiver.got("/mine")) == len(receiver.got("/theirs")) == 1
    assert await redis.xlen(keys.callbacks) == 0


@pytest.mark.asyncio
async def test_internal_ipv4_inside_ipv6_is_refused_at_delivery(redis, keys, cb_settings,
                                                                receiver):
    """Even with 127.0.0.1 allowed (cb_settings): the addresses getaddrinfo gives for each
    form are checked before any request, and nothing reaches the receiver on loopback."""
    urls = [f"http://[2002:7f00:1::]:{receiver.port}/6to4",
            f"http://[64:ff9b::7f00:1]:{receiver.port}/nat64",
            f"http://[::127.0.0.1]:{receiver.port}/compatible",
            f"http://[2001:0:4136:e378:8000:63bf:80ff:fffe]:{receiver.port}/teredo",
            f"http://[::ffff:10.0.0.1]:{receiver.port}/mapped"]
    jobs = [await finished_job(redis, keys, url) for url in urls]
    async with dispatching(redis, keys, cb_settings):
        settled_jobs = [await settled(redis, keys, job_id) for job_id in jobs]
    for url, job in zip(urls, settled_jobs, strict=True):
        assert job["callback_status"] == "refused", (url, job)
        assert job.get("callback_attempts", "0") == "0"
        assert " address 1" in job["callback_last_error"], job["callback_last_error"]
    assert not any(receiver.got(f"/{path}") for path in
                   ("6to4", "nat64", "compatible", "teredo", "mapped"))
    assert (await redis.hgetall(keys.stats))["callbacks_refused"] == str(len(urls))


@pytest.mark.asyncio
async def test_a_job_with_an_embedded_internal_callback_is_refused(tiny_engine, redis, keys,
                                                                   cb_settings, receiver):
    """End to end: the API takes the job (it checks only the scheme; the guard runs before
    each delivery, where DNS is asked), the worker scores it, the dispatcher refuses the
    callback, and the job says so."""
    settings = cb_settings.model_copy(update={"callback_allow": []})
    body = {"messages": [{"role": "user", "content": "Please refund me."}],
            "scoring": {"queries": [{"id": "refund", "template": "\nRefund?{?}",
                                     "options": [" yes", " no"]}]}}
    urls = [f"http://[2002:7f00:1::]:{receiver.port}/api-6to4",
            f"http://[::ffff:127.0.0.1]:{receiver.port}/api-mapped"]
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings):
        async with httpx.AsyncClient(base_url=server.v1, timeout=WAIT_S) as client, \
                dispatching(redis, keys, settings):
            job_ids = []
            for url in urls:
                queued = await client.post("/jobs", json={**body, "callback": url})
                assert queued.status_code == 202, queued.text
                job_ids.append(queued.json()["id"])
            for job_id in job_ids:
                job = await settled(redis, keys, job_id)
                assert job["status"] == "succeeded" and job["callback_status"] == "refused"
                assert "loopback: the " in job["callback_last_error"]
                shown = (await client.get(f"/jobs/{job_id}")).json()
                assert shown["callback_status"] == "refused" and shown["response"]
    assert not receiver.got("/api-6to4") and not receiver.got("/api-mapped")

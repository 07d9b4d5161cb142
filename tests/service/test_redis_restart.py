"""A Redis restart and a Redis outage under a live API and a worker (uvicorn on loopback, a
private redis-server, the tiny engine): while Redis is down every route that needs it answers
503 ``redis_unavailable`` with Retry-After in the envelope, and once it is back — with its AOF
or with nothing — requests answer as before, on the same pooled clients, with no 500."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis as redis_sync

from spinf_worker.protocol import ScoreResponse

from ..conftest import WAIT_S
from .live import InProcessWorker, LiveServer, PrivateRedis, wait_for
from .test_api import assert_error

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="no redis-server binary")

MESSAGES = [{"role": "user", "content": "I was charged twice, please refund me."}]
SCORING = {"queries": [{"id": "refund", "template": "\nRefund?{?}", "options": [" yes", " no"]}]}
BODY = {"messages": MESSAGES, "scoring": SCORING}
# more requests at once than one connection serves: the pools hold many connections, all
# of them left stale by the restart
CONCURRENCY = 16


@pytest.fixture
def private_redis(tmp_path, request):
    server = PrivateRedis(tmp_path, aof=getattr(request, "param", False)).start()
    yield server
    server.stop()


@pytest.fixture
def redis_settings(settings, private_redis):
    return settings.model_copy(update={"redis_url": private_redis.url})


def calls(client: httpx.Client, job_id: str) -> list[tuple[str, httpx.Response]]:
    """One of each kind of Redis call a route makes: reads, a job queued, a sync wait."""
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [("models", pool.submit(client.get, "/v1/models")),
                   ("job", pool.submit(client.get, f"/v1/jobs/{job_id}")),
                   ("queue", pool.submit(client.post, "/v1/jobs", json=BODY)),
                   ("score", pool.submit(client.post, "/v1/score", json=BODY))]
        futures += [(name, pool.submit(client.get, path)) for _ in range(CONCURRENCY)
                    for name, path in (("models", "/v1/models"), ("job", f"/v1/jobs/{job_id}"))]
        return [(name, future.result()) for name, future in futures]


def assert_answered(replies: list[tuple[str, httpx.Response]], *, job_known: bool) -> None:
    for name, reply in replies:
        assert reply.status_code < 500, (name, reply.status_code, reply.text)
        if name == "models":     # (empty until the worker's next heartbeat after a restart)
            assert reply.status_code == 200 and "models" in reply.json(), reply.text
        elif name == "job":
            assert reply.status_code == (200 if job_known else 404), reply.text
        elif name == "queue":
            assert reply.status_code == 202, reply.text
        else:
            assert reply.status_code == 200, reply.text
            scored = ScoreResponse.model_validate(reply.json())
            assert scored.results[0].queries[0].id == "refund"


def queued_job(client: httpx.Client) -> str:
    reply = client.post("/v1/jobs", json=BODY)
    assert reply.status_code == 202, reply.text
    return reply.json()["id"]


@pytest.mark.parametrize("private_redis", [False, True], ids=["no-aof", "aof"],
                         indirect=True)
def test_a_redis_restart_leaves_no_error_behind(tiny_engine, redis_settings, private_redis):
    """Killed and started again while nobody asks: every pooled connection (the API's, the
    producer's, the reply listener's, the worker's) is stale; none of them fails a request."""
    with LiveServer(redis_settings) as server, \
            InProcessWorker(tiny_engine, redis_settings) as worker, \
            httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
        job_id = queued_job(client)
        assert_answered(calls(client, job_id), job_known=True)

        private_redis.kill()
        private_redis.start()

        # with the AOF the job queued before the crash is still there; without it, it is
        # gone: a 404, not an error
        assert_answered(calls(client, job_id), job_known=private_redis.aof)
        assert_answered(calls(client, job_id), job_known=private_redis.aof)
        assert worker._thread.is_alive()


def test_a_redis_outage_is_503_with_retry_after(tiny_engine, redis_settings, private_redis):
    with LiveServer(redis_settings) as server, \
            InProcessWorker(tiny_engine, redis_settings), \
            httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
        job_id = queued_job(client)
        assert_answered(calls(client, job_id), job_known=True)

        private_redis.kill()
        down = calls(client, job_id)
        down.append(("ready", client.get("/ready")))
        for name, reply in down:
            assert_error(reply, 503, "redis_unavailable")
            assert int(reply.headers["retry-after"]) > 0, name

        private_redis.start()
        # the worker backs off while Redis is away (at most a few seconds): the first sync
        # answer may wait for it, never fail
        assert_answered(calls(client, job_id), job_known=False)


def test_the_worker_and_the_reply_listener_read_again_after_a_restart(
        tiny_engine, redis_settings, private_redis):
    """A job queued after the restart is scored and its sync answer comes through the reply
    stream: the worker made its consumer group again, the API's listener reads its stream."""
    with LiveServer(redis_settings) as server, \
            InProcessWorker(tiny_engine, redis_settings), \
            httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
        listener = server.app.state.services.listener
        assert client.post("/v1/score", json=BODY).status_code == 200
        private_redis.kill()
        private_redis.start()
        reply = client.post("/v1/score", json=BODY)
        assert reply.status_code == 200, reply.text
        job_id = reply.headers["x-job-id"]
        check = redis_sync.Redis.from_url(private_redis.url, decode_responses=True)
        try:
            # the worker's hint for this job is in the new stream, and the listener read it
            # (a dead listener would leave the sync wait to its fallback read at the end)
            (last_id, fields), = check.xrevrange(listener.stream, count=1)
            assert fields["job"] == job_id
            wait_for(lambda: listener._last_id == last_id, what="the listener to read it")
        finally:
            check.close()

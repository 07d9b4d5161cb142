"""Queueing a batch's input: an API process killed in the middle of a file is taken over by
another instance from the progress it recorded (no line queued twice, none lost, a cancel still
ends ``cancelled``), and a small backlog limit paces the queueing instead of flooding the
stream. Real Redis, a real ``spinf-serve api`` process, the tiny engine."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from spinf_worker.queue import batches
from spinf_worker.queue.keys import Keys
from spinf_worker.queue.redis_client import connect

from ..conftest import WAIT_S
from .live import InProcessWorker, LiveServer, api_process, jsonl, wait_for
from .test_batches import TEXTS, batch_in, lines_of, score_line, upload

LEASE_S = 2.0        # the killed queuer's lease: another instance takes over this long after
KILLED_BACKLOG = 150  # the killed API stops queueing here at the latest: always mid-file
LINES = 200


@pytest.fixture
def sync_redis(redis_url) -> Iterator[redis_sync.Redis]:
    client = redis_sync.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def batch_fields(client: redis_sync.Redis, keys: Keys, batch_id: str) -> dict:
    return client.hgetall(keys.batch(batch_id))


def assert_consistent(client: redis_sync.Redis, keys: Keys, batch_id: str) -> dict:
    """The counts agree with what is in Redis (no worker ran): every line handled is an error
    line or a pending custom_id with exactly one entry in the bulk stream."""
    fields = batch_fields(client, keys, batch_id)
    pending = client.smembers(keys.batch_pending(batch_id))
    entries = [f["custom_id"] for _, f in client.xrange(keys.bulk)]
    errors = client.llen(keys.batch_lines(batch_id, "err"))
    assert int(fields["completed"]) == 0
    assert int(fields["failed"]) == errors
    assert int(fields["total"]) == errors + len(pending), (fields, len(pending))
    assert sorted(entries) == sorted(pending), "one stream entry per pending custom_id"
    return fields


def input_file() -> tuple[bytes, collections.Counter, collections.Counter]:
    """LINES lines: valid ones, and a few bad ones, some of whose custom_ids come back near the
    end of the file (past where the killed API can have got): those later lines must be
    refused by whoever queues them. Returns the content and the expected (custom_id, code)
    of the output and error lines."""
    rows: list[bytes] = []
    out: collections.Counter = collections.Counter()
    err: collections.Counter = collections.Counter()
    for i in range(LINES - 5):
        rows.append(json.dumps(score_line(f"doc-{i}", TEXTS[i % len(TEXTS)])).encode())
        out[(f"doc-{i}", None)] += 1
        if i == 3:
            rows.append(b'{"custom_id": "broken", ')
            err[(None, "invalid_json")] += 1
        if i == 7:
            rows.append(json.dumps(score_line("early-bad", "x", url="/v1/embeddings")).encode())
            err[("early-bad", "invalid_url")] += 1
    # near the end: an id whose first line was invalid, one whose first line was valid
    rows.append(json.dumps(score_line("early-bad", "now valid")).encode())
    rows.append(json.dumps(score_line("doc-5", "again")).encode())
    err[("early-bad", "duplicate_custom_id")] += 1
    err[("doc-5", "duplicate_custom_id")] += 1
    rows.append(json.dumps(score_line("last", TEXTS[0])).encode())
    out[("last", None)] += 1
    assert len(rows) == LINES
    return b"\n".join(rows) + b"\n", out, err


def kill_api_while_queueing(settings, keys: Keys, client: redis_sync.Redis, content: bytes,
                            tmp_path: Path) -> str:
    """Create a batch on a real API process and SIGKILL it as soon as Redis shows it queued
    something. Its backlog limit stops it well before the end of the file, so the kill is
    always in the middle; whether it is in the middle of a chunk is up to the timing, and
    every moment must be survivable. Returns the batch id."""
    env = {"SPINF_MAX_BACKLOG": str(KILLED_BACKLOG), "SPINF_BATCH_LEASE_S": str(LEASE_S)}
    with api_process(settings, tmp_path / "api.log", **env) as (process, v1):
        http = httpx.Client(base_url=v1, timeout=WAIT_S)
        uploaded = upload(http, content)
        created = http.post("/batches", json={"input_file_id": uploaded["id"],
                                              "endpoint": "/v1/score"})
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]
        wait_for(lambda: int(batch_fields(client, keys, batch_id).get("total") or 0) > 0,
                 WAIT_S, 0.005, "the API process to queue something")
        process.send_signal(signal.SIGKILL)
        process.wait(WAIT_S)
    fields = assert_consistent(client, keys, batch_id)
    assert fields["status"] == "in_progress" and fields.get("sealed") == "0"
    assert 0 < int(fields["queued_line"]) < LINES, fields
    return batch_id


def test_a_batch_whose_api_was_killed_is_queued_on_by_another_instance(
        tiny_engine, settings, keys, sync_redis, tmp_path):
    content, expected_out, expected_err = input_file()
    batch_id = kill_api_while_queueing(settings, keys, sync_redis, content, tmp_path)

    settings = settings.model_copy(update={"batch_lease_s": LEASE_S})
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings):
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        done = batch_in(client, batch_id, "completed", "failed", "cancelled")
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": LINES, "completed": sum(expected_out.values()),
                                          "failed": sum(expected_err.values())}
        out = collections.Counter((line["custom_id"], None)
                                  for line in lines_of(client, done["output_file_id"]))
        err = collections.Counter((line["custom_id"], line["error"]["code"])
                                  for line in lines_of(client, done["error_file_id"]))
    # every line exactly once: nothing queued twice by the two instances, nothing lost
    assert out == expected_out
    assert err == expected_err
    assert not sync_redis.exists(keys.batch_pending(batch_id))
    assert not sync_redis.sismember(keys.batch_queueing, batch_id)


def test_cancelling_a_batch_whose_api_was_killed_ends_cancelled(
        settings, keys, sync_redis, tmp_path):
    content, _out, _err = input_file()
    batch_id = kill_api_while_queueing(settings, keys, sync_redis, content, tmp_path)
    queued = assert_consistent(sync_redis, keys, batch_id)

    async def cancel() -> tuple[str, bool]:   # what the route does, while no API runs
        client = connect(settings.redis_url, socket_timeout=WAIT_S)
        try:
            return await batches.cancel_batch(client, keys, batch_id)
        finally:
            await client.aclose()

    # not all queued: the queuer drains once it stops, and this one is dead
    assert asyncio.run(cancel()) == ("cancelling", False)

    settings = settings.model_copy(update={"batch_lease_s": LEASE_S})
    with LiveServer(settings) as server:   # no worker: nothing queued gets an answer
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        done = batch_in(client, batch_id, "cancelled")
        errors = lines_of(client, done["error_file_id"])
        assert client.post(f"/batches/{batch_id}/cancel").status_code == 400
    # the instance that took over stopped where the dead one had, and drained what it queued
    total = int(queued["total"])
    assert done["request_counts"] == {"total": total, "completed": 0, "failed": total}
    assert done["output_file_id"] is None and len(errors) == total
    cancelled = [line["custom_id"] for line in errors
                 if line["error"]["code"] == "batch_cancelled"]
    assert sorted(cancelled) == sorted(f["custom_id"] for _, f in sync_redis.xrange(keys.bulk))
    assert len(set(cancelled)) == len(cancelled)
    assert int(sync_redis.hget(keys.batch(batch_id), "queued_line")) == \
        int(queued["queued_line"])


def test_a_small_backlog_paces_the_queueing_and_the_batch_completes(
        tiny_engine, settings, keys, sync_redis):
    limit, count = 5, 100
    settings = settings.model_copy(update={"max_backlog": limit})
    content = jsonl([score_line(f"doc-{i}", TEXTS[i % len(TEXTS)]) for i in range(count)])

    def backlog() -> int:
        return sync_redis.xlen(keys.bulk) + sync_redis.xlen(keys.interactive)

    with LiveServer(settings) as server:
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        uploaded = upload(client, content)
        batch = client.post("/batches", json={"input_file_id": uploaded["id"],
                                              "endpoint": "/v1/score"}).json()
        # no worker yet: the queuer fills the stream to the limit and pauses
        wait_for(lambda: backlog() > limit or sync_redis.hexists(keys.batch(batch["id"]),
                                                                 "queue_paused_ms"),
                 WAIT_S, 0.01, "the queuer to pause")
        assert backlog() == limit
        assert client.get(f"/batches/{batch['id']}").json()["request_counts"]["total"] == limit

        seen_most = 0

        def finished() -> bool:
            nonlocal seen_most
            seen_most = max(seen_most, backlog())
            assert seen_most <= limit, f"{seen_most} entries queued, the limit is {limit}"
            status = client.get(f"/batches/{batch['id']}").json()["status"]
            return status in ("completed", "failed", "cancelled")

        with InProcessWorker(tiny_engine, settings):
            wait_for(finished, WAIT_S, 0.01, "the batch to finish")
        done = batch_in(client, batch["id"], "completed")
        assert done["request_counts"] == {"total": count, "completed": count, "failed": 0}
        output = [line["custom_id"] for line in lines_of(client, done["output_file_id"])]
        assert sorted(output) == sorted(f"doc-{i}" for i in range(count))

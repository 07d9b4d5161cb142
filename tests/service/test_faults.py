"""Faults under a bulk batch, end to end: real ``spinf-serve api`` and ``spinf-serve worker``
processes (the tiny model), a private redis-server with its AOF. The same input file runs once
undisturbed and once with, at moments a seeded ``random.Random`` picks, (a) a worker killed
(SIGKILL) while it holds entries, (b) the API that queues the batch killed in the middle of the
file, (c) Redis killed and started again from its AOF. The disturbed batch completes, every
custom_id is answered exactly once, and every answer equals the undisturbed run's bit for bit.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from spinf_worker.queue.keys import GROUP, Keys
from spinf_worker.queue.settings import ServiceSettings

from ..conftest import WAIT_S
from .live import ROOT, PrivateRedis, api_process, wait_for
from .test_batches import lines_of, score_line, upload

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="no redis-server binary")

SEED = 20261202
DOCS = 200
LEASE_S = 2.0      # a killed queuer's lease: the other API takes over this long after
BACKLOG = 32       # entries waiting at most: the queueing spans the run, so a kill lands mid-file
# small passes (four tiny documents) and quick reclaims, so each fault hits work in flight
WORKER_ENV = {"SPINF_MAX_PASS_TOKENS": "512", "SPINF_CLAIM_IDLE_MS": "1500",
              "SPINF_HEARTBEAT_S": "0.2", "SPINF_MAX_WAIT_MS": "20"}
API_ENV = {"SPINF_MAX_BACKLOG": str(BACKLOG), "SPINF_BATCH_LEASE_S": str(LEASE_S)}
# Redis stays down this long: past the clients' own retries (under a second), so the errors
# reach the queuer, the keepers and the workers, and held entries look idle once it is back
REDIS_DOWN_S = 2.0
# what differs between two runs of the same request: ids, clocks, timings
VOLATILE = ("id", "created", "timing")
TERMINAL = ("completed", "failed", "cancelled", "expired")


def input_file() -> tuple[bytes, collections.Counter]:
    """DOCS valid lines (each text its own) and two invalid on purpose: bad JSON early, a
    repeated custom_id late (refused by whichever API queues that far). Returns the content
    and the expected (custom_id, code) of the error lines."""
    rows = [json.dumps(score_line(f"doc-{i}", f"Story {i}: the home team won by {i} points."))
            .encode() for i in range(DOCS)]
    rows.insert(3, b'{"custom_id": "broken", ')
    rows.insert(DOCS - 5, json.dumps(score_line("doc-10", "again")).encode())
    errors = collections.Counter({(None, "invalid_json"): 1, ("doc-10", "duplicate_custom_id"): 1})
    return b"\n".join(rows) + b"\n", errors


@contextlib.contextmanager
def worker_processes(settings: ServiceSettings, model: Path, names: list[str],
                     log_dir: Path) -> Iterator[dict[str, subprocess.Popen]]:
    """``spinf-serve worker`` processes, started together; yields them by name once all have
    registered. Killed at the end if still running."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPINF_")}
    env = {**environ, "PYTHONPATH": str(ROOT), **WORKER_ENV}
    processes: dict[str, subprocess.Popen] = {}
    try:
        for name in names:
            with open(log_dir / f"{name}.log", "w") as log:
                processes[name] = subprocess.Popen(
                    [sys.executable, "-m", "spinf_worker.cli", "worker", "--redis",
                     settings.redis_url, "--prefix", settings.prefix, "--model", str(model),
                     "--device", "cpu", "--name", name],
                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        client = redis_sync.Redis.from_url(settings.redis_url, decode_responses=True)

        def registered() -> bool:
            for name, process in processes.items():
                assert process.poll() is None, (log_dir / f"{name}.log").read_text()
            workers = client.hgetall(Keys(settings.prefix).workers)
            return all('"available"' in workers.get(name, "") for name in names)

        wait_for(registered, WAIT_S, 0.2, "the workers to register")
        client.close()
        yield processes
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
            process.wait(WAIT_S)


def create_batch(api: httpx.Client, content: bytes) -> str:
    uploaded = upload(api, content)
    created = api.post("/batches", json={"input_file_id": uploaded["id"],
                                         "endpoint": "/v1/score"})
    assert created.status_code == 200, created.text
    return created.json()["id"]


def batch_hash(client: redis_sync.Redis, keys: Keys, batch_id: str) -> dict | None:
    """The batch's fields, or None while Redis is away (restarting)."""
    try:
        return client.hgetall(keys.batch(batch_id))
    except (redis_sync.ConnectionError, redis_sync.BusyLoadingError):
        return None


def holds_entries(client: redis_sync.Redis, keys: Keys, consumer: str) -> bool:
    try:
        return bool(client.xpending_range(keys.bulk, GROUP, "-", "+", 1,
                                          consumername=consumer))
    except redis_sync.ResponseError:   # no group yet
        return False


@dataclass
class Faults:
    """When each fault strikes, drawn from the seed: the API once this many lines are queued,
    the worker and Redis once this many lines are answered. Redis comes after the API kill
    (answered <= queued), so the kill always hits the API that queues."""

    api_at: int
    worker_at: int
    redis_at: int

    @classmethod
    def draw(cls, seed: int) -> Faults:
        rng = random.Random(seed)
        return cls(api_at=rng.randint(40, 110), worker_at=rng.randint(20, 120),
                   redis_at=rng.randint(120, 170))


def run_with_faults(faults: Faults, batch_id: str, keys: Keys, private_redis: PrivateRedis,
                    api: subprocess.Popen, worker: subprocess.Popen) -> dict[str, str]:
    """Watch the batch in Redis and strike each fault at its moment; returns what each hit."""
    client = redis_sync.Redis.from_url(private_redis.url, decode_responses=True,
                                       socket_timeout=WAIT_S)
    hits: dict[str, str] = {}
    deadline = time.monotonic() + 3 * WAIT_S
    try:
        while True:
            assert time.monotonic() < deadline, f"the batch did not finish; faults hit: {hits}"
            fields = batch_hash(client, keys, batch_id)
            if fields is None:
                time.sleep(0.05)
                continue
            total, completed = int(fields.get("total") or 0), int(fields.get("completed") or 0)
            if "api" not in hits and total >= faults.api_at:
                api.send_signal(signal.SIGKILL)
                api.wait(WAIT_S)
                queued = int(batch_hash(client, keys, batch_id)["queued_line"])
                hits["api"] = f"killed at queued_line {queued}"
                assert queued < DOCS, hits   # in the middle of the file
            if "worker" not in hits and completed >= faults.worker_at:
                # frozen first, so what it holds cannot change between the look and the kill
                worker.send_signal(signal.SIGSTOP)
                if holds_entries(client, keys, "doomed"):
                    worker.send_signal(signal.SIGKILL)
                    worker.wait(WAIT_S)
                    hits["worker"] = f"killed at {completed} answered"
                else:
                    worker.send_signal(signal.SIGCONT)
            # (with work in flight: not in a lull while the other API takes the queueing over)
            if ("redis" not in hits and completed >= faults.redis_at
                    and (pending := client.scard(keys.batch_pending(batch_id)))):
                private_redis.kill()
                time.sleep(REDIS_DOWN_S)
                private_redis.start()
                hits["redis"] = (f"restarted at {completed} answered, {pending} pending, "
                                 f"queued_line {fields.get('queued_line')}")
            if fields.get("status") in TERMINAL:
                assert set(hits) == {"api", "worker", "redis"}, (fields, hits)
                return hits
            time.sleep(0.01)
    finally:
        client.close()


def wait_done(api: httpx.Client, batch_id: str) -> dict:
    def check() -> dict | None:
        with contextlib.suppress(httpx.TransportError):
            reply = api.get(f"/batches/{batch_id}")
            if reply.status_code == 200 and reply.json()["status"] in TERMINAL:
                return reply.json()
        return None
    return wait_for(check, 3 * WAIT_S, 0.1, f"batch {batch_id} to finish")


def answers(api: httpx.Client, batch: dict) -> tuple[dict, collections.Counter]:
    """custom_id -> response body without the fields that differ run to run, and the error
    lines' (custom_id, code). Fails on a custom_id answered twice."""
    bodies: dict[str, dict] = {}
    for line in lines_of(api, batch["output_file_id"]):
        assert line["custom_id"] not in bodies, f"{line['custom_id']} answered twice"
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        body = line["response"]["body"]
        bodies[line["custom_id"]] = {k: v for k, v in body.items() if k not in VOLATILE}
    errors = collections.Counter((line["custom_id"], line["error"]["code"])
                                 for line in lines_of(api, batch["error_file_id"]))
    return bodies, errors


def test_a_batch_survives_killed_workers_a_killed_api_and_a_redis_restart(
        tiny_dir, settings, tmp_path):
    content, expected_errors = input_file()
    faults = Faults.draw(SEED)
    (tmp_path / "redis").mkdir()
    private_redis = PrivateRedis(tmp_path / "redis", aof=True).start()
    settings = settings.model_copy(update={"redis_url": private_redis.url})
    keys = Keys(settings.prefix)
    with contextlib.ExitStack() as stack:
        stack.callback(private_redis.stop)
        workers = stack.enter_context(
            worker_processes(settings, tiny_dir, ["doomed", "survivor"], tmp_path))
        _, survivor_v1 = stack.enter_context(
            api_process(settings, tmp_path / "api-survivor.log", **API_ENV))
        doomed_api, doomed_v1 = stack.enter_context(
            api_process(settings, tmp_path / "api-doomed.log", **API_ENV))
        survivor = stack.enter_context(httpx.Client(base_url=survivor_v1, timeout=WAIT_S))
        doomed = stack.enter_context(httpx.Client(base_url=doomed_v1, timeout=WAIT_S))

        baseline = wait_done(survivor, create_batch(survivor, content))   # undisturbed
        assert baseline["status"] == "completed", baseline
        expected, errors = answers(survivor, baseline)
        assert sorted(expected) == sorted(f"doc-{i}" for i in range(DOCS))
        assert errors == expected_errors

        batch_id = create_batch(doomed, content)   # queued by the API about to be killed
        hits = run_with_faults(faults, batch_id, keys, private_redis, doomed_api,
                               workers["doomed"])
        done = wait_done(survivor, batch_id)
        assert done["status"] == "completed", (done, hits)
        assert done["request_counts"] == {"total": DOCS + 2, "completed": DOCS, "failed": 2}
        got, errors = answers(survivor, done)
        assert errors == expected_errors, hits
        assert sorted(got) == sorted(expected), hits   # none lost
        differ = [c for c in expected if got[c] != expected[c]]
        assert not differ, f"answers differ from the undisturbed run: {differ[:5]} ({hits})"

        check = redis_sync.Redis.from_url(private_redis.url, decode_responses=True)
        assert not check.exists(keys.batch_pending(batch_id))
        assert not check.sismember(keys.batch_queueing, batch_id)
        assert check.xlen(keys.dead) == 0
        check.close()

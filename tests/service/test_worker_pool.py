"""``spinf-serve worker --devices``: one worker process per device on one queue, supervised.
On the CPU two children (``--devices cpu,cpu``) stand for two GPUs: a batch is shared by
both, a child killed (SIGKILL) while it holds entries is started again under its name and
finishes them, every custom_id is answered once with the answer a lone worker gives, and
SIGTERM stops the pool and its children gracefully."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
import redis as redis_sync

from spinf_worker.queue.keys import GROUP, Keys
from spinf_worker.queue.settings import ServiceSettings
from spinf_worker.worker_pool import (
    DevicesError,
    WorkerPool,
    parse_devices,
    shared_without_mps,
)

from ..conftest import WAIT_S
from .live import ROOT, api_process, wait_for
from .test_batches import batch_in, lines_of, score_line, upload

DOCS = 60
WORKER_ENV = {"SPINF_MAX_PASS_TOKENS": "512", "SPINF_CLAIM_IDLE_MS": "1500",
              "SPINF_HEARTBEAT_S": "0.2", "SPINF_MAX_WAIT_MS": "20"}


def test_devices_are_parsed_into_one_worker_each():
    assert parse_devices("all", gpus=2) == ["cuda:0", "cuda:1"]
    assert parse_devices("0,1", gpus=4) == ["cuda:0", "cuda:1"]
    assert parse_devices("cuda:1, 3", gpus=4) == ["cuda:1", "cuda:3"]
    assert parse_devices("cpu,cpu", gpus=0) == ["cpu", "cpu"]
    assert parse_devices("0,1,0", gpus=2) == ["cuda:0", "cuda:1", "cuda:0"]
    for spec, gpus, says in [("all", 0, "no GPU is visible"),
                             ("2", 2, r"2 GPU\(s\) are visible"), ("gpu1", 2, "not a GPU index"),
                             ("", 1, "not a GPU index")]:
        with pytest.raises(DevicesError, match=says):
            parse_devices(spec, gpus=gpus)


def test_a_bad_devices_value_is_one_line():
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPINF_")}
    done = subprocess.run([sys.executable, "-m", "spinf_worker.cli", "worker", "--redis",
                           "redis://127.0.0.1:1/0", "--devices", "0,gpu1"], cwd=ROOT,
                          env={**environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=WAIT_S)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "spinf-serve: --devices: 'gpu1' is not a GPU index, cuda:K or cpu"]


def test_workers_sharing_a_gpu_get_names_of_their_own():
    pool = WorkerPool(ServiceSettings(), ["cuda:0", "cuda:1", "cuda:0", "cpu"], base_name="h")
    assert [c.name for c in pool.children] == ["h-gpu0", "h-gpu1", "h-gpu0-2", "h-cpu3"]
    assert [pool._command(c)[1]["CUDA_VISIBLE_DEVICES"] for c in pool.children[:3]] == [
        "0", "1", "0"]


def test_gpus_shared_without_mps_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    devices = ["cuda:0", "cuda:1", "cuda:0", "cpu", "cpu"]
    assert shared_without_mps(devices) == ["cuda:0"]
    assert shared_without_mps(["cuda:0", "cuda:1"]) == []
    (tmp_path / "control").touch()            # the control daemon's pipe: MPS runs
    assert shared_without_mps(devices) == []


def registrations(client: redis_sync.Redis, keys: Keys) -> dict[str, dict]:
    return {name: json.loads(raw) for name, raw in client.hgetall(keys.workers).items()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_pool_shares_a_batch_restarts_a_killed_child_and_stops_gracefully(
        tiny_dir, settings, tmp_path):
    keys = Keys(settings.prefix)
    client = redis_sync.Redis.from_url(settings.redis_url, decode_responses=True)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPINF_")}
    names = ["pool-cpu0", "pool-cpu1"]
    with open(tmp_path / "pool.log", "w") as log:
        pool = subprocess.Popen(
            [sys.executable, "-m", "spinf_worker.cli", "worker", "--redis", settings.redis_url,
             "--prefix", settings.prefix, "--model", str(tiny_dir), "--devices", "cpu,cpu",
             "--name", "pool", "--log-format", "json"],
            cwd=ROOT, env={**environ, "PYTHONPATH": str(ROOT), **WORKER_ENV}, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: pool.poll() is None and os.killpg(pool.pid, signal.SIGKILL))

        def available() -> dict[str, dict] | None:
            assert pool.poll() is None, (tmp_path / "pool.log").read_text()
            found = registrations(client, keys)
            ok = all(found.get(n, {}).get("status") == "available" for n in names)
            return found if ok else None

        first = wait_for(available, WAIT_S, 0.2, "both workers of the pool to register")
        assert {first[n]["device"] for n in names} == {"cpu"}
        _, v1 = stack.enter_context(api_process(settings, tmp_path / "api.log"))
        api = stack.enter_context(httpx.Client(base_url=v1, timeout=WAIT_S))
        content = "".join(json.dumps(score_line(f"doc-{i}", f"Story {i}: the team won."))
                          + "\n" for i in range(DOCS)).encode()
        created = api.post("/batches", json={"input_file_id": upload(api, content)["id"],
                                             "endpoint": "/v1/score"})
        assert created.status_code == 200, created.text

        def holding() -> bool:
            return bool(client.xpending_range(keys.bulk, GROUP, "-", "+", 1,
                                              consumername=names[1]))

        wait_for(holding, WAIT_S, 0.02, "the second worker to hold entries")
        doomed = first[names[1]]["pid"]
        os.kill(doomed, signal.SIGKILL)

        def restarted() -> bool:
            now = available()
            return now is not None and now[names[1]]["pid"] != doomed

        wait_for(restarted, WAIT_S, 0.2, "the killed worker to be started again")
        assert not alive(doomed)
        done = batch_in(api, created.json()["id"], "completed", "failed", timeout=WAIT_S * 2)
        assert done["request_counts"] == {"total": DOCS, "completed": DOCS, "failed": 0}
        lines = lines_of(api, done["output_file_id"])
        assert sorted(line["custom_id"] for line in lines) == sorted(f"doc-{i}"
                                                                    for i in range(DOCS))
        assert {line["response"]["status_code"] for line in lines} == {200}
        fingerprints = {line["response"]["body"]["system_fingerprint"] for line in lines}
        assert len(fingerprints) == 1   # both workers: one device class, the same bits
        # the batch was shared: the second worker held entries (above), the first ran passes
        wait_for(lambda: registrations(client, keys)[names[0]]["passes"] > 0, WAIT_S, 0.2,
                 "the first worker's passes in its heartbeat")

        children = [registrations(client, keys)[n]["pid"] for n in names]
        pool.send_signal(signal.SIGTERM)
        assert pool.wait(WAIT_S) == 0, (tmp_path / "pool.log").read_text()
        assert not any(alive(pid) for pid in children)
        assert not set(names) & set(registrations(client, keys))   # each left the group
        assert client.xlen(keys.dead) == 0
    client.close()


def test_a_killed_pool_takes_its_workers_with_it(tiny_dir, settings, tmp_path):
    """SIGKILL of the pool (no chance to stop its children): each child gets SIGTERM from the
    kernel (PR_SET_PDEATHSIG) and stops."""
    keys = Keys(settings.prefix)
    client = redis_sync.Redis.from_url(settings.redis_url, decode_responses=True)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPINF_")}
    with open(tmp_path / "pool.log", "w") as log:
        pool = subprocess.Popen(
            [sys.executable, "-m", "spinf_worker.cli", "worker", "--redis", settings.redis_url,
             "--prefix", settings.prefix, "--model", str(tiny_dir), "--devices", "cpu",
             "--name", "lone"],
            cwd=ROOT, env={**environ, "PYTHONPATH": str(ROOT), **WORKER_ENV}, stdout=log,
            stderr=subprocess.STDOUT)
    try:
        def child() -> int | None:
            assert pool.poll() is None, (tmp_path / "pool.log").read_text()
            found = registrations(client, keys).get("lone-cpu0", {})
            return found.get("pid") if found.get("status") == "available" else None

        pid = wait_for(child, WAIT_S, 0.2, "the pool's worker to register")
        pool.kill()
        pool.wait(WAIT_S)
        wait_for(lambda: not alive(pid), WAIT_S, 0.1, "the worker to stop with its pool")
    finally:
        if pool.poll() is None:
            pool.kill()
        client.close()

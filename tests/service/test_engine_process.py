"""The worker with its engine in a process of its own (queue/engine_process.py), on the real
default model, a real Redis and the real API: the same answers as the engine thread's, bit for
bit; a clean stop; an engine process that dies makes the worker exit non-zero, not hang."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from spinf_worker.queue.engine_process import EngineProcess
from spinf_worker.queue.producer import Producer, Submission
from spinf_worker.queue.redis_client import connect
from spinf_worker.queue.worker import Worker
from spinf_worker.serve import WorkerSpec, load_engine

from ..conftest import WAIT_S
from .live import InProcessWorker, LiveServer, _registered, jsonl, wait_for
from .test_batches import batch_in, lines_of, score_line, upload
from .test_worker import results_of, running

ROOT = Path(__file__).resolve().parents[2]
QUESTION = {"id": "sport", "template": "\nIs it about sport? Answer:{?}",
            "options": [" yes", " no"]}
TEXTS = [f"Report {i}: the home team won the match by {i} points." for i in range(6)]


def said(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def score_bodies() -> list[dict]:
    """A mix: one text each, several inputs in one call, a query of an input's own."""
    bodies = [{"text": t, "scoring": {"queries": [QUESTION]}} for t in TEXTS[:4]]
    bodies.append({"inputs": [{"id": "a", "messages": said(TEXTS[4])},
                              {"id": "b", "messages": said(TEXTS[5])}],
                   "scoring": {"queries": [QUESTION]}})
    bodies.append({"inputs": [{"id": "c", "messages": said(TEXTS[0]), "queries": [
        {"id": "calm", "template": "\nIs it calm? Answer:{?}", "options": [" yes", " no"]}]}],
                   "scoring": {"queries": [QUESTION]}})
    return bodies


def without_ids(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created", "timing")}


def answers(settings, engine) -> dict:
    """Every kind of call through the API and a worker on ``engine``: score calls at once, a
    completion, a batch, and a call only the worker can refuse."""
    with LiveServer(settings) as server, InProcessWorker(engine, settings):
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        with ThreadPoolExecutor(8) as pool:
            scored = list(pool.map(lambda b: client.post("/score", json=b), score_bodies()))
        completion = client.post("/completions", json={
            "model": engine.model_name, "prompt": TEXTS[1], "echo": True, "logprobs": 2,
            "max_tokens": 2})
        # the option merges with the template's end once tokenised: a 400 from the worker
        refused = client.post("/score", json={"text": TEXTS[2], "scoring": {"queries": [
            {"id": "q", "template": "Sport? {?}", "options": [" yes", " no"]}]}})
        uploaded = upload(client, jsonl([score_line(f"doc-{i}", t)
                                         for i, t in enumerate(TEXTS)]))
        batch = client.post("/batches", json={"input_file_id": uploaded["id"],
                                              "endpoint": "/v1/score",
                                              "completion_window": "24h"}).json()
        # the real model on a CPU shared with others: its passes may take a minute
        done = batch_in(client, batch["id"], "completed", "failed", timeout=3 * WAIT_S)
        lines = {line["custom_id"]: line["response"]["body"]
                 for line in lines_of(client, done["output_file_id"])}
    for response in [*scored, completion]:
        assert response.status_code == 200, response.text
    assert refused.status_code == 400, refused.text
    return {"score": [without_ids(r.json()) for r in scored],
            "completion": without_ids(completion.json()),
            "refused": refused.json()["error"],
            "batch": {k: without_ids(v) for k, v in lines.items()}}


def test_engine_process_answers_as_the_engine_thread_bit_for_bit(default_engine, settings):
    in_thread = answers(settings, default_engine)
    engine = EngineProcess.start(WorkerSpec(device="cpu"), settings)
    try:
        assert (engine.model_name, engine.fingerprint) == (default_engine.model_name,
                                                           default_engine.fingerprint)
        in_process = answers(settings, engine)
    finally:
        engine.close()
    assert engine._process.exitcode == 0          # stopped when asked
    assert len(in_thread["batch"]) == len(TEXTS)
    assert in_process == in_thread
    assert "torch.cuda" not in sys.modules or not sys.modules["torch"].cuda.is_initialized()


def engine_processes(pid: int) -> list[int]:
    """The children of ``pid`` that multiprocessing spawned (not its resource tracker)."""
    found = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
             for c in (task / "children").read_text().split()]
    return [c for c in found if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_dead_engine_process_makes_the_worker_exit_non_zero(settings, tmp_path):
    log = tmp_path / "worker.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "spinf_worker.cli", "worker", "--redis", settings.redis_url,
             "--prefix", settings.prefix, "--device", "cpu", "--name", "split",
             "--engine-process"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (_registered(settings, "split") and json.loads(
            _worker_entry(settings))["status"] == "available") or worker.poll() is not None,
            2 * WAIT_S, interval=0.2, what="the worker to load its engine")
        assert worker.poll() is None, log.read_text()[-4000:]
        engine_pids = engine_processes(worker.pid)
        assert len(engine_pids) == 1, engine_pids
        os.kill(engine_pids[0], signal.SIGKILL)
        started = time.monotonic()
        code = worker.wait(WAIT_S)
        assert code != 0, log.read_text()[-4000:]
        assert "EngineProcessDied" in log.read_text()
        assert time.monotonic() - started < WAIT_S
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def _worker_entry(settings) -> str:
    import redis as redis_sync

    from spinf_worker.queue.keys import Keys

    client = redis_sync.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        return client.hget(Keys(settings.prefix).workers, "split") or "{}"
    finally:
        client.close()


@pytest_asyncio.fixture
async def redis(redis_url):
    client = connect(redis_url, socket_timeout=WAIT_S)
    yield client
    await client.aclose()


class PoisonedEngine:
    """The engine, whose passes raise when a request's text says POISON (in the child)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _check(self, requests) -> None:
        if any("POISON" in (r.text or "") for r in requests):
            raise RuntimeError("poisoned pass")

    def start_batch(self, requests):
        self._check(requests)
        return self.engine.start_batch(requests)

    def score_batch(self, requests):
        self._check(requests)
        return self.engine.score_batch(requests)


def poisoned_engine(spec, settings) -> PoisonedEngine:
    """EngineProcess.start's ``load`` (the child imports this module for it)."""
    return PoisonedEngine(load_engine(spec, settings))


@pytest.mark.asyncio
async def test_a_pass_raising_in_the_engine_process_is_scored_entry_by_entry(redis, keys,
                                                                              settings):
    engine = await asyncio.to_thread(EngineProcess.start, WorkerSpec(device="cpu"), settings,
                                     poisoned_engine)
    try:
        producer = Producer(redis, keys, settings)
        bodies = score_bodies()
        good = [(await producer.submit(Submission(b)))[0] for b in bodies[:2]]
        poisoned, _ = await producer.submit(Submission({**bodies[0], "text": "POISON"}))
        async with running(Worker(engine, redis, keys, settings)):
            results = await results_of(redis, keys, good, timeout=3 * WAIT_S)
            record = await redis.hgetall(keys.job(poisoned))
            deadline = time.monotonic() + WAIT_S
            while "last_error" not in record and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                record = await redis.hgetall(keys.job(poisoned))
    finally:
        await asyncio.to_thread(engine.close)
    assert [r["status_code"] for r in results] == [200, 200]
    # the poisoned entry is left pending with its error, to be retried, then dead-lettered
    assert "poisoned pass" in record["last_error"]
    assert await redis.get(keys.result(poisoned)) is None

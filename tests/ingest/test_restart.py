"""Restart safety: the real CLI killed with SIGKILL while items wait for their results, then
run again with ``--once``; and a JSONL sink torn by a crash in the middle of a write."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spinf_worker.ingest.sinks import JsonlSink, Result
from spinf_worker.ingest.state import IngestKeys, LeaseError, State
from spinf_worker.queue.keys import Keys
from tests.service.live import InProcessWorker

from ..conftest import WAIT_S
from .helpers import read_lines, wait_until

ROOT = Path(__file__).resolve().parents[2]


def _append(path: Path, numbers) -> None:
    with open(path, "a") as f:
        for n in numbers:
            f.write(json.dumps({"id": f"wire-{n}", "title": f"Wire story {n}",
                                "text": f"Prices moved on wire story {n}.",
                                "published": "2026-11-30T09:00:00Z"}) + "\n")


def _ingest(settings, *args: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "a") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "spinf_worker.cli", "ingest", "--redis", settings.redis_url,
             "--prefix", settings.prefix, "--log-format", "json", *args],
            cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)


@pytest.mark.asyncio
async def test_killed_consumer_resumes_without_losing_or_repeating_items(
        tmp_path, settings, queries_file, tiny_engine, redis):
    wire, out, log = tmp_path / "wire.jsonl", tmp_path / "out.jsonl", tmp_path / "ingest.log"
    pending = f"{settings.prefix}:{{q}}:ingest:default:pending"
    args = ["--jsonl", str(wire), "--queries", str(queries_file), "--sink", f"jsonl:{out}",
            "--interval", "0.2"]
    _append(wire, range(3))
    first = _ingest(settings, *args, log=log)
    try:
        with InProcessWorker(tiny_engine, settings):
            await wait_until(lambda: len(read_lines(out)) == 3, what="the first items")
        # no worker now: new items are claimed and submitted, and wait for their results
        _append(wire, range(3, 6))

        async def submitted():
            records = [json.loads(r) for r in (await redis.hgetall(pending)).values()]
            return len(records) == 3 and all(r.get("job") for r in records)

        await wait_until(submitted, what="the new items to be submitted")
        first.kill()
        assert first.wait(WAIT_S) == -9
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    _append(wire, [6])
    with InProcessWorker(tiny_engine, settings):
        again = _ingest(settings, *args, "--once", log=log)
        code = await asyncio.to_thread(again.wait, WAIT_S)
    assert code == 0, log.read_text()[-3000:]
    ids = [line["item_id"] for line in read_lines(out)]
    assert sorted(ids) == [f"wire-{n}" for n in range(7)], ids
    assert not await redis.hlen(pending)
    events = [json.loads(line)["event"] for line in log.read_text().splitlines()
              if line.startswith("{")]
    assert "resuming pending items" in events and "ingest done" in events


@pytest.mark.asyncio
async def test_jsonl_sink_recovers_from_a_write_torn_by_a_crash(tmp_path, redis, settings):
    out = tmp_path / "out.jsonl"
    state = State(redis, IngestKeys(Keys(settings.prefix), "t"))
    sink = JsonlSink(f"jsonl:{out}", state)
    whole = json.dumps({"item_id": "a", "feed": "f"}) + "\n"
    out.write_text(whole + '{"item_id": "b", "fe')          # the crash cut b's line
    await redis.hset(state.keys.intent(sink.id), mapping={
        "key-a": json.dumps({"pos": 0, "item_id": "a"}),
        "key-b": json.dumps({"pos": len(whole), "item_id": "b"}),
        "key-c": json.dumps({"pos": len(whole) + 100, "item_id": "c"})})   # never written
    await sink.open()
    assert out.read_text() == whole
    assert await state.sunk(sink.id, ["key-a", "key-b", "key-c"]) == {"key-a"}
    assert not await redis.exists(state.keys.intent(sink.id))
    # the retry writes b and c once, and a repeat of a is skipped
    await sink.write([Result(key, {"item_id": name, "feed": "f"})
                      for key, name in (("key-a", "a"), ("key-b", "b"), ("key-c", "c"))])
    await sink.write([Result("key-b", {"item_id": "b", "feed": "f"})])
    assert [line["item_id"] for line in read_lines(out)] == ["a", "b", "c"]


@pytest.mark.asyncio
async def test_one_consumer_per_name_and_a_dead_one_is_taken_over(redis, settings):
    keys = IngestKeys(Keys(settings.prefix), "news")
    first, second = State(redis, keys), State(redis, keys)
    await first.acquire()
    with pytest.raises(LeaseError, match="another ingest consumer named 'news'"):
        await second.acquire()
    assert await first.renew() and not await second.renew()
    # the holder died on this machine (kill -9): no need to wait for the lease to expire
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    await redis.set(keys.lease, first.token.replace(f":{os.getpid()}:",
                                                    f":{dead.stdout.strip()}:"))
    await second.acquire()
    assert await redis.get(keys.lease) == second.token
    await second.release()
    assert not await redis.exists(keys.lease)


def test_embedded_stack_without_redis_url(tmp_path, tiny_dir, queries_file):
    """No --redis: a private redis-server on the state dir and a worker in the process."""
    wire, out = tmp_path / "wire.jsonl", tmp_path / "out.jsonl"
    _append(wire, range(2))
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPINF_REDIS_URL", "SPINF_WEBHOOK_SECRET")}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [sys.executable, "-m", "spinf_worker.cli", "ingest", "--jsonl", str(wire),
         "--queries", str(queries_file), "--sink", f"jsonl:{out}", "--once",
         "--model", str(tiny_dir), "--device", "cpu", "--state-dir", str(tmp_path / "state"),
         "--log-format", "json"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(line["item_id"] for line in read_lines(out)) == ["wire-0", "wire-1"]
    assert "redis-server stopped" in run.stderr
    assert list((tmp_path / "state" / "redis").rglob("appendonly*"))

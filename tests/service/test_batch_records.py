"""Batch lines recorded many at a time: one script call per worker pass, lines of several
batches in it, each counted once however often its job is delivered."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from spinf_worker.queue import batches, files
from spinf_worker.queue.keys import GROUP
from spinf_worker.queue.producer import Producer, Submission
from spinf_worker.queue.results import JobResult
from spinf_worker.queue.worker import Worker

from ..conftest import WAIT_S
from .live import jsonl

QUERY = {"id": "animal", "template": "Is it about an animal? {?}", "options": [" yes", " no"]}


async def queued_batch(redis, keys, settings, name: str, n: int) -> str:
    """A batch of ``n`` score lines, queued on the bulk stream; its id."""
    lines = [{"custom_id": f"{name}-{i}", "method": "POST", "url": "/v1/score",
              "body": {"text": f"{name} note {i}: the cat sat.", "scoring": {"queries": [QUERY]}}}
             for i in range(n)]
    upload = await files.create_file(redis, keys, jsonl(lines), filename=f"{name}.jsonl",
                                     purpose="batch", ttl_s=600)
    batch = await batches.create_batch(redis, keys, input_file_id=upload["id"],
                                       endpoint="/v1/score", completion_window="24h",
                                       metadata=None, ttl_s=600)
    await batches.enqueue_batch(redis, keys, Producer(redis, keys, settings), batch["id"])
    return batch["id"]


async def out_lines(redis, keys, batch_id: str) -> list[dict]:
    return [json.loads(line) for line in
            await redis.lrange(keys.batch_lines(batch_id, "out"), 0, -1)]


@pytest.mark.asyncio
async def test_lines_of_two_batches_in_one_call_count_once(redis, keys, settings, monkeypatch):
    first = await queued_batch(redis, keys, settings, "a", 3)
    second = await queued_batch(redis, keys, settings, "b", 2)
    jobs = [batches.Finished(f["batch"], f["job"], f["custom_id"],
                             JobResult.ok({"id": f"score-{f['custom_id']}", "queries": []}))
            for _, f in await redis.xrange(keys.bulk)]
    calls = []
    real_eval = redis.eval

    async def counted(*args):
        calls.append(args[0])
        return await real_eval(*args)

    monkeypatch.setattr(redis, "eval", counted)
    # the first job twice in the same call (a repeated delivery): counted once
    recorded = await batches.record_results(redis, keys, [*jobs, jobs[0]])
    assert recorded == [True] * len(jobs) + [False]
    assert len(calls) == 1
    for batch_id, n in ((first, 3), (second, 2)):
        done = await batches.get_batch(redis, keys, batch_id)
        assert done["status"] == "completed"
        assert done["request_counts"] == {"total": n, "completed": n, "failed": 0}
        lines = await out_lines(redis, keys, batch_id)
        assert sorted(line["custom_id"] for line in lines) == sorted(
            j.custom_id for j in jobs if j.batch_id == batch_id)
        out = "".join([c async for c in await files.iter_content(
            redis, keys, done["output_file_id"])])
        assert (await files.get_file(redis, keys, done["output_file_id"]))["bytes"] == len(out)
    # once more, after the end: nothing changes
    assert await batches.record_results(redis, keys, jobs[:2]) == [False, False]
    assert (await batches.get_batch(redis, keys, first))["request_counts"]["completed"] == 3


@pytest.mark.asyncio
async def test_a_pass_records_its_lines_in_one_call_and_a_repeat_is_not_counted(
        tiny_engine, redis, keys, settings, monkeypatch):
    first = await queued_batch(redis, keys, settings, "a", 3)
    second = await queued_batch(redis, keys, settings, "b", 2)
    entries = await redis.xrange(keys.bulk)
    # a-0 was answered by an earlier delivery whose entry came back (at-least-once)
    earlier = next(f for _, f in entries if f["custom_id"] == "a-0")
    assert await batches.record_results(redis, keys, [batches.Finished(
        first, earlier["job"], "a-0", JobResult.ok({"id": "earlier", "queries": []}))]) == [True]

    async def one_at_a_time(*args, **kwargs):
        raise AssertionError("a worker records a pass's lines together")

    monkeypatch.setattr(batches, "record_result", one_at_a_time)
    calls = []
    queue = batches.RecordCall.queue

    def counted(self, pipe):
        calls.append(len(self.keys) // 8)
        queue(self, pipe)

    monkeypatch.setattr(batches.RecordCall, "queue", counted)
    worker = Worker(tiny_engine, redis, keys, settings, name="records")
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        deadline = time.monotonic() + WAIT_S
        while not all([(await batches.get_batch(redis, keys, b))["status"] == "completed"
                       for b in (first, second)]):
            assert time.monotonic() < deadline, "the batches did not complete"
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)
    assert sum(calls) == 5 and len(calls) <= worker.passes   # one call per pass at most
    for batch_id, n in ((first, 3), (second, 2)):
        done = await batches.get_batch(redis, keys, batch_id)
        assert done["request_counts"] == {"total": n, "completed": n, "failed": 0}
        lines = await out_lines(redis, keys, batch_id)
        assert sorted(line["custom_id"] for line in lines) == [
            f"{'a' if batch_id == first else 'b'}-{i}" for i in range(n)]
    kept = next(line for line in await out_lines(redis, keys, first)
                if line["custom_id"] == "a-0")
    assert kept["response"]["body"]["id"] == "earlier"   # the first line stays, alone
    for stream in keys.streams:   # every entry acked and deleted
        assert await redis.xlen(stream) == 0
        assert (await redis.xpending(stream, GROUP))["pending"] == 0


@pytest.mark.asyncio
async def test_a_batch_lines_result_key_is_kept_for_batch_result_ttl_s(
        tiny_engine, redis, keys, settings):
    """The answer of a batch line is held once for result_ttl_s, in the output file: its
    job's result key expires after batch_result_ttl_s; a synchronous job's is kept."""
    settings = settings.model_copy(update={"batch_result_ttl_s": 300})
    batch_id = await queued_batch(redis, keys, settings, "t", 3)
    jobs = [f["job"] for _, f in await redis.xrange(keys.bulk)]
    single, _ = await Producer(redis, keys, settings).submit(Submission(
        {"text": "a lone note", "scoring": {"queries": [QUERY]}}))
    worker = Worker(tiny_engine, redis, keys, settings, name="ttl")
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        deadline = time.monotonic() + WAIT_S
        while (await batches.get_batch(redis, keys, batch_id))["status"] != "completed" \
                or await redis.get(keys.result(single)) is None:
            assert time.monotonic() < deadline, "the batch or the job did not complete"
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)
    assert len(await out_lines(redis, keys, batch_id)) == 3
    for job in jobs:
        assert await redis.get(keys.result(job)) is not None
        assert 0 < await redis.ttl(keys.result(job)) <= 300
    assert await redis.ttl(keys.result(single)) > 300
    assert await redis.ttl(keys.result(single)) <= settings.result_ttl_s

"""An item submitted again under the same idempotency key with another body (a crash between
submitting it and recording its job, then its page read anew and changed) keeps the job the
key names: the producer refuses the new body, and the consumer waits for the first job."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.service.live import InProcessWorker

from ..conftest import WAIT_S
from .helpers import consuming, make_config, read_lines, wait_until


@pytest.mark.asyncio
async def test_a_repeat_with_another_body_keeps_the_first_job(tmp_path, settings, queries_file,
                                                               tiny_engine, redis):
    wire, out = tmp_path / "wire.jsonl", tmp_path / "out.jsonl"
    wire.write_text(json.dumps({"id": "wire-1", "title": "Wire story",
                                "text": "Prices moved on the wire story."}) + "\n")
    config = make_config(queries_file, feeds=[{"jsonl": str(wire)}], sinks=[f"jsonl:{out}"])
    pending = f"{settings.prefix}:{{q}}:ingest:default:pending"

    async def submitted():
        records = await redis.hgetall(pending)
        return len(records) == 1 and json.loads(next(iter(records.values()))).get("job")

    async with consuming(config, settings):    # no worker: the job waits in the stream
        first_job = await wait_until(submitted, what="the item to be submitted")
    [(key, raw)] = (await redis.hgetall(pending)).items()
    record = json.loads(raw)
    del record["job"]
    record["item"]["text"] = "The page says something else now."
    await redis.hset(pending, key, json.dumps(record))

    with InProcessWorker(tiny_engine, settings):
        async with consuming(config, settings, once=True) as (_consumer, task):
            await asyncio.wait_for(task, WAIT_S)
    [line] = read_lines(out)
    assert line["job_id"] == first_job and line["status"] == "succeeded", line
    stream = f"{settings.prefix}:{{q}}:jobs:bulk"
    assert int((await redis.xinfo_stream(stream))["entries-added"]) == 1
    assert not await redis.hlen(pending)

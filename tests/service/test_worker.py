"""The queue end to end on a real Redis and the tiny engine: producer -> worker -> result,
greedy passes, request errors, deadlines, poison entries, a killed worker, a graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from redis.exceptions import ResponseError

from spinf_worker.protocol import ScoreRequest
from spinf_worker.queue.keys import GROUP
from spinf_worker.queue.producer import IdempotencyKeyReused, Producer, Submission
from spinf_worker.queue.replies import ReplyListener
from spinf_worker.queue.worker import REQUESTS_RECENT_S, Worker
from spinf_worker.tiles import ROW_TILE

from ..conftest import WAIT_S

ROOT = Path(__file__).resolve().parents[2]


def body(i: int, **extra) -> dict:
    return {"text": f"Note {i}: the cat sat on the mat.",
            "scoring": {"queries": [{"id": "animal", "template": "Is it about an animal? {?}",
                                     "options": [" yes", " no"]}]}, **extra}


@contextlib.asynccontextmanager
async def running(worker: Worker):
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)


async def results_of(redis, keys, jobs: list[str], timeout: float = WAIT_S,
                     worker: tuple[subprocess.Popen, Path] | None = None) -> list[dict]:
    """The jobs' results once all are stored. ``worker``: a worker process that must stay up
    meanwhile, and its log, shown when it dies or the wait runs out."""
    deadline = time.monotonic() + timeout
    while True:
        raw = await redis.mget([keys.result(j) for j in jobs])
        if all(r is not None for r in raw):
            return [json.loads(r) for r in raw]
        exited = worker is not None and worker[0].poll() is not None
        if exited or time.monotonic() > deadline:
            log = worker[1].read_text()[-8000:] if worker else ""
            raise AssertionError(f"{sum(r is None for r in raw)} results missing"
                                 f"{'; the worker exited' if exited else ''}\n{log}")
        await asyncio.sleep(0.05)


async def pending(redis, keys) -> int:
    return sum([(await redis.xpending(s, GROUP))["pending"] for s in keys.streams])


async def stream_lengths(redis, keys) -> int:
    return sum([await redis.xlen(s) for s in keys.streams])


def without_ids(response: dict) -> dict:
    """What two scorings of one request share: all but the id, the time and the timings."""
    return {k: v for k, v in response.items() if k not in ("id", "created", "timing")}


class GatedEngine:
    """The engine, whose ``gated_call``-th start_batch waits for ``gate`` (``reached`` is set
    when it gets there): a pass held in flight for as long as a test needs."""

    def __init__(self, engine, gated_call: int):
        self.engine, self.gated_call, self.calls = engine, gated_call, 0
        self.gate, self.reached = threading.Event(), threading.Event()
        self.gated: list = []       # the requests of the gated call

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def start_batch(self, requests):
        self.calls += 1
        if self.calls == self.gated_call:
            self.gated = list(requests)
            self.reached.set()
            self.gate.wait(WAIT_S)
        return self.engine.start_batch(requests)


@pytest.mark.asyncio
async def test_submit_is_scored_like_the_engine_alone(redis, keys, settings, tiny_engine):
    producer = Producer(redis, keys, settings)
    listener = ReplyListener(redis, keys)
    await listener.start()
    request = body(1)
    try:
        async with running(Worker(tiny_engine, redis, keys, settings)):
            job_id, created = await producer.submit(
                Submission(request, reply_to=listener.instance_id, custom_id="c1"))
            listener.expect(job_id)
            result = await listener.wait(job_id, timeout=WAIT_S)
    finally:
        await listener.stop()
    assert created and job_id.startswith("job_")
    assert result.status_code == 200 and result.succeeded
    scored = tiny_engine.score(request)
    alone = scored.model_dump(mode="json")
    assert without_ids(result.body) == without_ids(alone)   # logprobs bit for bit
    job = await producer.get_job(job_id)
    assert job["status"] == "succeeded" and job["custom_id"] == "c1"
    assert job["finished_at"] >= job["created_at"]
    assert await producer.get_result(job_id) == result
    assert await pending(redis, keys) == 0 and await stream_lengths(redis, keys) == 0
    assert await producer.backlog() == 0
    stats = await redis.hgetall(keys.stats)
    assert int(stats["docs"]) == 1 and int(stats["tokens"]) == scored._rows
    assert int(stats["questions"]) == 1
    assert float(stats["seconds_gc"]) >= 0.0     # the collector's seconds, told per pass
    assert not await redis.hlen(keys.workers)   # signed off on the way out


@pytest.mark.asyncio
async def test_a_worker_sets_its_switch_interval_while_it_runs(redis, keys, settings,
                                                               tiny_engine):
    before = sys.getswitchinterval()
    producer = Producer(redis, keys, settings)
    job, _ = await producer.submit(Submission(body(0)))
    worker = Worker(tiny_engine, redis, keys,
                    settings.model_copy(update={"switch_interval_ms": 0.5}))
    async with running(worker):
        [result] = await results_of(redis, keys, [job])
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert result["status_code"] == 200
    assert sys.getswitchinterval() == before       # given back on the way out


class ThreadNoting:
    """The engine, its batches noting which thread read each back and which answered it."""

    def __init__(self, engine):
        self.engine, self.threads = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def start_batch(self, requests):
        flight = self.engine.start_batch(requests)

        def noted(name, fn):
            def call():
                self.threads.append((name, threading.current_thread().name))
                return fn()
            return call

        return SimpleNamespace(read_back=noted("read_back", flight.read_back),
                               respond=noted("respond", flight.respond))


@pytest.mark.asyncio
async def test_replies_are_written_beside_the_engine_thread(redis, keys, settings, tiny_engine):
    """A pass is read back on the engine thread and its replies written on the responder:
    the engine thread lays out the next pass meanwhile."""
    producer = Producer(redis, keys, settings)
    jobs = [(await producer.submit(Submission(body(i))))[0] for i in range(6)]
    engine = ThreadNoting(tiny_engine)
    async with running(Worker(engine, redis, keys, settings)):
        results = await results_of(redis, keys, jobs)
    assert [r["status_code"] for r in results] == [200] * 6
    assert {name for name, _ in engine.threads} == {"read_back", "respond"}
    for name, thread in engine.threads:
        assert thread.startswith("spinf-engine" if name == "read_back" else "spinf-respond")


@pytest.mark.asyncio
async def test_a_pass_tells_how_long_each_of_its_steps_took(redis, keys, settings, tiny_engine):
    """Each pass's log line says where its time went, step by step (the wait to launch, the
    wait on the engine thread, the launch, the device, the read-back, the replies, the
    store), and how long the engine thread had sat idle when the launch reached it; each
    read says how long its entries took to parse."""
    from structlog.testing import capture_logs

    producer = Producer(redis, keys, settings)
    jobs = [(await producer.submit(Submission(body(i))))[0] for i in range(4)]
    with capture_logs() as logs:
        async with running(Worker(tiny_engine, redis, keys, settings)):
            await results_of(redis, keys, jobs)
    passes = [e for e in logs if e["event"] == "pass done"]
    steps = ["launching_ms", "begun_ms", "launched_ms", "ran_ms", "read_ms", "answered_ms",
             "stored_ms", "engine_idle_ms"]
    assert passes and sum(e["docs"] for e in passes) == 4
    for line in passes:
        assert [k for k in line if k.endswith("_ms")] == steps
        assert all(line[k] >= 0 for k in steps)
        assert line["requests"] == line["docs"]      # submitted as requests (interactive)
    reads = [e for e in logs if e["event"] == "entries read"]
    assert sum(e["entries"] for e in reads) == 4 and all(e["parse_ms"] >= 0 for e in reads)


@pytest.mark.asyncio
async def test_a_launch_tells_how_long_the_engine_thread_sat_idle_before_it():
    """A launch reaching an idle engine thread counts the thread's idle time since its last
    call; one queued behind another call finds it busy (idle ~0), however long it waited."""
    from spinf_worker.queue.engine_thread import ENGINE_THREAD, LAUNCH
    from spinf_worker.queue.worker import timed_launch

    await ENGINE_THREAD.run(lambda: None, priority=LAUNCH)
    await asyncio.sleep(0.2)
    _, _, _, idle_s = await ENGINE_THREAD.run(timed_launch, lambda: None, priority=LAUNCH)
    assert idle_s >= 0.2
    busy = ENGINE_THREAD.run(time.sleep, 0.2, priority=LAUNCH)
    behind = ENGINE_THREAD.run(timed_launch, lambda: None, priority=LAUNCH)
    await busy
    value, seconds, begun, idle_s = await behind
    assert value is None and seconds >= 0 and begun > 0
    assert idle_s < 0.2      # it began when the call ahead of it ended


@pytest.mark.asyncio
async def test_waiting_jobs_are_packed_into_full_passes(redis, keys, settings, tiny_engine):
    producer = Producer(redis, keys, settings)
    jobs = [(await producer.submit(Submission(body(i))))[0] for i in range(20)]
    assert await producer.backlog() == 20
    worker = Worker(tiny_engine, redis, keys, settings)
    async with running(worker):
        results = await results_of(redis, keys, jobs)
    assert all(r["status_code"] == 200 for r in results)
    assert worker.passes <= 2
    assert int(await redis.hget(keys.stats, "passes")) == worker.passes
    assert await pending(redis, keys) == 0 and await stream_lengths(redis, keys) == 0


@pytest.mark.asyncio
async def test_a_pass_waits_only_for_entries_still_to_read(redis, keys, settings, tiny_engine):
    """``max_wait_ms`` far beyond the test's wait: a lone request reaching an idle worker is
    scored at once (nothing is left to read, no pass is on the device), and twenty waiting
    requests read four at a time still fill passes (a read that comes back full says more
    wait), the last one starting once the streams are empty."""
    settings = settings.model_copy(update={"max_wait_ms": 3_600_000, "read_count": 4})
    producer = Producer(redis, keys, settings)
    jobs = [(await producer.submit(Submission(body(i))))[0] for i in range(20)]
    worker = Worker(tiny_engine, redis, keys, settings)
    async with running(worker):
        results = await results_of(redis, keys, jobs)
        assert all(r["status_code"] == 200 for r in results)
        assert worker.passes <= 2
        lone = (await producer.submit(Submission(body(99))))[0]
        assert (await results_of(redis, keys, [lone]))[0]["status_code"] == 200


class SlowLayoutEngine:
    """The engine, laying out each entry ``delay_s`` late: entries are parsed slower than a
    pass is launched, as a fast device's worker sees it."""

    def __init__(self, engine, delay_s: float):
        self.engine, self.delay_s = engine, delay_s

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def row_parts_many(self, requests):
        time.sleep(self.delay_s * len(requests))
        return self.engine.row_parts_many(requests)


@pytest.mark.asyncio
async def test_leftovers_of_a_full_pass_wait_for_the_entries_being_read(redis, keys, settings,
                                                                       tiny_engine):
    """A backlog of bulk entries read five at a time, a pass fitting three, ``max_wait_ms``
    of 1 and entries parsed slower than a pass launches: the entries left over when a full
    pass starts wait past ``max_wait_ms`` for those being parsed, so every pass but the last
    is full (a pass of leftovers alone would cost the device a pass for a fraction of its
    rows)."""
    text = " ".join(f"Line {k}: the market rose and the team won again." for k in range(20))

    def long_body(i: int) -> dict:
        return {**body(i), "text": f"Note {i}. {text}"}

    per_entry = tiny_engine.rows(long_body(0))
    assert per_entry > ROW_TILE          # a read sized by ROW_TILE overfills the first pass
    docs, per_pass = 20, 3
    settings = settings.model_copy(update={"max_pass_tokens": per_pass * per_entry,
                                           "max_wait_ms": 1, "read_count": 5})
    producer = Producer(redis, keys, settings)
    jobs = [(await producer.submit(Submission(long_body(i), priority="bulk")))[0]
            for i in range(docs)]
    assert {tiny_engine.rows(long_body(i)) for i in range(docs)} == {per_entry}
    worker = Worker(SlowLayoutEngine(tiny_engine, 0.1), redis, keys, settings)
    async with running(worker):
        results = await results_of(redis, keys, jobs)
    assert all(r["status_code"] == 200 for r in results)
    assert worker.passes == -(-docs // per_pass)
    assert int(await redis.hget(keys.stats, "docs")) == docs


@pytest.mark.asyncio
async def test_requests_about_one_text_fill_a_pass_as_one(redis, keys, settings, tiny_engine):
    """Requests that each ask one question about the same text share a root in a pass
    (engine/merge.py): the worker counts that root once when it fills a pass (Engine.row_parts),
    so they take one pass, where counted alone they would take four; each answer is what the
    request gets alone."""
    from spinf_worker.tiles import PassRows

    text = " ".join(f"Line {k}: the market rose and the team won again." for k in range(40))
    requests = [{"text": text, "scoring": {"queries": [{
        "id": f"q{k}", "template": f"\n\nQuestion {k}: is it good news?{{?}}",
        "options": [" yes", " no"]}]}} for k in range(8)]
    fill = PassRows()
    for request in requests:
        fill.add_parts(tiny_engine.row_parts(request))
    alone = sum(tiny_engine.rows(r) for r in requests)
    assert fill.rows * 4 <= alone          # the root counted once
    settings = settings.model_copy(update={"max_pass_tokens": fill.rows, "max_wait_ms": 2000})
    producer = Producer(redis, keys, settings)
    jobs = [(await producer.submit(Submission(r)))[0] for r in requests]
    worker = Worker(tiny_engine, redis, keys, settings)
    async with running(worker):
        results = await results_of(redis, keys, jobs)
    assert worker.passes == 1
    for request, result in zip(requests, results, strict=True):
        assert result["body"]["results"] == \
            tiny_engine.score(request).model_dump(mode="json")["results"]


@pytest.mark.asyncio
async def test_requests_about_a_text_read_before_run_on_its_kept_root(redis, keys, settings,
                                                                      tiny_engine):
    """With kept roots (``root_cache_mib``), requests about a text an earlier pass read lay
    out their questions' rows alone (engine/root_cache.py); the stats count them
    (``kept_roots``, ``kept_root_rows``), and every answer is what the request gets alone."""
    from spinf_worker.engine.root_cache import RootCache

    text = " ".join(f"Line {k}: the river rose and the bridge closed." for k in range(30))
    requests = [{"text": text, "scoring": {"queries": [{
        "id": f"q{k}", "template": f"\n\nQuestion {k}: is it bad news?{{?}}",
        "options": [" yes", " no"]}]}} for k in range(4)]
    want = [tiny_engine.score(r).model_dump(mode="json")["results"] for r in requests]
    producer = Producer(redis, keys, settings)
    old, tiny_engine.roots = tiny_engine.roots, RootCache(64 << 20)
    try:
        worker = Worker(tiny_engine, redis, keys, settings)
        async with running(worker):
            first = await results_of(redis, keys, [(await producer.submit(
                Submission(requests[0])))[0]])
            root_rows = tiny_engine.preparer.prepare_batch([requests[0]])[0].docs[0].flat.root
            jobs = [(await producer.submit(Submission(r)))[0] for r in requests[1:]]
            results = first + await results_of(redis, keys, jobs)
    finally:
        tiny_engine.roots = old
    assert [r["body"]["results"] for r in results] == want
    stats = await redis.hgetall(keys.stats)
    assert int(stats["kept_roots"]) == 3
    assert int(stats["kept_root_rows"]) == 3 * root_rows


@pytest.mark.asyncio
async def test_completion_prompts_sharing_a_context_fill_a_pass_as_one(redis, keys, settings,
                                                                      tiny_engine):
    """lm-eval's one completions request per option: the prompts share the context in a pass
    (its whole blocks and the rest of it, engine/prompt_blocks.py), and the worker counts it
    once when it fills a pass, so the requests take one pass, where counted alone they would
    not fit in it; each answer is what the request gets alone."""
    from spinf_worker.completions import CompletionRequest
    from spinf_worker.tiles import PROMPT_BLOCK, ROW_TILE, PassRows, padded_rows

    context = [tiny_engine.checkpoint.bos_token_id, *(10 + k % 500 for k in range(299))]
    requests = [CompletionRequest.parse({"prompt": [context + [600 + k, 700 + k]],
                                         "echo": True, "logprobs": 1, "max_tokens": 0})
                for k in range(4)]
    fill = PassRows()
    for request in requests:
        fill.add_parts(tiny_engine.row_parts(request))
    alone = sum(tiny_engine.rows(r) for r in requests)
    # the context's 300 tokens once, each prompt's two own tokens, in whole row tiles
    assert fill.rows == padded_rows(300 + 4 * 2) == PROMPT_BLOCK * 3
    assert alone == PROMPT_BLOCK * 3 * 4
    # a pass of 512 rows: the worker's first read takes 512 / ROW_TILE = 4 entries
    settings = settings.model_copy(update={"max_pass_tokens": 4 * ROW_TILE, "max_wait_ms": 2000})
    producer = Producer(redis, keys, settings)
    jobs = [(await producer.submit(Submission(
        {"model": None, "completion": r.model_dump(mode="json")})))[0] for r in requests]
    worker = Worker(tiny_engine, redis, keys, settings)
    async with running(worker):
        results = await results_of(redis, keys, jobs)
    assert worker.passes == 1
    for request, result in zip(requests, results, strict=True):
        expected = tiny_engine.complete(request).model_dump(mode="json")
        assert result["body"]["choices"] == expected["choices"]


@pytest.mark.asyncio
async def test_idempotency_key_maps_to_one_job(redis, keys, settings):
    producer = Producer(redis, keys, settings)
    first = await producer.submit(Submission(body(1), idempotency_key="k-1"))
    again = await producer.submit(Submission(body(1), idempotency_key="k-1"))
    other = await producer.submit(Submission(body(1), idempotency_key="k-2"))
    assert first[1] and not again[1] and other[1]
    assert again[0] == first[0] != other[0]
    assert await stream_lengths(redis, keys) == 2
    # the key is bound to the body it came with: another body is refused, naming the job
    for changed in (Submission(body(2), idempotency_key="k-1"),
                    Submission(body(1), idempotency_key="k-1", callback="https://a.example/h"),
                    Submission(body(1), idempotency_key="k-1", priority="bulk")):
        with pytest.raises(IdempotencyKeyReused) as refused:
            await producer.submit(changed)
        assert refused.value.job_id == first[0]
    # a tenant's keys are its own, and its jobs record it
    mine = await producer.submit(Submission(body(2), idempotency_key="k-1", tenant="acme"))
    theirs = await producer.submit(Submission(body(3), idempotency_key="k-1", tenant="bolt"))
    assert mine[1] and theirs[1] and len({first[0], mine[0], theirs[0]}) == 3
    assert await producer.submit(Submission(body(2), idempotency_key="k-1", tenant="acme")) \
        == (mine[0], False)
    assert (await producer.get_job(mine[0]))["tenant"] == "acme"
    assert "tenant" not in await producer.get_job(first[0])
    assert await stream_lengths(redis, keys) == 4
    assert (await producer.get_job(first[0]))["status"] == "queued"
    assert await producer.get_job("job_unknown") is None
    assert await producer.get_result(first[0]) is None


@pytest.mark.asyncio
async def test_request_errors_are_answers_not_retries(redis, keys, settings, tiny_engine):
    settings = settings.model_copy(update={"claim_idle_ms": 300, "max_deliveries": 1})
    no_slot = body(1)
    no_slot["scoring"]["queries"][0]["template"] = "Is it about an animal?"
    # rejected when parsed, and rejected by the engine itself (a model it does not serve)
    await redis.xadd(keys.interactive, {"job": "job_noslot", "payload": json.dumps(no_slot)})
    await redis.xadd(keys.bulk, {"job": "job_model",
                                 "payload": json.dumps(body(2, model="not-this-one"))})
    worker = Worker(tiny_engine, redis, keys, settings)
    async with running(worker):
        noslot, model = await results_of(redis, keys, ["job_noslot", "job_model"])
        await asyncio.sleep(1.0)   # past claim_idle_ms: nothing may come back
    assert noslot["status_code"] == 400
    assert noslot["error"]["param"] == "scoring.queries.0.template"
    assert model["status_code"] == 400 and model["error"]["code"] == "model_not_served"
    for job in ("job_noslot", "job_model"):
        record = await redis.hgetall(keys.job(job))
        assert record["status"] == "failed" and json.loads(record["error"])["message"]
    assert await redis.xlen(keys.dead) == 0
    assert await pending(redis, keys) == 0 and await stream_lengths(redis, keys) == 0
    assert int(await redis.hget(keys.stats, "failed")) == 2


@pytest.mark.asyncio
async def test_expired_entries_are_answered_without_scoring(redis, keys, settings,
                                                            tiny_engine):
    producer = Producer(redis, keys, settings)
    late, _ = await producer.submit(Submission(body(1), deadline_s=-1.0))
    worker = Worker(tiny_engine, redis, keys, settings)
    async with running(worker):
        (result,) = await results_of(redis, keys, [late])
    assert result["status_code"] == 408 and result["error"]["code"] == "deadline_exceeded"
    assert (await producer.get_job(late))["status"] == "expired"
    assert worker.passes == 0
    assert await pending(redis, keys) == 0 and await stream_lengths(redis, keys) == 0


@pytest.mark.asyncio
async def test_poison_entry_is_dead_lettered(redis, keys, settings, tiny_engine):
    settings = settings.model_copy(update={"claim_idle_ms": 300, "max_deliveries": 2})
    entry_id = await redis.xadd(keys.interactive, {"job": "job_poison", "payload": "{not json"})
    async with running(Worker(tiny_engine, redis, keys, settings)):
        (result,) = await results_of(redis, keys, ["job_poison"])
    assert result["status_code"] == 500 and result["error"]["code"] == "dead_letter"
    ((_, dead),) = await redis.xrange(keys.dead)
    assert dead["job"] == "job_poison" and dead["entry"] == entry_id
    assert dead["stream"] == keys.interactive and dead["payload"] == "{not json"
    assert int(dead["deliveries"]) == 3 and "JSONDecodeError" in dead["error"]
    record = await redis.hgetall(keys.job("job_poison"))
    assert record["status"] == "failed" and "JSONDecodeError" in record["last_error"]
    assert await pending(redis, keys) == 0 and await stream_lengths(redis, keys) == 0
    assert int(await redis.hget(keys.stats, "dead")) == 1


@pytest.mark.asyncio
async def test_graceful_stop_finishes_the_pass_and_hands_back_the_rest(
        redis, keys, settings, tiny_engine):
    settings = settings.model_copy(update={"max_pass_tokens": 128})   # one document a pass
    producer = Producer(redis, keys, settings)
    jobs = [(await producer.submit(Submission(body(i))))[0] for i in range(8)]
    # the second pass waits at the gate until the stop is given: stopped with a pass in flight
    engine = GatedEngine(tiny_engine, gated_call=2)
    worker = Worker(engine, redis, keys, settings)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    assert await asyncio.to_thread(engine.reached.wait, WAIT_S), "no second pass started"
    stop.set()
    engine.gate.set()
    await asyncio.wait_for(task, WAIT_S)
    (gated,) = engine.gated
    running_job = jobs[[body(i)["text"] for i in range(len(jobs))].index(gated.text)]
    assert (await producer.get_result(running_job)).status_code == 200
    done = [j for j in jobs if await producer.get_result(j) is not None]
    assert 1 <= len(done) < len(jobs)
    statuses = {(await producer.get_job(j))["status"] for j in jobs if j not in done}
    assert statuses == {"queued"}
    # the rest waits in the stream for any worker, held by none
    assert await pending(redis, keys) == 0
    assert await stream_lengths(redis, keys) == len(jobs) - len(done)
    assert await redis.hget(keys.workers, worker.name) is None

    async with running(Worker(tiny_engine, redis, keys, settings)):
        results = await results_of(redis, keys, jobs)
    assert all(r["status_code"] == 200 for r in results)
    assert await pending(redis, keys) == 0 and await stream_lengths(redis, keys) == 0


async def held_by(redis, keys, consumer: str) -> list:
    """The entries a consumer holds; none before the group exists (a worker registers, as
    loading, before it creates the group)."""
    try:
        return await redis.xpending_range(keys.interactive, GROUP, "-", "+", 100,
                                          consumername=consumer)
    except ResponseError as err:
        if "NOGROUP" not in str(err):
            raise
        return []


@pytest.mark.asyncio
async def test_killed_worker_entries_are_reclaimed(redis, redis_url, keys, settings, tiny_dir,
                                                   tmp_path):
    settings = settings.model_copy(update={"claim_idle_ms": 1000})
    env = {**os.environ, "SPINF_MAX_PASS_TOKENS": "512", "SPINF_CLAIM_IDLE_MS": "1000",
           "SPINF_HEARTBEAT_S": "0.2", "SPINF_MAX_WAIT_MS": "20"}

    def start_worker(name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")   # noqa: SIM115 - closed with the process
        return subprocess.Popen(
            [sys.executable, "-m", "spinf_worker.cli", "worker", "--redis", redis_url,
             "--prefix", keys.prefix, "--model", str(tiny_dir), "--device", "cpu",
             "--name", name], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    producer = Producer(redis, keys, settings)
    jobs = [(await producer.submit(Submission(body(i))))[0] for i in range(40)]
    doomed = start_worker("doomed")
    survivor = None
    try:
        # kill the first worker while it holds entries: frozen first (SIGSTOP), so that what
        # it holds cannot change between the look and the kill; more jobs are queued if it
        # got through them all before it was caught
        deadline = time.monotonic() + WAIT_S
        while True:
            assert doomed.poll() is None, (tmp_path / "doomed.log").read_text()
            if await held_by(redis, keys, "doomed"):
                doomed.send_signal(signal.SIGSTOP)
                if await held_by(redis, keys, "doomed"):
                    break
                doomed.send_signal(signal.SIGCONT)
            if await stream_lengths(redis, keys) == 0:
                jobs += [(await producer.submit(Submission(body(i))))[0] for i in range(10)]
            assert time.monotonic() < deadline, \
                "the worker never got going\n" + (tmp_path / "doomed.log").read_text()[-3000:]
            await asyncio.sleep(0.01)
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        assert await redis.xpending_range(keys.interactive, GROUP, "-", "+", 100,
                                          consumername="doomed")
        assert await redis.xlen(keys.interactive) > 0   # work left that nobody holds yet
        survivor = start_worker("survivor")

        results = await results_of(redis, keys, jobs, timeout=2 * WAIT_S,
                                   worker=(survivor, tmp_path / "survivor.log"))
        assert all(r["status_code"] == 200 for r in results)
        assert {(await producer.get_job(j))["status"] for j in jobs} == {"succeeded"}
        assert await pending(redis, keys) == 0 and await stream_lengths(redis, keys) == 0
        assert await redis.xlen(keys.dead) == 0
        assert await redis.hexists(keys.workers, "survivor")

        survivor.send_signal(signal.SIGTERM)   # graceful: exits 0 and signs off
        assert survivor.wait(WAIT_S) == 0, (tmp_path / "survivor.log").read_text()
        assert not await redis.hexists(keys.workers, "survivor")
        assert "reclaimed entries" in (tmp_path / "survivor.log").read_text()
    finally:
        for proc in (doomed, survivor):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.asyncio
async def test_reply_listener_wakes_on_notice_and_reads_the_result_key(redis, keys):
    listener = ReplyListener(redis, keys)
    await listener.start()
    try:
        # stored, never notified (the notice was missed): found at once
        await redis.set(keys.result("job_a"), json.dumps({"status_code": 200, "body": {}}))
        assert (await listener.wait("job_a", timeout=WAIT_S)).status_code == 200

        async def finish_later():
            await asyncio.sleep(0.3)
            await redis.set(keys.result("job_b"), json.dumps({"status_code": 408}))
            await redis.xadd(listener.stream, {"job": "job_b"})

        listener.expect("job_b")
        notice = listener._waiting["job_b"]
        later = asyncio.create_task(finish_later())
        assert (await listener.wait("job_b", timeout=WAIT_S)).status_code == 408
        # woken by the notice, not the timeout: at the timeout the future is still unset
        assert notice.done() and not notice.cancelled()
        await later
        assert await listener.wait("job_never", timeout=0.2) is None
    finally:
        await listener.stop()


@pytest.mark.asyncio
async def test_a_job_expected_before_it_is_queued_is_not_looked_up_before_the_wait(
        redis, keys, settings, tiny_engine):
    """``expecting`` then ``wait(fresh=True)``: the answer of a job created inside the block
    comes through its notice (its result is not read before the wait, so a result stored
    before that is only found at the timeout); a job named by an idempotency key, created
    earlier, is read first as always."""
    producer = Producer(redis, keys, settings)
    listener = ReplyListener(redis, keys)
    await listener.start()
    try:
        async with running(Worker(tiny_engine, redis, keys, settings)):
            with listener.expecting("job_fresh"):
                job_id, created = await producer.submit(Submission(
                    body(1), reply_to=listener.instance_id, job_id="job_fresh",
                    idempotency_key="k1"))
                result = await listener.wait(job_id, WAIT_S, fresh=created)
            assert (job_id, created) == ("job_fresh", True) and result.succeeded
            assert not listener._waiting
            # the same key again: the job created before, whose result is read at once
            with listener.expecting("job_other"):
                again, created = await producer.submit(Submission(
                    body(1), reply_to=listener.instance_id, job_id="job_other",
                    idempotency_key="k1"))
                assert (again, created) == ("job_fresh", False)
                assert await listener.wait(again, timeout=0.0, fresh=created) == result
        # a fresh wait does not look first: a result stored without a notice is found only
        # once the wait is over
        await redis.set(keys.result("job_quiet"), json.dumps({"status_code": 200, "body": {}}))
        waiting = asyncio.create_task(listener.wait("job_quiet", timeout=WAIT_S, fresh=True))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await redis.xadd(listener.stream, {"job": "job_quiet"})
        assert (await waiting).status_code == 200
    finally:
        await listener.stop()
    assert not listener._waiting


def test_entry_rows_are_the_engines_own_count(tiny_engine, keys, settings):
    """A pass is packed by the engine's layout (Engine.rows); what that count rejects is the
    entry's own error, answered without a pass."""
    worker = Worker(tiny_engine, None, keys, settings)
    entry = worker._parse(keys.interactive, "1-0",
                          {"job": "job_1", "payload": json.dumps(body(1))})
    assert entry.error is None and entry.failure is None
    assert entry.rows == tiny_engine.rows(body(1)) and entry.rows % 128 == 0
    wrong = worker._parse(keys.interactive, "2-0",
                          {"job": "job_2", "payload": json.dumps(body(2, model="not-this-one"))})
    assert wrong.error is not None and wrong.error.code == "model_not_served"
    assert wrong.failure is None and wrong.rows == 0


def test_a_read_is_laid_out_with_its_contents_tokenised_together(tiny_engine, keys, settings,
                                                                   monkeypatch):
    """The entries of one read: their contents go to the tokenizer in one call (it encodes
    them in parallel), each entry gets the rows it has alone, and a bad entry its own error
    (or, damaged, its own failure) without touching its neighbours."""
    presenter = tiny_engine.preparer.presenter
    calls: list[int] = []
    encode = presenter.root_ids_batch
    monkeypatch.setattr(presenter, "root_ids_batch",
                        lambda texts: calls.append(len(texts)) or encode(texts))
    raw = [(keys.bulk, f"{i}-0", {"job": f"job_{i}", "payload": json.dumps(body(i))})
           for i in range(5)]
    raw.insert(2, (keys.bulk, "9-0", {"job": "job_9",
                                      "payload": json.dumps(body(9, model="not-this-one"))}))
    raw.insert(4, (keys.bulk, "8-0", {"job": "job_8", "payload": "{not json"}))
    entries = Worker(tiny_engine, None, keys, settings)._parse_many(raw)
    assert calls == [5]
    good = [e for e in entries if e.job not in ("job_8", "job_9")]
    assert [e.rows for e in good] == [tiny_engine.rows(body(i)) for i in range(5)]
    assert all(e.error is None and e.failure is None for e in good)
    [wrong] = [e for e in entries if e.job == "job_9"]
    assert wrong.error.code == "model_not_served" and wrong.rows == 0
    [damaged] = [e for e in entries if e.job == "job_8"]
    assert damaged.failure is not None and damaged.rows == 0


@pytest.mark.asyncio
async def test_an_entry_is_prepared_once_for_its_pass(redis, keys, settings, tiny_engine,
                                                      monkeypatch):
    """The parse thread prepares each entry whole (parsed, tokenised, laid out, checked);
    its pass takes that preparation instead of parsing the request again, and scores it as
    the engine alone does."""
    preparer = tiny_engine.preparer
    preparer._kept.clear()     # what other tests' rows() left there (the engine is shared)
    parsed: list[int] = []
    parse = preparer.parse
    monkeypatch.setattr(preparer, "parse",
                        lambda raw, texts=None: parsed.append(id(raw)) or parse(raw, texts))
    producer = Producer(redis, keys, settings)
    jobs = [(await producer.submit(Submission(body(i))))[0] for i in range(6)]
    async with running(Worker(tiny_engine, redis, keys, settings)):
        results = await results_of(redis, keys, jobs)
    assert len(parsed) == 6 and len(set(parsed)) == 6
    assert not preparer._kept          # every preparation was taken by its pass
    monkeypatch.undo()
    assert [without_ids(r["body"]) for r in results] == [
        without_ids(tiny_engine.score(body(i)).model_dump(mode="json")) for i in range(6)]


@pytest.mark.asyncio
async def test_an_interactive_request_joins_the_next_pass_ahead_of_bulk(redis, keys, settings,
                                                                       tiny_engine):
    """A request that arrives while a pass runs and the next pass is already full of bulk
    entries is scored in that next pass, ahead of them (it waits for the pass in flight only)."""
    producer = Producer(redis, keys, settings)
    worker = Worker(tiny_engine, redis, keys, settings)
    rows = tiny_engine.rows(ScoreRequest.parse(body(0)))
    bulk_jobs = [(await producer.submit(Submission(body(i), priority="bulk")))[0]
                 for i in range(2 * worker.budget // rows + 2)]
    await worker._create_groups()
    worker._need_groups = False
    while sum(e.rows for e in worker._ready) < worker.budget:   # the next pass is full
        raw, redelivered = await worker._read(64, None)
        await worker._admit(raw, redelivered)
    single, _ = await producer.submit(Submission(body(999)))
    never = asyncio.ensure_future(asyncio.Event().wait())
    await worker._step(never)
    never.cancel()
    assert worker._starting is not None
    await asyncio.wait_for(worker._drain(), WAIT_S)     # that pass launched, read back, stored
    (result,) = await results_of(redis, keys, [single])
    assert result["status_code"] == 200
    answered = await redis.mget([keys.result(j) for j in bulk_jobs])
    assert 0 < sum(r is not None for r in answered) < len(bulk_jobs)


@pytest.mark.asyncio
async def test_bulk_passes_go_one_at_a_time_while_requests_come(redis, keys, settings,
                                                                tiny_engine):
    """Within ``interactive_window_ms`` of an interactive request, a pass of bulk entries
    alone starts only once the device is free (a request then waits for one pass, not two);
    a pass holding a request may still queue behind the one running; outside the window
    passes go two deep."""
    settings = settings.model_copy(update={"interactive_window_ms": 60_000})
    producer = Producer(redis, keys, settings)
    worker = Worker(tiny_engine, redis, keys, settings)
    for i in range(3):
        await producer.submit(Submission(body(i), priority="bulk"))
    await worker._create_groups()
    await _read_until(worker, 1)
    worker._launched = object()          # a pass on the device, not read back
    assert worker._may_start()           # no request came: two deep
    request, _ = await producer.submit(Submission(body(99)))
    raw, redelivered = await worker._read(64, None)
    await worker._admit(raw, redelivered)
    assert worker._may_start()           # the request waits: its pass may queue
    worker._ready = [e for e in worker._ready if e.stream != keys.interactive]
    assert not worker._may_start()       # bulk alone after it: one at a time
    worker._interactive_seen -= 61.0     # the window has passed
    assert worker._may_start()
    worker._launched = None


@pytest.mark.asyncio
async def test_the_next_launch_queues_behind_the_read_backs(redis, keys, settings, tiny_engine):
    """A pass may start while the pass before the last is still being read back (its launch
    waits on the engine thread only for that pass to have run: one other pass at most is on
    the device when it runs). It waits for the launch before it, and for the stores to keep
    up."""
    worker = Worker(tiny_engine, redis, keys, settings)
    worker._launched = object()                    # launched, its read-back not yet asked
    reading = asyncio.get_running_loop().create_future()
    worker._reading.add(reading)                   # the one before, being read back
    assert worker._may_start()
    worker._starting = reading                     # a launch not yet done: one at a time
    assert not worker._may_start()
    worker._starting = None
    worker._finishing.update(asyncio.get_running_loop().create_future() for _ in range(2))
    assert not worker._may_start()                 # results not stored fast enough
    worker._finishing.clear()
    worker._reading.clear()
    worker._launched = None


@pytest.mark.asyncio
async def test_a_pass_holding_a_request_is_read_back_before_bulk_layout(redis, keys, settings,
                                                                       tiny_engine):
    """During a bulk job a pass holding a request is read back as soon as it has run, ahead
    of the next bulk pass's layout on the engine thread; while other requests wait (ready,
    or still in the stream), passes of requests stay pipelined (read back behind the next
    launch). Either way each is answered."""
    producer = Producer(redis, keys, settings)
    worker = Worker(tiny_engine, redis, keys, settings)
    jobs = [(await producer.submit(Submission(body(90 + i))))[0] for i in range(2)]
    for i in range(2):
        await producer.submit(Submission(body(i), priority="bulk"))
    await worker._create_groups()
    await _read_until(worker, 4 * tiny_engine.rows(ScoreRequest.parse(body(0))))
    first, second, *bulk = sorted(worker._ready, key=lambda e: e.stream != keys.interactive)
    assert first.stream == second.stream == keys.interactive
    assert {e.stream for e in bulk} == {keys.bulk}
    worker._ready = [second, *bulk]           # another request waits: pipelined
    await worker._start_pass([first])
    assert worker._launched is not None and not worker._reading
    worker._ready = list(bulk)                # none ready, but one not read yet: pipelined
    jobs.append((await producer.submit(Submission(body(99))))[0])
    await worker._start_pass([second])
    assert worker._launched is not None
    raw, redelivered = await worker._read(64, None)
    await worker._admit(raw, redelivered)
    (late,) = [e for e in worker._ready if e.stream == keys.interactive]
    worker._ready = list(bulk)                # only bulk work follows: answered first
    await worker._start_pass([late])
    assert worker._launched is None and worker._reading   # its read-back queued
    await asyncio.wait_for(worker._drain(), WAIT_S)
    assert [r["status_code"] for r in await results_of(redis, keys, jobs)] == [200] * 3


class DeviceEngine:
    """The engine, its passes on a device the test runs: each launched pass has run only once
    the test sets its event (``ran``), and reading it back waits for that, as a CUDA pass's
    read-back waits for the device."""

    def __init__(self, engine):
        self.engine, self.ran, self.launched, self.passes = engine, [], [], []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def start_batch(self, requests):
        flight, ran = self.engine.start_batch(requests), threading.Event()
        self.ran.append(ran)
        self.launched.append(len(requests))
        self.passes.append(list(requests))

        def read_back():
            assert ran.wait(WAIT_S), "read back before it ran"
            flight.read_back()

        return SimpleNamespace(read_back=read_back, respond=flight.respond, on_device=True,
                               wait_device=lambda: ran.wait(WAIT_S))


@pytest.mark.asyncio
async def test_a_launch_never_waits_behind_a_read_back_waiting_for_the_device(
        redis, keys, settings, tiny_engine):
    """A pass read back early (nothing else due) waits for the device on a thread of its own:
    the next pass still launches on the engine thread at once, while the first one runs. A
    third pass waits for the first to have run (two deep on the device); all are answered."""
    producer = Producer(redis, keys, settings)
    engine = DeviceEngine(tiny_engine)
    worker = Worker(engine, redis, keys, settings)
    jobs = [(await producer.submit(Submission(body(i), priority="bulk")))[0] for i in range(3)]
    await worker._create_groups()
    await _read_until(worker, 3 * tiny_engine.rows(ScoreRequest.parse(body(0))))
    first, second, third = worker._ready
    worker._ready = []
    await asyncio.wait_for(worker._start_pass([first]), WAIT_S)
    worker._read_back()                  # asked for at once: it waits for the device
    await asyncio.wait_for(worker._start_pass([second]), WAIT_S)
    assert engine.launched == [1, 1] and not engine.ran[0].is_set()
    launching = asyncio.create_task(worker._start_pass([third]))
    for _ in range(20):                  # the loop turns; the third pass may not launch yet
        await asyncio.sleep(0)
    assert engine.launched == [1, 1] and not launching.done()
    engine.ran[0].set()
    await asyncio.wait_for(launching, WAIT_S)
    assert engine.launched == [1, 1, 1]
    for ran in engine.ran:
        ran.set()
    await asyncio.wait_for(worker._drain(), WAIT_S)
    assert [r["status_code"] for r in await results_of(redis, keys, jobs)] == [200] * 3


@pytest.mark.asyncio
async def test_a_request_joins_a_bulk_pass_waiting_to_launch(redis, keys, settings,
                                                             tiny_engine):
    """Two passes on the device and a third, full of bulk entries, waiting for the first to
    have run: a request that comes meanwhile is put in that third pass, ahead of its bulk
    entries, which keep only the interactive budget (the others go back first in line). The
    request waits for the passes on the device when it came, not for one more."""
    rows = tiny_engine.rows(ScoreRequest.parse(body(0)))
    settings = settings.model_copy(update={"max_pass_tokens": 4 * rows,
                                           "interactive_pass_tokens": 2 * rows})
    producer = Producer(redis, keys, settings)
    engine = DeviceEngine(tiny_engine)
    worker = Worker(engine, redis, keys, settings)
    bulk = [(await producer.submit(Submission(body(i), priority="bulk")))[0] for i in range(6)]
    await worker._create_groups()
    await _read_until(worker, 6 * rows)
    first, second, *third = worker._ready
    worker._ready = []
    await asyncio.wait_for(worker._start_pass([first]), WAIT_S)
    await asyncio.wait_for(worker._start_pass([second]), WAIT_S)
    launching = asyncio.create_task(worker._start_pass(third))
    for _ in range(20):                  # the loop turns; the third pass waits for the first
        await asyncio.sleep(0)
    assert not launching.done()
    request, _ = await producer.submit(Submission(body(99)))
    engine.ran[0].set()
    await asyncio.wait_for(launching, WAIT_S)
    texts = [r.documents()[0].messages[0].content for r in engine.passes[2]]
    assert texts == [body(99)["text"], body(2)["text"]]   # two rows: the request's budget
    assert [e.job for e in worker._ready] == bulk[3:]     # back, first in line
    for ran in engine.ran:
        ran.set()
    await asyncio.wait_for(worker._drain(), WAIT_S)
    (result,) = await results_of(redis, keys, [request])
    assert result["status_code"] == 200
    assert [r["status_code"] for r in await results_of(redis, keys, bulk[:3])] == [200] * 3


async def _bulk_worker(redis, keys, settings, engine, passes: int
                       ) -> tuple[Producer, Worker, int]:
    """A worker (groups created) with ``passes`` whole passes of bulk entries queued, and
    the rows one takes."""
    rows = engine.rows(ScoreRequest.parse(body(0)))
    producer = Producer(redis, keys, settings)
    worker = Worker(engine, redis, keys, settings)
    for i in range(passes * worker.budget // rows + passes):
        await producer.submit(Submission(body(i), priority="bulk"))
    await worker._create_groups()
    worker._need_groups = False
    return producer, worker, rows


async def _dispatched(worker: Worker) -> list:
    """The entries of the pass ``_dispatch`` starts over the ready ones, once it is done."""
    before = list(worker._ready)
    worker._dispatch()
    batch = [e for e in before if e not in worker._ready]
    await asyncio.wait_for(worker._drain(), WAIT_S)
    return batch


async def _read_until(worker: Worker, rows: int) -> None:
    """Read and parse entries until the ready ones hold at least ``rows`` rows."""
    while sum(e.rows for e in worker._ready) < rows:
        raw, redelivered = await worker._read(64, None)
        assert raw, "the streams ran dry"
        await worker._admit(raw, redelivered)


@pytest.mark.asyncio
async def test_bulk_fills_a_pass_with_an_interactive_request_only_up_to_its_budget(
        redis, keys, settings, tiny_engine):
    """A pass that holds an interactive request takes bulk entries up to
    interactive_pass_tokens rows, so the request waits for a short pass; a bulk pass is
    filled to the whole budget, and so is a pass of interactive entries alone."""
    rows = tiny_engine.rows(ScoreRequest.parse(body(0)))
    settings = settings.model_copy(update={"interactive_pass_tokens": 3 * rows})
    producer, worker, _ = await _bulk_worker(redis, keys, settings, tiny_engine, 2)
    assert worker.interactive_budget == 3 * rows < worker.budget
    await _read_until(worker, worker.budget)
    single, _ = await producer.submit(Submission(body(999)))
    await worker._take_interactive()
    batch = await _dispatched(worker)
    assert [e.job for e in batch if e.stream == keys.interactive] == [single]
    assert 0 < sum(e.rows for e in batch if e.stream == keys.bulk) <= 3 * rows
    (result,) = await results_of(redis, keys, [single])
    assert result["status_code"] == 200

    worker._interactive_seen -= REQUESTS_RECENT_S     # no request lately
    await _read_until(worker, worker.budget)
    batch = await _dispatched(worker)          # bulk alone: the whole budget
    assert all(e.stream == keys.bulk for e in batch)
    assert sum(e.rows for e in batch) > worker.budget - rows

    singles = [(await producer.submit(Submission(body(1000 + i))))[0]
               for i in range(worker.budget // rows)]
    await worker._take_interactive()
    batch = await _dispatched(worker)          # interactive entries fill the whole budget
    assert sum(e.stream == keys.interactive for e in batch) == len(singles)
    assert sum(e.rows for e in batch) > 3 * rows


@pytest.mark.asyncio
async def test_bulk_passes_are_shorter_while_requests_keep_coming(
        redis, keys, settings, tiny_engine):
    """A pass of bulk entries alone holds at most interactive_bulk_pass_tokens rows (half
    the budget by default) while requests keep coming (one read within REQUESTS_RECENT_S),
    so the next request waits behind a short pass; with none read that recently, the
    whole budget."""
    rows = tiny_engine.rows(ScoreRequest.parse(body(0)))
    settings = settings.model_copy(update={"interactive_bulk_pass_tokens": 3 * rows})
    producer, worker, _ = await _bulk_worker(redis, keys, settings, tiny_engine, 3)
    assert worker.bulk_budget() == worker.budget > 3 * rows     # no request read yet
    await _read_until(worker, worker.budget)
    single, _ = await producer.submit(Submission(body(999)))
    await worker._take_interactive()
    assert worker.bulk_budget() == 3 * rows
    default = Worker(tiny_engine, redis, keys, settings.model_copy(
        update={"interactive_bulk_pass_tokens": None}))
    default._interactive_seen = worker._interactive_seen
    assert default.bulk_budget() == default.budget // 2     # half a pass by default
    batch = await _dispatched(worker)          # the request's own pass
    assert [e.job for e in batch if e.stream == keys.interactive] == [single]

    await _read_until(worker, worker.budget)
    batch = await _dispatched(worker)          # bulk alone, a request read just now: short
    assert all(e.stream == keys.bulk for e in batch)
    assert 0 < sum(e.rows for e in batch) <= 3 * rows

    worker._interactive_seen -= REQUESTS_RECENT_S     # the last request long ago
    await _read_until(worker, worker.budget)
    batch = await _dispatched(worker)          # bulk alone, no request lately: the whole budget
    assert sum(e.rows for e in batch) > worker.budget - rows
    (result,) = await results_of(redis, keys, [single])
    assert result["status_code"] == 200

"""The queue worker's host time per entry and per pass: everything but the engine's
``score_batch`` (reading, parsing, ``Engine.rows``, storing results, notifying, batch lines,
acks), on a real Redis and the default model's engine on the CPU.

The job: bulk batches of the news job (an article of ../shared/data/news_articles.jsonl cut to
470 tokens, the 56 questions of benchmarks/news_questions.json), 14 documents a pass. The
engine's ``score_batch`` is replaced by one that answers at once with a response of the real
shape (56 queries, two options each), so what is left is the worker's own work.

    python benchmarks/worker_host.py [--code DIR] [--docs 280] [--repeat 3] [--interactive]
                                     [--out FILE]

``--interactive``: the same documents as requests (``POST /v1/score``'s entries: the
interactive stream, a reply notification each, no batch lines), all queued before the worker
starts, as many callers keep the stream full; the worker's done when every reply came.

``--code DIR``: measure the ``spinf_worker/`` of another checkout (``git worktree add``), the
benchmark itself staying this one. ``cpu_ms_per_entry`` is the process's CPU time (every
thread) less the answering ``score_batch``'s; ``loop_cpu_ms_per_entry`` the event loop's thread
alone (the worker's loop and the benchmark's polling of the batch, queued before the worker
starts): the share that holds the interpreter lock beside the engine thread;
``redis_cpu_ms_per_entry`` the Redis server's (INFO cpu: meaningful on a Redis nothing else
uses meanwhile).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
ARTICLES = ROOT.parent / "shared" / "data" / "news_articles.jsonl"
QUESTIONS = ROOT / "benchmarks" / "news_questions.json"
DOC_TOKENS = 470
PER_PASS = 14
REDIS_URL = os.environ.get("SPINF_REDIS_URL", "redis://127.0.0.1:6379/0")


class AnsweringEngine:
    """The real engine's rows() and settings; score_batch answers at once (its time noted)."""

    def __init__(self, engine, template):
        self.engine, self.template = engine, template
        self.settings, self.model_name = engine.settings, engine.model_name
        self.fingerprint, self.device = engine.fingerprint, engine.device
        self.stub_s = self.stub_cpu_s = 0.0

    def row_parts(self, request):
        return self.engine.row_parts(request)

    def row_parts_many(self, requests):
        return self.engine.row_parts_many(requests)

    def score_batch(self, requests):
        from spinf_worker.protocol import ScoreResponse

        started, cpu = time.perf_counter(), time.thread_time()
        out = []
        for request in requests:
            # as the engine answers (engine/respond.py): plain data, validated once read
            response = ScoreResponse.of_engine(self.template.plain(), {"score_ms": 40})
            response._rows, response._padded_rows, response._questions = 1027, 1152, 56
            out.append(response)
            # what score_batch takes from the engine's caches for this request: its
            # preparation (since f7932fd), else its content's tokens (--code: before)
            preparer = self.engine.preparer
            if hasattr(preparer, "_kept"):
                preparer._kept.pop(id(request), None)
            else:
                for doc in request.documents():
                    preparer._roots.pop(doc.messages[0].content, None)
        self.stub_s += time.perf_counter() - started
        self.stub_cpu_s += time.thread_time() - cpu
        return out

    def start_batch(self, requests):
        out = self.score_batch(requests)
        # finish: as a worker before the responder thread read a pass back (--code)
        return SimpleNamespace(read_back=lambda: None, respond=lambda: out, finish=lambda: out)


def response_template(questions: dict):
    from spinf_worker.protocol import ScoreResponse

    queries = [{"id": q["id"], "combinations": [{
        "values": {}, "residual": 0.7178162274275633, "floor_residual": 0.7068899856753895,
        "options": [{"text": o, "logprob": -1.390878677368164 - k, "p": 0.8818953040921418,
                     "floor_p": 0.9492888394486824} for k, o in enumerate(q["options"])]}]}
        for q in questions["queries"]]
    template = ScoreResponse.model_validate({
        "id": "scr_01M8VR7EW2BXEHRRZM0EFVZ1F9", "created": 1796227709,
        "model": "google/gemma-3-270m", "system_fingerprint": "fp_2d2dc302d0",
        "results": [{"input_id": "0", "queries": queries}],
        "usage": {"prompt_tokens": 1027, "completion_tokens": 0, "total_tokens": 1027,
                  "prompt_tokens_details": {}, "inputs": 1, "content": {"tokens": 471},
                  "scoring": {"tokens": 556}, "processed_tokens": 1027},
        "timing": {"score_ms": 40}})
    # as the engine builds replies (engine/respond.py): plain() need not dump the model; an
    # input's result is its JSON text where the measured tree writes it so (a bulk job's)
    template._plain = template.model_dump(exclude={"timing"})
    import spinf_worker

    # (an editable install resolves a module the measured tree lacks to this checkout's)
    if (Path(spinf_worker.__file__).parent / "jsonio.py").exists():
        from spinf_worker.jsonio import RawJSON, dumps

        template._plain["results"] = [RawJSON(dumps(r)) for r in template._plain["results"]]
    return template


async def redis_cpu_s(redis) -> float:
    """The Redis server's CPU seconds so far (INFO cpu: its main thread and the others)."""
    info = await redis.info("cpu")
    return info["used_cpu_user"] + info["used_cpu_sys"]


async def queue_batch(redis, keys, settings, lines: list[dict]):
    """The lines as one bulk batch, enqueued; returns a coroutine function telling whether
    it completed."""
    from spinf_worker.queue import batches, files
    from spinf_worker.queue.producer import Producer

    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = await files.create_file(redis, keys, content, filename="in.jsonl",
                                     purpose="batch", ttl_s=600)
    batch = await batches.create_batch(redis, keys, input_file_id=upload["id"],
                                       endpoint="/v1/score", completion_window="24h",
                                       metadata=None, ttl_s=600)
    settings = settings.model_copy(update={"max_backlog": len(lines) + 1})
    await batches.enqueue_batch(redis, keys, Producer(redis, keys, settings), batch["id"])

    async def done() -> bool:
        return (await batches.get_batch(redis, keys, batch["id"]))["status"] == "completed"
    return done


async def queue_requests(redis, keys, settings, lines: list[dict]):
    """The lines' bodies as interactive requests answered to one reply stream, as the API
    submits ``POST /v1/score``; returns a coroutine function telling whether all were
    answered (a length read: no reply reader's work lands in the measured process)."""
    from spinf_worker.queue.producer import Producer, Submission

    producer = Producer(redis, keys, settings)
    for line in lines:
        await producer.submit(Submission(request=line["body"], reply_to="bench"))

    async def done() -> bool:
        return await redis.xlen(keys.reply("bench")) >= len(lines)
    return done


async def one_run(engine, docs: list[str], questions: dict, n: int, rows: int,
                  interactive: bool = False) -> dict:
    from spinf_worker.queue.keys import Keys
    from spinf_worker.queue.redis_client import connect
    from spinf_worker.queue.settings import ServiceSettings
    from spinf_worker.queue.worker import Worker

    prefix = f"bench-host-{uuid.uuid4().hex[:8]}"
    keys = Keys(prefix)
    settings = ServiceSettings(redis_url=REDIS_URL, prefix=prefix, max_wait_ms=20,
                               max_pass_tokens=PER_PASS * rows)
    redis = connect(settings.redis_url)
    scoring = {**questions, "case_insensitive": False}
    lines = [{"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/score",
              "body": {"text": docs[i % len(docs)], "scoring": scoring}} for i in range(n)]
    queue = queue_requests if interactive else queue_batch
    done = await queue(redis, keys, settings, lines)
    engine.stub_s, engine.stub_cpu_s = 0.0, 0.0
    worker = Worker(engine, redis, keys, settings, name="bench")
    stop = asyncio.Event()
    redis_cpu = await redis_cpu_s(redis)
    cpu, loop_cpu = time.process_time(), time.thread_time()
    started = time.perf_counter()
    task = asyncio.create_task(worker.run(stop))
    while not await done():
        await asyncio.sleep(0.002)
    wall = time.perf_counter() - started
    cpu, loop_cpu = time.process_time() - cpu, time.thread_time() - loop_cpu
    redis_cpu = await redis_cpu_s(redis) - redis_cpu
    stop.set()
    await task
    async for key in redis.scan_iter(match=f"{prefix}:*", count=1000):
        await redis.delete(key)
    await redis.aclose()
    host = wall - engine.stub_s
    passes = worker.passes
    return {"wall_s": wall, "host_ms_per_entry": 1000 * host / n,
            "cpu_ms_per_entry": 1000 * (cpu - engine.stub_cpu_s) / n,
            "loop_cpu_ms_per_entry": 1000 * loop_cpu / n,
            "redis_cpu_ms_per_entry": 1000 * redis_cpu / n,
            "host_ms_per_pass": 1000 * host / passes, "passes": passes,
            "docs_per_pass": n / passes}


def parse_per_entry(engine, docs: list[str], questions: dict, n: int) -> dict:
    """The parse thread's work per entry (Worker._parse: JSON, validation, Engine.rows), and
    JSON of a result (JobResult.ok and its stored text)."""
    from spinf_worker.queue.keys import Keys
    from spinf_worker.queue.results import JobResult
    from spinf_worker.queue.settings import ServiceSettings
    from spinf_worker.queue.worker import Worker

    worker = Worker(engine, None, Keys("bench"), ServiceSettings())
    scoring = {**questions, "case_insensitive": False}
    payloads = [json.dumps({"text": docs[i % len(docs)], "scoring": scoring},
                           separators=(",", ":")) for i in range(n)]
    started = time.perf_counter()
    for i, payload in enumerate(payloads):
        entry = worker._parse("bulk", f"{i}-0", {"job": f"job-{i}", "payload": payload})
        assert entry.request is not None, entry.failure or entry.error
    parse_ms = 1000 * (time.perf_counter() - started) / n
    started = time.perf_counter()
    for _ in range(n):
        result = JobResult.ok(engine.template)
        stored = result.to_bytes() if hasattr(result, "to_bytes") else result.to_json()
    result_ms = 1000 * (time.perf_counter() - started) / n
    started = time.perf_counter()
    for _ in range(n):
        JobResult.from_json(stored)
    return {"parse_rows_ms": parse_ms, "result_ms": result_ms,
            "result_read_ms": 1000 * (time.perf_counter() - started) / n}


def news_job():
    """The default model's engine on the CPU, the 24 news documents cut to DOC_TOKENS tokens,
    the questions, and the rows a document takes in a pass (as the worker counts them)."""
    from spinf_worker.engine import Engine
    from spinf_worker.tiles import padded_rows

    engine = Engine.load(device="cpu")
    texts = [json.loads(line)["text"] for line in ARTICLES.read_text().splitlines()[:24]]
    docs = [engine.checkpoint.tokenizer.decode(list(engine.presenter.encode(t)[:DOC_TOKENS]))
            for t in texts]
    questions = json.loads(QUESTIONS.read_text())
    rows = max(padded_rows(1027), engine.rows({"text": docs[0], "scoring": {
        **questions, "case_insensitive": False}}))
    return engine, docs, questions, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", type=Path, help="a checkout whose spinf_worker/ to measure")
    parser.add_argument("--docs", type=int, default=280)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--interactive", action="store_true",
                        help="the documents as requests, not one bulk batch")
    parser.add_argument("--out", type=Path, help="write the figures there as JSON too")
    args = parser.parse_args()
    if args.code is not None:
        sys.path.insert(0, str(args.code.resolve()))
    import spinf_worker
    from spinf_worker.engine.engine import freeze_heap

    engine, docs, questions, rows = news_job()
    freeze_heap()     # as the worker does once its engine is warm
    answering = AnsweringEngine(engine, response_template(questions))
    parse = parse_per_entry(answering, docs, questions, 200)
    runs = [asyncio.run(one_run(answering, docs, questions, args.docs, rows, args.interactive))
            for _ in range(args.repeat)]
    best = min(runs, key=lambda r: r["wall_s"])
    figures = {"code": str(Path(spinf_worker.__file__).parent),
               "entries": "interactive" if args.interactive else "bulk", **parse,
               "median_host_ms_per_entry": statistics.median(
                   r["host_ms_per_entry"] for r in runs),
               "median_host_ms_per_pass": statistics.median(r["host_ms_per_pass"] for r in runs),
               "median_cpu_ms_per_entry": statistics.median(r["cpu_ms_per_entry"] for r in runs),
               "median_loop_cpu_ms_per_entry": statistics.median(
                   r["loop_cpu_ms_per_entry"] for r in runs),
               "median_redis_cpu_ms_per_entry": statistics.median(
                   r["redis_cpu_ms_per_entry"] for r in runs),
               "best": best, "runs": runs}
    report(figures, args.out)


def report(figures: dict, out: Path | None) -> None:
    """The figures as JSON on stdout, and in ``out`` when given."""
    text = json.dumps(figures, indent=1)
    if out is not None:
        out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

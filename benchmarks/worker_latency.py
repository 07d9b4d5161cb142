"""A request's wait during a bulk job, counted in passes: the queue worker's scheduling against
a simulated device.

The real worker (spinf_worker/queue/worker.py) on a real Redis, serving the default model's
engine whose passes run on a simulated device, so that what is measured is how the worker
orders and overlaps its work, not how fast this machine is:
- ``start_batch`` does ``--host-ms`` of layout work per document (Python holding the
  interpreter lock, as the engine's own host work does) and ``--launch-ops`` small torch
  operations spread through it (each lets go of the interpreter lock and takes it back, as
  every torch call of a CUDA launch does: a thread that must take the lock back from one
  running Python waits for it up to the interpreter's switch interval), queues the pass on the device's
  timeline (it runs once the pass before it is done, for ``--pass-ms`` times its share of a
  full pass's documents) and returns;
- ``finish`` waits for its pass to be done, then does ``--host-ms`` of reply work per
  document and answers with responses of the real shape (benchmarks/worker_host.py's).

A bulk batch of ``--docs`` news documents (the 56 questions each, 14 a full pass) runs while
single interactive requests of one such document arrive every ``--trickle-ms``; each single's
latency, from its submission to its reply notification, in passes (of ``--pass-ms``), p50
and p99, with its ``queue_ms`` (in the stream) and the rest; and the batch's documents/s
against the simulated device's at full passes.

    python benchmarks/worker_latency.py [--pass-ms 60] [--host-ms 0.4] [--docs 840]
        [--launch-ops 0] [--trickle-ms 150 | --callers N] [--code DIR] [--out FILE]

``--callers N`` instead: N concurrent callers, each sending one interactive request once its
last is answered, ``--docs`` in all (the service benchmark's callers, less HTTP and the API
tier): documents/s against the device's, documents a pass, latency in passes.

``--code DIR``: the ``spinf_worker/`` of another checkout, the benchmark staying this one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
import uuid
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_host import (  # noqa: E402
    PER_PASS,
    REDIS_URL,
    AnsweringEngine,
    news_job,
    report,
    response_template,
)

READER = "latency"      # the reply stream the singles' notifications come to


def spin(seconds: float) -> None:
    """Python work holding the interpreter lock for ``seconds`` (as the engine's host work)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def host_work(seconds: float, ops: int, scratch: torch.Tensor) -> None:
    """``seconds`` of Python work with ``ops`` torch operations spread through it."""
    for _ in range(ops):
        spin(seconds / ops)
        scratch.add_(1)
    if not ops:
        spin(seconds)


class SimulatedDevice:
    """Passes one after another on a timeline: each starts when it is queued or when the one
    before it is done, whichever is later."""

    def __init__(self, pass_s: float):
        self.pass_s, self.free_at, self.busy_s = pass_s, 0.0, 0.0
        self.passes: list[tuple[float, float, int]] = []   # (queued, done, documents)
        self.lock = threading.Lock()

    def queue(self, docs: int) -> float:
        """Queue a pass of ``docs`` documents; when it will be done."""
        seconds = self.pass_s * docs / PER_PASS
        with self.lock:
            now = time.perf_counter()
            self.free_at = max(self.free_at, now) + seconds
            self.busy_s += seconds
            self.passes.append((now, self.free_at, docs))
            return self.free_at


class SimulatedEngine(AnsweringEngine):
    """The real engine's rows() and settings; its passes on a SimulatedDevice."""

    def __init__(self, engine, template, device: SimulatedDevice, host_s: float,
                 launch_ops: int = 0):
        super().__init__(engine, template)
        self.device, self.host_s, self.launch_ops = device, host_s, launch_ops
        self.scratch = torch.zeros(16)

    def start_batch(self, requests):
        host_work(self.host_s * len(requests), self.launch_ops, self.scratch)   # layout
        done_at = self.device.queue(len(requests))

        def wait_device():
            time.sleep(max(0.0, done_at - time.perf_counter()))

        def read_back():
            wait_device()
            spin(self.host_s * len(requests))             # readouts (replies: respond)

        def finish():   # as a worker before the responder thread read a pass back (--code)
            read_back()
            return self.score_batch(requests)

        # as Engine.start_batch's batch on a GPU (engine/batch.py)
        return SimpleNamespace(read_back=read_back, respond=lambda: self.score_batch(requests),
                               finish=finish, wait_device=wait_device, on_device=True)


def private_queue(name: str, rows: int, n: int):
    """A key prefix of its own on the local Redis: its keys, the worker's settings (passes
    of ``rows`` rows a document) and a client."""
    from spinf_worker.queue.keys import Keys
    from spinf_worker.queue.redis_client import connect
    from spinf_worker.queue.settings import ServiceSettings

    prefix = f"bench-{name}-{uuid.uuid4().hex[:8]}"
    settings = ServiceSettings(redis_url=REDIS_URL, prefix=prefix,
                               max_pass_tokens=PER_PASS * rows, max_backlog=n + 1000)
    return Keys(prefix), settings, connect(settings.redis_url)


async def drop_queue(redis, keys) -> None:
    """Delete every key of a private_queue and close its client."""
    async for key in redis.scan_iter(match=f"{keys.prefix}:*", count=1000):
        await redis.delete(key)
    await redis.aclose()


async def one_run(engine: SimulatedEngine, docs: list[str], questions: dict, n: int,
                  rows: int, trickle_s: float) -> dict:
    from spinf_worker.queue import batches, files
    from spinf_worker.queue.producer import Producer, Submission
    from spinf_worker.queue.worker import Worker

    keys, settings, redis = private_queue("latency", rows, n)
    scoring = {**questions, "case_insensitive": False}
    lines = [{"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/score",
              "body": {"text": docs[i % len(docs)], "scoring": scoring}} for i in range(n)]
    upload = await files.create_file(redis, keys, "".join(
        json.dumps(line) + "\n" for line in lines).encode(), filename="in.jsonl",
        purpose="batch", ttl_s=600)
    batch = await batches.create_batch(redis, keys, input_file_id=upload["id"],
                                       endpoint="/v1/score", completion_window="24h",
                                       metadata=None, ttl_s=600)
    producer = Producer(redis, keys, settings)
    await batches.enqueue_batch(redis, keys, producer, batch["id"])
    sent: dict[str, float] = {}
    answered: dict[str, float] = {}
    done = asyncio.Event()

    async def trickle() -> None:
        i = 0
        while not done.is_set():
            job, _ = await producer.submit(Submission(
                {"text": docs[i % len(docs)], "scoring": scoring}, priority="interactive",
                reply_to=READER))
            sent[job] = time.perf_counter()
            i += 1
            await asyncio.sleep(trickle_s)

    async def replies() -> None:
        last = "0-0"
        while not done.is_set() or len(answered) < len(sent):
            reply = await redis.xread({keys.reply(READER): last}, block=100)
            for _, entries in reply or ():
                for entry_id, fields in entries:
                    answered[fields["job"]] = time.perf_counter()
                    last = entry_id

    worker = Worker(engine, redis, keys, settings, name="bench")
    stop = asyncio.Event()
    started = time.perf_counter()
    busy_before, first_pass = engine.device.busy_s, len(engine.device.passes)
    task = asyncio.create_task(worker.run(stop))
    side = [asyncio.create_task(trickle()), asyncio.create_task(replies())]
    while (await batches.get_batch(redis, keys, batch["id"]))["status"] != "completed":
        await asyncio.sleep(0.01)
    wall = time.perf_counter() - started
    done.set()
    await asyncio.wait_for(asyncio.gather(*side), 60)
    stop.set()
    await task
    results = {job: json.loads(await redis.get(keys.result(job))) for job in sent}
    await drop_queue(redis, keys)
    pass_s = engine.device.pass_s
    waits = sorted(answered[job] - sent[job] for job in sent)
    queued = sorted(r["body"]["timing"]["queue_ms"] / 1000 for r in results.values())
    return {"wall_s": wall, "docs_per_s": n / wall,
            "device_docs_per_s": PER_PASS / pass_s,
            "of_device": n / wall / (PER_PASS / pass_s),
            "device_busy": (engine.device.busy_s - busy_before) / wall,
            "singles": len(waits),
            "p50_passes": statistics.median(waits) / pass_s,
            "p99_passes": waits[min(len(waits) - 1, int(0.99 * len(waits)))] / pass_s,
            "max_passes": waits[-1] / pass_s,
            "queue_p50_passes": statistics.median(queued) / pass_s,
            "queue_p99_passes": queued[min(len(queued) - 1, int(0.99 * len(queued)))] / pass_s,
            "passes": worker.passes, "docs_per_pass": statistics.mean(
                docs for _, _, docs in engine.device.passes[first_pass:]),
            # the device idle while the batch ran: a pass queued after the one before it
            # was done (the first pass's wait for its entries left out)
            "device_gaps_s": sum(max(0.0, queued - before) for (_, before, _), (queued, _, _)
                                 in pairwise(engine.device.passes[first_pass:]))}


async def callers_run(engine: SimulatedEngine, docs: list[str], questions: dict, n: int,
                      rows: int, callers: int) -> dict:
    """``callers`` concurrent callers, each sending one interactive request and, once it is
    answered, the next, ``n`` in all (as 256 ``POST /v1/score`` clients, less HTTP and the
    API tier): documents/s against the device's, documents a pass, latency in passes."""
    from spinf_worker.queue.producer import Producer, Submission
    from spinf_worker.queue.worker import Worker

    keys, settings, redis = private_queue("callers", rows, n)
    scoring = {**questions, "case_insensitive": False}
    waiting: dict[str, asyncio.Future] = {}
    latencies: list[float] = []
    sent = 0
    done = asyncio.Event()

    async def caller() -> None:
        nonlocal sent
        producer = Producer(redis, keys, settings)
        while sent < n:
            i, sent = sent, sent + 1
            answer = asyncio.get_running_loop().create_future()
            t0 = time.perf_counter()
            job, _ = await producer.submit(Submission(
                {"text": docs[i % len(docs)], "scoring": scoring}, priority="interactive",
                reply_to=READER))
            waiting[job] = answer
            await answer
            latencies.append(time.perf_counter() - t0)

    async def replies() -> None:
        last, early = "0-0", set()
        while not done.is_set():
            reply = await redis.xread({keys.reply(READER): last}, block=100)
            for _, entries in reply or ():
                for entry_id, fields in entries:
                    last = entry_id
                    early.add(fields["job"])
            for job in [j for j in early if j in waiting]:   # a reply before its submit returned
                early.discard(job)
                waiting.pop(job).set_result(None)

    worker = Worker(engine, redis, keys, settings, name="bench")
    stop = asyncio.Event()
    busy_before, first_pass = engine.device.busy_s, len(engine.device.passes)
    task = asyncio.create_task(worker.run(stop))
    reader = asyncio.create_task(replies())
    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    wall = time.perf_counter() - started
    done.set()
    await reader
    stop.set()
    await task
    await drop_queue(redis, keys)
    pass_s = engine.device.pass_s
    latencies.sort()
    passes = engine.device.passes[first_pass:]
    return {"wall_s": wall, "docs_per_s": n / wall, "device_docs_per_s": PER_PASS / pass_s,
            "of_device": n / wall / (PER_PASS / pass_s),
            "device_busy": (engine.device.busy_s - busy_before) / wall,
            "passes": len(passes), "docs_per_pass": statistics.mean(d for _, _, d in passes),
            "p50_passes": statistics.median(latencies) / pass_s,
            "p99_passes": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
            / pass_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pass-ms", type=float, default=60.0,
                        help="the simulated device's time for a full pass (14 documents)")
    parser.add_argument("--host-ms", type=float, default=0.4,
                        help="the engine's host work per document, at layout and at reply each")
    parser.add_argument("--launch-ops", type=int, default=0,
                        help="torch operations in a pass's layout (a CUDA launch: ~35)")
    parser.add_argument("--docs", type=int, default=840)
    parser.add_argument("--trickle-ms", type=float, default=150.0)
    parser.add_argument("--callers", type=int, default=0,
                        help="instead of the bulk batch and the trickle: this many concurrent "
                             "callers, --docs requests in all")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--code", type=Path, help="a checkout whose spinf_worker/ to measure")
    parser.add_argument("--out", type=Path, help="write the figures there as JSON too")
    args = parser.parse_args()
    if args.code is not None:
        sys.path.insert(0, str(args.code.resolve()))
    import spinf_worker
    from spinf_worker.engine.engine import freeze_heap

    engine, docs, questions, rows = news_job()
    freeze_heap()     # as the worker does once its engine is warm
    device = SimulatedDevice(args.pass_ms / 1000)
    simulated = SimulatedEngine(engine, response_template(questions), device,
                                args.host_ms / 1000, args.launch_ops)
    if args.callers:
        runs = [asyncio.run(callers_run(simulated, docs, questions, args.docs, rows,
                                        args.callers)) for _ in range(args.repeat)]
    else:
        runs = [asyncio.run(one_run(simulated, docs, questions, args.docs, rows,
                                    args.trickle_ms / 1000)) for _ in range(args.repeat)]
    settings = {k: v for k, v in vars(args).items() if k not in ("code", "out")}
    report({"code": str(Path(spinf_worker.__file__).parent), **settings, "runs": runs},
           args.out)


if __name__ == "__main__":
    main()

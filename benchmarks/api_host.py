"""The API tier's CPU per request: one ``spinf-serve api`` process answering ``POST /v1/score``
callers, on a real Redis, with a worker that answers at once (worker_host.py's answering
engine: the default model's tokenizer and layout, no forward), so that the API's own work is
what is measured, not the model's.

The requests: the news job (an article cut to 470 tokens, the 56 questions of
benchmarks/news_questions.json), ``--concurrency`` in flight from ``--client-procs`` client
processes. Per run: requests/s and the API process's CPU milliseconds per request (its user +
system time over the timed requests, from /proc), after a warm-up of ``--concurrency``
requests (the tokenizer loaded, connections opened).

    python benchmarks/api_host.py [--requests 2000] [--concurrency 64] [--client-procs 2] \\
        [--repeat 3] [--code DIR] [--out FILE]

``--code DIR``: the API process runs that checkout's ``api/`` and ``spinf_worker/`` (a
``git worktree add`` of another commit), the worker and the clients staying this one's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from service_http import free_port, process_cpu_s  # noqa: E402
from worker_host import REDIS_URL, AnsweringEngine, news_job, response_template  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def client_process(url: str, bodies: list[dict], concurrency: int, start, done) -> None:
    async def run() -> None:
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            gate = asyncio.Semaphore(concurrency)

            async def one(body: dict) -> None:
                async with gate:
                    reply = await client.post("/v1/score", json=body)
                    if reply.status_code != 200:
                        raise SystemExit(f"{reply.status_code}: {reply.text[:300]}")

            start.wait()
            await asyncio.gather(*(one(b) for b in bodies))
        done.put(os.getpid())

    asyncio.run(run())


def drive(url: str, bodies: list[dict], concurrency: int, procs: int) -> float:
    """Send ``bodies`` from ``procs`` processes at once; the wall seconds until the last."""
    ctx = mp.get_context("spawn")
    start, done = ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=client_process,
                           args=(url, bodies[k::procs], max(1, concurrency // procs), start,
                                 done)) for k in range(procs)]
    for w in workers:
        w.start()
    time.sleep(1.0)     # the clients imported and waiting
    t0 = time.perf_counter()
    start.set()
    for _ in workers:
        done.get(timeout=600)
    seconds = time.perf_counter() - t0
    for w in workers:
        w.join()
        if w.exitcode:
            raise SystemExit(f"a client process failed ({w.exitcode})")
    return seconds


async def serve_worker(engine, prefix: str, stop: asyncio.Event) -> None:
    from spinf_worker.queue.keys import Keys
    from spinf_worker.queue.redis_client import connect
    from spinf_worker.queue.settings import ServiceSettings
    from spinf_worker.queue.worker import Worker

    settings = ServiceSettings(redis_url=REDIS_URL, prefix=prefix, max_wait_ms=5)
    redis = connect(REDIS_URL)
    try:
        await Worker(engine, redis, Keys(prefix), settings, name="api-host").run(stop)
    finally:
        await redis.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--code", type=Path, default=ROOT)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    engine, docs, questions, _rows = news_job()
    answering = AnsweringEngine(engine, response_template(questions))
    scoring = {**questions, "case_insensitive": False}
    bodies = [{"text": docs[i % len(docs)], "scoring": scoring} for i in range(args.requests)]
    prefix, port = f"bench-api-{uuid.uuid4().hex[:8]}", free_port()
    env = {**os.environ, "SPINF_REDIS_URL": REDIS_URL, "SPINF_PREFIX": prefix,
           "PYTHONPATH": str(args.code.resolve())}
    api = subprocess.Popen([sys.executable, "-m", "spinf_worker.cli", "api", "--port",
                            str(port), "--log-level", "warning"], env=env, cwd=args.code)
    url = f"http://127.0.0.1:{port}"

    async def measure() -> list[dict]:
        stop = asyncio.Event()
        worker = asyncio.create_task(serve_worker(answering, prefix, stop))
        runs = []
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    ready = await asyncio.to_thread(httpx.get, f"{url}/readyz", timeout=5)
                    if ready.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or api.poll() is not None:
                    raise SystemExit("the API did not come up")
                await asyncio.sleep(0.2)
            await asyncio.to_thread(drive, url, bodies[:args.concurrency], args.concurrency,
                                    args.client_procs)
            for _ in range(args.repeat):
                before = process_cpu_s(api.pid)
                seconds = await asyncio.to_thread(drive, url, bodies, args.concurrency,
                                                  args.client_procs)
                api_cpu = process_cpu_s(api.pid) - before
                runs.append({"seconds": round(seconds, 3),
                             "requests_per_s": round(len(bodies) / seconds, 1),
                             "api_cpu_ms_per_request": round(1000 * api_cpu / len(bodies), 3)})
                print(json.dumps(runs[-1]), flush=True)
        finally:
            stop.set()
            await worker
        return runs

    try:
        runs = asyncio.run(measure())
    finally:
        api.terminate()
        api.wait(30)
    figures = {"code": str(args.code.resolve()), "requests": args.requests,
               "concurrency": args.concurrency, "client_procs": args.client_procs,
               "median_api_cpu_ms_per_request": statistics.median(
                   r["api_cpu_ms_per_request"] for r in runs),
               "median_requests_per_s": statistics.median(r["requests_per_s"] for r in runs),
               "runs": runs}
    text = json.dumps(figures, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

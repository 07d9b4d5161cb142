"""The host's work per lm-eval item on /v1/completions (one request per option) against
/v1/score (one request per item), with the model's forward left out: on a GPU host that work,
not the forward, bounds the completions path.

The items of benchmarks/completions_sharing.py (``--items`` contexts of 300 tokens, one
question, four one-token options) and its bodies (lm-eval's ``local-completions``: ``echo``,
``logprobs: 1``, ``max_tokens: 1``). The default model's engine on the CPU, its runner's
forward stubbed: a pass's readouts (option summands, echo logprobs and top-N) come back at
once, of the real shapes, so layout, merging, packing, splitting and response building are
the engine's real host work.

1. **stages**: each stage of a request timed alone, per request (µs): the API's parse,
   its check against the served tokenizer and the payload it queues; the worker's read of
   the entry and ``Engine.row_parts``; the engine's host work (``score_batch`` over a pass's
   worth of requests, the stubbed forward included); the worker's stored result; the API's
   read of it and its JSON reply.
2. **service**: the FastAPI app (called as ASGI, no sockets) with a real Redis and a Worker
   on the same event loop, as ``spinf-serve serve`` runs them; ``--concurrency`` requests at
   a time, each answered synchronously. Items/s and CPU µs per item; the ratio of the
   completions path to the score path is the figure to raise.

    python benchmarks/completions_host.py [--items 64] [--concurrency 64] [--out FILE]
    python benchmarks/completions_host.py --profile FILE   # cProfile of the service phase

``--code DIR``: measure another checkout's ``spinf_worker/`` and ``api/``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
REDIS_URL = os.environ.get("SPINF_REDIS_URL", "redis://127.0.0.1:6379/0")
PASS_ROWS = 16384            # the engine's pass on CUDA


COMMON_TOKENS = 8192         # top-N ids beside the next token are drawn from these


def stub_forward(engine, seed: int = 0) -> None:
    """The engine's runner answers a pass at once: every summand, echo logprob and top-N
    of the real shapes (random values). A row's most likely token is the one that follows
    it (a language model's often is), the rest of its top-N common tokens."""
    import torch

    from spinf_worker.engine.runner import PendingPass

    rng = np.random.default_rng(seed)
    vocab = int(engine.config.vocab_size)

    def launch(docs, keep_roots=()):
        n_terms = sum(len(d.block.term_readout) for d in docs)
        values = torch.from_numpy(-4 * rng.random(n_terms, dtype=np.float32))
        echo = {}
        for i, doc in enumerate(docs):
            if doc.echo is None:
                continue
            reads, top = len(doc.echo.next_ids), doc.echo.top
            token_lp = -8 * rng.random(reads, dtype=np.float32)
            top_lp = -np.sort(8 * rng.random((reads, top), dtype=np.float32), axis=1)
            top_ids = rng.integers(0, min(vocab, COMMON_TOKENS), (reads, top), dtype=np.int64)
            top_ids[:, 0] = np.where(doc.echo.next_ids >= 0, doc.echo.next_ids, top_ids[:, 0])
            echo[i] = tuple(torch.from_numpy(a) for a in (token_lp, top_lp, top_ids))
        return PendingPass(list(docs), values, torch.arange(n_terms), echo=echo)

    engine.runner.launch = launch


def per_us(fn, items: list, repeat: int = 1) -> float:
    """µs per item of ``fn`` over ``items`` (the best of ``repeat`` rounds)."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for item in items:
            fn(item)
        best = min(best, time.perf_counter() - started)
    return 1e6 * best / len(items)


def stages(engine, tokens, bodies: list[dict], kind: str, per_pass: int) -> dict:
    """Each stage of one request on its own, µs per request."""
    try:    # the API's reply of a result (api/routes/scoring.py), where it has its own
        from api.routes.scoring import ResultResponse as JSONResponse
    except ImportError:
        from starlette.responses import JSONResponse
    from spinf_worker import jsonio
    from spinf_worker.completions import CompletionRequest
    from spinf_worker.protocol import ScoreRequest
    from spinf_worker.queue.results import JobResult
    from spinf_worker.queue.worker import read_request
    from spinf_worker.request_limits import check_completion, check_request

    raws = [orjson.dumps(b) for b in bodies]
    if kind == "completions":
        def parse(raw):
            return CompletionRequest.parse(orjson.loads(raw))

        def check(request):
            check_completion(request, tokens)

        def payload(request):
            return jsonio.dumps({"model": request.model,
                                 "completion": request.model_dump(mode="json")})
    else:
        def parse(raw):
            return ScoreRequest.parse(orjson.loads(raw))

        def check(request):
            check_request(request, {}, tokens=tokens)

        def payload(request):
            return jsonio.dumps(request.model_dump(mode="json", exclude_none=True))

    def admit(payload):     # the worker's parse of an entry (Worker._parse)
        request = read_request(payload)
        engine.row_parts(request)
        return request

    requests = [parse(r) for r in raws]
    payloads = [payload(r) for r in requests]
    out = {"api_parse_us": per_us(parse, raws, 3), "api_check_us": per_us(check, requests, 3),
           "api_payload_us": per_us(payload, requests, 3),
           "worker_read_us": per_us(read_request, payloads, 3),
           "worker_read_row_parts_us": per_us(admit, payloads, 3)}
    queued = [admit(p) for p in payloads]
    batches = [queued[i:i + per_pass] for i in range(0, len(queued), per_pass)]
    engine.score_batch(batches[0])        # warm: floors, caches
    started = time.perf_counter()
    outcomes = [o for batch in batches for o in engine.score_batch(batch)]
    out["engine_us"] = 1e6 * (time.perf_counter() - started) / len(queued)

    def store(outcome):
        if kind == "completions":   # as the worker stores it (queue/worker.py)
            outcome = outcome.plain() if hasattr(outcome, "plain") else outcome.model_dump()
        return JobResult.ok(outcome).to_bytes()

    stored = [store(o) for o in outcomes]
    out["worker_result_us"] = per_us(store, outcomes, 3)
    out["api_reply_us"] = per_us(
        lambda raw: JSONResponse(JobResult.from_json(raw).body).body, stored, 3)
    out["total_us"] = sum(v for k, v in out.items() if k != "worker_read_us")
    return out


async def asgi_post(app, path: str, body: bytes, headers: tuple = ()) -> tuple[int, bytes]:
    """One POST through the ASGI app, as uvicorn hands it over (no sockets)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode()),
                         (b"x-sync-timeout", b"600"), *headers],
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000)}
    given = asyncio.Event()

    async def receive():
        if not given.is_set():
            given.set()
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()

    status, chunks = 0, []

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


async def service(engine, bodies: list[bytes], path: str, concurrency: int) -> dict:
    """Every body POSTed ``concurrency`` at a time to the app, answered by a Worker on the
    same loop; wall and CPU seconds (the engine thread's included)."""
    from api.app import create_app
    from spinf_worker.queue.keys import Keys
    from spinf_worker.queue.redis_client import connect
    from spinf_worker.queue.settings import ServiceSettings
    from spinf_worker.queue.worker import Worker

    prefix = f"bench-chost-{uuid.uuid4().hex[:8]}"
    keys = Keys(prefix)
    settings = ServiceSettings(redis_url=REDIS_URL, prefix=prefix, max_wait_ms=5,
                               max_pass_tokens=PASS_ROWS, max_backlog=len(bodies) + 100,
                               sync_timeout_s=600)
    app = create_app(settings)
    redis = connect(settings.redis_url)
    try:
        async with app.router.lifespan_context(app):
            worker = Worker(engine, redis, keys, settings, name="bench")
            stop = asyncio.Event()
            task = asyncio.create_task(worker.run(stop))
            while not await redis.hexists(keys.workers, worker.name):   # registered
                await asyncio.sleep(0.01)
            status, text = await asgi_post(app, path, bodies[0])    # warm-up (the tokenizer)
            assert status == 200, text[:300]
            limit = asyncio.Semaphore(concurrency)

            async def one(body: bytes) -> int:
                async with limit:
                    return (await asgi_post(app, path, body))[0]

            engine.busy_s = 0.0
            cpu, started = time.process_time(), time.perf_counter()
            statuses = await asyncio.gather(*(one(b) for b in bodies))
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu
            assert set(statuses) == {200}, statuses
            stop.set()
            await task
            return {"wall_s": wall, "cpu_s": cpu, "engine_s": engine.busy_s,
                    "passes": worker.passes - 1}
    finally:
        async for key in redis.scan_iter(match=f"{prefix}:*", count=1000):
            await redis.delete(key)
        await redis.aclose()


class TimedEngine:
    """The engine as the worker drives it, its host seconds counted (start_batch, read_back, respond)."""

    def __init__(self, engine):
        self._engine, self.busy_s = engine, 0.0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def start_batch(self, requests):
        started = time.perf_counter()
        batch = self._engine.start_batch(requests)
        self.busy_s += time.perf_counter() - started
        # the worker's two halves of finish: the read-back and the replies
        for name in ("read_back", "respond"):
            setattr(batch, name, self._timed(getattr(batch, name)))
        return batch

    def _timed(self, fn):
        def timed(*args):
            at = time.perf_counter()
            out = fn(*args)
            self.busy_s += time.perf_counter() - at
            return out
        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=64)
    parser.add_argument("--context-tokens", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--code", type=Path, help="a checkout whose spinf_worker/, api/ to measure")
    parser.add_argument("--profile", type=Path, help="cProfile of the service phases, here")
    parser.add_argument("--ways", default="completions,score", help="which paths to measure")
    parser.add_argument("--prompts-per-request", type=int, default=1, metavar="N",
                        help="completions: N (item, option) prompts in one request's list "
                             "(lm-eval's local-completions batch_size)")
    parser.add_argument("--no-stages", action="store_true", help="the service phase only")
    parser.add_argument("--out", type=Path, help="write the figures there as JSON too")
    args = parser.parse_args()
    if args.code is not None:
        sys.path.insert(0, str(args.code.resolve()))
    from completions_sharing import completion_bodies, items, score_bodies

    import spinf_worker
    from api.tokens import load
    from spinf_worker.engine import Engine, EngineSettings
    from spinf_worker.engine.engine import freeze_heap

    engine = Engine.load(device="cpu", settings=EngineSettings(max_pass_tokens=PASS_ROWS))
    stub_forward(engine)
    freeze_heap()     # as `serve` does once its engine is loaded
    tokens = load(engine.model_name)
    contexts = items(engine.checkpoint.tokenizer, args.items, args.context_tokens)
    ways = {"completions": ("/v1/completions", completion_bodies(engine.model_name, contexts)),
            "score": ("/v1/score", score_bodies(contexts))}
    options = len(ways["completions"][1]) // len(contexts)
    ways = {way: ways[way] for way in args.ways.split(",")}
    if args.prompts_per_request > 1 and "completions" in ways:
        singles, n = ways["completions"][1], args.prompts_per_request
        ways["completions"] = ("/v1/completions", [
            {**singles[i], "prompt": [b["prompt"] for b in singles[i:i + n]]}
            for i in range(0, len(singles), n)])
    figures: dict = {"code": str(Path(spinf_worker.__file__).parent), "items": args.items,
                     "context_tokens": args.context_tokens, "options": options,
                     "concurrency": args.concurrency, "pass_rows": PASS_ROWS,
                     "prompts_per_request": args.prompts_per_request}
    for way, (_, bodies) in ways.items() if not args.no_stages else ():
        figures[f"{way}_stages_us"] = stages(engine, tokens, bodies, way, args.concurrency)
    timed = TimedEngine(engine)
    profile = cProfile.Profile() if args.profile else None
    for way, (path, bodies) in ways.items():
        raws = [orjson.dumps(b) for b in bodies]
        runs = []
        for _ in range(args.repeat):
            with profile or contextlib.nullcontext():
                runs.append(asyncio.run(service(timed, raws, path, args.concurrency)))
        wall = statistics.median(r["wall_s"] for r in runs)
        cpu = statistics.median(r["cpu_s"] for r in runs)
        figures[f"{way}_service"] = {
            "items_per_s": args.items / wall, "requests": len(raws),
            "wall_us_per_request": 1e6 * wall / len(raws),
            "wall_us_per_item": 1e6 * wall / args.items,
            "cpu_us_per_item": 1e6 * cpu / args.items,
            "engine_us_per_item": 1e6 * statistics.median(r["engine_s"] for r in runs)
            / args.items, "runs": runs}
    for name in ("items_per_s", "cpu_us_per_item") if len(ways) == 2 else ():
        figures[f"completions_vs_score_{name}"] = (figures["completions_service"][name]
                                                   / figures["score_service"][name])
    if profile is not None:
        profile.dump_stats(args.profile)
    text = json.dumps(figures, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

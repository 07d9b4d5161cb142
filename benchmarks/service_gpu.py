"""The service at the engine's speed? In-process engine vs the real service on a GPU, one run.

The documents: the AG News sample and the news articles of ``../shared/data`` (each cut to
``--doc-tokens`` tokens), and windows of the articles' words, ``--docs`` distinct ones in
all, each asked the 56 questions of ``news_questions.json`` (options as given;
``--case-insensitive``: with their spellings, the API's default). Phases:

a. **engine**: the in-process engine (``Engine.load``), two warm-up ``score_batch`` calls of
   every document (the first computes the floors, the second packs without them: each pass
   size compiles before the timed call), the heap frozen as the worker freezes it
   (``freeze_heap``), then one timed ``score_batch`` of every document;
b. **batch**: the same documents as one bulk batch through ``/v1/files`` + ``/v1/batches`` on
   the real service: a private ``redis-server``, ``spinf-serve api`` (``--api-workers``
   processes) and one ``spinf-serve worker`` on the device, as separate processes;
c. **concurrent**: the documents as ``--clients`` concurrent ``POST /v1/score`` callers,
   spread over ``--client-procs`` client processes (so the client is not the bottleneck);
d. **interactive**: a trickle of single ``POST /v1/score`` requests (one every
   ``--trickle-ms``) while a second bulk batch of the documents runs: their p50 / p99 latency
   against the duration of one full pass (phase b's mean; and, as
   ``interactive_p99_over_engine_pass``, against the in-process engine's: the device's time
   on phase a's passes over their count); each single's timeline entry
   holds its send time, latency, and the ``queue_ms`` and ``score_ms`` of its reply (waiting
   in the stream; from its pass's start to its answer), the rest being the API's and the
   reply path's; ``interactive_bulk_of_batch``: that bulk batch's speed over phase b's.

``--phases`` picks among b, c and d (the warm-up runs regardless); the clients' CPU seconds
count from the phase's start barrier.

Every service answer is compared with the in-process one, bit for bit. Per phase: docs/s,
questions/s, the fraction of the wall time the device ran the passes (CUDA events: the
in-process engine's, and the worker's ``spinf_worker_busy_seconds_total``) and the worker's
engine thread worked on
them (``spinf_worker_engine_seconds_total``), the seconds the worker's cyclic collector ran
(``spinf_worker_gc_seconds_total``), CPU seconds of each tier (API processes, worker, Redis,
clients), and peak device memory (``nvidia-smi``, sampled, the worker's process and the
in-process engine's ``torch.cuda.max_memory_allocated``).

``{phase}_worker_steps``: the worker's own account of the phase (its log lines): each step
of its passes in milliseconds (median, 90th percentile), its reads' entries and parse times.

``--profile DIR`` records py-spy profiles of the worker process during each phase (py-spy on
the PATH): every thread's samples and, apart, those of whichever thread holds the
interpreter lock, as collapsed stacks.

``--load-format dummy`` with a directory holding config.json and tokenizer.json measures a
model's shapes with random weights (the same weights in-process and in the worker).

    python benchmarks/service_gpu.py --model DIR --load-format dummy --quant fp8 \\
        --redis-server PATH --data DIR --docs 2000 --out OUT
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# (service_http imports torch: its helpers are imported where used, so that the client
# processes, which re-import this module, start without it)

QUESTIONS = ROOT / "benchmarks" / "news_questions.json"
HTTP_TIMEOUT_S = 900.0
READY_TIMEOUT_S = 900.0
POLL_S = 0.01          # a batch is seen completed within this (the measurement's resolution)
WINDOW_WORDS = 150


def load_docs(data: Path, tokenizer, n: int, doc_tokens: int) -> list[str]:
    """n distinct documents: AG News items, the articles cut to doc_tokens tokens, then
    windows of the articles' words (stride chosen to reach n)."""
    ag = [json.loads(x) for x in (data / "ag_news_sample.jsonl").read_text().splitlines()]
    articles = [json.loads(x)["text"] for x in
                (data / "news_articles.jsonl").read_text().splitlines()]

    def cut(text: str) -> str:
        return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids[:doc_tokens])

    docs = [f"{a['title']}\n\n{a['description']}" for a in ag] + [cut(t) for t in articles]
    words = [t.split() for t in articles]
    total = sum(max(0, len(w) - WINDOW_WORDS) for w in words)
    stride = max(1, total // max(1, n - len(docs)))
    for w in words:
        docs += [" ".join(w[i:i + WINDOW_WORDS]) for i in range(0, len(w) - WINDOW_WORDS, stride)]
    docs = list(dict.fromkeys(docs))
    if len(docs) < n:
        raise SystemExit(f"only {len(docs)} distinct documents in {data}")
    return docs[:n]


def requests_for(docs: list[str], case_insensitive: bool = False) -> list[dict]:
    scoring = {**json.loads(QUESTIONS.read_text()), "case_insensitive": case_insensitive}
    return [{"messages": [{"role": "user", "content": d}], "scoring": scoring} for d in docs]


def questions_in(bodies: list[dict]) -> int:
    return sum(len(q["combinations"]) for b in bodies for r in b["results"] for q in r["queries"])


# ---- device memory and CPU ----------------------------------------------------------------


class MemorySampler:
    """nvidia-smi's used memory of the device, every 0.2 s, in a thread: the peak."""

    def __init__(self):
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                                      "--format=csv,noheader,nounits"], capture_output=True,
                                     text=True, timeout=10).stdout.split()
                self.peak_mib = max(self.peak_mib, float(out[0]))
            except (OSError, subprocess.SubprocessError, IndexError, ValueError):
                return
            self._stop.wait(0.2)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def tree_pids(pid: int) -> list[int]:
    """A process and its descendants (uvicorn's worker processes): every thread's children."""
    pids, frontier = [pid], [pid]
    while frontier:
        children = []
        for p in frontier:
            with contextlib.suppress(OSError):     # it ended
                for task in Path(f"/proc/{p}/task").iterdir():
                    children += [int(c) for c in (task / "children").read_text().split()]
        pids += children
        frontier = children
    return pids


def tier_cpu_s(tiers: dict[str, int]) -> dict[str, float]:
    from service_http import process_cpu_s

    out = {}
    for name, pid in tiers.items():
        total = 0.0
        for p in tree_pids(pid):
            with contextlib.suppress(OSError):
                total += process_cpu_s(p)
        out[name] = total
    return out


@contextlib.contextmanager
def profiled(out: Path | None, name: str, pid: int):
    """py-spy profiles of the worker process while a phase runs (``--profile``): every
    thread's samples, and those of whichever thread holds the interpreter lock (``--gil``),
    and every thread's with the waiting ones too (``--idle``: a thread waiting for the lock
    or for its queue), as collapsed stacks (``{name}-worker.txt``, ``{name}-worker-gil.txt``,
    ``{name}-worker-idle.txt``)."""
    if out is None:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    spies = [subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--threads",
                               "--nonblocking", "--rate", "200", "--format", "raw",
                               "--output", str(out / f"{name}-worker{tag}.txt"), *flags],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for tag, flags in (("", []), ("-gil", ["--gil"]), ("-idle", ["--idle"]))]
    time.sleep(1.0)      # attached before the phase starts
    try:
        yield
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(60)


# ---- the service ----------------------------------------------------------------------------


class Service:
    """A private redis-server, ``spinf-serve api`` and ``spinf-serve worker`` processes on
    the one device (``--device-workers``, one by default)."""

    def __init__(self, args: argparse.Namespace, tmp: Path, root: Path = ROOT):
        from service_http import free_port

        self.args, self.tmp, self.root = args, tmp, root
        self.port, self.redis_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.workers = ["worker"] + [f"worker{k}" for k in range(2, args.device_workers + 1)]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SPINF_")}
        self.env.update(PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
                        SPINF_REDIS_URL=f"redis://127.0.0.1:{self.redis_port}/0",
                        SPINF_SYNC_TIMEOUT_S=str(HTTP_TIMEOUT_S),
                        SPINF_LOAD_FORMAT=args.load_format,
                        SPINF_MAX_BACKLOG=str(10 * args.docs + 1000))
        if args.quant:
            self.env["SPINF_QUANT"] = args.quant
        if args.switch_interval_ms:
            self.env["SPINF_SWITCH_INTERVAL_MS"] = str(args.switch_interval_ms)
        for setting in args.setting:    # NAME=VALUE: the service's SPINF_NAME
            name, _, value = setting.partition("=")
            self.env[f"SPINF_{name.upper()}"] = value

    def _start(self, name: str, command: list[str]) -> None:
        log = (self.tmp / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(command, cwd=self.root, env=self.env,
                                            stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT)

    def start(self) -> None:
        self._start("redis", [self.args.redis_server, "--port", str(self.redis_port),
                              "--save", "", "--appendonly", "no", "--dir", str(self.tmp)])
        cli = [sys.executable, "-m", "spinf_worker.cli"]
        api = [*cli, "api", "--port", str(self.port), "--log-format", "json"]
        if self.args.api_workers > 1:
            api += ["--workers", str(self.args.api_workers)]
        time.sleep(0.5)
        self._start("api", api)
        # DEBUG: each read's parse time too (worker_steps)
        for name in self.workers:
            self._start(name, [*cli, "worker", "--model", self.args.model, "--device",
                               self.args.device, "--log-format", "json", "--log-level", "DEBUG"])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while time.monotonic() < deadline:
                for name, proc in self.procs.items():
                    if proc.poll() is not None:
                        raise RuntimeError(f"{name} exited {proc.returncode}: {self.tail(name)}")
                try:
                    # every worker serving (warmed up), not only the first
                    if client.get("/readyz").status_code == 200 and all(
                            self.logged(name, '"worker started"') for name in self.workers):
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        raise RuntimeError(f"not ready within {READY_TIMEOUT_S} s: {self.tail('worker')}")

    @contextlib.contextmanager
    def running(self):
        """Started and ready until the block ends; the tiers' logs on stderr if it fails."""
        try:
            self.start()
            self.wait_ready()
            yield self
        except Exception:
            for tier in ("worker", "api"):
                print(f"--- {tier} log ---\n{self.tail(tier)}", file=sys.stderr)
            raise
        finally:
            self.stop()

    def tail(self, name: str, n: int = 20) -> str:
        path = self.tmp / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""

    def logged(self, name: str, text: str) -> bool:
        """Whether a tier's log holds ``text`` so far."""
        path = self.tmp / f"{name}.log"
        return path.exists() and text in path.read_text(errors="replace")

    def worker_log_lines(self) -> list[dict]:
        """Every worker's JSON log lines."""
        return [x for name in self.workers for x in self.log_lines(name)]

    def log_lines(self, name: str) -> list[dict]:
        """A tier's JSON log lines."""
        path = self.tmp / f"{name}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return [json.loads(x) for x in lines if x.startswith("{")]

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}

    def stop(self) -> None:
        for name in (*self.workers, "api", "redis"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT if name != "redis" else signal.SIGTERM)
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def utc_now() -> str:
    """Now as the worker's log lines stamp it (ISO, UTC)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def worker_steps(lines: list[dict], since: str, until: str, requests_only: bool = False
                 ) -> dict:
    """Where the worker's passes of a phase (log lines timed in [since, until], ISO UTC)
    spent their time, step by step (the worker's "pass done" lines: milliseconds, median and
    90th percentile), and its reads' parse times ("entries read"). ``requests_only``: the
    passes that carried interactive requests alone."""
    def spread(values: list[float]) -> list[float]:
        values = sorted(values)
        return [round(statistics.median(values), 1),
                round(values[min(len(values) - 1, int(0.9 * len(values)))], 1)] if values else []

    within = [x for x in lines if since <= x.get("timestamp", "") <= until]
    passes = [x for x in within if x.get("event") == "pass done"
              and (not requests_only or x.get("requests"))]
    reads = [x for x in within if x.get("event") == "entries read"]
    steps = dict.fromkeys(k for x in passes for k in x if k.endswith("_ms"))
    return {"passes": len(passes),
            **{k: spread([x[k] for x in passes if k in x]) for k in steps},
            "reads": len(reads), "entries_per_read": spread([x["entries"] for x in reads]),
            "parse_ms": spread([x["parse_ms"] for x in reads])}


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    from service_http import parse_metrics

    return parse_metrics((await client.get("/metrics")).text)


async def post_score(client: httpx.AsyncClient, body: dict) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = await client.post("/v1/score", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"/v1/score answered {r.status_code}: {r.text[:300]}")
    return r.json(), time.perf_counter() - t0


async def run_batch(client: httpx.AsyncClient, requests: list[dict], tag: str) -> tuple[float, list]:
    seconds, batch = await submit_batch(client, requests, tag)
    return seconds, await batch_output(client, batch, requests, tag)


async def submit_batch(client: httpx.AsyncClient, requests: list[dict], tag: str
                       ) -> tuple[float, dict]:
    """The requests as one batch, waited for until it completes: (seconds, the batch)."""
    content = "".join(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST",
                                  "url": "/v1/score", "body": b}) + "\n"
                      for i, b in enumerate(requests)).encode()
    r = await client.post("/v1/files", data={"purpose": "batch"},
                          files={"file": (f"{tag}.jsonl", content, "application/jsonl")})
    r.raise_for_status()
    t0 = time.perf_counter()
    r = await client.post("/v1/batches", json={"input_file_id": r.json()["id"],
                                               "endpoint": "/v1/score",
                                               "completion_window": "24h"})
    r.raise_for_status()
    batch = r.json()
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        await asyncio.sleep(POLL_S)
        batch = (await client.get(f"/v1/batches/{batch['id']}")).json()
    seconds = time.perf_counter() - t0
    if batch["status"] != "completed":
        raise RuntimeError(f"batch ended {batch['status']}: {batch}")
    return seconds, batch


async def batch_output(client: httpx.AsyncClient, batch: dict, requests: list[dict], tag: str
                       ) -> list:
    """Each request's reply body, in order, from the completed batch's output file."""
    out = await client.get(f"/v1/files/{batch['output_file_id']}/content")
    rows = {row["custom_id"]: row for row in map(json.loads, out.text.splitlines())}
    if len(rows) != len(requests):
        raise RuntimeError(f"batch output has {len(rows)} lines, not {len(requests)}")
    return [rows[f"{tag}-{i}"]["response"]["body"] for i in range(len(requests))]


def _client_process(url: str, items: list[tuple[int, dict]], concurrency: int,
                    start: multiprocessing.Barrier, out: multiprocessing.Queue) -> None:
    """One client process: ``concurrency`` callers, each sending its next request when the
    last is answered. Starts when every client process is ready (imports done, connections
    open), so the phase times the service, not the processes' start."""
    async def main() -> tuple[list, float, float]:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        done = []
        async with httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT_S, limits=limits) as c:
            await asyncio.gather(*(c.get("/healthz") for _ in range(concurrency)))
            await asyncio.to_thread(start.wait)
            began, cpu0 = time.time(), time.process_time()

            async def caller() -> None:
                while not queue.empty():
                    i, body = queue.get_nowait()
                    got, seconds = await post_score(c, body)
                    done.append((i, got, seconds))
            await asyncio.gather(*(caller() for _ in range(concurrency)))
            return done, began, time.time(), time.process_time() - cpu0
    # CPU from the start barrier on: the process's start and imports are not the phase's
    done, began, ended, cpu_s = asyncio.run(main())
    out.put((done, cpu_s, began, ended))


def run_concurrent(url: str, requests: list[dict], clients: int, procs: int
                   ) -> tuple[float, list, float, dict]:
    """(seconds from the first request sent to the last answer, bodies in request order, the
    client processes' CPU seconds, where a request's time went: latency_shares)."""
    ctx = multiprocessing.get_context("spawn")
    out, start = ctx.Queue(), ctx.Barrier(procs)
    shares = [[(i, r) for i, r in enumerate(requests) if i % procs == p] for p in range(procs)]
    workers = [ctx.Process(target=_client_process, args=(url, s, clients // procs, start, out))
               for s in shares]
    for w in workers:
        w.start()
    results, cpu_s, began, ended = [], 0.0, [], []
    for _ in workers:
        done, used, first, last = out.get()
        results += done
        cpu_s += used
        began.append(first)
        ended.append(last)
    seconds = max(ended) - min(began)
    for w in workers:
        w.join()
    bodies = [None] * len(requests)
    for i, body, _ in results:
        bodies[i] = body
    return seconds, bodies, cpu_s, latency_shares([(s, body) for _, body, s in results])


def latency_shares(answers: list[tuple[float, dict]]) -> dict:
    """Of (latency in seconds, reply body) pairs: the p50 / p99 latency and the medians of
    each share of it: waiting in the stream for a pass (the reply's ``timing.queue_ms``), the
    pass to the answer (``score_ms``), and the rest (the API, the stores after the pass and
    the reply path, the client)."""
    latencies = sorted(s for s, _ in answers)
    shares = [(t["queue_ms"], t["score_ms"], s * 1000 - t["queue_ms"] - t["score_ms"])
              for s, body in answers if (t := body.get("timing") or {}).get("queue_ms")
              is not None and t.get("score_ms") is not None]
    columns = list(zip(*shares, strict=True)) if shares else [(), (), ()]
    return dict(p50_s=statistics.median(latencies) if latencies else None,
                p99_s=latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
                if latencies else None,
                **{f"{name}_p50_ms": round(statistics.median(column), 1) if column else None
                   for name, column in zip(("queue", "score", "rest"), columns, strict=True)})


async def run_interactive(client: httpx.AsyncClient, requests: list[dict], trickle_s: float
                          ) -> dict:
    """A bulk batch of every document, and meanwhile one single request every trickle_s. The
    batch's output is read only after the last single is answered: reading and parsing it
    in this client's one event loop would delay the singles' replies by seconds."""
    batch = asyncio.create_task(submit_batch(client, requests, "bulk2"))
    singles, sent, k = [], [], 0
    t0 = time.perf_counter()
    while not batch.done():
        body = dict(requests[k % len(requests)])
        singles.append(asyncio.create_task(post_score(client, body)))
        sent.append(time.perf_counter() - t0)
        k += 1
        await asyncio.sleep(trickle_s)
    seconds, _ = await batch
    # each request: (seconds after the batch was submitted, its latency, and of it the ms it
    # waited in the stream for its pass and the ms from that pass's start to its answer), to
    # place outliers and tell the worker's share from the API's and the reply path's
    timeline, answers = [], []
    for at, task in zip(sent, singles, strict=True):
        body, s = await task
        answers.append((s, body))
        timing = body.get("timing") or {}
        timeline.append([round(at, 3), round(s, 4), timing.get("queue_ms"),
                         timing.get("score_ms")])
    return dict(batch_seconds=seconds, singles=len(answers), timeline=timeline,
                **latency_shares(answers))


# ---- phases -------------------------------------------------------------------------------


def run_engine(args: argparse.Namespace, requests: list[dict]) -> dict:
    import torch

    from spinf_worker.engine import Engine
    from spinf_worker.engine.engine import EngineSettings, freeze_heap

    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    engine = Engine.load(args.model, device=args.device,
                         settings=EngineSettings(scheme=args.quant), load_format=args.load_format)
    engine.score_batch(requests)                 # floors, compiled kernels, graphs
    engine.score_batch(requests)                 # without the floors: other pass sizes
    freeze_heap()      # as the worker does once its engine is loaded: the same collector work
    t0 = time.perf_counter()
    batch = engine.start_batch(requests)         # score_batch, its device time kept
    responses = batch.finish()                   # answers are on the host: the device is done
    seconds = time.perf_counter() - t0
    device_s = batch.device_seconds
    passes = batch.scheduler.passes
    bodies = [r.model_dump(mode="json") for r in responses]
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    tokenizer = engine.checkpoint.tokenizer
    del engine, responses, batch
    import gc

    # the frozen heap holds the engine (its weights on the device) past its last reference:
    # the service phases' memory is the worker's alone only once it is collected
    gc.unfreeze()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return dict(seconds=seconds, bodies=bodies, peak_allocated_gib=round(peak, 2),
                tokenizer=tokenizer, passes=passes,
                mean_pass_s=None if device_s is None else round(device_s / passes, 4),
                gpu_busy=None if device_s is None else round(device_s / seconds, 3))


def phase(name: str, seconds: float, bodies: list, reference: list, busy_s: float,
          engine_s: float, cpu: dict[str, float]) -> dict:
    from service_http import compare

    same, worst, fingerprint = compare(reference, bodies)
    return {f"{name}_seconds": round(seconds, 3),
            f"{name}_docs_per_s": round(len(bodies) / seconds, 1),
            f"{name}_questions_per_s": round(questions_in(bodies) / seconds, 1),
            f"{name}_gpu_busy": round(busy_s / seconds, 3),
            f"{name}_engine_thread_busy": round(engine_s / seconds, 3),
            f"{name}_bit_identical": same, f"{name}_max_abs_diff": worst,
            f"{name}_same_fingerprint": fingerprint,
            **{f"{name}_cpu_s_{tier}": round(s, 2) for tier, s in cpu.items()}}


async def run_service(args: argparse.Namespace, service: Service, requests: list[dict],
                      reference: list) -> dict:
    row: dict = {}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=service.url, timeout=HTTP_TIMEOUT_S,
                                 limits=limits) as client:
        # every pass size the phases will use compiles (and is captured) here: full passes
        # of a batch, and the smaller ones of callers arriving one by one
        await run_batch(client, requests, "warm")
        warm = requests[:2 * args.clients]
        await asyncio.to_thread(run_concurrent, service.url, warm, args.clients,
                                args.client_procs)
        for body in requests[:8]:
            await post_score(client, body)

        async def measured(name: str, run) -> dict:
            m0, c0 = await metrics(client), tier_cpu_s(service.pids())
            own0 = time.process_time()
            since = utc_now()
            with profiled(args.profile, name, service.pids()["worker"]):
                seconds, bodies, client_cpu, shares = await run()
            until = utc_now()
            m1, c1 = await metrics(client), tier_cpu_s(service.pids())
            cpu = {k: c1[k] - c0[k] for k in c0}
            cpu["client"] = client_cpu + time.process_time() - own0
            busy, engine, collector = (m1.get(f"spinf_worker_{k}_seconds_total", 0)
                                       - m0.get(f"spinf_worker_{k}_seconds_total", 0)
                                       for k in ("busy", "engine", "gc"))
            passes, rows = (m1.get(k, 0) - m0.get(k, 0)
                            for k in ("spinf_passes_total", "spinf_pass_rows_total"))
            out = phase(name, seconds, bodies, reference, busy, engine, cpu)
            out[f"{name}_worker_gc_s"] = round(collector, 3)
            out.update({f"{name}_{k}": (round(v, 4) if isinstance(v, float) else v)
                        for k, v in shares.items()})
            out[f"{name}_passes"] = int(passes)
            out[f"{name}_mean_pass_s"] = round(busy / passes, 4) if passes else None
            # how full the worker's passes are (partial ones go to a starved device)
            out[f"{name}_rows_per_pass"] = round(rows / passes) if passes else None
            out[f"{name}_worker_steps"] = worker_steps(service.worker_log_lines(), since, until)
            return out

        async def batch():
            seconds, bodies = await run_batch(client, requests, "bulk")
            return seconds, bodies, 0.0, {}

        async def concurrent():
            return await asyncio.to_thread(run_concurrent, service.url, requests,
                                           args.clients, args.client_procs)

        if "batch" in args.phases:
            row.update(await measured("batch", batch))
        if "concurrent" in args.phases:
            row.update(await measured("concurrent", concurrent))
        if "interactive" not in args.phases:
            return row
        # the earlier phases' replies frozen out of the collector's walks: once this
        # process's loop stalled ~0.9 s (its trickle stopped sending; the service had
        # answered), most likely a full collection over them
        gc.collect()
        gc.freeze()
        m0, since = await metrics(client), utc_now()
        inter = await run_interactive(client, requests, args.trickle_ms / 1000)
        m1, until = await metrics(client), utc_now()
        # the passes that carried the single requests, step by step
        row["interactive_worker_steps"] = worker_steps(service.worker_log_lines(), since,
                                                       until, requests_only=True)
        passes = m1.get("spinf_passes_total", 0) - m0.get("spinf_passes_total", 0)
        busy = m1.get("spinf_worker_busy_seconds_total", 0) - \
            m0.get("spinf_worker_busy_seconds_total", 0)
        mean_pass = busy / passes if passes else None
        row.update({f"interactive_{k}": (round(v, 4) if isinstance(v, float) else v)
                    for k, v in inter.items()})
        row["interactive_mean_pass_s"] = round(mean_pass, 4) if mean_pass else None
        # "one pass": a full pass of the bulk job, phase (b)'s mean (the interactive phase's
        # own mean mixes in the short passes that carry the requests)
        full_pass = row.get("batch_mean_pass_s")
        if full_pass and inter["p99_s"]:
            row["interactive_p99_over_pass"] = round(inter["p99_s"] / full_pass, 2)
        if row.get("batch_seconds"):    # the bulk job's speed beside the requests, of (b)'s
            row["interactive_bulk_of_batch"] = round(row["batch_seconds"]
                                                     / inter["batch_seconds"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", required=True, help="model id or HF directory")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--quant", default="fp8")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--redis-server", default="redis-server")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--doc-tokens", type=int, default=470)
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--client-procs", type=int, default=4)
    parser.add_argument("--api-workers", type=int, default=1)
    parser.add_argument("--device-workers", type=int, default=1,
                        help="worker processes sharing the device (each with an interpreter "
                             "lock of its own); their busy times and steps are summed, their "
                             "CPU told per process")
    parser.add_argument("--case-insensitive", action="store_true",
                        help="options with their spellings summed (the API's default)")
    parser.add_argument("--trickle-ms", type=float, default=200.0)
    parser.add_argument("--phases", type=lambda s: s.split(","),
                        default=["batch", "concurrent", "interactive"],
                        help="the service's phases to measure, comma-separated (b: batch, "
                             "c: concurrent, d: interactive); the warm-up runs regardless")
    parser.add_argument("--name", default=None, help="the row's name (default: model + quant)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="the worker's interpreter switch interval (default: Python's)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="a directory for py-spy profiles of the worker in each phase")
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                        help="a service setting (docs/SERVICE.md) for the API and workers, "
                             "as SPINF_NAME; repeatable")
    args = parser.parse_args()
    name = args.name or f"{Path(args.model).name}-{args.quant}"
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                           capture_output=True, text=True).stdout.strip()
    from tokenizers import Tokenizer

    from spinf_worker.models.loader import load_checkpoint

    tokenizer = load_checkpoint(args.model, load_format="dummy").tokenizer \
        if args.load_format == "dummy" else load_checkpoint(args.model).tokenizer
    assert isinstance(tokenizer, Tokenizer)
    requests = requests_for(load_docs(args.data, tokenizer, args.docs, args.doc_tokens),
                            args.case_insensitive)
    row = {"date": datetime.date.today().isoformat(), "commit": commit, "name": name,
           "model": args.model, "load_format": args.load_format, "quant": args.quant,
           "docs": len(requests), "api_workers": args.api_workers, "clients": args.clients,
           "client_procs": args.client_procs,
           "switch_interval_ms": args.switch_interval_ms, "settings": args.setting,
           "device_workers": args.device_workers,
           "case_insensitive": args.case_insensitive}
    with MemorySampler() as engine_memory:
        engine = run_engine(args, requests)
    reference = engine.pop("bodies")
    engine.pop("tokenizer")
    row.update(engine_seconds=round(engine["seconds"], 3),
               engine_docs_per_s=round(len(reference) / engine["seconds"], 1),
               engine_questions_per_s=round(questions_in(reference) / engine["seconds"], 1),
               engine_gpu_busy=engine["gpu_busy"],
               engine_passes=engine["passes"], engine_mean_pass_s=engine["mean_pass_s"],
               engine_peak_allocated_gib=engine["peak_allocated_gib"],
               engine_nvidia_smi_peak_gib=round(engine_memory.peak_mib / 1024, 2))
    print(json.dumps(row), flush=True)
    with tempfile.TemporaryDirectory(prefix="spinf-service-gpu-") as tmp:
        with MemorySampler() as service_memory, Service(args, Path(tmp)).running() as service:
            row.update(asyncio.run(run_service(args, service, requests, reference)))
        row["service_nvidia_smi_peak_gib"] = round(service_memory.peak_mib / 1024, 2)
    for key in set(args.phases) & {"batch", "concurrent"}:
        row[f"{key}_vs_engine"] = round(row[f"{key}_questions_per_s"]
                                        / row["engine_questions_per_s"], 3)
    # the p99 against the in-process engine's pass too: with several worker processes on
    # the device, a worker's pass lasts longer than the device's work on it
    if row.get("engine_mean_pass_s") and row.get("interactive_p99_s"):
        row["interactive_p99_over_engine_pass"] = round(
            row["interactive_p99_s"] / row["engine_mean_pass_s"], 2)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{row['date']}-service-gpu-{name}-{commit}.json"
    path.write_text(json.dumps(row, indent=1))
    for key, value in row.items():
        print(f"| {key} | {value} |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

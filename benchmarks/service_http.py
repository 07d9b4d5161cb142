"""Service throughput over HTTP against the in-process engine, in one run (CPU, default model).

The job set of ``cpu_news_job.py``: the first 24 articles of ``../shared/data/news_articles.jsonl``
(each cut to its first 470 tokens) x the 56 two-option questions of ``news_questions.json``.

1. **engine**: ``Engine.load(None, device="cpu")``, a warm-up call on one short document (it
   computes the floor values), then one timed ``score_batch`` of the 24 requests.
2. **service**: ``spinf-serve serve --device cpu`` as a subprocess (private redis-server, a
   fresh state dir, ``SPINF_SYNC_TIMEOUT_S`` raised so that /v1/score answers synchronously),
   warmed up with one short document, then
   - **concurrent**: the 24 requests as 24 concurrent ``POST /v1/score``, timed from the first
     send to the last response;
   - **batch**: the 24 requests as one JSONL file (``POST /v1/files``), one ``POST /v1/batches``,
     timed from the batch creation to the poll that sees it ``completed``; the output file must
     hold 24 lines with status 200.
   Every HTTP result is compared with the in-process one (option logprobs, exactly).
3. The service is stopped with SIGINT; a table goes to stdout and the flat figures to
   ``<out>/<date>-service-<commit>.json``.

Both sides run the same code: a snapshot of ``spinf_worker/`` and ``api/`` taken at the start
(``git archive HEAD``, or the working tree with ``--tree worktree``), so edits made in the checkout
while the benchmark runs do not end up on one side only. CPU seconds of the machine as a whole
are sampled per phase: ``other_cpu_share`` is what processes other than the benchmark and the
service used (redis-server included), a sign of a disturbed measurement.

Options are scored exactly as given (``"case_insensitive": false``: the work of the figures in
RESULTS.md); ``--case-insensitive`` sends the hosted default instead (each option also scored
as its single-token case and leading-space spellings). The JSON says which ran.

Target: the service delivers >= 90% of the in-process engine's throughput.

    /work/venv/bin/python benchmarks/service_http.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import torch

if TYPE_CHECKING:    # imported at run time from the snapshot (see main)
    from spinf_worker.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("spinf_worker", "api")   # what the engine and the service import from the project

ARTICLES = ROOT.parent / "shared" / "data" / "news_articles.jsonl"
QUESTIONS = ROOT / "benchmarks" / "news_questions.json"
DOC_TOKENS = 470                 # as in cpu_news_job.py
TARGET_RATIO = 0.90
HTTP_TIMEOUT_S = 900.0           # one request may wait for the whole job set
READY_TIMEOUT_S = 600.0          # the first start converts the model once
POLL_S = 0.1
STOP_TIMEOUT_S = 120.0


def sh(cmd: str) -> str:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=ROOT).stdout.strip()


def cpu_model() -> str:
    line = next(x for x in sh("lscpu").splitlines() if x.startswith("Model name:"))
    return line.split(":", 1)[1].strip()


def snapshot(tree: str, commit: str, dest: Path) -> None:
    """The project's packages as of ``commit`` (``git archive``) or of the working tree."""
    dest.mkdir(parents=True)
    if tree == "head":
        archive = subprocess.run(["git", "archive", commit, *SOURCES], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    else:
        for name in SOURCES:
            shutil.copytree(ROOT / name, dest / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def machine_busy_s() -> float:
    """CPU seconds all processes of the machine have used so far (/proc/stat, all cores)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(
        int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def load_docs(engine: Engine, n: int) -> list[str]:
    """The first n articles, each cut to its first DOC_TOKENS tokens (as cpu_news_job.py)."""
    lines = ARTICLES.read_text(encoding="utf-8").splitlines()[:n]
    texts = [json.loads(line)["text"] for line in lines]
    return [engine.checkpoint.tokenizer.decode(list(engine.presenter.encode(t)[:DOC_TOKENS]))
            for t in texts]


def logprobs_of(body: dict) -> list[list[list[float]]]:
    """Per input, per scored query, per combination, the options' logprobs, from a response
    body (dict), flattened over the inputs."""
    return [[[o["logprob"] for o in c["options"]] for c in q["combinations"]]
            for result in body["results"] for q in result["queries"] if "kind" not in q]


def compare(reference: list[dict], got: list[dict]) -> tuple[bool, float, bool]:
    """(all option logprobs identical, max |difference|, same system_fingerprint)."""
    same, worst, fingerprints = True, 0.0, True
    for ref, body in zip(reference, got, strict=True):
        fingerprints &= ref["system_fingerprint"] == body["system_fingerprint"]
        a, b = logprobs_of(ref), logprobs_of(body)
        same &= a == b
        for qa, qb in zip(a, b, strict=True):
            for ca, cb in zip(qa, qb, strict=True):
                worst = max([worst, *(abs(x - y) for x, y in zip(ca, cb, strict=True))])
    return same, worst, fingerprints


# ---- in-process engine ------------------------------------------------------------------


def run_engine(engine: Engine, requests: list[dict], warmup: dict) -> dict:
    from spinf_worker.engine.packer import pack
    from spinf_worker.protocol import ScoreResponse

    t0 = time.perf_counter()
    engine.score_batch([warmup])        # computes the floors of the 56 questions
    warmup_s = time.perf_counter() - t0

    threads0 = thread_cpu_s(os.getpid())
    t0, c0, m0 = time.perf_counter(), time.process_time(), machine_busy_s()
    responses = engine.score_batch(requests)
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    other_s = machine_busy_s() - m0 - cpu_s
    threads = busy_threads(threads0, thread_cpu_s(os.getpid()))
    for r in responses:
        if not isinstance(r, ScoreResponse):
            raise RuntimeError(f"engine returned an error: {r!r}")
    flats = [d.flat for p in engine.preparer.prepare_batch(requests)   # what score_batch packed
             for d in p.docs]
    passes = pack(flats, engine.settings.max_pass_tokens)
    return dict(seconds=seconds, cpu_s=cpu_s, other_cpu_s=other_s, warmup_s=warmup_s,
                threads=threads,
                bodies=[r.model_dump(mode="json") for r in responses],
                passes=len(passes), doc_rows=[f.length for f in flats],
                fill=sum(f.tokens for f in flats) / sum(p.rows for p in passes),
                max_pass_tokens=engine.settings.max_pass_tokens)


# ---- the service ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far of each thread of a process (thread id -> seconds)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:          # the thread ended
            continue
        out[task.name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def busy_threads(before: dict[str, float], after: dict[str, float]) -> str:
    """CPU seconds per thread between two samples, threads above 0.5 s, busiest first:
    which threads the passes ran on (each thread that runs torch ops has its own OpenMP team)."""
    used = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)
    return "/".join(f"{x:.1f}" for x in used if x >= 0.5)


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r"(spinf_[a-z_]+) ([-+0-9.eE]+|NaN)", line.strip())
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


class Service:
    """``python -m spinf_worker.cli serve`` on a free port and a fresh state dir."""

    def __init__(self, src: Path, state_dir: Path, port: int, model: str | None = None):
        self.src = src
        self.state_dir = state_dir
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = state_dir / "serve.log"
        self.process: subprocess.Popen | None = None
        self.command = [sys.executable, "-m", "spinf_worker.cli", "serve", "--port", str(port),
                        "--state-dir", str(state_dir / "state"), "--device", "cpu",
                        "--log-format", "json"] + (["--model", model] if model else [])

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPINF_")}
        # the snapshot first; a PYTHONPATH of the caller's (site packages of a bare host) after it
        env.update(PYTHONPATH=os.pathsep.join(
                       [str(self.src)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
                   # /v1/score waits for its result (X-Sync-Timeout can only shorten this)
                   SPINF_SYNC_TIMEOUT_S=str(HTTP_TIMEOUT_S))
        # the service must import the snapshot, not the checkout (python -m puts cwd first)
        check = subprocess.run([sys.executable, "-c", "import api, spinf_worker; "
                                "print(spinf_worker.__file__); print(api.__file__)"],
                               cwd=self.src, env=env, capture_output=True, text=True, check=True)
        if not all(Path(f).is_relative_to(self.src) for f in check.stdout.split()):
            raise RuntimeError(f"the service would not import the snapshot: {check.stdout}")
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(self.command, cwd=self.src, env=env,
                                        stdin=subprocess.DEVNULL, stdout=self._log,
                                        stderr=subprocess.STDOUT)

    def wait_ready(self) -> float:
        t0 = time.perf_counter()
        deadline = time.monotonic() + READY_TIMEOUT_S
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the service exited with {self.process.returncode}: "
                                       f"{self.log_tail()}")
                try:
                    if client.get("/ready").status_code == 200:
                        return time.perf_counter() - t0
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the service was not ready within {READY_TIMEOUT_S} s: "
                                       f"{self.log_tail()}")
                time.sleep(0.2)

    def log_offset(self) -> int:
        self._log.flush()
        return self.log_path.stat().st_size

    def pass_events(self, start: int, end: int | None = None) -> list[dict]:
        """The worker's "pass done" log events written between two log offsets."""
        with self.log_path.open("rb") as f:
            f.seek(start)
            data = f.read() if end is None else f.read(end - start)
        events = []
        for line in data.decode(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and event.get("event") == "pass done":
                events.append(event)
        return events

    def log_tail(self, n: int = 15) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self) -> int | None:
        """SIGINT (graceful), then wait; a second SIGINT / SIGKILL when it does not stop."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print("service did not stop after SIGINT; killing it", file=sys.stderr)
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


async def score_one(client: httpx.AsyncClient, body: dict) -> tuple[dict, float]:
    """POST /v1/score; follow the job when it answers 202. (response body, seconds)."""
    t0 = time.perf_counter()
    r = await client.post("/v1/score", json=body,
                          headers={"X-Sync-Timeout": str(HTTP_TIMEOUT_S)})
    if r.status_code == 202:
        job_url = r.json()["url"]
        while True:
            await asyncio.sleep(POLL_S)
            job = (await client.get(job_url)).json()
            if job.get("status_code") is not None:
                if job["status_code"] != 200:
                    raise RuntimeError(f"job failed: {job}")
                return job["response"], time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"/v1/score answered {r.status_code}: {r.text[:500]}")
    return r.json(), time.perf_counter() - t0


def pass_log(service: Service, offset: int) -> dict:
    events = service.pass_events(offset)
    return dict(calls=[e.get("docs") for e in events],
                pass_seconds=[float(e.get("seconds") or 0.0) for e in events])


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    return parse_metrics((await client.get("/metrics")).text)


def metric_delta(before: dict, after: dict) -> dict:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return dict(worker_calls=int(d.get("spinf_passes_total", 0)),
                worker_busy_s=d.get("spinf_worker_busy_seconds_total", 0.0),
                docs=int(d.get("spinf_documents_total", 0)))


async def run_concurrent(service: Service, client: httpx.AsyncClient,
                         requests: list[dict]) -> dict:
    before, offset = await metrics(client), service.log_offset()
    threads0 = thread_cpu_s(service.process.pid)
    cpu0, own0, m0 = process_cpu_s(service.process.pid), time.process_time(), machine_busy_s()
    t0 = time.perf_counter()
    done = await asyncio.gather(*(score_one(client, r) for r in requests))
    seconds = time.perf_counter() - t0
    cpu_s = process_cpu_s(service.process.pid) - cpu0
    other_s = machine_busy_s() - m0 - cpu_s - (time.process_time() - own0)
    threads = busy_threads(threads0, thread_cpu_s(service.process.pid))
    await asyncio.sleep(0.5)     # the worker logs "pass done" just after it answers
    latencies = [s for _, s in done]
    return dict(seconds=seconds, bodies=[b for b, _ in done], service_cpu_s=cpu_s,
                other_cpu_s=other_s, threads=threads,
                latency_min_s=min(latencies), latency_median_s=statistics.median(latencies),
                latency_max_s=max(latencies),
                **pass_log(service, offset), **metric_delta(before, await metrics(client)))


async def run_batch(service: Service, client: httpx.AsyncClient, requests: list[dict]) -> dict:
    lines = [{"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/score", "body": body}
             for i, body in enumerate(requests)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    t_upload = time.perf_counter()
    r = await client.post("/v1/files", data={"purpose": "batch"},
                          files={"file": ("news.jsonl", content, "application/jsonl")})
    r.raise_for_status()
    file_id = r.json()["id"]
    upload_s = time.perf_counter() - t_upload

    before, offset = await metrics(client), service.log_offset()
    threads0 = thread_cpu_s(service.process.pid)
    cpu0, own0, m0 = process_cpu_s(service.process.pid), time.process_time(), machine_busy_s()
    t0 = time.perf_counter()
    r = await client.post("/v1/batches", json={"input_file_id": file_id,
                                               "endpoint": "/v1/score",
                                               "completion_window": "24h"})
    r.raise_for_status()
    batch = r.json()
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        await asyncio.sleep(POLL_S)
        batch = (await client.get(f"/v1/batches/{batch['id']}")).json()
    seconds = time.perf_counter() - t0
    cpu_s = process_cpu_s(service.process.pid) - cpu0
    other_s = machine_busy_s() - m0 - cpu_s - (time.process_time() - own0)
    threads = busy_threads(threads0, thread_cpu_s(service.process.pid))
    await asyncio.sleep(0.5)     # the worker logs "pass done" just after it answers
    if batch["status"] != "completed":
        raise RuntimeError(f"batch ended {batch['status']}: {batch}")

    out = await client.get(f"/v1/files/{batch['output_file_id']}/content")
    out.raise_for_status()
    rows = [json.loads(x) for x in out.text.splitlines() if x.strip()]
    by_id = {row["custom_id"]: row for row in rows}
    ok = (len(rows) == len(requests) and set(by_id) == {x["custom_id"] for x in lines}
          and all(row["response"] and row["response"]["status_code"] == 200 for row in rows))
    if not ok:
        raise RuntimeError(f"batch output: {len(rows)} lines, expected {len(requests)} with "
                           f"status 200; counts {batch.get('request_counts')}")
    return dict(seconds=seconds, upload_s=upload_s, service_cpu_s=cpu_s, other_cpu_s=other_s,
                threads=threads, output_lines=len(rows),
                bodies=[by_id[x["custom_id"]]["response"]["body"] for x in lines],
                **pass_log(service, offset), **metric_delta(before, await metrics(client)))


async def run_http(service: Service, requests: list[dict], warmup: dict) -> dict:
    limits = httpx.Limits(max_connections=len(requests) + 8,
                          max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(base_url=service.url, timeout=HTTP_TIMEOUT_S,
                                 limits=limits) as client:
        t0 = time.perf_counter()
        await score_one(client, warmup)      # floors and kernels of the worker's engine
        warmup_s = time.perf_counter() - t0
        concurrent = await run_concurrent(service, client, requests)
        batch = await run_batch(service, client, requests)
    return dict(warmup_s=warmup_s, concurrent=concurrent, batch=batch)


# ---- report -----------------------------------------------------------------------------


def markdown(r: dict, command: str) -> str:
    rows = [
        ("in-process engine (`score_batch`)", "engine", f"{r['engine_passes']} engine passes "
         f"(max_pass_tokens {r['max_pass_tokens']}, fill {r['engine_pass_fill_ratio']:.3f})"),
        (f"HTTP, {r['docs']} concurrent `POST /v1/score`", "http_concurrent",
         f"{r['http_concurrent_worker_calls']} worker passes, docs per pass "
         f"{r['http_concurrent_docs_per_worker_pass']}"),
        ("HTTP, one bulk batch (`/v1/batches`)", "http_batch",
         f"{r['http_batch_worker_calls']} worker passes, docs per pass "
         f"{r['http_batch_docs_per_worker_pass']}"),
    ]
    table = ["| | seconds | docs/s | questions/s | vs engine | notes |",
             "|---|---|---|---|---|---|"]
    for name, key, note in rows:
        ratio = "1" if key == "engine" else f"{r[f'{key}_ratio']:.3f}"
        table.append(f"| {name} | {r[f'{key}_seconds']:.2f} | {r[f'{key}_docs_per_s']:.3f} | "
                     f"{r[f'{key}_questions_per_s']:.2f} | {ratio} | {note} |")
    met = min(r["http_concurrent_ratio"], r["http_batch_ratio"]) >= TARGET_RATIO
    return "\n".join([
        f"## {r['date']} — service over HTTP vs. in-process engine (CPU), commit "
        f"`{r['commit']}`" + (" + uncommitted changes" if r["measured_tree"] == "worktree"
                              and r["worktree_dirty"] else ""),
        "",
        f"- machine: {r['machine']}, torch {r['torch']}, {r['threads']} threads "
        f"(1-min load average at start: {r['load_avg_1m_at_start']:.2f})",
        f"- command: `{command}`",
        f"- model: {r['model']} (fp32 on the CPU); job set: {r['docs']} news articles (first {DOC_TOKENS} tokens) x "
        f"{r['questions_per_doc']} questions; {r['tokens_read']} tokens read; options "
        + ("case-insensitively (the hosted default)" if r.get("case_insensitive")
           else "exactly as given (case_insensitive false)"),
        "",
        *table,
        "",
        f"- target (both HTTP figures >= {TARGET_RATIO:.0%} of the engine): "
        f"**{'met' if met else 'NOT met'}**",
        f"- HTTP results identical to the in-process ones (option logprobs, all "
        f"{r['docs']} docs): concurrent {r['identical_concurrent']}, batch "
        f"{r['identical_batch']}; same system_fingerprint: {r['same_fingerprint']}",
        f"- worker busy in `score_batch`: concurrent {r['http_concurrent_worker_busy_s']:.2f} s "
        f"of {r['http_concurrent_seconds']:.2f} s, batch {r['http_batch_worker_busy_s']:.2f} s "
        f"of {r['http_batch_seconds']:.2f} s",
        f"- CPU share (CPU s / (wall s x {r['cores']} cores)): engine "
        f"{r['engine_cpu_share']:.2f}, service concurrent {r['http_concurrent_cpu_share']:.2f}, "
        f"service batch {r['http_batch_cpu_share']:.2f}; other processes "
        f"{r['engine_other_cpu_share']:.2f} / {r['http_concurrent_other_cpu_share']:.2f} / "
        f"{r['http_batch_other_cpu_share']:.2f}",
        f"- code measured: {r['measured_tree']} (a snapshot of spinf_worker/ and api/ taken at "
        "the start; both sides ran it)",
        f"- worker pass seconds: concurrent {r['http_concurrent_worker_pass_seconds']}, batch "
        f"{r['http_batch_worker_pass_seconds']}",
        f"- CPU seconds per thread (> 0.5 s): engine {r['engine_thread_cpu_s']}; service "
        f"concurrent {r['http_concurrent_thread_cpu_s']}, batch {r['http_batch_thread_cpu_s']}",
        f"- concurrent request latency: min {r['http_concurrent_latency_min_s']:.1f} s, median "
        f"{r['http_concurrent_latency_median_s']:.1f} s, max "
        f"{r['http_concurrent_latency_max_s']:.1f} s",
        f"- not timed: engine warm-up {r['engine_warmup_s']:.1f} s, service start to /ready "
        f"{r['service_ready_s']:.1f} s, HTTP warm-up {r['http_warmup_s']:.1f} s, batch file "
        f"upload {r['http_batch_upload_s']:.2f} s",
        "", ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--model", default=None,
                    help="model for the engine and the service (default: the packaged one)")
    ap.add_argument("--tree", choices=("head", "worktree"), default="head",
                    help="measure the committed HEAD (default) or the working tree as it is "
                         "at the start")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--case-insensitive", action="store_true",
                    help="send the hosted default (options over their case and leading-space "
                         "spellings); default: the options exactly as given")
    args = ap.parse_args()
    load_at_start = os.getloadavg()[0]   # other work on the machine skews every figure
    commit = sh("git rev-parse --short HEAD")
    # uncommitted changes to the packages: measured only with --tree worktree
    dirty = bool(sh("git status --porcelain --untracked-files=no -- " + " ".join(SOURCES)))
    with tempfile.TemporaryDirectory(prefix="spinf-service-bench-") as tmp:
        src = Path(tmp) / "src"
        snapshot(args.tree, commit, src)
        sys.path.insert(0, str(src))
        r = measure(args, src, Path(tmp))
    r.update(commit=commit, worktree_dirty=dirty, measured_tree=args.tree,
             load_avg_1m_at_start=load_at_start)

    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{r['date']}-service-{r['commit']}.json"
    n = 2
    while path.exists():     # a second run on the same commit keeps the first one's figures
        path, n = out / f"{r['date']}-service-{r['commit']}-{n}.json", n + 1
    path.write_text(json.dumps(r, indent=1) + "\n")
    command = ("/work/venv/bin/python benchmarks/service_http.py"
               + (f" --model {args.model}" if args.model else "")
               + (" --tree worktree" if args.tree == "worktree" else "")
               + (" --case-insensitive" if args.case_insensitive else "")
               + f" --docs {args.docs} --out {args.out}")
    print(markdown(r, command))
    print(f"wrote {path}")
    if not r["identical"]:
        sys.exit("HTTP results differ from the in-process engine's")


def measure(args: argparse.Namespace, src: Path, tmp: Path) -> dict:
    import spinf_worker
    from spinf_worker.engine import Engine

    if not Path(spinf_worker.__file__).is_relative_to(src):
        raise RuntimeError(f"imported {spinf_worker.__file__}, not the snapshot in {src}")

    block = {**json.loads(QUESTIONS.read_text()), "case_insensitive": args.case_insensitive}
    n_q = len(block["queries"])
    engine = Engine.load(args.model, device="cpu")
    model_name = engine.model_name
    docs = load_docs(engine, args.docs)
    requests = [{"text": d, "scoring": block} for d in docs]
    warmup = {"text": docs[0][:200], "scoring": block}
    e = run_engine(engine, requests, warmup)
    threads = torch.get_num_threads()
    del engine          # the service loads its own; free this one's memory first
    gc.collect()

    (tmp / "service").mkdir()
    service = Service(src, tmp / "service", free_port(), args.model)
    service.start()
    try:
        ready_s = service.wait_ready()
        h = asyncio.run(run_http(service, requests, warmup))
    except BaseException:
        print(service.log_tail(30), file=sys.stderr)
        raise
    finally:
        stop_code = service.stop()

    same_c, diff_c, fp_c = compare(e["bodies"], h["concurrent"]["bodies"])
    same_b, diff_b, fp_b = compare(e["bodies"], h["batch"]["bodies"])
    n_docs, cores = len(docs), os.cpu_count() or 1
    r: dict = dict(
        model=model_name, docs=n_docs, questions_per_doc=n_q,
        case_insensitive=args.case_insensitive,
        # the rows laid out: each content once plus its query tree (floors not counted)
        tokens_read=sum(b["usage"]["processed_tokens"] for b in e["bodies"]),
        engine_seconds=e["seconds"],
        engine_docs_per_s=n_docs / e["seconds"],
        engine_questions_per_s=n_docs * n_q / e["seconds"],
        engine_passes=e["passes"],
        engine_pass_fill_ratio=e["fill"],
        engine_warmup_s=e["warmup_s"],
        engine_cpu_share=e["cpu_s"] / (e["seconds"] * cores),
        engine_other_cpu_share=e["other_cpu_s"] / (e["seconds"] * cores),
        engine_thread_cpu_s=e["threads"],
        max_pass_tokens=e["max_pass_tokens"],
        doc_rows_min=min(e["doc_rows"]), doc_rows_max=max(e["doc_rows"]),
    )
    for key, m in (("http_concurrent", h["concurrent"]), ("http_batch", h["batch"])):
        r.update({
            f"{key}_seconds": m["seconds"],
            f"{key}_docs_per_s": n_docs / m["seconds"],
            f"{key}_questions_per_s": n_docs * n_q / m["seconds"],
            f"{key}_ratio": e["seconds"] / m["seconds"],
            f"{key}_worker_calls": m["worker_calls"],
            f"{key}_worker_busy_s": m["worker_busy_s"],
            f"{key}_docs_per_worker_pass": "/".join(str(c) for c in m["calls"]),
            f"{key}_cpu_share": m["service_cpu_s"] / (m["seconds"] * cores),
            f"{key}_other_cpu_share": m["other_cpu_s"] / (m["seconds"] * cores),
            f"{key}_thread_cpu_s": m["threads"],
            f"{key}_worker_pass_seconds": "/".join(f"{x:.1f}" for x in m["pass_seconds"]),
        })
    r.update(
        http_concurrent_latency_min_s=h["concurrent"]["latency_min_s"],
        http_concurrent_latency_median_s=h["concurrent"]["latency_median_s"],
        http_concurrent_latency_max_s=h["concurrent"]["latency_max_s"],
        http_batch_upload_s=h["batch"]["upload_s"],
        http_batch_output_lines=h["batch"]["output_lines"],
        http_warmup_s=h["warmup_s"],
        service_ready_s=ready_s,
        service_exit_code=stop_code,
        identical_concurrent=same_c,
        identical_batch=same_b,
        identical=same_c and same_b,
        max_abs_dlogprob=max(diff_c, diff_b),
        same_fingerprint=fp_c and fp_b,
        target_ratio=TARGET_RATIO,
        target_met=min(e["seconds"] / h["concurrent"]["seconds"],
                       e["seconds"] / h["batch"]["seconds"]) >= TARGET_RATIO,
        date=datetime.date.today().isoformat(),
        machine=f"{cpu_model()}, {cores} cores",
        cores=cores,
        torch=torch.__version__,
        threads=threads,
    )
    return r


if __name__ == "__main__":
    main()

"""How long an API process keeps a request waiting while it queues a batch's lines.

``spinf-serve api`` (one process, no worker: the lines only queue) on a real Redis. Per
interpreter switch interval (``--switch-interval-ms``, the API's ``api_switch_interval_ms``):
``GET /healthz`` probed back to back while idle, then while the process validates and queues
an uploaded batch of ``--lines`` news documents (the 56 news questions each) on its
validation thread; the probes' p50 / p90 / max latency in each state, and the seconds the
queueing took (from the batch's creation to the poll that counts every line).

    python benchmarks/api_batch_stall.py [--lines 4000] [--switch-interval-ms 5,0.5] \\
        [--repeat 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import redis
from soak import free_port  # benchmarks/: the soak's own

ROOT = Path(__file__).resolve().parents[1]
ARTICLES = ROOT.parent / "shared" / "data" / "news_articles.jsonl"
QUESTIONS = ROOT / "benchmarks" / "news_questions.json"
REDIS_URL = os.environ.get("SPINF_REDIS_URL", "redis://127.0.0.1:6379/0")
IDLE_PROBES = 50
PROBE_GAP_S = 0.005


def batch_file(lines: int) -> bytes:
    texts = [json.loads(line)["text"][:2500] for line in ARTICLES.read_text().splitlines()]
    scoring = {**json.loads(QUESTIONS.read_text()), "case_insensitive": False}
    return "".join(json.dumps({
        "custom_id": f"doc-{i}", "method": "POST", "url": "/v1/score",
        "body": {"text": f"{i}. {texts[i % len(texts)]}", "scoring": scoring}}) + "\n"
        for i in range(lines)).encode()


@contextlib.contextmanager
def api_process(prefix: str, interval_ms: float):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPINF_")}
    env.update(PYTHONPATH=str(ROOT), SPINF_API_SWITCH_INTERVAL_MS=str(interval_ms))
    process = subprocess.Popen(
        [sys.executable, "-m", "spinf_worker.cli", "api", "--redis", REDIS_URL, "--prefix",
         prefix, "--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"p50_ms": round(1000 * statistics.median(ordered), 2),
            "p90_ms": round(1000 * ordered[int(0.9 * len(ordered))], 2),
            "max_ms": round(1000 * ordered[-1], 2)}


async def probe(client: httpx.AsyncClient) -> float:
    started = time.perf_counter()
    (await client.get("/healthz")).raise_for_status()
    return time.perf_counter() - started


async def one_run(url: str, content: bytes, lines: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for _ in range(600):   # the process starting
            with contextlib.suppress(httpx.TransportError):
                if (await client.get("/healthz")).status_code == 200:
                    break
            await asyncio.sleep(0.1)
        idle = []
        for _ in range(IDLE_PROBES):
            idle.append(await probe(client))
            await asyncio.sleep(PROBE_GAP_S)
        upload = (await client.post("/v1/files", files={"file": ("in.jsonl", content)},
                                    data={"purpose": "batch"})).json()
        batch = (await client.post("/v1/batches", json={
            "input_file_id": upload["id"], "endpoint": "/v1/score",
            "completion_window": "24h"})).json()
        started, queueing = time.perf_counter(), []
        while True:
            queueing.append(await probe(client))
            state = (await client.get(f"/v1/batches/{batch['id']}")).json()
            if state["request_counts"]["total"] >= lines:
                break
            await asyncio.sleep(PROBE_GAP_S)
        return {"queue_s": round(time.perf_counter() - started, 3),
                "idle": percentiles(idle), "queueing": percentiles(queueing),
                "queueing_probes": len(queueing)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=4000)
    parser.add_argument("--switch-interval-ms", default="5,0.5",
                        type=lambda s: [float(v) for v in s.split(",")])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    content = batch_file(args.lines)
    runs = []
    for _ in range(args.repeat):
        for interval_ms in args.switch_interval_ms:
            prefix = f"bench-stall-{uuid.uuid4().hex[:8]}"
            try:
                with api_process(prefix, interval_ms) as url:
                    run = asyncio.run(one_run(url, content, args.lines))
            finally:
                client = redis.Redis.from_url(REDIS_URL)
                for key in client.scan_iter(f"{prefix}:*", count=1000):
                    client.delete(key)
                client.close()
            runs.append({"switch_interval_ms": interval_ms, **run})
            print(json.dumps(runs[-1]), flush=True)
    figures = {"lines": args.lines, "runs": runs}
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()

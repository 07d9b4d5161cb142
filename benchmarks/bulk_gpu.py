"""A bulk batch of many documents through the real service: one result per custom_id, Redis
memory while it runs, the output file streamed.

``--docs`` distinct documents (AG News items and windows of the articles' words) as one ``/v1/files`` +
``/v1/batches`` job on a private ``redis-server``, ``spinf-serve api`` and one
``spinf-serve worker`` (``service_gpu.Service``). While it runs: Redis ``used_memory`` and the
work streams' lengths, sampled. When it completes: the output file read as a stream, line by
line (custom_ids counted, each a 200), with the API processes' resident memory sampled during
the download; then what Redis still holds (stream lengths, the TTL left on result keys).

    python benchmarks/bulk_gpu.py --model DIR --redis-server PATH --data DIR --docs 20000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from service_gpu import (  # noqa: E402
    HTTP_TIMEOUT_S,
    QUESTIONS,
    Service,
    tree_pids,
)

SAMPLE_S = 0.5
WINDOWS = (150, 130, 110, 90)    # words: windows of each length at every word of the articles


def bulk_docs(data: Path, n: int) -> list[str]:
    """n distinct documents: the AG News items, then windows of the articles' words."""
    ag = [json.loads(x) for x in (data / "ag_news_sample.jsonl").read_text().splitlines()]
    docs = [f"{a['title']}\n\n{a['description']}" for a in ag]
    for size in WINDOWS:
        for line in (data / "news_articles.jsonl").read_text().splitlines():
            words = json.loads(line)["text"].split()
            docs += [" ".join(words[i:i + size]) for i in range(len(words) - size)]
    docs = list(dict.fromkeys(docs))
    if len(docs) < n:
        raise SystemExit(f"only {len(docs)} distinct documents in {data}")
    return docs[:n]


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


class Peak:
    """A value sampled every SAMPLE_S on a thread; the peak."""

    def __init__(self, read):
        self.read, self.peak = read, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):    # a missed sample is not a failure
                self.peak = max(self.peak, float(self.read()))
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def run(args: argparse.Namespace, service: Service, lines: bytes, n: int) -> dict:
    import redis

    from spinf_worker.queue.keys import Keys

    keys = Keys()
    r = redis.Redis(port=service.redis_port)
    streams = lambda: sum(r.xlen(s) for s in keys.streams)   # noqa: E731
    out: dict = {}
    async with httpx.AsyncClient(base_url=service.url, timeout=HTTP_TIMEOUT_S) as client:
        up = await client.post("/v1/files", data={"purpose": "batch"},
                               files={"file": ("bulk.jsonl", lines, "application/jsonl")})
        up.raise_for_status()
        memory_before = r.info("memory")["used_memory"]
        with Peak(lambda: r.info("memory")["used_memory"]) as redis_peak, \
                Peak(streams) as stream_peak:
            t0 = time.perf_counter()
            batch = (await client.post("/v1/batches", json={
                "input_file_id": up.json()["id"], "endpoint": "/v1/score",
                "completion_window": "24h"})).raise_for_status().json()
            while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
                await asyncio.sleep(1.0)
                batch = (await client.get(f"/v1/batches/{batch['id']}")).json()
            seconds = time.perf_counter() - t0
        out.update(status=batch["status"], seconds=round(seconds, 1),
                   docs_per_s=round(n / seconds, 1),
                   request_counts=batch.get("request_counts"),
                   redis_used_before_mib=round(memory_before / 2**20, 1),
                   redis_used_peak_mib=round(redis_peak.peak / 2**20, 1),
                   stream_entries_peak=int(stream_peak.peak))
        api_pids = tree_pids(service.procs["api"].pid)
        rss_before = rss_mib(api_pids)
        ids: set[str] = set()
        lines_read = not_ok = size = 0
        with Peak(lambda: rss_mib(api_pids)) as api_rss:
            async with client.stream("GET", f"/v1/files/{batch['output_file_id']}/content") as s:
                s.raise_for_status()
                async for line in s.aiter_lines():
                    if not line:
                        continue
                    size += len(line) + 1
                    row = json.loads(line)
                    lines_read += 1
                    ids.add(row["custom_id"])
                    not_ok += (row.get("response") or {}).get("status_code") != 200
        questions = 0
        if ids:
            questions = len(json.loads(QUESTIONS.read_text())["queries"][:args.questions])
        out.update(output_lines=lines_read, distinct_custom_ids=len(ids),
                   expected_custom_ids=n, lines_not_200=not_ok,
                   exactly_one_per_custom_id=lines_read == len(ids) == n,
                   output_mib=round(size / 2**20, 1),
                   questions_per_s=round(n * questions / seconds, 1),
                   api_rss_before_download_mib=round(rss_before, 1),
                   api_rss_peak_download_mib=round(api_rss.peak, 1),
                   stream_entries_after=streams(),
                   redis_used_after_mib=round(r.info("memory")["used_memory"] / 2**20, 1))
        sample = next(iter(r.scan_iter(match=keys.result("*"), count=1000)), None)
        out["result_key_ttl_s"] = r.ttl(sample) if sample is not None else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", required=True, help="model id or HF directory")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--quant", default="fp8")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--redis-server", default="redis-server")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--questions", type=int, default=56, help="the first N news questions")
    parser.add_argument("--api-workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                           capture_output=True, text=True).stdout.strip()
    docs = bulk_docs(args.data, args.docs)
    scoring = json.loads(QUESTIONS.read_text())
    scoring = {"queries": scoring["queries"][:args.questions], "case_insensitive": False}
    lines = "".join(json.dumps({"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/score",
                                "body": {"messages": [{"role": "user", "content": d}],
                                         "scoring": scoring}}) + "\n"
                    for i, d in enumerate(docs)).encode()
    row = {"date": datetime.date.today().isoformat(), "commit": commit,
           "model": args.model, "load_format": args.load_format, "quant": args.quant,
           "docs": len(docs), "questions_per_doc": len(scoring["queries"]),
           "input_mib": round(len(lines) / 2**20, 1)}
    with tempfile.TemporaryDirectory(prefix="spinf-bulk-gpu-") as tmp:
        service = Service(args, Path(tmp))
        service.env["SPINF_MAX_FILE_BYTES"] = str(len(lines) + (1 << 20))
        with service.running():
            row.update(asyncio.run(run(args, service, lines, len(docs))))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{row['date']}-bulk-gpu-{Path(args.model).name}-{args.quant}-{commit}.json"
    path.write_text(json.dumps(row, indent=1))
    for key, value in row.items():
        print(f"| {key} | {value} |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

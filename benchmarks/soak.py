"""Soak run of the real service under faults: lost and duplicated answers, memory over time.

Starts a private ``redis-server`` (AOF, ``appendfsync always``, on a free port), one
``spinf-serve api`` and ``--workers`` ``spinf-serve worker`` processes, then for ``--minutes``:

- submits ``--docs`` documents as bulk batches (``POST /v1/files`` + ``POST /v1/batches``,
  ``--batch-size`` lines each) at a steady pace over the first 80% of the run;
- at moments drawn from ``--seed`` (``random.Random``) between 10% and 80% of the run
  (while documents come in), SIGKILLs a worker ``--worker-kills`` times (one that holds
  entries, frozen with SIGSTOP first; restarted a few seconds later under its old name or a
  new one, so both the re-read of its own pending entries and the reclaim by others happen)
  and kills Redis (SIGKILL) ``--redis-restarts`` times while the streams hold work, starting
  it again from its AOF after a few seconds down. A fault waits at most ``--fault-wait-s``
  for work to hit;
- every ``--sample-s`` samples Redis ``used_memory`` / ``used_memory_rss``, the RSS of every
  process (psutil when installed, else ``VmRSS`` of /proc/<pid>/status), the backlog and the
  answers so far.

After the run it waits (up to ``--drain-minutes``) for every batch to finish, reads the output
and error files and counts **lost** custom_ids (never answered) and **duplicated** ones
(answered more than once). The curves, the faults and the summary go to
``<out>/<date>-soak-<commit>.json``, the summary also to stdout and ``....txt``. The exit
status is 1 when anything was lost, duplicated or left unfinished.

``--model tiny`` (the default) is the test suite's tiny random Gemma 3 (tests/conftest.py),
written into the run's temporary directory; any other value goes to ``spinf-serve worker
--model`` as is. Not part of CI:

    .venv/bin/python benchmarks/soak.py --docs 10000 --minutes 30 --workers 3 --seed 0
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis as redis_sync

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spinf_worker.queue.keys import GROUP, Keys  # noqa: E402  (the project, from ROOT)

try:
    import psutil
except ImportError:
    psutil = None

PREFIX = "soak"
START_TIMEOUT_S = 600.0      # a first start of the default model converts it once
HTTP_TIMEOUT_S = 60.0
RETRY_FOR_S = 120.0          # a request refused while Redis is away is sent again this long
POLL_S = 0.25
QUERIES = {"queries": [
    {"id": "good", "template": "\nGood news?{?}", "options": [" yes", " no"]},
    {"id": "topic", "template": "\nTopic (business, sports, science or politics):{?}",
     "options": [" business", " sports", " science", " politics"]}]}
SUBJECTS = ["The home team", "The central bank", "Scientists at the university",
            "The government", "The company", "The customer"]
VERBS = ["won the match by", "raised its rate by", "published a study with", "announced",
         "reported", "was charged twice for"]


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True).stdout.strip()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a live process (None: gone)."""
    if psutil is not None:
        try:
            return psutil.Process(pid).memory_info().rss
        except psutil.Error:
            return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def document(i: int, rng: random.Random) -> str:
    return (f"Story {i}: {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.randint(1, 99)} "
            f"points on day {rng.randint(1, 28)}, and {rng.choice(SUBJECTS).lower()} "
            f"{rng.choice(VERBS)} {rng.randint(1, 999)}.")


@dataclass
class Proc:
    kind: str                  # redis | api | worker
    name: str
    process: subprocess.Popen

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(HTTP_TIMEOUT_S)


@dataclass
class Service:
    """The processes of one run, all logging into ``logs``."""

    logs: Path
    model: str
    device: str
    env: dict[str, str]
    redis_port: int = field(default_factory=free_port)
    api_port: int = field(default_factory=free_port)
    redis: Proc | None = None
    api: Proc | None = None
    workers: dict[int, Proc] = field(default_factory=dict)   # slot -> its current process

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def v1(self) -> str:
        return f"http://127.0.0.1:{self.api_port}/v1"

    def _spawn(self, kind: str, name: str, cmd: list[str]) -> Proc:
        with open(self.logs / f"{name}.log", "a") as log:
            process = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log,
                                       stderr=subprocess.STDOUT)
        return Proc(kind, name, process)

    def start_redis(self) -> None:
        # appendfsync always: what was acknowledged before a kill is there after it
        self.redis = self._spawn("redis", "redis", [
            "redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "yes", "--appendfsync", "always",
            "--dir", str(self.logs)])
        client = redis_sync.Redis.from_url(self.redis_url, socket_timeout=HTTP_TIMEOUT_S)
        wait(lambda: self._pings(client), START_TIMEOUT_S, "redis-server to answer")
        client.close()

    def _pings(self, client: redis_sync.Redis) -> bool:
        assert self.redis is not None and self.redis.alive, "redis-server exited"
        try:
            return bool(client.ping())
        except (redis_sync.ConnectionError, redis_sync.BusyLoadingError):
            return False

    def start_api(self) -> None:
        self.api = self._spawn("api", "api", [
            sys.executable, "-m", "spinf_worker.cli", "api", "--redis", self.redis_url,
            "--prefix", PREFIX, "--port", str(self.api_port), "--log-format", "json"])

        def healthy() -> bool:
            assert self.api is not None and self.api.alive, "the API exited"
            try:
                return httpx.get(f"{self.v1[:-3]}/healthz", timeout=5).status_code == 200
            except httpx.TransportError:
                return False
        wait(healthy, START_TIMEOUT_S, "the API to start")

    def start_worker(self, slot: int, name: str) -> None:
        self.workers[slot] = self._spawn("worker", name, [
            sys.executable, "-m", "spinf_worker.cli", "worker", "--redis", self.redis_url,
            "--prefix", PREFIX, "--model", self.model, "--device", self.device,
            "--name", name, "--log-format", "json"])

    def processes(self) -> list[Proc]:
        return [p for p in (self.redis, self.api, *self.workers.values()) if p is not None]

    def stop(self) -> None:
        for proc in self.processes():
            if proc.kind != "redis" and proc.alive:
                proc.process.send_signal(signal.SIGTERM)
        for proc in self.processes():
            if proc.kind != "redis":
                try:
                    proc.process.wait(HTTP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
        if self.redis is not None:
            self.redis.kill()


def wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def request(http: httpx.Client, method: str, url: str, **kwargs) -> httpx.Response:
    """One API call, sent again while the answer is a 503 or no answer (Redis away): the
    routes write nothing when they answer 503, so sending again adds nothing twice."""
    deadline = time.monotonic() + RETRY_FOR_S
    while True:
        try:
            reply = http.request(method, url, **kwargs)
            if reply.status_code != 503:
                reply.raise_for_status()
                return reply
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{method} {url}: no answer for {RETRY_FOR_S:.0f} s")
        time.sleep(0.5)


def submit(http: httpx.Client, lines: list[dict]) -> str:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = request(http, "POST", "/files", data={"purpose": "batch"},
                       files={"file": ("docs.jsonl", content, "application/jsonl")}).json()
    return request(http, "POST", "/batches", json={"input_file_id": uploaded["id"],
                                                   "endpoint": "/v1/score"}).json()["id"]


def sample(service: Service, keys: Keys, t: float, answered: int) -> dict:
    point: dict = {"t_s": round(t, 2), "answered": answered,
                   "rss": {p.name: rss_bytes(p.process.pid) for p in service.processes()
                           if p.alive}}
    client = redis_sync.Redis.from_url(service.redis_url, socket_timeout=5,
                                       socket_connect_timeout=1)
    try:
        memory = client.info("memory")
        point["redis_used_memory"] = memory["used_memory"]
        point["redis_used_memory_rss"] = memory["used_memory_rss"]
        point["backlog"] = sum(client.xlen(s) for s in keys.streams)
    except (redis_sync.ConnectionError, redis_sync.BusyLoadingError, redis_sync.TimeoutError):
        point["redis_down"] = True
    finally:
        client.close()
    return point


def backlog(service: Service, keys: Keys) -> int:
    """Entries in the work streams, waiting or held (acked ones are deleted)."""
    client = redis_sync.Redis.from_url(service.redis_url, socket_timeout=5)
    try:
        return sum(client.xlen(s) for s in keys.streams)
    except redis_sync.RedisError:
        return 0
    finally:
        client.close()


def held_by(service: Service, keys: Keys, consumer: str) -> int | None:
    client = redis_sync.Redis.from_url(service.redis_url, socket_timeout=5)
    try:
        return sum(len(client.xpending_range(s, GROUP, "-", "+", 10_000,
                                             consumername=consumer)) for s in keys.streams)
    except redis_sync.RedisError:
        return None
    finally:
        client.close()


def run(args: argparse.Namespace, tmp: Path) -> dict:
    rng = random.Random(args.seed)
    keys = Keys(PREFIX)
    model = args.model
    if model == "tiny":
        from tests.conftest import write_tiny_gemma3, write_tiny_tokenizer

        for name in ("tok", "tiny-model"):
            (tmp / name).mkdir()
        model = str(write_tiny_gemma3(tmp / "tiny-model", write_tiny_tokenizer(tmp / "tok")))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPINF_")}
    env = {**environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads),
           "SPINF_CLAIM_IDLE_MS": str(args.claim_idle_ms), "SPINF_HEARTBEAT_S": "1"}
    if args.max_pass_tokens:
        env["SPINF_MAX_PASS_TOKENS"] = str(args.max_pass_tokens)
    logs = tmp / "logs"
    logs.mkdir()
    service = Service(logs, model, args.device, env)

    window = args.minutes * 60
    size = args.batch_size or max(50, args.docs // 20)
    n_batches = math.ceil(args.docs / size)
    events: list[tuple[float, str, int]] = [(0.8 * window * b / n_batches, "submit", b)
                                            for b in range(n_batches)]
    events += [(rng.uniform(0.1, 0.8) * window, "kill-worker", k)
               for k in range(args.worker_kills)]
    events += [(rng.uniform(0.1, 0.8) * window, "restart-redis", k)
               for k in range(args.redis_restarts)]
    events.sort()
    texts = [document(i, rng) for i in range(args.docs)]

    faults: list[dict] = []
    samples: list[dict] = []
    batches: dict[str, dict] = {}        # id -> its last batch object
    generations = collections.Counter()  # slot -> restarts so far
    restart_as: dict[int, str] = {}      # slot -> the name its killed worker comes back as
    # a fault waiting for its moment -> when it strikes anyway; kills by their number,
    # restarts by -1 - their number
    aim: dict[int, float] = {}
    try:
        service.start_redis()
        service.start_api()
        for slot in range(args.workers):
            service.start_worker(slot, f"soak-w{slot}")
        watch = redis_sync.Redis.from_url(service.redis_url)
        wait(lambda: len(watch.hgetall(keys.workers)) >= args.workers, START_TIMEOUT_S,
             "the workers to register")
        watch.close()
        http = httpx.Client(base_url=service.v1, timeout=HTTP_TIMEOUT_S)
        start = time.monotonic()
        next_sample = 0.0
        next_poll = 0.0
        while True:
            now = time.monotonic() - start
            while events and events[0][0] <= now:
                at, kind, arg = events.pop(0)
                if kind == "submit":
                    lines = [{"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/score",
                              "body": {"text": texts[i], "scoring": QUERIES}}
                             for i in range(arg * size, min(args.docs, (arg + 1) * size))]
                    batches[submit(http, lines)] = {"status": "validating"}
                elif kind == "kill-worker":
                    # a worker that holds entries, frozen first so that they cannot go
                    # between the look and the kill; with none busy, looked at again, up to
                    # --fault-wait-s, then any live one
                    give_up = aim.setdefault(arg, now + args.fault_wait_s)
                    live = sorted(slot for slot, w in service.workers.items() if w.alive)
                    busy = [slot for slot in live
                            if held_by(service, keys, service.workers[slot].name)]
                    if not live:     # all killed, none restarted yet
                        events.append((now + 0.5, kind, arg))
                        events.sort()
                        continue
                    slot = rng.choice(busy or live)
                    victim = service.workers[slot]
                    victim.process.send_signal(signal.SIGSTOP)
                    held = held_by(service, keys, victim.name) or 0
                    if not held and now < give_up:
                        victim.process.send_signal(signal.SIGCONT)
                        events.append((now + 0.05, kind, arg))
                        events.sort()
                        continue
                    victim.kill()
                    generations[slot] += 1
                    # the old name: it re-reads its own pending entries; a new one: others
                    # reclaim them once idle
                    restart_as[slot] = victim.name if rng.random() < 0.5 else \
                        f"soak-w{slot}-g{generations[slot]}"
                    delay = rng.uniform(1, 10)
                    events.append((now + delay, "start-worker", slot))
                    events.sort()
                    faults.append({"t_s": round(now, 2), "kind": "worker_kill",
                                   "worker": victim.name, "held_entries": held,
                                   "restart_as": restart_as[slot],
                                   "restart_after_s": round(delay, 2)})
                    print(f"[{now:7.1f} s] killed {victim.name} (held {held})", flush=True)
                elif kind == "start-worker":
                    service.start_worker(arg, restart_as.pop(arg))
                elif kind == "restart-redis":
                    # with work in the streams, waited for up to --fault-wait-s
                    assert service.redis is not None
                    give_up = aim.setdefault(-1 - arg, now + args.fault_wait_s)
                    if not backlog(service, keys) and now < give_up:
                        events.append((now + 0.05, kind, arg))
                        events.sort()
                        continue
                    down = rng.uniform(1, 5)
                    service.redis.kill()
                    time.sleep(down)
                    service.start_redis()
                    faults.append({"t_s": round(now, 2), "kind": "redis_restart",
                                   "down_s": round(down, 2),
                                   "back_after_s": round(time.monotonic() - start - now, 2)})
                    print(f"[{now:7.1f} s] redis restarted", flush=True)
            now = time.monotonic() - start
            if now >= next_poll:
                next_poll = now + 1.0
                for batch_id, batch in batches.items():
                    if batch["status"] not in ("completed", "failed", "cancelled", "expired"):
                        try:
                            reply = http.get(f"/batches/{batch_id}")
                            if reply.status_code == 200:
                                batches[batch_id] = reply.json()
                        except httpx.TransportError:
                            pass
            answered = sum(b["request_counts"]["completed"] + b["request_counts"]["failed"]
                           for b in batches.values() if "request_counts" in b)
            if now >= next_sample:
                next_sample = now + args.sample_s
                samples.append(sample(service, keys, now, answered))
                print(f"[{now:7.1f} s] answered {answered}/{args.docs}, "
                      f"batches {len(batches)}/{n_batches}", flush=True)
            finished = all(b["status"] in ("completed", "failed", "cancelled", "expired")
                           for b in batches.values())
            if now >= window and not events and finished:
                break
            if now >= window + args.drain_minutes * 60:
                print("drain time over: batches left unfinished", flush=True)
                break
            time.sleep(POLL_S)
        samples.append(sample(service, keys, time.monotonic() - start, answered))
        duration = time.monotonic() - start
        counts, error_codes = collections.Counter(), collections.Counter()
        for batch in batches.values():
            for file_field in ("output_file_id", "error_file_id"):
                if batch.get(file_field):
                    text = request(http, "GET", f"/files/{batch[file_field]}/content").text
                    for line in map(json.loads, text.splitlines()):
                        counts[line["custom_id"]] += 1
                        if line.get("error"):
                            error_codes[line["error"]["code"]] += 1
        check = redis_sync.Redis.from_url(service.redis_url, decode_responses=True)
        dead = check.xlen(keys.dead)
        check.close()
    finally:
        service.stop()
    expected = {f"doc-{i}" for i in range(args.docs)}
    return {"samples": samples, "faults": faults, "duration_s": round(duration, 1),
            "batches": {k: v.get("status") for k, v in batches.items()},
            "lost": len(expected - set(counts)),
            "duplicated": sum(1 for c in counts.values() if c > 1),
            "unexpected": len(set(counts) - expected),
            "error_lines": dict(error_codes), "dead_letters": dead}


def summarize(result: dict) -> dict:
    """Peaks and start/end values of the curves, per process kind."""
    samples = [s for s in result["samples"] if "rss" in s]
    kinds: dict[str, list[list[int]]] = collections.defaultdict(list)
    for s in samples:
        by_kind: dict[str, list[int]] = collections.defaultdict(list)
        for name, rss in s["rss"].items():
            if rss is not None:
                by_kind["worker" if name.startswith("soak-w") else name].append(rss)
        for kind, values in by_kind.items():
            kinds[kind].append(values)
    mib = 1 / 2**20
    rss = {kind: {"start_mib": round(max(series[0]) * mib, 1),
                  "peak_mib": round(max(max(v) for v in series) * mib, 1),
                  "end_mib": round(max(series[-1]) * mib, 1)}
           for kind, series in kinds.items()}
    memory = [s["redis_used_memory"] for s in samples if "redis_used_memory" in s]
    return {"lost": result["lost"], "duplicated": result["duplicated"],
            "unexpected": result["unexpected"], "error_lines": result["error_lines"],
            "dead_letters": result["dead_letters"],
            "unfinished_batches": sum(1 for s in result["batches"].values()
                                      if s != "completed"),
            "worker_kills": sum(f["kind"] == "worker_kill" for f in result["faults"]),
            "redis_restarts": sum(f["kind"] == "redis_restart" for f in result["faults"]),
            "rss_per_process_max": rss,
            "redis_used_memory_mib": {"start": round(memory[0] * mib, 1),
                                      "peak": round(max(memory) * mib, 1),
                                      "end": round(memory[-1] * mib, 1)} if memory else None}


def text_summary(args: argparse.Namespace, result: dict, summary: dict) -> str:
    lines = [f"soak: {args.docs} docs, {args.minutes} min window ({result['duration_s']} s run), "
             f"{args.workers} workers, seed {args.seed}, model {args.model}",
             f"faults: {summary['worker_kills']} worker kills, "
             f"{summary['redis_restarts']} Redis restarts",
             f"lost {summary['lost']}, duplicated {summary['duplicated']}, unexpected "
             f"{summary['unexpected']}, error lines {summary['error_lines'] or 0}, dead letters "
             f"{summary['dead_letters']}, unfinished batches {summary['unfinished_batches']}"]
    for kind, figures in summary["rss_per_process_max"].items():
        lines.append(f"RSS {kind:7s} start {figures['start_mib']} MiB, peak "
                     f"{figures['peak_mib']} MiB, end {figures['end_mib']} MiB")
    if summary["redis_used_memory_mib"]:
        m = summary["redis_used_memory_mib"]
        lines.append(f"Redis used_memory start {m['start']} MiB, peak {m['peak']} MiB, "
                     f"end {m['end']} MiB")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=10_000)
    ap.add_argument("--minutes", type=float, default=30.0, help="the run's window")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="fault moments, victims, texts")
    ap.add_argument("--model", default="tiny",
                    help="tiny (the tests' random Gemma 3), or what `worker --model` takes")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="lines per batch (default docs/20, at least 50)")
    ap.add_argument("--worker-kills", type=int, default=6)
    ap.add_argument("--redis-restarts", type=int, default=2)
    ap.add_argument("--fault-wait-s", type=float, default=30.0,
                    help="a fault waits this long at most for work in flight to hit")
    ap.add_argument("--claim-idle-ms", type=int, default=10_000,
                    help="a dead worker's entries are reclaimed after this")
    ap.add_argument("--max-pass-tokens", type=int, default=None)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--drain-minutes", type=float, default=10.0)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not on the PATH")

    commit = sh("git", "rev-parse", "--short", "HEAD")
    tmp = Path(tempfile.mkdtemp(prefix="spinf-soak-"))
    try:
        result = run(args, tmp)
    finally:
        if args.keep_logs:
            print(f"logs: {tmp / 'logs'}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    summary = summarize(result)
    text = text_summary(args, result, summary)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{datetime.date.today().isoformat()}-soak-{commit}"
    stem.with_suffix(".json").write_text(json.dumps(
        {"commit": commit, "dirty": bool(sh("git", "status", "--porcelain", "--",
                                            "spinf_worker", "api")),
         "args": vars(args), "summary": summary, **result}, indent=1) + "\n")
    stem.with_suffix(".txt").write_text(text + "\n")
    print(f"wrote {stem}.json")
    bad = summary["lost"] or summary["duplicated"] or summary["unfinished_batches"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

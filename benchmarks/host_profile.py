"""The engine's host work per pass on the news job: where a ``score_batch`` spends the time
that does not depend on the device, stage by stage.

The real default model (Gemma 3 270M: its tokenizer, config and engine) on the CPU, the 56
news questions over ``--docs`` distinct documents (consecutive ``DOC_TOKENS``-token windows
of the articles joined end to end, as many as asked). Named functions of the engine are
wrapped with timers that keep each one's own time (less the wrapped functions it calls), and
grouped into stages:

- prepare: parsing and checking requests, query sets, tokenising contents
- layout: placing each content's branch block (FlatDoc), the floors' trees
- pack: packing passes, root keys, merging and splitting documents that share a root
- launch: ModelRunner.launch less the model's forward; ``launch_cpu`` (its CPU attention
  metadata, ``doc_span``) is shown apart and left out of the host total: a CUDA pass builds
  its masks on the device from one array of its rows, which ``launch_cuda`` builds beside
  each pass (``pass_plan.pass_rows``, as a CUDA launch does) and counts instead
- readout: the readout gather's host side and reading a pass back (``_readouts`` less the
  LM head, ``finish``)
- respond: building each ScoreResponse
- other: the rest of score_batch's wall time (the batch's and scheduler's own loops)
- store: what a worker does next with each reply, its body's JSON (``JobResult.body_json``);
  after ``score_batch``, on the worker's event loop: shown, left out of the host total

The model's forward and LM head are device work: timed apart and left out of the host total.
``--forward stub`` (the default) replaces them by constants of the right shapes, so that a
240-document job runs in seconds on the CPU (the host work is the same: nothing on the host
reads the values but the response); ``--forward real`` runs the model (fewer documents: the
CPU forward takes ~2.5 s a document). The stub's hidden state is one column wide: gathering a
pass's readout rows of it (a copy of [rows, hidden] on the CPU, device work on CUDA) would
count the stub's own work as the readout's. ``--cprofile N`` adds the N functions of most own
time under cProfile (one more run; its overhead inflates Python-heavy functions).

    python benchmarks/host_profile.py --docs 240 --repeat 5 --out benchmarks/results

Each stage is the median over ``--repeat`` runs (after one untimed run that scores the
floors, and the heap frozen as a worker freezes it), in wall seconds (``--clock thread``:
the engine thread's CPU seconds, which move less on a machine shared with other work but
leave out the tokenizer's own threads).
The cyclic collector runs inside whichever stage allocates: its share is shown apart. Writes ``<out>/<date>-cpu-host-profile-<commit>.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import functools
import gc
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# --code DIR: the spinf_worker/ of another checkout (a `git worktree add` or `git archive` of
# an earlier commit), for before/after figures; the benchmark itself stays this one
CODE = Path(sys.argv[sys.argv.index("--code") + 1]) if "--code" in sys.argv else ROOT
sys.path.insert(0, str(CODE))

import orjson  # noqa: E402
import torch  # noqa: E402

try:   # where the measured checkout keeps its JSON writer
    from spinf_worker.jsonio import dumps  # noqa: E402
except ImportError:
    from spinf_worker.queue.jsonio import dumps  # noqa: E402

from spinf_worker.tools.news_job import (  # noqa: E402
    ARTICLES,
    DOC_TOKENS,
    build_requests,
    checked,
    data_dir,
    load_questions,
)

STAGES = ("prepare", "layout", "pack", "launch", "launch_cpu", "launch_cuda", "readout",
          "respond", "other", "store")
# the host work of a pass on CUDA: launch_cpu is the CPU attention's, launch_cuda the CUDA
# launch's pass rows (built beside each CPU pass, as runner.launch builds them on CUDA)
HOST = ("prepare", "layout", "pack", "launch", "launch_cuda", "readout", "respond", "other")


def sh(cmd: str) -> str:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=ROOT).stdout.strip()


def windows(data: Path, tokenizer, count: int, length: int = DOC_TOKENS) -> list[str]:
    """``count`` distinct documents of ``length`` tokens: windows of the articles joined end
    to end, their starts spread evenly (overlapping when there are more than fit)."""
    ids: list[int] = []
    with (data / ARTICLES).open(encoding="utf-8") as lines:
        for line in lines:
            ids += tokenizer.encode(json.loads(line)["text"], add_special_tokens=False).ids
    stride = max(1, (len(ids) - length) // max(1, count - 1)) if count > 1 else 1
    if (count - 1) * stride + length > len(ids):
        raise SystemExit(f"the articles hold {len(ids)} tokens: too few for {count} windows")
    return [tokenizer.decode(ids[k * stride:k * stride + length]) for k in range(count)]


class CollectorTime:
    """Seconds the cyclic garbage collector ran (it runs inside whichever stage allocates, so
    its share is shown apart too)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.seconds, self.collections, self._t0 = 0.0, 0, 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = self.clock()
        else:
            self.seconds += self.clock() - self._t0
            self.collections += 1


class Timers:
    """Own time per stage: a wrapped function's time less that of the wrapped functions it
    calls. ``device`` is the model's share (left out of the host total)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.own: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []   # per open call: its children's time

    def wrap(self, stage: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._stack.append([0.0])
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = self.clock() - t0
                children = self._stack.pop()[0]
                self.own[stage] += spent - children
                self.calls[stage] += 1
                if self._stack:
                    self._stack[-1][0] += spent
        return timed

    def reset(self) -> None:
        self.own.clear()
        self.calls.clear()


def instrument(engine, timers: Timers, stub: bool) -> None:
    """Wrap the engine's stage functions (module attributes, methods, the model's forward)."""
    from spinf_worker.engine import batch, layout, prepare, runner, scheduler
    from spinf_worker.engine.pass_plan import pass_rows

    def patch(owner, name: str, stage: str) -> None:
        setattr(owner, name, timers.wrap(stage, getattr(owner, name)))

    patch(prepare.Preparer, "prepare_batch", "prepare")
    patch(layout.BranchBlock, "place", "layout")
    patch(layout.DocTree, "flatten", "layout")
    for name in ("pack", "merge", "split", "root_key"):
        patch(scheduler, name, "pack")
    launch, cuda_rows = runner.ModelRunner.launch, timers.wrap("launch_cuda", pass_rows)

    def launch_and_rows(self, docs, keep_roots=()):
        pending = launch(self, docs, keep_roots)
        rows = -(-sum(d.length for d in docs) // runner.PASS_BUCKET) * runner.PASS_BUCKET
        cuda_rows(docs, rows, self.pad_id)
        return pending

    runner.ModelRunner.launch = timers.wrap("launch", launch_and_rows)
    patch(runner, "doc_span", "launch_cpu")
    patch(runner.ModelRunner, "_readouts", "readout")
    patch(runner.ModelRunner, "finish", "readout")
    patch(batch, "build_response", "respond")
    model = engine.model
    if stub:
        vocab = model.cfg.vocab_size
        # constants expanded (never allocated) to the rows asked; the hidden state one column
        # wide: the readout gathers its rows on the host here, on the device on CUDA
        model.forward = (lambda ids, pos, plan: torch.zeros(1, 1).expand(ids.shape[0], 1))
        model.readout_logprobs = (lambda h: torch.full((1, 1), -0.75).expand(h.shape[0], vocab))
    model.forward = timers.wrap("device", model.forward)
    model.readout_logprobs = timers.wrap("device", model.readout_logprobs)


def run_once(engine, requests: list[dict], timers: Timers, collector: CollectorTime,
             keep: bool = False) -> dict:
    """One timed ``score_batch``; ``keep``: the responses' results (plain data) kept."""
    timers.reset()
    collector.seconds = collector.collections = 0
    t0, c0 = time.perf_counter(), timers.clock()
    responses = checked(engine.score_batch(requests))
    wall, spent = time.perf_counter() - t0, timers.clock() - c0
    # counted on the plain data, as a worker counts: reading ``results`` would validate every
    # option into a model, and those models, kept, would be walked by the cyclic collector
    # in every run after (a worker keeps no reply)
    results = [r.plain()["results"] for r in responses]
    # what a worker does with each reply next: its body's JSON (JobResult.body_json)
    c1 = timers.clock()
    stored = [dumps(r.plain()) for r in responses]
    store = timers.clock() - c1
    questions = sum(getattr(r, "_questions", 0) for r in responses) or sum(
        len(q["combinations"]) for rs in results for res in rs for q in res["queries"])
    stages = {s: timers.own.get(s, 0.0) for s in STAGES if s not in ("other", "store")}
    stages["other"] = spent - sum(stages.values()) - timers.own.get("device", 0.0)
    stages["store"] = store
    results = [orjson.loads(s)["results"] for s in stored] if keep else None
    return dict(wall_s=wall, device_s=timers.own.get("device", 0.0), stages_s=stages,
                passes=timers.calls.get("launch", 0), gc_s=collector.seconds,
                gc_collections=collector.collections,
                questions=questions, results=results)


def hot_functions(engine, requests: list[dict], top: int) -> list[dict]:
    """The ``top`` functions of most own time in one score_batch under cProfile."""
    profile = cProfile.Profile()
    profile.enable()
    engine.score_batch(requests)
    profile.disable()
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in stats.stats.items():
        where = path.split("/spinf_worker/")[-1] if "/spinf_worker/" in path else Path(path).name
        rows.append(dict(function=f"{where}:{line}({name})", calls=calls, own_ms=own * 1e3,
                         cumulative_ms=cum * 1e3))
    rows.sort(key=lambda r: -r["own_ms"])
    return rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=240)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-pass-tokens", type=int, default=16384,
                    help="rows a pass (default: the CUDA passes' 16384)")
    ap.add_argument("--forward", choices=("stub", "real"), default="stub")
    ap.add_argument("--case-insensitive", action="store_true")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="time stages in wall seconds (default) or in the engine thread's "
                         "CPU seconds (steadier on a machine shared with other work, but "
                         "the tokenizer's own threads do not count)")
    ap.add_argument("--no-freeze", action="store_true",
                    help="leave the loaded heap to the cyclic collector (a worker freezes it: "
                         "engine.freeze_heap)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N")
    ap.add_argument("--data", default=None, help="the news data (default: ../shared/data)")
    ap.add_argument("--code", default=None, metavar="DIR",
                    help="measure the spinf_worker/ under DIR (default: this checkout's)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--no-write", action="store_true", help="print only (trial runs)")
    args = ap.parse_args()
    load_at_start = os.getloadavg()[0]

    from spinf_worker.engine import Engine, EngineSettings
    from spinf_worker.engine.engine import freeze_heap

    engine = Engine.load(None, device="cpu",
                         settings=EngineSettings(max_pass_tokens=args.max_pass_tokens))
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    timers, collector = Timers(clock), CollectorTime(clock)
    instrument(engine, timers, args.forward == "stub")
    docs = windows(data_dir(args.data or ROOT.parent / "shared" / "data"),
                   engine.checkpoint.tokenizer, args.docs)
    requests = build_requests(docs, load_questions(ROOT / "benchmarks" / "news_questions.json"),
                              args.case_insensitive)
    # scores the floors, fills the caches
    first = run_once(engine, requests, timers, collector, keep=True)
    if not args.no_freeze:
        freeze_heap()
    runs = [run_once(engine, requests, timers, collector, keep=k == args.repeat - 1)
            for k in range(args.repeat)]
    assert first["results"] == runs[-1]["results"]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    stages = {s: statistics.median(r["stages_s"][s] for r in runs) for s in STAGES}
    # the least of the runs: what other work on the machine added least to
    fastest = {s: min(r["stages_s"][s] for r in runs) for s in STAGES}
    host_runs = [sum(r["stages_s"][s] for s in HOST) for r in runs]
    passes, questions = runs[0]["passes"], runs[0]["questions"]
    host = statistics.median(host_runs)
    result = dict(
        date=datetime.date.today().isoformat(),
        commit=sh("git rev-parse --short HEAD"), code=str(CODE),
        dirty=CODE == ROOT and bool(sh("git status --porcelain -- spinf_worker")),
        machine=f"{sh('lscpu | sed -n s/^Model.name:.//p').strip()}, {os.cpu_count()} cores",
        load_avg_1m_at_start=load_at_start, torch=torch.__version__,
        forward=args.forward, docs=len(docs), questions=questions, passes=passes,
        max_pass_tokens=args.max_pass_tokens, clock=args.clock, frozen_heap=not args.no_freeze,
        case_insensitive=args.case_insensitive,
        repeat=args.repeat, wall_s=med("wall_s"), device_s=med("device_s"),
        gc_s=med("gc_s"), gc_collections=med("gc_collections"),
        host_s=host, host_s_runs=host_runs,
        host_us_per_question=host / questions * 1e6,
        stages_ms=stages_table(stages, passes, questions),
        stages_min_ms=stages_table(fastest, passes, questions),
        host_min_s=min(host_runs),
    )
    print(f"{len(docs)} docs x 56 q = {questions} questions, {passes} passes of "
          f"<= {args.max_pass_tokens} rows, forward {args.forward}; {args.clock} time, median "
          f"of {args.repeat} (load {load_at_start:.2f})")
    print(f"{'stage':<12}{'ms/run':>10}{'ms/pass':>10}{'ms/1k q (us/q)':>16}{'min ms/run':>12}")
    for s, row in result["stages_ms"].items():
        print(f"{s:<12}{row['run']:>10.1f}{row['per_pass']:>10.2f}"
              f"{row['per_1k_questions']:>16.2f}{result['stages_min_ms'][s]['run']:>12.1f}")
    print(f"host total (launch_cuda, not launch_cpu): {host * 1e3:.1f} ms, {host / passes * 1e3:.2f} ms/pass, "
          f"{result['host_us_per_question']:.2f} us/question (least of the runs: "
          f"{result['host_min_s'] * 1e3:.1f} ms); device (forward + LM head, "
          f"not counted) {result['device_s'] * 1e3:.1f} ms; wall {result['wall_s'] * 1e3:.1f} ms")
    print(f"of the host total, the cyclic collector: {result['gc_s'] * 1e3:.1f} ms "
          f"({result['gc_collections']:.0f} collections)")
    if args.cprofile:
        result["hot_functions"] = hot_functions(engine, requests, args.cprofile)
        print(f"\ncProfile, top {args.cprofile} by own time (one run):")
        for r in result["hot_functions"]:
            print(f"{r['own_ms']:>9.1f} {r['cumulative_ms']:>9.1f} {r['calls']:>8}  "
                  f"{r['function']}")
    if not args.no_write:
        out = ROOT / args.out
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{result['date']}-cpu-host-profile-{result['commit']}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")


def stages_table(stages: dict[str, float], passes: int, questions: int) -> dict:
    """Per stage its ms a run, a pass and per 1,000 questions (us per question)."""
    return {s: dict(run=v * 1e3, per_pass=v * 1e3 / passes, per_1k_questions=v * 1e6 / questions)
            for s, v in stages.items()}


if __name__ == "__main__":
    main()

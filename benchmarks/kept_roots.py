"""Documents sent again, with and without kept roots (engine/root_cache.py, ``root_cache_mib``).

The news job (24 articles cut to 470 tokens, the 56 questions) three ways, each timed cold
(no kept roots: every pass reads its roots) and on kept roots (a first call kept them):
- ``again``: the same requests again (a job re-run; vLLM's "warm");
- ``new questions``: the first 28 questions asked, then the other 28 of the same documents
  (questions added to documents scored before);
- ``one per request``: one request per (document, question), 1,344 requests in one call
  (a client that sends one question per request, across passes).
Every response on kept roots is checked equal to the cold one (the run stops otherwise).

    python benchmarks/kept_roots.py [--model ID|DIR] [--load-format dummy] [--device cuda]
        [--quant bf16] [--data DIR] [--out benchmarks/results] [--commit X]
    python benchmarks/kept_roots.py --shape 12b --tokenizer DIR --device cuda --quant bf16

Writes ``<out>/<date>-kept-roots-<device>-<model>-<scheme>-<commit>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def engine_for(args: argparse.Namespace):
    from spinf_worker.engine import Engine, EngineSettings

    settings = EngineSettings(scheme=args.quant or "auto", presentation="raw")
    if args.shape:
        from gpu_bench import GEMMA_12B, GEMMA_270M, random_checkpoint
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
        config = {"12b": GEMMA_12B, "270m": GEMMA_270M}[args.shape]
        return Engine(random_checkpoint(config, tokenizer), device=args.device,
                      settings=settings), f"gemma-3-{args.shape}-shape"
    engine = Engine.load(args.model, device=args.device, settings=settings,
                         load_format=args.load_format)
    return engine, engine.model_name.replace("/", "--")


def timed(fn, device: str, repeat: int) -> tuple[float, object]:
    """The median wall seconds of ``repeat`` calls of ``fn`` and the last call's result."""
    import torch

    times, out = [], None
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the packaged one")
    ap.add_argument("--shape", choices=("12b", "270m"), default=None,
                    help="random weights of this Gemma 3 shape (with --tokenizer)")
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quant", default=None)
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--root-cache-mib", type=int, default=4096)
    ap.add_argument("--ways", nargs="*", default=None,
                    help="some of: again, new, one (default: all three)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()

    from spinf_worker.engine.root_cache import RootCache
    from spinf_worker.tools.news_job import (
        build_requests,
        checked,
        load_docs,
        load_questions,
        questions_answered,
    )

    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                           capture_output=True, text=True).stdout.strip()
    engine, name = engine_for(args)
    docs = load_docs(args.data, engine.checkpoint.tokenizer, args.docs)
    questions = load_questions()
    queries = questions["queries"]
    half = len(queries) // 2
    first_half = build_requests(docs, {**questions, "queries": queries[:half]})
    ways = {
        "again": (build_requests(docs, questions), build_requests(docs, questions)),
        "new questions": (first_half, build_requests(docs, {**questions,
                                                            "queries": queries[half:]})),
        "one per request": (first_half, [r for q in queries for r in
                                         build_requests(docs, {**questions, "queries": [q]})]),
    }
    picked = {"again": "again", "new": "new questions", "one": "one per request"}
    if args.ways:
        ways = {picked[w]: ways[picked[w]] for w in args.ways}
    engine.score_batch(build_requests(docs, questions))     # floors cached
    row = {"date": datetime.date.today().isoformat(), "commit": commit, "model": name,
           "device": args.device, "scheme": engine.scheme, "docs": len(docs),
           "root_cache_mib": args.root_cache_mib, "ways": {}}
    for way, (before, asked) in ways.items():
        engine.roots = None
        cold_s, cold = timed(lambda asked=asked: checked(engine.score_batch(asked)), args.device,
                             args.repeat)
        engine.roots = RootCache(args.root_cache_mib << 20)
        engine.score_batch(before)                 # keeps the documents' roots
        hits_before = engine.roots.hits
        kept_s, kept = timed(lambda asked=asked: checked(engine.score_batch(asked)), args.device,
                             args.repeat)
        same = [a.results == b.results for a, b in zip(kept, cold, strict=True)]
        if not all(same):
            raise SystemExit(f"{way}: kept roots changed {same.count(False)} responses")
        n = questions_answered(cold)
        row["ways"][way] = {"requests": len(asked), "questions": n,
                            "cold_s": round(cold_s, 4), "kept_s": round(kept_s, 4),
                            "cold_questions_per_s": round(n / cold_s, 1),
                            "kept_questions_per_s": round(n / kept_s, 1),
                            "speedup": round(cold_s / kept_s, 2),
                            "kept_roots": len(engine.roots),
                            "root_hits": engine.roots.hits - hits_before,
                            "kept_mib": round(engine.roots.bytes / 2**20, 1)}
        print(way, row["ways"][way], flush=True)
    engine.roots = None
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / (f"{row['date']}-kept-roots-{args.device}-{name}-{engine.scheme}-"
                       f"{commit}.json")
    path.write_text(json.dumps(row, indent=2) + "\n")
    print(f"\n{path}\n| way | requests | questions | cold q/s | kept roots q/s | speedup |")
    print("|---|---|---|---|---|---|")
    for way, f in row["ways"].items():
        print(f"| {way} | {f['requests']} | {f['questions']} | {f['cold_questions_per_s']:,} "
              f"| {f['kept_questions_per_s']:,} | {f['speedup']} |")


if __name__ == "__main__":
    main()

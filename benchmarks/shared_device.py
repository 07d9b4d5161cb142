"""What one device gives engines in several processes: the in-process engine of
``service_gpu.py`` phase (a), in 1..N processes at once on the one device, each scoring its
share of the same documents. Tells how much of a device's rate a process leaves unused by its
host work (layout, launch, replies), and what sharing the device between processes costs,
apart from the service around them.

    python benchmarks/shared_device.py --model DIR --load-format dummy --quant fp8 \\
        [--data DIR] [--docs 4000] [--processes 1,2] [--out FILE]

Each process loads the engine and warms it up on its share (two ``score_batch`` calls), then
waits at a barrier; all then score their share once, timed from the barrier to the last
one's end. Per count: questions/s of all together, and each process's own seconds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from service_gpu import load_docs, questions_in, requests_for  # noqa: E402


def scorer(args: argparse.Namespace, requests: list[dict], barrier, results) -> None:
    from spinf_worker.engine import Engine
    from spinf_worker.engine.engine import EngineSettings, freeze_heap

    engine = Engine.load(args.model, device=args.device,
                         settings=EngineSettings(scheme=args.quant), load_format=args.load_format)
    engine.score_batch(requests)      # floors, kernels, graphs
    engine.score_batch(requests)      # the pass sizes without the floors
    freeze_heap()
    barrier.wait()
    t0 = time.perf_counter()
    responses = engine.score_batch(requests)
    seconds = time.perf_counter() - t0
    results.put((t0, time.perf_counter(), seconds,
                 questions_in([r.model_dump(mode="json") for r in responses])))


def run(args: argparse.Namespace, requests: list[dict], n: int) -> dict:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    shares = [requests[k::n] for k in range(n)]
    procs = [ctx.Process(target=scorer, args=(args, share, barrier, results)) for share in shares]
    for p in procs:
        p.start()
    done = [results.get() for _ in procs]
    for p in procs:
        p.join()
    start, end = min(d[0] for d in done), max(d[1] for d in done)
    questions = sum(d[3] for d in done)
    return {"processes": n, "seconds": round(end - start, 4),
            "questions_per_s": round(questions / (end - start), 1),
            "each_seconds": [round(d[2], 4) for d in done]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    ap.add_argument("--quant", default="fp8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--doc-tokens", type=int, default=470)
    ap.add_argument("--processes", default="1,2")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from spinf_worker.models.loader import load_checkpoint

    # the documents' tokenizer only: a dummy checkpoint reads no weights, builds no model
    tokenizer = load_checkpoint(args.model, load_format="dummy").tokenizer
    requests = requests_for(load_docs(args.data, tokenizer, args.docs, args.doc_tokens))
    rows = [run(args, requests, int(n)) for n in args.processes.split(",")]
    for row in rows:
        print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "quant": args.quant,
                                        "docs": args.docs, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Where a pass's time goes on the GPU: torch.profiler over one score_batch of the news job,
or with ``--host``: wall time of consecutive calls, the host's share (laying out the requests,
one replay or launch per pass), and a cProfile of one call.

    python benchmarks/gpu_profile.py --tokenizer DIR --data DIR [--model 12b|270m] \
        [--scheme bf16|fp8] [--host] [--no-graphs] [--case-insensitive] [--slots]

Options are scored exactly as given (``"case_insensitive": false``) unless
``--case-insensitive`` (the hosted default: each option also as its case spellings).
``--slots``: four extraction slots per document too (gpu_jobs.py's slots job), each decoding
step's forward and search marked (``slots.step``, ``slots.next``) in the tables.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_slots import SLOTS  # noqa: E402
from gpu_bench import (  # noqa: E402
    GEMMA_12B,
    GEMMA_270M,
    ROOT,
    build_requests,
    cuda_time,
    doc_layouts,
    load_docs,
    random_checkpoint,
)

from spinf_worker.engine import Engine, EngineSettings  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--model", default="12b")
    parser.add_argument("--scheme", default="bf16")
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--host", action="store_true")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--case-insensitive", action="store_true")
    parser.add_argument("--slots", action="store_true")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    questions = json.loads((ROOT / "benchmarks" / "news_questions.json").read_text())
    if args.slots:
        questions = {**questions, "queries": questions["queries"] + SLOTS}
        mark_decoding()
    requests = build_requests(load_docs(args.data, tokenizer, 24, 470), questions,
                              args.case_insensitive)
    cfg = GEMMA_12B if args.model == "12b" else GEMMA_270M
    ckpt = random_checkpoint(cfg, tokenizer)
    engine = Engine(ckpt, device="cuda", settings=EngineSettings(
        scheme=args.scheme, cuda_graphs=not args.no_graphs))
    engine.score_batch(requests)
    engine.score_batch(requests)
    torch.cuda.synchronize()
    if args.host:
        host_profile(engine, requests, args.rows)
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.score_batch(requests)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.rows))


def mark_decoding() -> None:
    """Each decoding step's forward and its search over the beams as ranges of their own in
    the profiler's tables."""
    from torch.profiler import record_function

    from spinf_worker.engine.decode import SlotDecoder

    def marked(original, label: str):
        def method(self, *args, **kwargs):
            with record_function(label):
                return original(self, *args, **kwargs)
        return method

    SlotDecoder._step = marked(SlotDecoder._step, "slots.step")
    SlotDecoder._next = marked(SlotDecoder._next, "slots.next")


def host_profile(engine: Engine, requests: list[dict], rows: int) -> None:
    from spinf_worker.engine.packer import pack

    print("score_batch s:", [round(cuda_time(lambda: engine.score_batch(requests), 1), 4)
                             for _ in range(6)])
    print("layout s:", [round(cuda_time(lambda: engine.preparer.prepare_batch(requests), 1), 4)
                        for _ in range(3)])
    flats = doc_layouts(engine, requests)
    passes = [[flats[i] for i in p.docs] for p in pack(flats, engine.settings.max_pass_tokens)]
    runner = engine.runner
    for docs in passes:
        t = time.perf_counter()
        pending = runner.launch(docs)
        queued = time.perf_counter() - t
        torch.cuda.synchronize()
        ran = time.perf_counter() - t
        t = time.perf_counter()
        runner.finish(pending)
        print(f"pass of {sum(d.length for d in docs)} rows: queued in {queued * 1e3:.2f} ms, "
              f"done after {ran * 1e3:.2f} ms, read back in {(time.perf_counter() - t) * 1e3:.2f} ms")
    prof = cProfile.Profile()
    prof.enable()
    engine.score_batch(requests)
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(rows)


if __name__ == "__main__":
    main()

"""``spinf-serve bench``: the news job on any model and device, one timed call.

The engine warms up first, untimed: a short document computes the floors of the 56 questions
(scored once per query, then cached), and on CUDA one call of the whole job compiles its pass
sizes; then one ``score_batch`` of every document is timed.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from . import load_engine, news_job


def _synchronize(engine) -> None:
    import torch

    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def measure(engine, requests: list[dict]) -> dict:
    """Warm-up, then the timed call: the job's figures."""
    import torch

    from ..engine.packer import pack

    cuda = engine.device.type == "cuda"
    t0 = time.perf_counter()
    news_job.checked(engine.score_batch([{**requests[0], "text": requests[0]["text"][:200]}]))
    if cuda:
        news_job.checked(engine.score_batch(requests))
        torch.cuda.reset_peak_memory_stats(engine.device)
    warmup_s = time.perf_counter() - t0

    _synchronize(engine)
    t0 = time.perf_counter()
    responses = news_job.checked(engine.score_batch(requests))
    _synchronize(engine)
    wall_s = time.perf_counter() - t0

    questions = news_job.questions_answered(responses)
    tokens = news_job.tokens_read(responses)
    passes = pack(news_job.doc_layouts(engine, requests), engine.settings.max_pass_tokens)
    figures = {
        "questions": questions, "tokens_read": tokens, "passes": len(passes),
        "wall_s": round(wall_s, 4), "warmup_s": round(warmup_s, 2),
        "questions_per_s": round(questions / wall_s, 2),
        "docs_per_s": round(len(requests) / wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 1),
        # the process's peak resident set (Linux reports KiB): the model, its load, the job
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if cuda:
        figures["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated(engine.device) / 2**30, 3)
    return figures


def run(args: argparse.Namespace) -> int:
    data = news_job.data_dir(args.data)   # before torch and the model: a bad path fails fast
    questions = news_job.load_questions(args.questions or news_job.QUESTIONS)
    if args.no_floors:
        questions = {**questions, "empty_floor": False}
    import torch

    t0 = time.perf_counter()
    engine = load_engine(args)
    load_s = time.perf_counter() - t0
    docs = news_job.load_docs(data, engine.checkpoint.tokenizer, args.docs, args.doc_tokens)
    requests = news_job.build_requests(docs, questions, args.case_insensitive)
    report = {
        "model": engine.model_name, "scheme": engine.scheme, "device": str(engine.device),
        "device_class": engine.device_class, "fingerprint": engine.fingerprint,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "docs": len(docs), "doc_tokens": args.doc_tokens,
        "questions_per_doc": len(questions["queries"]),
        "case_insensitive": args.case_insensitive, "floors": not args.no_floors,
        "max_pass_tokens": engine.settings.max_pass_tokens, "load_s": round(load_s, 2),
        **measure(engine, requests),
    }
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)
    return 0


def _print_table(report: dict) -> None:
    lines = [
        ("model", f"{report['model']} ({report['scheme']} on {report['device_class']}, "
                  f"{report['threads']} threads)"),
        ("job", f"{report['docs']} docs x {report['questions_per_doc']} questions, "
                f"{report['tokens_read']} tokens read in {report['passes']} passes"),
        ("questions/s", f"{report['questions_per_s']:.2f}"),
        ("docs/s", f"{report['docs_per_s']:.3f}"),
        ("tokens/s", f"{report['tokens_per_s']:.0f}"),
        ("wall time", f"{report['wall_s']:.2f} s (warm-up {report['warmup_s']:.2f} s, "
                      f"load {report['load_s']:.2f} s, not timed)"),
        ("peak memory", f"{report['peak_rss_mib']:.0f} MiB resident"
         + (f", {report['peak_gpu_gib']:.2f} GiB on the GPU" if "peak_gpu_gib" in report else "")),
        ("fingerprint", report["fingerprint"]),
    ]
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key:<{width}}  {value}", file=sys.stdout)

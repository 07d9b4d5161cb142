"""The Gated DeltaNet rule of one layer over a pass's roots on CUDA, both root forms side by
side (kernels/delta_triton.py): token by token, and by 64-row chunks (roots of
``CHUNKED_ROOT`` rows or more). Random q, k, v, g, beta at the Qwen3.5-27B layer's sizes (48
value heads, head dims 128), ``--docs`` roots of ``--rows`` rows each with a few questions.
Prints each form's milliseconds a layer (median of ``--repeat`` calls after a warm-up) and,
with ``--profile``, the kernels' table of one call.

    python3 benchmarks/delta_roots.py --rows 512 2048 --docs 8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import torch.nn.functional as F

from spinf_worker.engine.layout import Branch, DocTree
from spinf_worker.engine.runner import doc_span
from spinf_worker.kernels import delta_tree, delta_triton
from spinf_worker.kernels.attention import AttentionPlan


def pass_plan(rows: int, docs: int, seed: int = 0):
    """``docs`` documents of ``rows`` content tokens and 8 short questions each, packed."""
    rng = random.Random(seed)
    flats = [DocTree([2] + [rng.randrange(40, 1000) for _ in range(rows)],
                     [Branch([rng.randrange(40, 1000) for _ in range(rng.randint(2, 9))],
                             [[rng.randrange(40, 1000)] for _ in range(3)])
                      for _ in range(8)]).flatten(0) for _ in range(docs)]
    starts = [sum(f.length for f in flats[:i]) for i in range(len(flats))]
    device = torch.device("cuda")
    plan = AttentionPlan([doc_span(f, s, 1 << 30, device) for f, s in zip(flats, starts, strict=True)])
    return plan, sum(f.length for f in flats)


def features(n: int, heads: int, dk: int, dv: int):
    gen = torch.Generator(device="cuda").manual_seed(n)
    q, k, v, a, b = torch.randn(n, heads, 2 * dk + dv + 2, device="cuda",
                                generator=gen).split([dk, dk, dv, 1, 1], dim=-1)
    q = F.normalize(q, dim=-1) * dk ** -0.5
    g = -torch.exp(torch.linspace(-5.0, 0.0, heads, device="cuda")) * F.softplus(a[..., 0])
    return q, F.normalize(k, dim=-1), v.contiguous(), g, b[..., 0].sigmoid()


def timed_ms(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    rule = delta_tree._triton_rule()
    assert rule is not None, "triton does not import"
    chunked_at = delta_triton.CHUNKED_ROOT
    for rows in args.rows:
        row = {"rows": rows, "docs": args.docs, "heads": args.heads}
        for form, threshold in (("token_by_token", 1 << 62), ("chunked", 256)):
            delta_triton.CHUNKED_ROOT = threshold
            plan, n = pass_plan(rows, args.docs)
            inputs = features(n, args.heads, args.dim, args.dim)
            t0 = time.perf_counter()
            rule(plan, *inputs)
            torch.cuda.synchronize()
            row[f"{form}_first_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
            row[f"{form}_ms"] = round(timed_ms(lambda p=plan, x=inputs: rule(p, *x), args.repeat), 3)
            if args.profile:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    rule(plan, *inputs)
                    torch.cuda.synchronize()
                print(f"== {form}, {args.docs} roots of {rows} rows")
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8))
        print(json.dumps(row))
    delta_triton.CHUNKED_ROOT = chunked_at


if __name__ == "__main__":
    main()

"""Which GEMM tiles suit extraction slots' decoding steps? One layer's GEMMs of a model shape
(q|k|v, o, gate|up with its activation, down) at a decoding step's row counts, timed for each
candidate tiling of ``STEP_CONFIGS`` (kernels/triton_matmul.py), fp8 or bf16 weights, random
values. Per shape and row count: microseconds a call and the weights' read rate (the floor
for few rows is reading every weight once).

    python benchmarks/step_tiles.py [--shape 12b] [--scheme fp8] [--rows 128,384,768]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spinf_worker.kernels import triton_matmul  # noqa: E402
from spinf_worker.kernels.fused import gate_up_act  # noqa: E402
from spinf_worker.kernels.rowwise import quantize_rows_fp8  # noqa: E402
from spinf_worker.quant.fp8 import quantize_weight  # noqa: E402

SHAPES = {   # hidden, q|k|v width, o input, intermediate
    "12b": (3840, (16 + 8 + 8) * 256, 16 * 256, 15360),
    "27b": (5376, (32 + 16 + 16) * 128, 32 * 128, 21504),
}
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
CANDIDATES = {
    "fp8": [(128, 256, 128, 8, 8, 3), (64, 128, 128, 8, 4, 4), (64, 64, 128, 8, 4, 4),
            (64, 128, 256, 8, 4, 3), (64, 256, 128, 8, 8, 3), (32, 128, 128, 8, 4, 4)],
    "bf16": [(128, 256, 64, 8, 8, 3), (64, 128, 64, 8, 4, 4), (64, 64, 64, 8, 4, 4),
             (64, 256, 64, 8, 8, 3), (32, 128, 64, 8, 4, 4)],
}


def weights(n: int, k: int, scheme: str):
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    if scheme == "fp8":
        return quantize_weight(w)
    return w.bfloat16(), None


def timed(fn, repeat: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="12b", choices=sorted(SHAPES))
    ap.add_argument("--scheme", default="fp8", choices=("fp8", "bf16"))
    ap.add_argument("--rows", default="128,384,768")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    hidden, qkv, o_in, inter = SHAPES[args.shape]
    layer = {"qkv": (qkv, hidden), "o": (hidden, o_in), "gate_up": (2 * inter, hidden),
             "down": (hidden, inter)}
    w = {name: weights(n, k, args.scheme) for name, (n, k) in layer.items()}
    dtype = torch.float8_e4m3fn if args.scheme == "fp8" else torch.bfloat16
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        x = {name: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
             for name, (_, k) in layer.items()}
        if args.scheme == "fp8":
            x = {name: quantize_rows_fp8(t) for name, t in x.items()}
        else:
            x = {name: (t, None) for name, t in x.items()}
        for tiles in CANDIDATES[args.scheme]:
            triton_matmul.STEP_CONFIGS[dtype] = tiles
            row = {"rows": rows, "tiles": tiles}
            total = 0.0
            for name, (weight, scale) in w.items():
                a, a_scale = x[name]
                if name == "gate_up":
                    def fn(weight=weight, scale=scale, a=a, a_scale=a_scale):
                        gate_up_act(weight, scale, a, a_scale, step=True)
                else:
                    def fn(weight=weight, scale=scale, a=a, a_scale=a_scale):
                        triton_matmul.matmul(a, weight, a_scale=a_scale, w_scale=scale,
                                             out_dtype=torch.bfloat16, step=True)
                us = timed(fn)
                row[f"{name}_us"] = round(us, 1)
                row[f"{name}_weights_tb_s"] = round(weight.numel() * weight.element_size()
                                                    / us / 1e6, 2)
                total += us
            row["layer_us"] = round(total, 1)
            results.append(row)
            print(json.dumps(row), flush=True)
    best = {}
    for row in results:
        if row["rows"] not in best or row["layer_us"] < best[row["rows"]]["layer_us"]:
            best[row["rows"]] = row
    summary = {"shape": args.shape, "scheme": args.scheme,
               "device": torch.cuda.get_device_name(),
               "best": {r: b["tiles"] for r, b in best.items()}, "results": results}
    print(json.dumps(summary["best"]))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

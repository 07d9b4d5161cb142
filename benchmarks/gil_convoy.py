"""How long a thread's torch calls take beside a thread running Python, per switch interval.

Every torch call lets go of the interpreter lock while it runs and takes it back after; a
thread running Python meanwhile keeps it until the switch interval has passed. A thread that
makes many short calls (the engine thread launching a pass: ~35 calls on a GPU) therefore
waits up to one switch interval per call whenever another thread is busy with Python (the
worker's event loop, its parse thread, its responder):

    python benchmarks/gil_convoy.py [--ops 40] [--intervals-ms 5,1,0.5,0.2,0.1] [--out FILE]

Per interval: the ``--ops`` calls' milliseconds alone and beside the busy thread (median and
90th percentile over one second), and how much Python the busy thread ran meanwhile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch


def calls(scratch: torch.Tensor, n: int) -> float:
    """Milliseconds for ``n`` small torch calls."""
    started = time.perf_counter()
    for _ in range(n):
        scratch.add_(1)
    return (time.perf_counter() - started) * 1000


def busy_python(stop: threading.Event, loops: list[int]) -> None:
    while not stop.is_set():
        total = 0
        for i in range(1000):
            total += i
        loops[0] += 1


def measure(interval_ms: float, ops: int) -> dict:
    sys.setswitchinterval(interval_ms / 1000)
    scratch = torch.zeros(16)
    alone = min(calls(scratch, ops) for _ in range(50))
    stop, loops = threading.Event(), [0]
    thread = threading.Thread(target=busy_python, args=(stop, loops))
    thread.start()
    time.sleep(0.05)
    started, beside = time.perf_counter(), []
    while time.perf_counter() - started < 1.0:
        beside.append(calls(scratch, ops))
        time.sleep(0.01)      # the engine thread's other waits (the device, its queue)
    seconds = time.perf_counter() - started
    stop.set()
    thread.join()
    beside.sort()
    return {"interval_ms": interval_ms, "ops": ops, "alone_ms": round(alone, 3),
            "beside_p50_ms": round(statistics.median(beside), 2),
            "beside_p90_ms": round(beside[int(0.9 * len(beside))], 2),
            "busy_loops_per_s": round(loops[0] / seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=40)
    parser.add_argument("--intervals-ms", default="5,1,0.5,0.2,0.1")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(float(ms), args.ops) for ms in args.intervals_ms.split(",")]
    for row in rows:
        print(json.dumps(row))
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""A lone request's latency through the real service on the CPU (default model), and of it
the time its entry waited in the stream for a pass (``timing.queue_ms``) and its pass's
(``timing.score_ms``): ``spinf-serve serve --device cpu`` on a private state dir, five
warm-up requests, then 30 single ``POST /v1/score`` requests one after another (one question
about a one-line text, each text distinct).

    python benchmarks/lone_request.py [--code DIR]

``--code DIR``: serve another checkout's ``spinf_worker/`` and ``api/`` (``git worktree add``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from service_http import Service, free_port  # noqa: E402

BODY = {"text": "The central bank raised rates by half a point on Tuesday, surprising markets.",
        "scoring": {"queries": [{"id": "econ", "template": "Is it about the economy?{?}",
                                 "options": [" yes", " no"]}]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--code", type=Path, default=ROOT)
    ap.add_argument("--requests", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        service = Service(args.code.resolve(), Path(tmp), free_port())
        service.start()
        try:
            service.wait_ready()
            with httpx.Client(base_url=service.url, timeout=120) as client:
                for _ in range(5):
                    client.post("/v1/score", json=BODY).raise_for_status()
                latency, queued, scored = [], [], []
                for i in range(args.requests):
                    body = dict(BODY, text=f"{BODY['text']} ({i})")
                    t0 = time.perf_counter()
                    r = client.post("/v1/score", json=body)
                    latency.append((time.perf_counter() - t0) * 1000)
                    r.raise_for_status()
                    timing = r.json()["timing"]
                    queued.append(timing["queue_ms"])
                    scored.append(timing["score_ms"])
                    time.sleep(0.05)
        finally:
            service.stop()
    print(f"{args.code.resolve().name}: latency ms median {statistics.median(latency):.1f}, "
          f"queue_ms median {statistics.median(queued)}, score_ms median "
          f"{statistics.median(scored)}")


if __name__ == "__main__":
    main()

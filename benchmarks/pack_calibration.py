"""AG News topic accuracy of the news-signals pack before and after calibration (CPU).

The pack's four topic categories (world, sports, business, sci_tech: one question each) are
scored on labelled AG News items; the topic is the category with the highest score. A seeded
half of the items fits the calibration (Platt and isotonic, per category) and the other half
measures accuracy, Brier, ECE and per-category precision/recall, before and after. The
documents are scored once; both methods fit on the same scores.

    python benchmarks/pack_calibration.py --docs 300 --out benchmarks/results

Prints the report, writes ``<date>-pack-calibration-<commit>.json`` and a reliability plot
per method to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATA = ROOT.parent / "shared" / "data" / "ag_news_sample.jsonl"
TOPICS = ["world", "sports", "business", "sci_tech"]


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="AG News JSONL (label_name)")
    parser.add_argument("--docs", type=int, default=300, help="the first N items")
    parser.add_argument("--fit-fraction", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)

    import torch

    from spinf_worker import calibrate as cal
    from spinf_worker.engine import Engine
    from spinf_worker.packs import official_packs

    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.data.exists():
        parser.error(f"{args.data} not found (the shared data lives in ../shared/data)")
    pack = official_packs()["spinf/news-signals"]
    data = cal.read_labelled(args.data, cal.label_map(pack), label_field="label_name",
                             limit=args.docs)
    questions = [q for q in pack.questions if q.category in TOPICS]
    load_avg = os.getloadavg()[0]
    started = time.perf_counter()
    engine = Engine.load(args.model, device=args.device)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    done = 0

    def progress(n: int) -> None:
        nonlocal done
        done += n
        print(f"  {done}/{len(data.texts)} documents, {time.perf_counter() - started:.0f} s",
              file=sys.stderr, flush=True)

    scored = cal.score_questions(engine, questions, data.texts, progress=progress)
    score_s = time.perf_counter() - started
    keep = [i for i, s in enumerate(scored) if s is not None]
    scored, labels = [scored[i] for i in keep], [data.labels[i] for i in keep]
    fit, held = cal.split(len(scored), args.fit_fraction, args.seed)
    fitted_on = cal.fitted_on_record(data, len(fit), engine.model_name)
    stamp = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    sha = commit()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"date": stamp, "commit": sha, "pack": f"{pack.id}@{pack.version}",
               "model": engine.model_name, "device": args.device,
               "threads": torch.get_num_threads(), "torch": torch.__version__,
               "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "load_average_at_start": round(load_avg, 2),
               "data": {"name": data.name, "sha256": data.sha256, "docs": len(scored)},
               "fit_docs": len(fit), "held_out_docs": len(held), "seed": args.seed,
               "questions": len(questions), "model_load_s": round(load_s, 2),
               "scoring_s": round(score_s, 2),
               "questions_per_s": round(len(scored) * len(questions) / score_s, 2),
               "methods": {}}
    for method in ("platt", "isotonic"):
        calibrated = cal.calibrate(pack, [scored[i] for i in fit], [labels[i] for i in fit],
                                   TOPICS, method=method, fitted_on=fitted_on)
        report = cal.before_after(pack, calibrated, [scored[i] for i in held],
                                  [labels[i] for i in held], TOPICS)
        report["calibration"] = calibrated.calibration.model_dump(mode="json")
        results["methods"][method] = report
        png = args.out / f"{stamp}-pack-calibration-{sha}-{method}.png"
        cal.reliability_plot(report, png, title=f"AG News held-out ({len(held)}), {method}")
        print(f"== {method}: fit on {len(fit)}, measured on {len(held)} AG News items")
        print(cal.format_report(report))
        print()
    path = args.out / f"{stamp}-pack-calibration-{sha}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"scored {len(scored)} x {len(questions)} questions in {score_s:.1f} s "
          f"({results['questions_per_s']} questions/s); wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

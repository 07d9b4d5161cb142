"""AG News topic accuracy of the news-signals pack before and after calibration (CPU).

The pack's four topic categories (world, sports, business, sci_tech: one four-way question
read once per topic) are scored on labelled AG News items; the topic is the category with the
highest score. Every item is scored once, the pack run as the API runs it
(``scoring.packs: [{id, version, context, include_queries: true}]``): "before" is the pack as
shipped, its categories read from ``results[0].packs`` (the server's own evaluation, checked
against the pack file's evaluator on the returned queries); "unfitted" is the pack with no
constants fitted (``calibrate.unfitted``: each topic's score its option's p). A seeded half of the items is the
normal traffic and the labelled set that ``spinf_worker.calibrate`` fits the constants on
(reads, Platt maps, thresholds, percentiles); "after" is the calibrated pack evaluated on the
other half's queries. On the held-out half, for each: topic accuracy, Brier, ECE and
per-category precision / recall at the thresholds.

    python benchmarks/pack_calibration.py --docs 300 --out benchmarks/results

Prints the report, writes ``<date>-pack-calibration-<commit>.json``, the calibrated pack file
(``...-pack.json``) and a reliability plot (all three) to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATA = ROOT.parent / "shared" / "data" / "ag_news_sample.jsonl"
PACK = "spinf/news-signals"
TOPICS = ["world", "sports", "business", "sci_tech"]
CHUNK = 32          # requests per score_batch call


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def pack_request(pack, text: str, context: str) -> dict:
    """One input and the pack as a request names it, its queries returned too."""
    return {"messages": [{"role": "user", "content": text}],
            "scoring": {"packs": [{"id": pack.id, "version": pack.version, "context": context,
                                   "include_queries": True}]}}


def score(engine, pack, texts: list[str], context: str, progress) -> tuple[list[dict], int]:
    """Per text its one ``results[0]`` (queries and packs) as plain data; the tokens
    processed (``usage.processed_tokens``) over all of them."""
    out, tokens = [], 0
    for start in range(0, len(texts), CHUNK):
        batch = [pack_request(pack, t, context) for t in texts[start:start + CHUNK]]
        for response in engine.score_batch(batch):
            if isinstance(response, Exception):
                raise response
            out.append(response.model_dump(mode="json")["results"][0])
            tokens += response.usage.processed_tokens
        progress(len(batch))
    return out, tokens


def topic_figures(category_scores: list[dict], labels: list[set[str]]) -> dict:
    """Topic accuracy (the highest-scoring topic category against the label) and, per topic,
    how often it is predicted."""
    predicted = [max(TOPICS, key=lambda c: s[c]["score"]) for s in category_scores]
    right = sum(p in y for p, y in zip(predicted, labels, strict=True))
    return {"accuracy": right / len(labels),
            "predicted": {c: predicted.count(c) for c in TOPICS}}


def reliability_plot(bins: dict[str, list[tuple]], path: Path, title: str) -> bool:
    """Fraction positive against mean score per bin, one line per pack version (False: no
    matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", linewidth=0.8, linestyle="--")
    for name, points in bins.items():
        ax.plot([b[0] for b in points], [b[1] for b in points], marker="o", label=name)
    ax.set_xlabel("mean score")
    ax.set_ylabel("fraction of the topic")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


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
    from spinf_worker.packs import find_pack, official_packs

    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.data.exists():
        parser.error(f"{args.data} not found (the shared data lives in ../shared/data)")
    pack = find_pack(official_packs(), PACK)
    context = next(iter(pack.contexts))
    data = cal.read_texts(args.data, cal.label_map(pack), label_field="label_name",
                          limit=args.docs)
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

    results, processed = score(engine, pack, data.texts, context, progress)
    score_s = time.perf_counter() - started
    queries = [r["queries"] for r in results]
    served = [r["packs"][0]["categories"] for r in results]
    # the server's evaluation is the pack file's, on the queries it returned
    worst = max(abs(pack.evaluate(q, None)["categories"][c]["score"] - s[c]["score"])
                for q, s in zip(queries, served, strict=True) for c in TOPICS)
    fit, held = cal.split(len(results), args.fit_fraction, args.seed)
    stamp = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    record = {"model": engine.model_name, "context": context, "date": stamp,
              "normal": {"name": data.name, "sha256": data.sha256, "n": len(fit),
                         "seed": args.seed},
              "labelled": {"name": data.name, "sha256": data.sha256, "n": len(fit),
                           "seed": args.seed}}
    calibrated, fitted = cal.calibrate(pack, [queries[i] for i in fit],
                                       labelled=[queries[i] for i in fit],
                                       labels=[data.labels[i] for i in fit], record=record)
    held_labels = [data.labels[i] for i in held]
    sha = commit()
    args.out.mkdir(parents=True, exist_ok=True)
    out: dict = {
        "date": stamp, "commit": sha, "pack": pack.group, "model": engine.model_name,
        "device": args.device, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "load_average_at_start": round(load_avg, 2),
        "case_insensitive": pack.case_insensitive,      # the pack's rule
        "data": {"name": data.name, "sha256": data.sha256, "docs": len(results)},
        "fit_docs": len(fit), "held_out_docs": len(held), "seed": args.seed,
        "queries_per_doc": len(queries[0]), "model_load_s": round(load_s, 2),
        "scoring_s": round(score_s, 2),
        "docs_per_s": round(len(results) / score_s, 3),
        "processed_tokens": processed,
        "served_vs_file_max_abs_dscore": worst,
        "fitted": {"platt": fitted.platt, "thresholds": fitted.thresholds,
                   "layer": fitted.layer},
    }
    bins = {}
    bare = cal.unfitted(pack)
    for name, version, evaluated, how in (
            ("unfitted", bare, [bare.evaluate(queries[i], None)["categories"] for i in held],
             cal.Fitted()),
            ("before", pack, [served[i] for i in held], cal.Fitted()),
            ("after", calibrated,
             [calibrated.evaluate(queries[i], None)["categories"] for i in held], fitted)):
        rep = cal.report(version, [queries[i] for i in held], held_labels)
        rep["categories"] = {c: rep["categories"][c] for c in TOPICS if c in rep["categories"]}
        rep.update(topic_figures(evaluated, held_labels))
        out[name] = rep
        pairs = [(s[c]["score"], int(c in y)) for s, y in zip(evaluated, held_labels, strict=True)
                 for c in TOPICS]
        bins[name] = cal.reliability([s for s, _ in pairs], [y for _, y in pairs])
        what = {"unfitted": "no constants fitted: calibrate.unfitted",
                "before": "the pack as shipped", "after": f"calibrated on {len(fit)} items"}
        print(f"== {name} ({what[name]}), measured on {len(held)} AG News items: topic "
              f"accuracy {rep['accuracy']:.3f}")
        print(cal.format_report(rep, how))
        print()
    path = args.out / f"{stamp}-pack-calibration-{sha}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    (args.out / f"{stamp}-pack-calibration-{sha}-pack.json").write_text(
        json.dumps(calibrated.raw, indent=1, ensure_ascii=False) + "\n")
    png = args.out / f"{stamp}-pack-calibration-{sha}.png"
    plotted = reliability_plot(bins, png,
                               f"{pack.group}, AG News held out ({len(held)})")
    print(f"scored {len(results)} documents in {score_s:.1f} s ({out['docs_per_s']} docs/s); "
          f"served vs file evaluation: max |Δscore| {worst:.2e}; wrote {path}"
          + (f" and {png}" if plotted else ""))
    return 0 if math.isfinite(worst) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The PNG of a ``gpu_jobs.py sweeps`` run: questions/s against questions per document and
against document length (tokens/s beside it), from the run's JSON; the PNG goes next to it.

    python benchmarks/plot_sweeps.py benchmarks/results/DATE-gpu-sweeps-COMMIT.json

``lines`` draws the same two panels for several servers at once (peers_gpu.py's report).
Needs matplotlib (the ``calibrate`` extra).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def at_points(axis, xs: list[int]) -> None:
    """A log x axis labelled at the points' values only."""
    import matplotlib.ticker

    axis.set_xscale("log")
    axis.set_xticks(xs, [str(x) for x in xs])
    axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axis.grid(alpha=0.3)


def plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    run = json.loads(Path(path).read_text())
    fig, (by_q, by_len) = plt.subplots(1, 2, figsize=(11, 4.2))
    points = run["by_questions"]
    by_q.plot([p["questions_per_doc"] for p in points], [p["questions_per_s"] for p in points],
              "o-")
    by_q.set(xlabel="questions per document", ylabel="questions/s",
             title=f"{run['docs']} documents x {run['doc_tokens']} tokens")
    at_points(by_q, [p["questions_per_doc"] for p in points])
    points = run["by_length"]
    lengths = [p["doc_tokens"] for p in points]
    by_len.plot(lengths, [p["questions_per_s"] for p in points], "o-", label="questions/s")
    by_len.set(xlabel="document tokens", ylabel="questions/s", title="56 questions per document")
    at_points(by_len, lengths)
    tokens = by_len.twinx()
    tokens.plot(lengths, [p["tokens_per_s"] for p in points], "s--", color="tab:orange",
                label="tokens/s")
    tokens.set_ylabel("tokens/s")
    tokens.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())   # the lengths only
    by_len.legend(handles=by_len.lines + tokens.lines, loc="upper right")
    fig.suptitle(f"{run['device']}, {run['scheme']}, commit {run['commit']}")
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


def lines(series: dict[str, dict[str, list]], titles: dict[str, str], title: str,
          out: Path, styles: dict[str, dict] | None = None) -> Path:
    """Two panels, log-log: ``series[label]["questions"]`` and ``["length"]`` as lists of
    [x, questions/s], one line per label (``styles[label]``: matplotlib's keywords)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, panels = plt.subplots(1, 2, figsize=(12, 4.8))
    for axis, sweep, xlabel in zip(panels, ("questions", "length"),
                                   ("questions per document", "document tokens"), strict=True):
        xs = set()
        for label, by_sweep in series.items():
            points = sorted(by_sweep.get(sweep, []))
            if points:
                xs.update(x for x, _ in points)
                axis.plot([x for x, _ in points], [q for _, q in points], label=label,
                          **(styles or {}).get(label, {"marker": "o"}))
        axis.set(yscale="log", xlabel=xlabel, ylabel="questions/s", title=titles.get(sweep, ""))
        for ticks in (axis.yaxis.set_major_formatter, axis.yaxis.set_minor_formatter):
            ticks(matplotlib.ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 1)))
        if xs:
            at_points(axis, sorted(xs))
        axis.grid(alpha=0.3, which="both")
    panels[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: plot_sweeps.py RUN.json")
    print(plot(Path(sys.argv[1])))

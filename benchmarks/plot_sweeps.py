"""The PNG of a ``gpu_jobs.py sweeps`` run: questions/s against questions per document and
against document length (tokens/s beside it), from the run's JSON; the PNG goes next to it.

    python benchmarks/plot_sweeps.py benchmarks/results/DATE-gpu-sweeps-COMMIT.json

Needs matplotlib (the ``calibrate`` extra).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


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
    by_q.set(xscale="log", xlabel="questions per document", ylabel="questions/s",
             title=f"{run['docs']} documents x {run['doc_tokens']} tokens")
    by_q.set_xticks([p["questions_per_doc"] for p in points],
                    [str(p["questions_per_doc"]) for p in points])
    points = run["by_length"]
    lengths = [p["doc_tokens"] for p in points]
    by_len.plot(lengths, [p["questions_per_s"] for p in points], "o-", label="questions/s")
    by_len.set(xscale="log", xlabel="document tokens", ylabel="questions/s",
               title="56 questions per document")
    by_len.set_xticks(lengths, [str(n) for n in lengths])
    tokens = by_len.twinx()
    tokens.plot(lengths, [p["tokens_per_s"] for p in points], "s--", color="tab:orange",
                label="tokens/s")
    tokens.set_ylabel("tokens/s")
    by_len.legend(handles=by_len.lines + tokens.lines, loc="upper right")
    for axis in (by_q, by_len, tokens):
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())   # the lengths only
    for axis in (by_q, by_len):
        axis.grid(alpha=0.3)
    fig.suptitle(f"{run['device']}, {run['scheme']}, commit {run['commit']}")
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: plot_sweeps.py RUN.json")
    print(plot(Path(sys.argv[1])))

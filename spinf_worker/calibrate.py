"""Calibrating a prompt pack on labelled data: fitting, thresholds, metrics, the report.

Everything but ``score_questions`` (which runs an engine) is pure and works on plain lists:
per document a dict question id -> (p, floor_p) and the set of categories it belongs to.
Brier and ECE are taken over every (document, category) pair: each category's score against
"the document has this category", the question the score answers. torch is never imported
here; the engine is passed in.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .packs import (
    Calibration,
    FittedOn,
    Isotonic,
    Pack,
    PackQuestion,
    Platt,
    category_scores,
    logit,
)

ECE_BINS = 10
PLATT_C = 1e4          # almost no regularisation: two parameters, hundreds of points

QuestionScores = dict[str, tuple[float, float]]     # question id -> (p, floor_p)


# ---- labelled data ---------------------------------------------------------------------------


@dataclass
class Labelled:
    texts: list[str]
    labels: list[set[str]]              # per document: the categories it belongs to
    unmapped: dict[str, int] = field(default_factory=dict)   # raw labels matching no category
    name: str = ""
    sha256: str = ""


def label_map(pack: Pack, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Raw label -> category id: each category's id and ``labels``, then ``extra``."""
    out = {}
    for category in pack.categories:
        out[category.id] = category.id
        for label in category.labels:
            out[label] = category.id
    for label, category in (extra or {}).items():
        if category not in {c.id for c in pack.categories}:
            raise ValueError(f"label map: {label!r} -> unknown category {category!r}")
        out[label] = category
    return out


def document_text(row: dict, text_field: str | None = None) -> str:
    """``text_field``, else ``text``, else the ``title`` and ``description`` (AG News)."""
    if text_field:
        return str(row[text_field])
    if "text" in row:
        return str(row["text"])
    parts = [str(row[k]) for k in ("title", "description") if row.get(k)]
    if not parts:
        raise ValueError("a line has no 'text' (nor 'title' / 'description'); see --text-field")
    return "\n\n".join(parts)


def read_labelled(path: Path, mapping: dict[str, str], *, text_field: str | None = None,
                  label_field: str = "label", limit: int | None = None) -> Labelled:
    """JSONL lines with a text and a label (a string, a number or a list of them; null or
    missing: no category)."""
    raw = Path(path).read_bytes()
    data = Labelled([], [], name=Path(path).name, sha256=hashlib.sha256(raw).hexdigest())
    for number, line in enumerate(raw.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if limit is not None and len(data.texts) >= limit:
            break
        try:
            row = json.loads(line)
            text = document_text(row, text_field)
        except (json.JSONDecodeError, KeyError, ValueError) as err:
            raise ValueError(f"{path}:{number}: {err}") from None
        value = row.get(label_field)
        values = value if isinstance(value, list) else [] if value is None else [value]
        mine = set()
        for label in map(str, values):
            if label in mapping:
                mine.add(mapping[label])
            else:
                data.unmapped[label] = data.unmapped.get(label, 0) + 1
        data.texts.append(text)
        data.labels.append(mine)
    return data


def split(n: int, fit_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """A seeded shuffle of range(n) cut into (fit, held-out)."""
    if not 0.0 < fit_fraction < 1.0:
        raise ValueError("the fit fraction must be between 0 and 1")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    cut = round(n * fit_fraction)
    return sorted(order[:cut]), sorted(order[cut:])


# ---- scoring (the one function that runs a model) -----------------------------------------


def score_questions(engine, questions: Sequence[PackQuestion], texts: Sequence[str], *,
                    chunk: int = 64, progress: Callable[[int], None] | None = None
                    ) -> list[QuestionScores | None]:
    """Per text, each question's positive-option (p, floor_p), from plain queries (equal to
    what the pack returns in a request); None for a text the engine rejected."""
    queries = [{"id": q.id, "template": q.template, "options": q.options} for q in questions]
    out: list[QuestionScores | None] = []
    for start in range(0, len(texts), chunk):
        batch = texts[start:start + chunk]
        results = engine.score_batch([{"text": t, "scoring": {"queries": queries}}
                                      for t in batch])
        for result in results:
            if isinstance(result, Exception):
                out.append(None)
                continue
            scores = {}
            for q, scored in zip(questions, result.queries, strict=True):
                option = next(o for o in scored.combinations[0].options if o.text == q.positive)
                scores[q.id] = (option.p, option.floor_p)
            out.append(scores)
        if progress is not None:
            progress(len(batch))
    return out


# ---- fitting -----------------------------------------------------------------------------


def fit_platt(scores: Sequence[float], labels: Sequence[int]) -> Platt:
    """Logistic regression of the label on logit(score): sigmoid(a * logit(s) + b)."""
    from sklearn.linear_model import LogisticRegression

    if len(set(labels)) < 2:
        raise ValueError("Platt scaling needs both positive and negative examples")
    x = [[logit(s)] for s in scores]
    model = LogisticRegression(C=PLATT_C).fit(x, list(labels))
    return Platt(method="platt", a=float(model.coef_[0][0]), b=float(model.intercept_[0]))


def fit_isotonic(scores: Sequence[float], labels: Sequence[int]) -> Isotonic:
    """The non-decreasing fit of the label on the score, as its breakpoints."""
    from sklearn.isotonic import IsotonicRegression

    model = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip")
    model.fit(list(scores), [float(v) for v in labels])
    return Isotonic(method="isotonic", x=[float(v) for v in model.X_thresholds_],
                    y=[float(v) for v in model.y_thresholds_])


FITS = {"platt": fit_platt, "isotonic": fit_isotonic}


def fit_threshold(scores: Sequence[float], labels: Sequence[int], *,
                  target_precision: float | None = None,
                  target_recall: float | None = None) -> float:
    """The decision threshold (score >= t is positive): with a precision target, the lowest t
    that meets it (the most recall at that precision); with a recall target, the highest t
    that meets it; with neither, the t of best F1. When a target cannot be met, the t that
    comes closest."""
    if target_precision is not None and target_recall is not None:
        raise ValueError("give a precision target or a recall target, not both")
    candidates = sorted(set(scores))
    if not candidates:
        raise ValueError("no scores to fit a threshold on")
    rows = [(t, *precision_recall(scores, labels, t)) for t in candidates]
    if target_precision is not None:
        met = [t for t, p, _ in rows if p >= target_precision]
        return min(met) if met else max(rows, key=lambda r: (r[1], r[0]))[0]
    if target_recall is not None:
        met = [t for t, _, r in rows if r >= target_recall]
        return max(met) if met else candidates[0]
    return max(rows, key=lambda r: (_f1(r[1], r[2]), r[0]))[0]


def _f1(p: float, r: float) -> float:
    return 0.0 if p + r == 0 else 2 * p * r / (p + r)


def calibrate(pack: Pack, scored: Sequence[QuestionScores], labels: Sequence[set[str]],
              categories: Iterable[str], *, method: str = "platt", level: str = "category",
              target: dict[str, float] | None = None, fitted_on: FittedOn) -> Pack:
    """``pack`` with a calibration fitted on (scored, labels) for ``categories``: maps per
    category (on the raw combined score) or per question (each question's p against its
    category's label), then a threshold per category on the calibrated scores. The version's
    patch number goes up by one."""
    raw = pack.uncalibrated()
    categories = list(categories)
    fit = FITS[method]
    maps: dict[str, Platt | Isotonic] = {}
    for c in categories:
        positives = sum(c in y for y in labels)
        if positives in (0, len(labels)):
            raise ValueError(f"category {c!r} has {positives} positive documents of "
                             f"{len(labels)} in the fit part: both kinds are needed (more "
                             "data, or leave it out with --categories)")
    if level == "category":
        raw_cats = [category_scores(raw, s) for s in scored]
        for c in categories:
            maps[c] = fit([cats[c] for cats in raw_cats], [int(c in y) for y in labels])
    elif level == "question":
        for q in raw.questions:
            if q.category in categories:
                maps[q.id] = fit([s[q.id][0] for s in scored],
                                 [int(q.category in y) for y in labels])
    else:
        raise ValueError(f"unknown calibration level {level!r} (category, question)")
    target = dict(target or {})
    calibration = Calibration(fitted_on=fitted_on, target=target,
                              **{"categories" if level == "category" else "questions": maps})
    mapped = raw.model_copy(update={"calibration": calibration})
    cal_cats = [category_scores(mapped, s) for s in scored]
    calibration.thresholds = {
        c: fit_threshold([cats[c] for cats in cal_cats], [int(c in y) for y in labels],
                         target_precision=target.get("precision"),
                         target_recall=target.get("recall"))
        for c in categories}
    data = pack.model_dump(mode="json", exclude_defaults=True)
    data["calibration"] = calibration.model_dump(mode="json", exclude_defaults=True)
    data["calibration"]["fitted_on"] = fitted_on.model_dump(mode="json")
    major, minor, patch = pack.version.split(".")
    data["version"] = f"{major}.{minor}.{int(patch) + 1}"
    return Pack.model_validate(data)


def fitted_on_record(data: Labelled, n: int, model: str = "") -> FittedOn:
    return FittedOn(name=data.name, sha256=data.sha256, n=n, model=model,
                    date=datetime.datetime.now(datetime.timezone.utc).date().isoformat())


# ---- metrics -----------------------------------------------------------------------------


def precision_recall(scores: Sequence[float], labels: Sequence[int], threshold: float
                     ) -> tuple[float, float]:
    tp = sum(1 for s, y in zip(scores, labels, strict=True) if s >= threshold and y)
    fp = sum(1 for s, y in zip(scores, labels, strict=True) if s >= threshold and not y)
    fn = sum(1 for s, y in zip(scores, labels, strict=True) if s < threshold and y)
    precision = tp / (tp + fp) if tp + fp else 1.0     # nothing flagged: no false alarm
    recall = tp / (tp + fn) if tp + fn else 1.0
    return precision, recall


def brier(scores: Sequence[float], labels: Sequence[int]) -> float:
    return sum((s - y) ** 2 for s, y in zip(scores, labels, strict=True)) / len(scores)


def reliability(scores: Sequence[float], labels: Sequence[int], bins: int = ECE_BINS
                ) -> list[tuple[float, float, int]]:
    """Per non-empty equal-width bin of the score: (mean score, fraction positive, count)."""
    sums = [[0.0, 0.0, 0] for _ in range(bins)]
    for s, y in zip(scores, labels, strict=True):
        b = sums[min(int(s * bins), bins - 1)]
        b[0] += s
        b[1] += y
        b[2] += 1
    return [(s / n, y / n, n) for s, y, n in sums if n]


def ece(scores: Sequence[float], labels: Sequence[int], bins: int = ECE_BINS) -> float:
    """Expected calibration error: the count-weighted mean |mean score - fraction positive|
    over equal-width bins."""
    return sum(n * abs(s - y) for s, y, n in reliability(scores, labels, bins)) / len(scores)


def accuracy(cats: Sequence[dict[str, float]], labels: Sequence[set[str]],
             categories: Sequence[str]) -> tuple[float, int]:
    """Top-1 accuracy over the documents that belong to exactly one of ``categories``: the
    category with the highest score is theirs. (accuracy, documents counted)."""
    hits = counted = 0
    for scores, mine in zip(cats, labels, strict=True):
        mine = mine & set(categories)
        if len(mine) != 1:
            continue
        counted += 1
        best = max(categories, key=lambda c: scores[c])
        hits += best in mine
    return (hits / counted if counted else math.nan), counted


def pairs(cats: Sequence[dict[str, float]], labels: Sequence[set[str]],
          categories: Sequence[str]) -> tuple[list[float], list[int]]:
    """Every (document, category) pair as (score, 0/1)."""
    scores, ys = [], []
    for c in categories:
        for doc, mine in zip(cats, labels, strict=True):
            scores.append(doc[c])
            ys.append(int(c in mine))
    return scores, ys


def evaluate(pack: Pack, scored: Sequence[QuestionScores], labels: Sequence[set[str]],
             categories: Sequence[str], thresholds: dict[str, float]) -> dict:
    """Accuracy, Brier, ECE and per-category precision/recall at ``thresholds``."""
    cats = [category_scores(pack, s) for s in scored]
    scores, ys = pairs(cats, labels, categories)
    acc, counted = accuracy(cats, labels, categories)
    per = {}
    for c in categories:
        p, r = precision_recall([d[c] for d in cats], [int(c in y) for y in labels],
                                thresholds[c])
        per[c] = {"threshold": thresholds[c], "precision": p, "recall": r,
                  "positives": sum(c in y for y in labels)}
    return {"accuracy": acc, "accuracy_docs": counted, "brier": brier(scores, ys),
            "ece": ece(scores, ys), "categories": per,
            "reliability": reliability(scores, ys)}


def before_after(raw: Pack, calibrated: Pack, scored: Sequence[QuestionScores],
                 labels: Sequence[set[str]], categories: Sequence[str],
                 raw_threshold: float = 0.5) -> dict:
    """The held-out report: the raw pack at ``raw_threshold``, the calibrated one at its
    fitted thresholds."""
    fitted = calibrated.calibration.thresholds
    return {"before": evaluate(raw, scored, labels, categories,
                               dict.fromkeys(categories, raw_threshold)),
            "after": evaluate(calibrated, scored, labels, categories,
                              {c: fitted[c] for c in categories})}


def format_report(report: dict) -> str:
    before, after = report["before"], report["after"]
    lines = [f"{'':<22}{'before':>10}{'after':>10}",
             f"{'accuracy (top-1)':<22}{before['accuracy']:>10.4f}{after['accuracy']:>10.4f}"
             f"   ({after['accuracy_docs']} docs)",
             f"{'Brier':<22}{before['brier']:>10.4f}{after['brier']:>10.4f}",
             f"{'ECE':<22}{before['ece']:>10.4f}{after['ece']:>10.4f}",
             "", f"{'category':<16}{'n+':>5}  {'before P/R @t':>22}  {'after P/R @t':>22}"]
    for c, b in before["categories"].items():
        a = after["categories"][c]
        lines.append(f"{c:<16}{b['positives']:>5}  "
                     f"{b['precision']:>6.3f}/{b['recall']:.3f} @{b['threshold']:.3f}  "
                     f"{a['precision']:>6.3f}/{a['recall']:.3f} @{a['threshold']:.3f}")
    return "\n".join(lines)


def reliability_plot(report: dict, path: Path, title: str = "") -> Path:
    """Reliability diagram of the held-out (document, category) pairs, before and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5), dpi=100)
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="perfect")
    for key, style in (("before", "o-"), ("after", "s-")):
        points = report[key]["reliability"]
        ax.plot([p[0] for p in points], [p[1] for p in points], style,
                label=f"{key} (ECE {report[key]['ece']:.3f})")
    ax.set_xlabel("mean score in bin")
    ax.set_ylabel("fraction positive")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title(title or "reliability (held-out)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


# ---- the whole run: score, fit on one part, report on the other ----------------------------


def run(pack: Pack, data: Labelled, engine, *, method: str = "platt", level: str = "category",
        target: dict[str, float] | None = None, fit_fraction: float = 0.5, seed: int = 0,
        categories: Sequence[str] | None = None, report_dir: Path | None = None,
        log: Callable[[str], None] = print) -> tuple[Pack, dict]:
    """Scores ``data`` with ``engine``, fits on ``fit_fraction`` of it and reports on the
    rest. Returns (the calibrated pack, the report); with ``report_dir``, writes
    report.json, scores.jsonl (raw question scores) and reliability.png there."""
    import time

    raw = pack.uncalibrated()
    present = set().union(*data.labels) if data.labels else set()
    chosen = list(categories) if categories else [c.id for c in raw.categories
                                                  if c.id in present]
    if not chosen:
        raise ValueError("no label of the data maps to a category of the pack; use "
                         "--label-field / --label-map (categories: "
                         f"{[c.id for c in raw.categories]}; labels seen: {sorted(data.unmapped)})")
    if data.unmapped:
        log(f"labels that match no category (negatives for every category): {data.unmapped}")
    questions = [q for q in raw.questions if q.category in chosen]
    log(f"scoring {len(data.texts)} documents x {len(questions)} questions "
        f"({len(chosen)} categories)")
    started = time.perf_counter()
    scored = score_questions(engine, questions, data.texts)
    seconds = time.perf_counter() - started
    keep = [i for i, s in enumerate(scored) if s is not None]
    if len(keep) < len(scored):
        log(f"{len(scored) - len(keep)} documents the engine rejected are left out")
    scored = [scored[i] for i in keep]
    labels = [data.labels[i] for i in keep]
    fit_idx, test_idx = split(len(scored), fit_fraction, seed)
    fitted_on = fitted_on_record(data, len(fit_idx), getattr(engine, "model_name", ""))
    calibrated = calibrate(raw, [scored[i] for i in fit_idx], [labels[i] for i in fit_idx],
                           chosen, method=method, level=level, target=target,
                           fitted_on=fitted_on)
    report = before_after(raw, calibrated, [scored[i] for i in test_idx],
                          [labels[i] for i in test_idx], chosen)
    report.update(pack=pack.id, version=calibrated.version, method=method, level=level,
                  target=target or {}, categories=chosen, fit_docs=len(fit_idx),
                  held_out_docs=len(test_idx), data={"name": data.name, "sha256": data.sha256,
                                                     "n": len(scored)},
                  questions=len(questions), scoring_seconds=round(seconds, 2),
                  questions_per_s=round(len(scored) * len(questions) / seconds, 2))
    if report_dir is not None:
        report_dir = Path(report_dir)
        report_dir.mkdir(parents=True, exist_ok=True)
        (report_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        with open(report_dir / "scores.jsonl", "w", encoding="utf-8") as f:
            for i, (s, y) in enumerate(zip(scored, labels, strict=True)):
                f.write(json.dumps({"doc": keep[i], "labels": sorted(y), "scores": s}) + "\n")
        reliability_plot(report, report_dir / "reliability.png",
                         title=f"{pack.id}: held-out, {method}")
    return calibrated, report

"""Fitting a pack's constants (`spinf-serve calibrate`).

From the pack's query results on normal traffic (unlabelled texts of the kind the pack will
see), and optionally on labelled texts:

  reads        mu (option / any / set reads: the mean log p per option) and mean / sd, so a
               read's z is 0 on typical traffic and counts standard deviations from it
  platt        per category [a, b] on its macro: a logistic regression on the labelled texts
               (their labels name the category by id or by its `labels`); without labels for
               a category, DEFAULT_PLATT
  thresholds   per category: the best-F1 score on the labelled texts, else the score that
               RATE of normal traffic reaches; a category whose threshold is `null` in the
               file stays reported-only
  percentiles  normal_quantiles: the category scores of normal traffic at LEVELS
  decision     max: the max deciding score RATE of normal traffic reaches; micro_layer:
               a logistic regression on the deciding categories' macros against "any label",
               else equal weights over them (1/n), its cut RATE of normal traffic; its lock

Everything but the scoring callable is plain Python on plain lists (sklearn for the
regressions); torch is never imported here.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .packs import (
    P_CLIP,
    Answers,
    Pack,
    Read,
    encode_weights,
    lock_of,
    pack_from_data,
    read_value,
)

RATE = 0.005           # the share of normal traffic a default threshold flags
LEVELS = [0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.995, 0.999, 1.0]
DEFAULT_PLATT = (1.0, -4.0)   # score 0.5 where the reads sit 4 sd above normal traffic
SD_FLOOR = 0.05        # a read that barely moves on normal traffic must not explode its z
PLATT_C = 1e4          # almost no regularisation: two parameters, hundreds of points
ECE_BINS = 10

# runs the model: (contents, the request's scoring object) -> per content its result queries
Scorer = Callable[[list[str], dict], list[list[dict]]]


# ---- texts -----------------------------------------------------------------------------------


@dataclass
class Texts:
    """JSONL texts, each with the categories its label names (empty: none of them)."""

    texts: list[str]
    labels: list[set[str]]
    ids: list[str] = field(default_factory=list)
    unmapped: dict[str, int] = field(default_factory=dict)   # labels matching no category
    name: str = ""
    sha256: str = ""


def label_map(pack: Pack, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Raw label -> category id: each category's id and `labels`, then ``extra``."""
    out = {}
    for c, spec in pack.file.categories.items():
        out[c] = c
        for label in spec.labels:
            out[label] = c
    for label, c in (extra or {}).items():
        if c not in pack.file.categories:
            raise ValueError(f"label map: {label!r} -> unknown category {c!r}")
        out[label] = c
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


def read_texts(path: Path, mapping: dict[str, str] | None = None, *,
               text_field: str | None = None, label_field: str = "label",
               limit: int | None = None) -> Texts:
    """JSONL lines with a text and, when ``mapping`` is given, a label (a string, a number or
    a list of them; null or missing: no category)."""
    raw = Path(path).read_bytes()
    data = Texts([], [], name=Path(path).name, sha256=hashlib.sha256(raw).hexdigest())
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
        mine = set()
        if mapping is not None:
            value = row.get(label_field)
            for label in map(str, value if isinstance(value, list) else
                             [] if value is None else [value]):
                if label in mapping:
                    mine.add(mapping[label])
                else:
                    data.unmapped[label] = data.unmapped.get(label, 0) + 1
        data.texts.append(text)
        data.labels.append(mine)
        data.ids.append(str(row.get("id", number)))
    return data


def split(n: int, fit_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """A seeded shuffle of range(n) cut into (fit, held-out)."""
    if not 0.0 < fit_fraction < 1.0:
        raise ValueError("the fit fraction must be between 0 and 1")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    cut = round(n * fit_fraction)
    return sorted(order[:cut]), sorted(order[cut:])


# ---- scoring (the one part that runs a model) ------------------------------------------------


def score_texts(score: Scorer, pack: Pack, texts: Sequence[str], *, context: str | None = None,
                chunk: int = 32, progress: Callable[[int], None] | None = None
                ) -> list[list[dict]]:
    """Per text the pack's result queries: the text in the pack's context, the pack's
    queries as the API runs them (its group, floor and case rule)."""
    before, after = pack.wrap(context, None)
    scoring = {"queries": pack.queries(), "case_insensitive": pack.case_insensitive}
    out: list[list[dict]] = []
    for start in range(0, len(texts), chunk):
        batch = [before + t + after for t in texts[start:start + chunk]]
        out += score(batch, scoring)
        if progress is not None:
            progress(len(batch))
    return out


def engine_scorer(engine) -> Scorer:
    """A Scorer over an engine's ``score_batch`` (hosted requests, one input each)."""
    def score(contents: list[str], scoring: dict) -> list[list[dict]]:
        requests = [{"messages": [{"role": "user", "content": text}], "scoring": scoring}
                    for text in contents]
        out = []
        for response in engine.score_batch(requests):
            if isinstance(response, Exception):
                raise response
            body = response.model_dump() if hasattr(response, "model_dump") else response
            out.append(body["results"][0]["queries"] if "results" in body else body["queries"])
        return out
    return score


def read_scores(path: Path) -> list[list[dict]]:
    """Stored results: JSONL lines with the result ``queries`` of one text each."""
    return [json.loads(line)["queries"] for line in Path(path).read_text().splitlines()
            if line.strip()]


# ---- fitting ---------------------------------------------------------------------------------


def quantile(values: Sequence[float], level: float) -> float:
    """Linear between order statistics (numpy's default)."""
    xs = sorted(values)
    pos = level * (len(xs) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(xs) - 1)
    return xs[low] + (xs[high] - xs[low]) * (pos - low)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _sd(xs: Sequence[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def _log_shares(answers: Answers, read: dict) -> list[float]:
    p = [max(x, P_CLIP) for x in answers[(read["query"], read.get("F"))]]
    return [math.log(x / sum(p)) for x in p]


def fit_reads(raw: dict, normal: Sequence[Answers]) -> None:
    """mu, mean and sd of every read on normal traffic (in place, on the file's data)."""
    for read in raw["reads"]:
        if read["kind"] == "option":
            read["mu"] = _mean([_log_shares(a, read)[read["option"]] for a in normal])
        elif read["kind"] in ("any", "set"):
            logs = [_log_shares(a, read) for a in normal]
            read["mu"] = [_mean(column) for column in zip(*logs, strict=True)]
        else:
            read.pop("mu", None)
        model = Read.model_validate({**read, "mean": 0.0, "sd": 1.0})
        values = [read_value(model, a) for a in normal]
        read["mean"] = _mean(values)
        read["sd"] = max(_sd(values), SD_FLOOR)


def fit_platt(macros: Sequence[float], labels: Sequence[int]) -> tuple[float, float]:
    """Logistic regression of the label on the macro: sigmoid(a * macro + b)."""
    from sklearn.linear_model import LogisticRegression

    if len(set(labels)) < 2:
        raise ValueError("a Platt map needs both positive and negative examples")
    model = LogisticRegression(C=PLATT_C).fit([[m] for m in macros], list(labels))
    return float(model.coef_[0][0]), float(model.intercept_[0])


def fit_threshold(scores: Sequence[float], labels: Sequence[int], *,
                  target_precision: float | None = None,
                  target_recall: float | None = None) -> float:
    """The cut (score >= t is positive): with a precision target, the lowest t that meets it
    (the most recall at that precision); with a recall target, the highest t that meets it;
    with neither, the t of best F1. When a target cannot be met, the t that comes closest."""
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


def fit_layer(x: Sequence[Sequence[float]], labels: Sequence[int]) -> tuple[list[float], float]:
    """A logistic regression of "unsafe" on the inputs: (weights, bias)."""
    from sklearn.linear_model import LogisticRegression

    if len(set(labels)) < 2:
        raise ValueError("the micro-layer needs both safe and unsafe examples")
    model = LogisticRegression(C=1.0).fit([list(row) for row in x], list(labels))
    return [float(w) for w in model.coef_[0]], float(model.intercept_[0])


def _round(x: float) -> float:
    return float(f"{x:.6g}")


@dataclass
class Fitted:
    """What calibrate() fitted, for the report and the pack's `calibration` record."""

    platt: dict[str, str] = field(default_factory=dict)        # category -> "labels" | "default"
    thresholds: dict[str, str] = field(default_factory=dict)   # category -> "labels" | "rate"
    layer: str = ""                                            # "labels" | "equal weights"


def calibrate(pack: Pack, normal: Sequence[list[dict]], *, labelled: Sequence[list[dict]] = (),
              labels: Sequence[set[str]] = (), target: dict[str, float] | None = None,
              rate: float = RATE, record: dict | None = None) -> tuple[Pack, Fitted]:
    """``pack`` with its constants fitted: ``normal`` the result queries of normal traffic,
    ``labelled`` / ``labels`` those of labelled texts and their categories. ``record`` is
    written as the file's `calibration` (what was fitted on what)."""
    if not normal:
        raise ValueError("no normal traffic to fit the reads on")
    if len(labelled) != len(labels):
        raise ValueError("labelled results and labels differ in length")
    target = target or {}
    raw = copy.deepcopy(pack.raw)
    raw["decision"].pop("micro_layer", None)     # refitted below, on the new reads
    normal_answers = [pack.answers(q) for q in normal]
    labelled_answers = [pack.answers(q) for q in labelled]
    fit_reads(raw, normal_answers)
    cats = raw["categories"]
    fitted = Fitted()
    # macros need the fitted reads; the Platt maps and thresholds come next
    staged = _staged(raw)
    normal_macros = [staged.macros(staged.read_z(a)) for a in normal_answers]
    labelled_macros = [staged.macros(staged.read_z(a)) for a in labelled_answers]
    for c, spec in cats.items():
        ys = [int(c in y) for y in labels]
        if 0 < sum(ys) < len(ys):
            spec["platt"] = [_round(v) for v in fit_platt([m[c] for m in labelled_macros], ys)]
            fitted.platt[c] = "labels"
        else:
            spec["platt"] = list(DEFAULT_PLATT)
            fitted.platt[c] = "default"
    staged = _staged(raw)
    normal_scores = [_scores(staged, m) for m in normal_macros]
    labelled_scores = [_scores(staged, m) for m in labelled_macros]
    for c, spec in cats.items():
        values = [s[c] for s in normal_scores]
        spec["normal_quantiles"] = {"levels": LEVELS,
                                    "values": [_round(quantile(values, q)) for q in LEVELS]}
        if "threshold" in spec and spec["threshold"] is None:
            continue              # reported only, by the file's choice
        ys = [int(c in y) for y in labels]
        if fitted.platt[c] == "labels":
            spec["threshold"] = _round(fit_threshold(
                [s[c] for s in labelled_scores], ys,
                target_precision=target.get("precision"), target_recall=target.get("recall")))
            fitted.thresholds[c] = "labels"
        else:
            spec["threshold"] = min(_round(quantile(values, 1 - rate)), 1.0)
            fitted.thresholds[c] = "rate"
    deciding = [c for c, spec in cats.items()
                if spec.get("threshold") is not None and spec.get("decides", True)]
    decision = raw["decision"]
    if deciding:
        top = [max(s[c] for c in deciding) for s in normal_scores]
        decision["max"] = {"threshold": min(_round(quantile(top, 1 - rate)), 1.0)}
        decision["micro_layer"] = _fit_micro_layer(deciding, normal_macros, labelled_macros,
                                                   labels, rate, fitted)
    else:
        decision.pop("micro_layer", None)
    if decision["mode"] == "micro_layer" and "micro_layer" not in decision:
        decision["mode"] = "per_category"
    if record is not None:
        raw["calibration"] = record
    if "micro_layer" in decision:
        decision["micro_layer"]["lock"] = lock_of(raw)
    return pack_from_data(raw, f"{pack.group} (calibrated)", source=pack.source), fitted


def unfitted(pack: Pack, record: dict | None = None) -> Pack:
    """``pack`` with the constants that need no data: every read's mu 0, mean 0, sd 1 and
    every Platt map [1, 0], so a category's score is the sigmoid of the mean logit of its
    answers (one yes/no question: its p); thresholds as the file has them (absent: 0.5);
    max at 0.5; no percentiles, no micro-layer (mode micro_layer becomes per_category)."""
    raw = copy.deepcopy(pack.raw)
    options = {q["id"]: len(q["options"]) for q in raw["scoring"]["queries"]}
    for read in raw["reads"]:
        if read["kind"] == "option":
            read["mu"] = 0.0
        elif read["kind"] in ("any", "set"):
            read["mu"] = [0.0] * options[read["query"]]
        read["mean"], read["sd"] = 0.0, 1.0
    for spec in raw["categories"].values():
        spec["platt"] = [1.0, 0.0]
        spec.setdefault("threshold", 0.5)
        spec.pop("normal_quantiles", None)
    decision = raw["decision"]
    decision.pop("micro_layer", None)
    decision["max"] = {"threshold": 0.5}
    if decision["mode"] == "micro_layer":
        decision["mode"] = "per_category"
    if record is not None:
        raw["calibration"] = record
    return pack_from_data(raw, f"{pack.group} (unfitted)", source=pack.source)


def _staged(raw: dict) -> Pack:
    """The pack half-way through its fit (no Platt maps yet: a draft)."""
    return pack_from_data(raw, "calibrating", draft=True)


def _scores(pack: Pack, macros: dict[str, float]) -> dict[str, float]:
    out = {}
    for c, spec in pack.file.categories.items():
        a, b = spec.platt or DEFAULT_PLATT
        z = a * macros[c] + b
        out[c] = 1 / (1 + math.exp(-z)) if z >= 0 else math.exp(z) / (1 + math.exp(z))
    return out


def _fit_micro_layer(deciding: list[str], normal_macros: list[dict], labelled_macros: list[dict],
                     labels: Sequence[set[str]], rate: float, fitted: Fitted) -> dict:
    inputs = [f"c:{c}" for c in deciding]
    unsafe = [int(bool(y & set(deciding))) for y in labels]
    if 0 < sum(unsafe) < len(unsafe):
        weights, bias = fit_layer([[m[c] for c in deciding] for m in labelled_macros], unsafe)
        fitted.layer = "labels"
        how = (f"logistic regression on {len(unsafe)} labelled texts; its cut is the best F1 "
               "of the layer's value")
        values = [sum(w * m[c] for w, c in zip(weights, deciding, strict=True)) + bias
                  for m in labelled_macros]
        cut = fit_threshold(values, unsafe)
    else:
        weights, bias = [1.0 / len(deciding)] * len(deciding), 0.0
        fitted.layer = "equal weights"
        how = (f"not fitted on labels: equal weights (1/{len(deciding)}) over the deciding "
               f"categories' macros; its cut is the value {rate:g} of normal traffic reaches")
        values = [sum(w * m[c] for w, c in zip(weights, deciding, strict=True)) + bias
                  for m in normal_macros]
        cut = quantile(values, 1 - rate)
    return {"inputs": inputs, "weights": encode_weights([*weights, bias, cut]), "hidden": 0,
            "dtype": "float32", "lock": "", "description": how}


def fitted_record(normal: Texts, labelled: Texts | None, model: str, context: str) -> dict:
    """The file's `calibration`: the data each constant was fitted on."""
    out = {"model": model, "context": context,
           "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
           "normal": {"name": normal.name, "sha256": normal.sha256, "n": len(normal.texts)}}
    if labelled is not None:
        out["labelled"] = {"name": labelled.name, "sha256": labelled.sha256,
                           "n": len(labelled.texts)}
    return out


# ---- metrics ---------------------------------------------------------------------------------


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
    """Expected calibration error over equal-width bins, weighted by count."""
    return sum(n * abs(s - y) for s, y, n in reliability(scores, labels, bins)) / len(scores)


def report(pack: Pack, results: Sequence[list[dict]], labels: Sequence[set[str]]) -> dict:
    """On held-out labelled texts: per labelled category precision / recall at its threshold,
    Brier and ECE over those categories' (text, category) pairs."""
    out = [pack.evaluate(q, None)["categories"] for q in results]
    named = sorted({c for y in labels for c in y} & set(pack.file.categories))
    scores, ys, per = [], [], {}
    for c in named:
        column = [o[c]["score"] for o in out]
        truth = [int(c in y) for y in labels]
        scores += column
        ys += truth
        t = pack.file.categories[c].threshold
        p, r = precision_recall(column, truth, t) if t is not None else (math.nan, math.nan)
        per[c] = {"threshold": t, "precision": p, "recall": r, "positives": sum(truth)}
    return {"texts": len(results), "categories": per,
            "brier": brier(scores, ys) if scores else math.nan,
            "ece": ece(scores, ys) if scores else math.nan}


def format_report(rep: dict, fitted: Fitted) -> str:
    lines = [f"held out: {rep['texts']} texts; Brier {rep['brier']:.4f}, ECE {rep['ece']:.4f}",
             f"{'category':<18}{'n+':>5}  {'precision':>9}  {'recall':>7}  threshold"]
    for c, row in rep["categories"].items():
        t = "-" if row["threshold"] is None else f"{row['threshold']:.4f}"
        lines.append(f"{c:<18}{row['positives']:>5}  {row['precision']:>9.3f}  "
                     f"{row['recall']:>7.3f}  {t}")
    by_labels = sorted(c for c, how in fitted.platt.items() if how == "labels")
    lines.append(f"Platt maps fitted on labels: {', '.join(by_labels) or 'none'}; "
                 f"micro-layer: {fitted.layer or 'none'}")
    return "\n".join(lines)

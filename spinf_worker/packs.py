"""Prompt packs: a versioned document of questions, how their answers combine into category
scores, and how category scores become a decision (pure Python, no torch).

A pack is a JSON file (docs/prompt-packs.md). This module holds its format, loading with
precise errors (file, field, reason), and the arithmetic from per-question scores to
(calibrated) categories and a decision.
"""

from __future__ import annotations

import bisect
import json
import math
from functools import cache
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from .errors import InvalidRequestError
from .templates import check_scored_template, parse_template

PACK_ID = r"^[a-z0-9][a-z0-9_.-]*/[a-z0-9][a-z0-9_.-]*$"
VERSION = r"^\d+\.\d+\.\d+$"
SHA256 = r"^[0-9a-f]{64}$"
DATE = r"^\d{4}-\d{2}-\d{2}$"
LOGIT_EPS = 1e-6          # p is clipped to [eps, 1 - eps] before its logit


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")   # a misspelt field must fail at load


class PackQuestion(_Strict):
    id: str = Field(min_length=1, max_length=128)
    template: str
    options: list[str] = Field(min_length=2)
    positive: str                    # the option whose probability is the question's score
    category: str
    weight: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> PackQuestion:
        try:
            check_scored_template(parse_template(self.template), param="template")
        except InvalidRequestError as err:
            raise ValueError(err.message) from None
        if len(set(self.options)) != len(self.options):
            raise ValueError("options repeat")
        if self.positive not in self.options:
            raise ValueError(f"positive {self.positive!r} is not one of the options")
        return self


class Category(_Strict):
    id: str
    combine: Literal["max", "mean", "weighted", "noisy_or"] = "max"
    # "p": the positive option's probability; "lift": max(p - floor_p, 0), what the content added
    on: Literal["p", "lift"] = "p"
    # the labels that mean this category in labelled data (besides its id), for calibration
    labels: list[str] = Field(default_factory=list)


class Rule(_Strict):
    """Fires when every named category's score is at least its threshold; "fitted" is the
    threshold the pack's calibration fitted for that category."""

    label: str
    when: dict[str, float | Literal["fitted"]] = Field(min_length=1)


# ---- calibration: maps a raw score to a probability fitted on labelled data -----------------


def logit(p: float) -> float:
    p = min(max(p, LOGIT_EPS), 1.0 - LOGIT_EPS)
    return math.log(p / (1.0 - p))


def sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)          # no overflow for very negative z
    return e / (1.0 + e)


class Platt(_Strict):
    """sigmoid(a * logit(s) + b)."""

    method: Literal["platt"]
    a: float
    b: float

    def apply(self, s: float) -> float:
        return sigmoid(self.a * logit(s) + self.b)


class Isotonic(_Strict):
    """A non-decreasing step-free curve: linear between the breakpoints (x, y), flat outside."""

    method: Literal["isotonic"]
    x: list[float] = Field(min_length=1)
    y: list[float] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> Isotonic:
        if len(self.x) != len(self.y):
            raise ValueError(f"x has {len(self.x)} breakpoints and y {len(self.y)}")
        if any(b < a for a, b in pairwise(self.x)):
            raise ValueError("x must be non-decreasing")
        if any(b < a for a, b in pairwise(self.y)):
            raise ValueError("y must be non-decreasing")
        if not all(0.0 <= v <= 1.0 for v in self.y):
            raise ValueError("y must lie in [0, 1]")
        return self

    def apply(self, s: float) -> float:
        x, y = self.x, self.y
        if s <= x[0]:
            return y[0]
        if s >= x[-1]:
            return y[-1]
        i = bisect.bisect_right(x, s)          # x[i - 1] <= s < x[i]
        x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
        return y0 if x1 == x0 else y0 + (y1 - y0) * (s - x0) / (x1 - x0)


Calibrator = Annotated[Platt | Isotonic, Field(discriminator="method")]


class FittedOn(_Strict):
    """The labelled data a calibration was fitted on."""

    name: str = Field(min_length=1)
    sha256: str = Field(pattern=SHA256)
    n: int = Field(ge=1)                 # documents used for fitting
    date: str = Field(pattern=DATE)      # YYYY-MM-DD
    model: str = ""                      # the model whose scores were fitted


class Calibration(_Strict):
    """Maps fitted on labelled data. A question's map applies to its positive option's p (and,
    for ``lift``, to its floor_p) before categories combine; a category's map applies to the
    combined score. ``thresholds`` are per category, on the calibrated score."""

    fitted_on: FittedOn
    questions: dict[str, Calibrator] = Field(default_factory=dict)
    categories: dict[str, Calibrator] = Field(default_factory=dict)
    thresholds: dict[str, float] = Field(default_factory=dict)
    target: dict[Literal["precision", "recall"], float] = Field(default_factory=dict,
                                                                max_length=1)


class Decision(_Strict):
    rules: list[Rule] = Field(default_factory=list)   # ordered: the first that fires decides
    default: str = "allow"


class Pack(_Strict):
    id: str = Field(pattern=PACK_ID)
    version: str = Field(pattern=VERSION)
    description: str = ""
    license: str = ""
    presentation: Literal["auto", "raw", "chat"] = "auto"
    questions: list[PackQuestion] = Field(min_length=1)
    categories: list[Category] = Field(min_length=1)
    decision: Decision = Field(default_factory=Decision)
    calibration: Calibration | None = None
    # where it was loaded from, for git sources: {"url", "rev", "commit"} (not part of the file)
    _origin: dict | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check(self) -> Pack:
        ids = [q.id for q in self.questions]
        if len(set(ids)) != len(ids):
            raise ValueError("question ids repeat")
        known = {c.id for c in self.categories}
        for i, q in enumerate(self.questions):
            if q.category not in known:
                raise ValueError(f"questions.{i}: category {q.category!r} is not declared")
        cal = self.calibration
        fitted = cal.thresholds if cal else {}
        for i, rule in enumerate(self.decision.rules):
            for name, threshold in rule.when.items():
                if name not in known:
                    raise ValueError(f"decision.rules.{i}: unknown category {name!r}")
                if threshold == "fitted" and name not in fitted:
                    raise ValueError(f"decision.rules.{i}: category {name!r} has no fitted "
                                     "threshold (calibration.thresholds)")
        if cal is not None:
            for field, names, kind in (("questions", set(ids), "question"),
                                       ("categories", known, "category"),
                                       ("thresholds", known, "category")):
                for name in getattr(cal, field):
                    if name not in names:
                        raise ValueError(f"calibration.{field}: unknown {kind} {name!r}")
        return self

    def summary(self) -> dict:
        out = {"id": self.id, "version": self.version, "questions": len(self.questions),
               "categories": [c.id for c in self.categories],
               "calibrated": self.calibration is not None}
        if self.calibration is not None:
            fitted = self.calibration.fitted_on
            out["fitted_on"] = {"name": fitted.name, "n": fitted.n, "date": fitted.date}
        if self._origin is not None:
            out["source"] = dict(self._origin)
        return out

    def uncalibrated(self) -> Pack:
        """The same pack without its calibration (raw scores), rules with "fitted" dropped."""
        rules = [r for r in self.decision.rules if "fitted" not in r.when.values()]
        return self.model_copy(update={"calibration": None, "decision": self.decision.model_copy(
            update={"rules": rules})})


class PackError(ValueError):
    """A pack that cannot be loaded: which file, which field, why."""


def load_pack(path: Path, shown: str | None = None) -> Pack:
    """``shown``: how errors name the file (default: its path)."""
    shown = str(path) if shown is None else shown
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise PackError(f"{shown}: cannot read the pack: {err}") from None
    try:
        return Pack.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in _data_path(first["loc"])) or "(top level)"
        raise PackError(f"{shown}: {where}: {first['msg']}") from None


def _data_path(loc: tuple) -> list:
    """A calibrator's tagged union adds its tag to the location
    ("calibration.categories.c.platt.a"): keep the path in the data."""
    return [part for i, part in enumerate(loc)
            if not (i >= 3 and loc[i - 3] == "calibration"
                    and loc[i - 2] in ("questions", "categories")
                    and part in ("platt", "isotonic"))]


def load_packs(*dirs: Path, shown: str | None = None) -> dict[str, Pack]:
    """Every ``*.json`` pack under the directories, by id (the highest version wins).
    ``shown``: errors name files as ``{shown}/{path relative to the directory}``."""
    packs: dict[str, Pack] = {}
    for folder in dirs:
        for path in sorted(Path(folder).glob("**/*.json")):
            name = None if shown is None else f"{shown}/{path.relative_to(folder)}"
            merge_packs(packs, {0: load_pack(path, name)})
    return packs


def merge_packs(into: dict[str, Pack], more: dict) -> dict[str, Pack]:
    """Adds ``more``'s packs to ``into``, by id; the highest version wins."""
    for pack in more.values():
        have = into.get(pack.id)
        if have is None or _version(pack.version) > _version(have.version):
            into[pack.id] = pack
    return into


def official_packs() -> dict[str, Pack]:
    """The packs shipped in packs/, by id (a fresh dict; the packs are read once)."""
    return dict(_official_packs())


@cache
def _official_packs() -> dict[str, Pack]:
    return load_packs(Path(__file__).resolve().parents[1] / "packs")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def find_pack(packs: dict[str, Pack], pack_id: str, version: str | None = None) -> Pack:
    pack = packs.get(pack_id)
    if pack is None or (version is not None and pack.version != version):
        wanted = pack_id if version is None else f"{pack_id}@{version}"
        raise InvalidRequestError(f"unknown prompt pack {wanted!r}; loaded: "
                                  f"{sorted(packs) or 'none'}", param="packs",
                                  code="unknown_pack")
    return pack


def combine(values: list[float], weights: list[float], how: str) -> float:
    if how == "max":
        return max(values)
    if how == "mean":
        return sum(values) / len(values)
    if how == "weighted":
        return sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)
    # noisy-or: the chance that at least one question fires, if they fire independently
    return 1.0 - math.prod(1.0 - v for v in values)


def category_scores(pack: Pack, scores: dict[str, tuple[float, float]]) -> dict[str, float]:
    """``scores``: question id -> (p, floor_p) of its positive option. Categories none of
    whose questions were scored (a request asking for some categories only) are left out.
    With a calibration, questions' maps apply before combining, categories' maps after."""
    cal = pack.calibration
    out = {}
    for category in pack.categories:
        mine = [q for q in pack.questions if q.category == category.id and q.id in scores]
        if not mine:
            continue
        values = []
        for q in mine:
            p, floor_p = scores[q.id]
            qmap = cal.questions.get(q.id) if cal else None
            if qmap is not None:
                p, floor_p = qmap.apply(p), qmap.apply(floor_p)
            values.append(p if category.on == "p" else max(p - floor_p, 0.0))
        value = combine(values, [q.weight for q in mine], category.combine)
        cmap = cal.categories.get(category.id) if cal else None
        out[category.id] = cmap.apply(value) if cmap is not None else value
    return out


def thresholds(pack: Pack, rule: Rule) -> dict[str, float]:
    """A rule's thresholds as numbers ("fitted" resolved from the calibration)."""
    fitted = pack.calibration.thresholds if pack.calibration else {}
    return {name: fitted[name] if t == "fitted" else t for name, t in rule.when.items()}


def decide(pack: Pack, categories: dict[str, float]) -> dict:
    """The first rule whose thresholds all hold decides; the reasons are its conditions.
    Rules naming a category that was not scored are skipped."""
    for rule in pack.decision.rules:
        when = thresholds(pack, rule)
        if all(name in categories and categories[name] >= t for name, t in when.items()):
            return {"label": rule.label,
                    "reasons": [{"category": name, "score": categories[name], "threshold": t}
                                for name, t in when.items()]}
    return {"label": pack.decision.default, "reasons": []}

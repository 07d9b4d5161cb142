"""Prompt packs: a versioned document of questions, how their answers combine into category
scores, and how category scores become a decision (pure Python, no torch).

A pack is a JSON file (docs/prompt-packs.md). This module holds its format, loading with
precise errors (file, field, reason), and the arithmetic from per-question scores to
categories and a decision.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import InvalidRequestError
from .templates import check_scored_template, parse_template

PACK_ID = r"^[a-z0-9][a-z0-9_.-]*/[a-z0-9][a-z0-9_.-]*$"
VERSION = r"^\d+\.\d+\.\d+$"


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


class Rule(_Strict):
    """Fires when every named category's score is at least its threshold."""

    label: str
    when: dict[str, float] = Field(min_length=1)


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

    @model_validator(mode="after")
    def _check(self) -> Pack:
        ids = [q.id for q in self.questions]
        if len(set(ids)) != len(ids):
            raise ValueError("question ids repeat")
        known = {c.id for c in self.categories}
        for i, q in enumerate(self.questions):
            if q.category not in known:
                raise ValueError(f"questions.{i}: category {q.category!r} is not declared")
        for i, rule in enumerate(self.decision.rules):
            for name in rule.when:
                if name not in known:
                    raise ValueError(f"decision.rules.{i}: unknown category {name!r}")
        return self

    def summary(self) -> dict:
        return {"id": self.id, "version": self.version, "questions": len(self.questions),
                "categories": [c.id for c in self.categories]}


class PackError(ValueError):
    """A pack that cannot be loaded: which file, which field, why."""


def load_pack(path: Path) -> Pack:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise PackError(f"{path}: cannot read the pack: {err}") from None
    try:
        return Pack.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise PackError(f"{path}: {where}: {first['msg']}") from None


def load_packs(*dirs: Path) -> dict[str, Pack]:
    """Every ``*.json`` pack under the directories, by id (the highest version wins)."""
    packs: dict[str, Pack] = {}
    for folder in dirs:
        for path in sorted(Path(folder).glob("**/*.json")):
            pack = load_pack(path)
            have = packs.get(pack.id)
            if have is None or _version(pack.version) > _version(have.version):
                packs[pack.id] = pack
    return packs


def official_packs() -> dict[str, Pack]:
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
        return sum(v * w for v, w in zip(values, weights)) / sum(weights)
    # noisy-or: the chance that at least one question fires, if they fire independently
    return 1.0 - math.prod(1.0 - v for v in values)


def category_scores(pack: Pack, scores: dict[str, tuple[float, float]]) -> dict[str, float]:
    """``scores``: question id -> (p, floor_p) of its positive option. Categories none of
    whose questions were scored (a request asking for some categories only) are left out."""
    out = {}
    for category in pack.categories:
        mine = [q for q in pack.questions if q.category == category.id and q.id in scores]
        if not mine:
            continue
        values = [scores[q.id][0] if category.on == "p"
                  else max(scores[q.id][0] - scores[q.id][1], 0.0) for q in mine]
        out[category.id] = combine(values, [q.weight for q in mine], category.combine)
    return out


def decide(pack: Pack, categories: dict[str, float]) -> dict:
    """The first rule whose thresholds all hold decides; the reasons are its conditions.
    Rules naming a category that was not scored are skipped."""
    for rule in pack.decision.rules:
        if all(name in categories for name in rule.when) and all(categories[name] >= threshold for name, threshold in rule.when.items()):
            return {"label": rule.label,
                    "reasons": [{"category": name, "score": categories[name],
                                 "threshold": threshold} for name, threshold in rule.when.items()]}
    return {"label": pack.decision.default, "reasons": []}

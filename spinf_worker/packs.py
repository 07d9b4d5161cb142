"""Prompt packs in the hosted spinf API's format (pure Python: no torch).

A pack is one JSON file per version (docs/prompt-packs.md): the scored queries the API runs on
each input (`scoring`), the contexts an input is wrapped in (`contexts`, one `{X}` each), how
the answers become z-scored reads (`reads`), how reads become calibrated category scores
(`categories`) and how scores become a safe / unsafe decision (`decision`). A pack is data:
loading validates the file and names the file, the field and the reason of every problem.

Per input, from the pack's query results:
  answers     per (query id, value of F) the option probabilities, from `p` or, when the pack
              says "answers": "logprob", from the logprobs renormalised over the options
  reads       pair: sign * logit(p0 / (p0 + p1)); option: ln p[j] - mu; any / set: over
              a = ln p - mu, any: logsumexp(a[1:]) - a[0], set: logsumexp(a[unsafe]) -
              logsumexp(a[rest]); then z = (value - mean) / sd
  categories  macro = the mean z of its reads (aggregate "views": the mean of per-view means);
              score = sigmoid(a * macro + b); percentile on normal traffic; flagged = score >=
              threshold (no threshold: reported only); `requires`: flagged only while those are
  decision    max | per_category | micro_layer (a small layer over macros "c:" and read z's
              "r:", used only while its lock matches the file, else the fallback mode); then a
              flagged category of `critical` makes the input unsafe in every mode
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import json
import math
import re
import struct
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import InvalidRequestError

X = "{X}"
MODES = ("max", "per_category", "micro_layer")
LOCK_WARNING = "micro-layer lock mismatch: the pack was edited; using the fallback mode"
P_CLIP = 1e-9         # an option's p is at least this before its log
PAIR_CLIP = 1e-6      # a pair's share is kept in [eps, 1 - eps] before its logit
DECIMALS = 6          # the API rounds scores to 6 decimals
MAX_PACK_BYTES = 16 << 20
PACK_ID = r"^[a-z0-9][a-z0-9._-]*/[a-z0-9][a-z0-9._-]*$"
VERSION = r"^[0-9A-Za-z][0-9A-Za-z.+-]*$"
NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
PLACEHOLDER = re.compile(r"\{([A-Za-z0-9_]+)\}")
SLOT = "{?}"
OFFICIAL_DIR = Path(__file__).resolve().parents[1] / "packs"

Answers = dict[tuple[str, str | None], list[float]]


class PackError(ValueError):
    """A pack file that does not load; ``problems``: one "field: reason" per problem."""

    def __init__(self, where: str, problems: list[str] | str):
        self.where = where
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(f"{where}: " + "; ".join(self.problems))


# ---- the file format -------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")   # a misspelt field fails at load


class Parameter(_Strict):
    """A value the caller gives per input (`inputs[].parameters`), filled into the contexts."""

    label: str = ""
    description: str = ""
    required: bool = True
    default: str | int | float | bool | None = None


class PackQuery(_Strict):
    """A scored query in the hosted shape; the loader adds the pack's group and floor."""

    id: str = Field(min_length=1, max_length=128)
    template: str
    options: list[str] = Field(min_length=2, max_length=1000)
    combinations: list[dict[str, str]] | Literal["all"] | None = None
    values: dict[str, list[str]] | None = None
    empty_floor: bool | None = None

    @field_validator("template")
    @classmethod
    def _one_slot_at_the_end(cls, template: str) -> str:
        if template.count(SLOT) != 1 or not template.endswith(SLOT):
            raise ValueError("a scored template has one {?}, at its end")
        return template

    @field_validator("options")
    @classmethod
    def _distinct(cls, options: list[str]) -> list[str]:
        if len(set(options)) != len(options):
            raise ValueError("options repeat")
        return options

    def placeholders(self) -> set[str]:
        text = self.template.replace("{{", "").replace("}}", "")
        return set(PLACEHOLDER.findall(text))

    def f_values(self) -> list[str | None]:
        """The values of F this query is scored with (None: the query has no combinations)."""
        if isinstance(self.combinations, list):
            return [c.get("F") for c in self.combinations]
        if self.combinations == "all":
            return list((self.values or {}).get("F", [None]))
        return [None]

    def prompts(self) -> int:
        if isinstance(self.combinations, list):
            return len(self.combinations)
        if self.combinations == "all":
            return math.prod(len(v) for v in (self.values or {}).values())
        return 1


class Scoring(_Strict):
    queries: list[PackQuery] = Field(min_length=1)
    empty_floor: bool = True
    case_insensitive: bool = False


class Read(_Strict):
    """One number per input from one query's answers, z-scored on normal traffic."""

    id: str = Field(min_length=1)
    query: str
    F: str | None = None
    kind: Literal["pair", "option", "any", "set"]
    category: str
    view: str | None = None
    sign: Literal[1, -1] = 1                 # pair
    option: int | None = Field(default=None, ge=0)     # option
    unsafe: list[int] | None = None          # set: the option indices that count against
    mu: float | list[float] | None = None    # option: a number; any / set: one per option
    mean: float | None = None
    sd: float | None = Field(default=None, gt=0)


class Quantiles(_Strict):
    """Scores on normal traffic at these levels: a score's percentile is interpolated."""

    levels: list[float] = Field(min_length=2)
    values: list[float] = Field(min_length=2)


class Category(_Strict):
    label: str = ""
    description: str = ""
    platt: tuple[float, float] | None = None          # [a, b]: sigmoid(a * macro + b)
    threshold: float | None = Field(default=None, ge=0, le=1)
    normal_quantiles: Quantiles | None = None
    aggregate: Literal["views"] | None = None
    requires: list[str] | None = None
    decides: bool = True
    labels: list[str] = Field(default_factory=list)   # its names in labelled data (calibrate)


class MaxMode(_Strict):
    threshold: float = Field(ge=0, le=1)


class MicroLayer(_Strict):
    """float32 weights, base64: linear [w..., b, threshold]; with `hidden` tanh units
    [W1 (inputs x hidden), b1, w2, b2, threshold]."""

    inputs: list[str] = Field(min_length=1)
    weights: str
    hidden: int = Field(default=0, ge=0)
    dtype: Literal["float32"] = "float32"
    lock: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    description: str = ""


class Decision(_Strict):
    mode: Literal["max", "per_category", "micro_layer"]
    fallback: Literal["max", "per_category"] = "per_category"
    max: MaxMode | None = None
    per_category: dict | None = None
    micro_layer: MicroLayer | None = None
    critical: list[str] = Field(default_factory=list)


class PackFile(BaseModel):
    """The file. Unknown top-level fields are kept (a hosted pack may carry listing fields)."""

    model_config = ConfigDict(extra="allow")

    pack: str = Field(pattern=PACK_ID)
    version: str = Field(pattern=VERSION)
    model: str = Field(min_length=1)
    name: str = ""
    description: str = ""
    media: list[Literal["text", "image", "audio", "video"]] = Field(default_factory=lambda: ["text"])
    answers: Literal["p", "logprob"] = "p"
    parameters: dict[str, Parameter] = Field(default_factory=dict)
    contexts: dict[str, str] = Field(min_length=1)
    scoring: Scoring
    reads: list[Read] = Field(min_length=1)
    categories: dict[str, Category] = Field(min_length=1)
    decision: Decision


def _problems(f: PackFile, draft: bool) -> list[str]:
    """What pydantic cannot see: references between fields, and (unless ``draft``, a pack
    before its calibration) the fitted constants."""
    out: list[str] = []
    for name in f.parameters:
        if not re.match(NAME, name) or name == "X":
            out.append(f"parameters.{name}: a name of letters, digits and _ (not X)")
    for name, text in f.contexts.items():
        if text.count(X) != 1:
            out.append(f"contexts.{name}: exactly one {X}")
        unknown = sorted({p for p in PLACEHOLDER.findall(text) if p != "X"} - set(f.parameters))
        if unknown:
            out.append(f"contexts.{name}: {{{unknown[0]}}} is not a parameter of the pack")
    queries: dict[str, PackQuery] = {}
    for i, q in enumerate(f.scoring.queries):
        where = f"scoring.queries.{i}"
        if q.id in queries:
            out.append(f"{where}.id: {q.id!r} repeats")
        queries[q.id] = q
        names = q.placeholders()
        if isinstance(q.combinations, list):
            given = [set(c) for c in q.combinations]
            if not given or any(g != names for g in given):
                out.append(f"{where}.combinations: each names exactly {sorted(names)}")
        elif q.combinations == "all":
            if set(q.values or {}) != names or not all((q.values or {}).values()):
                out.append(f"{where}.values: a non-empty list for each of {sorted(names)}")
        elif names:
            out.append(f"{where}.combinations: the template's {sorted(names)} need combinations")
        if q.values is not None and q.combinations != "all":
            out.append(f"{where}.values: only with combinations \"all\"")
    read_ids: set[str] = set()
    for i, r in enumerate(f.reads):
        out += [f"reads.{i}.{p}" for p in _read_problems(r, queries.get(r.query), f, draft)]
        if r.id in read_ids:
            out.append(f"reads.{i}.id: {r.id!r} repeats")
        read_ids.add(r.id)
    fed = {r.category for r in f.reads}
    viewed = {r.category for r in f.reads if r.view}
    for c, spec in f.categories.items():
        where = f"categories.{c}"
        if c not in fed:
            out.append(f"{where}: no read feeds it")
        if spec.aggregate == "views" and c not in viewed:
            out.append(f"{where}.aggregate: \"views\" needs reads with a view")
        if spec.platt is None and not draft:
            out.append(f"{where}.platt: [a, b] is needed")
        for r in spec.requires or []:
            if r not in f.categories or r == c:
                out.append(f"{where}.requires: {r!r} is not another category")
        q = spec.normal_quantiles
        if q is not None and (len(q.levels) != len(q.values) or q.levels != sorted(q.levels)
                              or q.values != sorted(q.values)):
            out.append(f"{where}.normal_quantiles: levels and values, increasing, one each")
    dec = f.decision
    for i, c in enumerate(dec.critical):
        if c not in f.categories:
            out.append(f"decision.critical.{i}: {c!r} is not a category")
    uses_max = "max" in (dec.mode, dec.fallback)
    if uses_max and dec.max is None and not draft:
        out.append("decision.max: {threshold} is needed by mode or fallback max")
    if dec.mode == "micro_layer" and dec.micro_layer is None and not draft:
        out.append("decision.micro_layer: needed by mode micro_layer")
    if dec.micro_layer is not None:
        for i, name in enumerate(dec.micro_layer.inputs):
            kind, _, ref = name.partition(":")
            if not ((kind == "c" and ref in f.categories) or (kind == "r" and ref in read_ids)):
                out.append(f"decision.micro_layer.inputs.{i}: {name!r} is not c:<category> "
                           "or r:<read id>")
        try:
            _decode_layer(dec.micro_layer)
        except ValueError as err:
            out.append(f"decision.micro_layer.weights: {err}")
    return out


def _read_problems(r: Read, q: PackQuery | None, f: PackFile, draft: bool) -> list[str]:
    if r.category not in f.categories:
        return [f"category: {r.category!r} is not a category"]
    if q is None:
        return [f"query: {r.query!r} is not in scoring.queries"]
    if r.F not in q.f_values():
        return [f"F: {r.F!r} is not a value of F in query {q.id!r}"]
    n = len(q.options)
    out = []
    if r.kind == "pair" and n != 2:
        out.append(f"kind: a pair read needs a query of two options ({q.id!r} has {n})")
    if r.kind == "option":
        if r.option is None or r.option >= n:
            out.append(f"option: an option index below {n}")
        if not draft and not isinstance(r.mu, float):
            out.append("mu: an option read needs one number")
    if r.kind in ("any", "set") and not draft and (
            not isinstance(r.mu, list) or len(r.mu) != n):
        out.append(f"mu: a {r.kind} read needs one number per option ({n})")
    if r.kind == "set":
        u = r.unsafe or []
        if not u or not all(0 <= i < n for i in u) or len(set(u)) >= n:
            out.append(f"unsafe: option indices below {n}, some but not all")
    if not draft and (r.mean is None or r.sd is None):
        out.append("mean: mean and sd are needed")
    return out


# ---- the evaluator ---------------------------------------------------------------------------


def _logsumexp(xs: list[float]) -> float:
    top = max(xs)
    return top + math.log(sum(math.exp(x - top) for x in xs))


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)          # no overflow for very negative x
    return e / (1.0 + e)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def answers_of(queries: list[dict], query_ids: set[str], source: str = "p") -> Answers:
    """One input's result queries -> {(query id, F or None): [p per option]} for the pack's
    queries. "logprob": exp(logprob - logsumexp) over the query's options, full precision."""
    out: Answers = {}
    for q in queries:
        if q["id"] not in query_ids:
            continue
        for combo in q["combinations"]:
            if source == "logprob":
                logprobs = [o["logprob"] for o in combo["options"]]
                total = _logsumexp(logprobs)
                ps = [math.exp(lp - total) for lp in logprobs]
            else:
                ps = [o["p"] for o in combo["options"]]
            out[(q["id"], (combo.get("values") or {}).get("F"))] = ps
    return out


def read_value(read: Read, answers: Answers) -> float:
    """The read before its z-score."""
    p = [max(x, P_CLIP) for x in answers[(read.query, read.F)]]
    if read.kind == "pair":
        share = min(max(p[0] / (p[0] + p[1]), PAIR_CLIP), 1 - PAIR_CLIP)
        return read.sign * math.log(share / (1 - share))
    total = sum(p)
    logs = [math.log(x / total) for x in p]
    if read.kind == "option":
        return logs[read.option] - read.mu
    shifted = [x - mu for x, mu in zip(logs, read.mu, strict=True)]
    if read.kind == "any":
        return _logsumexp(shifted[1:]) - shifted[0]
    unsafe = set(read.unsafe)
    return (_logsumexp([shifted[i] for i in sorted(unsafe)])
            - _logsumexp([x for i, x in enumerate(shifted) if i not in unsafe]))


def interpolate(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise linear through (xs, ys), flat outside (numpy.interp)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x) - 1
    return ys[i] + (x - xs[i]) * (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])


def lock_of(raw: dict) -> str:
    """What the micro-layer was fitted on, hashed: the queries, the reads, the Platt maps and
    the layer's inputs (canonical JSON). Thresholds and `critical` stay editable."""
    fitted = {"queries": raw["scoring"]["queries"], "reads": raw["reads"],
              "platt": {c: spec.get("platt") for c, spec in raw["categories"].items()},
              "inputs": raw["decision"]["micro_layer"]["inputs"]}
    canonical = json.dumps(fitted, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def layer_size(inputs: int, hidden: int) -> int:
    """The float32 count of a layer's weights, its threshold included."""
    return inputs * hidden + 2 * hidden + 2 if hidden else inputs + 2


def encode_weights(values: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


class _Layer:
    """A decoded micro-layer: value(x) and its default threshold."""

    def __init__(self, weights: list[float], inputs: int, hidden: int):
        n, h = inputs, hidden
        self.hidden = h
        if h:
            self.w1 = [weights[i * h:(i + 1) * h] for i in range(n)]
            self.b1 = weights[n * h:n * h + h]
            self.w2 = weights[n * h + h:n * h + 2 * h]
            self.b2, self.threshold = weights[n * h + 2 * h], weights[n * h + 2 * h + 1]
        else:
            self.w, self.b, self.threshold = weights[:n], weights[n], weights[n + 1]

    def value(self, x: list[float]) -> float:
        if not self.hidden:
            return sum(xi * wi for xi, wi in zip(x, self.w, strict=True)) + self.b
        units = [math.tanh(sum(x[i] * self.w1[i][k] for i in range(len(x))) + self.b1[k])
                 for k in range(self.hidden)]
        return sum(u * w for u, w in zip(units, self.w2, strict=True)) + self.b2


def _decode_layer(ml: MicroLayer) -> _Layer:
    try:
        raw = base64.b64decode(ml.weights, validate=True)
    except ValueError:
        raise ValueError("not base64") from None
    if len(raw) % 4:
        raise ValueError("not a whole number of float32")
    weights = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    want = layer_size(len(ml.inputs), ml.hidden)
    if len(weights) != want:
        raise ValueError(f"{len(weights)} floats for {len(ml.inputs)} inputs and {ml.hidden} "
                         f"hidden units ({want} expected)")
    return _Layer(weights, len(ml.inputs), ml.hidden)


def _rounded(value: Any) -> Any:
    return round(value, DECIMALS) if isinstance(value, float) else value


# ---- a loaded pack ---------------------------------------------------------------------------


def _number(value: Any, param: str, low: float = -math.inf, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequestError(f"{param} must be a number.", param=param, code="invalid_field")
    if not low <= value <= high:
        raise InvalidRequestError(f"{param} must be between {low:g} and {high:g}.", param=param,
                                  code="invalid_field")
    return float(value)


class Pack:
    """A loaded, validated pack file. ``raw`` is the file as loaded (GET /v1/packs/{id});
    ``source`` says where it came from ("official", a folder, "github:owner/repo@commit")."""

    def __init__(self, raw: dict, file: PackFile, *, source: str = "", draft: bool = False):
        self.raw = raw
        self.file = file
        self.source = source
        self.draft = draft
        self.id: str = file.pack
        self.version: str = file.version
        self.model: str | None = file.model
        self.contexts: dict[str, str] = dict(file.contexts)
        self.case_insensitive: bool = file.scoring.case_insensitive
        ml = file.decision.micro_layer
        self._layer = _decode_layer(ml) if ml is not None else None
        self.lock_ok = ml is not None and ml.lock == lock_of(raw)

    def __repr__(self) -> str:
        return f"Pack({self.group!r})"

    @property
    def group(self) -> str:
        """The query group of the pack's queries: their own prefix tree, so the pack scores
        the same whatever else the call asks."""
        return f"{self.id}@{self.version}"

    @property
    def query_ids(self) -> set[str]:
        return {q.id for q in self.file.scoring.queries}

    @property
    def modes(self) -> list[str]:
        """The decision modes a call may pick: max and micro_layer need their block."""
        dec = self.file.decision
        return [m for m in MODES if m == "per_category" or getattr(dec, m) is not None]

    def prompts(self) -> int:
        """The filled templates one input costs."""
        return sum(q.prompts() for q in self.file.scoring.queries)

    def queries(self) -> list[dict]:
        """The pack's queries as hosted query dicts: the pack's floor setting on each (unless
        the query sets its own) and the pack's group."""
        floor = self.file.scoring.empty_floor
        return [{"empty_floor": floor, **q, "group": self.group}
                for q in self.raw["scoring"]["queries"]]

    def parameter_values(self, parameters: dict | None, param: str = "parameters"
                         ) -> dict[str, str]:
        given = dict(parameters or {})
        out = {}
        for name, spec in self.file.parameters.items():
            value = given.pop(name, spec.default)
            if value is None:
                if spec.required:
                    raise InvalidRequestError(f"{param}: the {self.id} pack needs the "
                                              f"parameter {name!r}.", param=param,
                                              code="invalid_field")
                value = ""
            out[name] = str(value)
        if given:
            raise InvalidRequestError(f"{param}: the {self.id} pack has no parameter "
                                      f"{min(given)!r}.", param=param, code="invalid_field")
        return out

    def wrap(self, context: str | None, parameters: dict | None, *,
             context_param: str = "context", parameters_param: str = "parameters"
             ) -> tuple[str, str]:
        """(text before the content, text after) in the named context (default: the first),
        the pack's parameters filled in."""
        name = context if context is not None else next(iter(self.contexts))
        if name not in self.contexts:
            raise InvalidRequestError(f"{context_param} must be one of "
                                      f"{', '.join(self.contexts)}.", param=context_param,
                                      code="invalid_field")
        before, _, after = self.contexts[name].partition(X)
        for key, value in self.parameter_values(parameters, parameters_param).items():
            before = before.replace("{" + key + "}", value)
            after = after.replace("{" + key + "}", value)
        return before, after

    def check_decision(self, decision: dict | None, param: str) -> None:
        """A request's decision override: {mode?, threshold?, thresholds?, critical?}."""
        if decision is None:
            return
        if not isinstance(decision, dict):
            raise InvalidRequestError(f"{param} must be an object.", param=param,
                                      code="invalid_field")
        unknown = sorted(set(decision) - {"mode", "threshold", "thresholds", "critical"})
        if unknown:
            raise InvalidRequestError(f"{param}: unknown field {unknown[0]!r}.",
                                      param=f"{param}.{unknown[0]}", code="invalid_field")
        mode = decision.get("mode")
        if mode is None:
            mode = self.file.decision.mode
        elif mode not in self.modes:
            raise InvalidRequestError(f"{param}.mode must be one of {', '.join(self.modes)}.",
                                      param=f"{param}.mode", code="invalid_field")
        if decision.get("threshold") is not None:
            where = f"{param}.threshold"
            if mode == "per_category":
                raise InvalidRequestError(f"{where} is the one threshold of max or micro_layer; "
                                          "per_category uses thresholds.", param=where,
                                          code="invalid_field")
            # a max compares a 0-1 category score; the micro-layer's value is unbounded
            _number(decision["threshold"], where, *((0.0, 1.0) if mode == "max" else ()))
        thresholds = decision.get("thresholds")
        if thresholds is not None:
            if not isinstance(thresholds, dict):
                raise InvalidRequestError(f"{param}.thresholds must be an object.",
                                          param=f"{param}.thresholds", code="invalid_field")
            for c, t in thresholds.items():
                where = f"{param}.thresholds.{c}"
                if c not in self.file.categories:
                    raise InvalidRequestError(f"{where}: {self.id} has no category {c!r}.",
                                              param=where, code="unknown_category")
                if t is not None:
                    _number(t, where, 0.0, 1.0)
        critical = decision.get("critical")
        if critical is not None:
            where = f"{param}.critical"
            if not isinstance(critical, list) or not all(isinstance(c, str) for c in critical):
                raise InvalidRequestError(f"{where} must be a list of category ids ([] = none).",
                                          param=where, code="invalid_field")
            for i, c in enumerate(critical):
                if c not in self.file.categories:
                    raise InvalidRequestError(f"{where}.{i}: {self.id} has no category {c!r}.",
                                              param=f"{where}.{i}", code="unknown_category")

    def answers(self, queries: list[dict]) -> Answers:
        return answers_of(queries, self.query_ids, self.file.answers)

    def read_z(self, answers: Answers) -> dict[str, float]:
        try:
            return {r.id: (read_value(r, answers) - r.mean) / r.sd for r in self.file.reads}
        except KeyError as err:
            raise ValueError(f"{self.group}: no result for query {err.args[0]}") from None

    def macros(self, z: dict[str, float]) -> dict[str, float]:
        """Each category's mean z (aggregate "views": the mean of its views' means)."""
        out = {}
        for c, spec in self.file.categories.items():
            mine = [r for r in self.file.reads if r.category == c]
            if spec.aggregate == "views":
                views: dict[str, list[float]] = {}
                for r in mine:
                    if r.view:
                        views.setdefault(r.view, []).append(z[r.id])
                out[c] = _mean([_mean(v) for v in views.values()])
            else:
                out[c] = _mean([z[r.id] for r in mine])
        return out

    def evaluate(self, queries: list[dict], decision: dict | None) -> dict:
        """One input's result queries -> {"categories", "decision"}, rounded as the API
        returns them. ``decision``: the request's override (check_decision first)."""
        if self.draft:
            raise ValueError(f"{self.group} is a draft: it has no fitted constants")
        out = self._evaluate(self.answers(queries), decision or {})
        categories = {c: {k: _rounded(v) for k, v in cat.items()}
                      for c, cat in out["categories"].items()}
        return {"categories": categories,
                "decision": {k: _rounded(v) for k, v in out["decision"].items()}}

    def _evaluate(self, answers: Answers, decision: dict) -> dict:
        f = self.file
        z = self.read_z(answers)
        macros = self.macros(z)
        limits = {c: spec.threshold for c, spec in f.categories.items()}
        limits.update(decision.get("thresholds") or {})
        cats: dict[str, dict] = {}
        for c, spec in f.categories.items():
            a, b = spec.platt
            score = _sigmoid(a * macros[c] + b)
            q = spec.normal_quantiles
            cats[c] = {"score": score,
                       "percentile": interpolate(score, q.values, q.levels) if q else None,
                       "flagged": None if limits[c] is None else score >= limits[c]}
        for c, spec in f.categories.items():   # in file order: a required one may be unset
            if cats[c]["flagged"] and spec.requires:
                cats[c]["flagged"] = all(cats[r]["flagged"] for r in spec.requires)

        asked = decision.get("mode") or f.decision.mode
        used = asked
        if asked == "micro_layer" and not self.lock_ok:
            used = f.decision.fallback
        threshold = decision.get("threshold")
        deciding = [c for c, spec in f.categories.items()
                    if limits[c] is not None and spec.decides]
        if used == "micro_layer":
            x = [macros[name[2:]] if name.startswith("c:") else z[name[2:]]
                 for name in f.decision.micro_layer.inputs]
            value = self._layer.value(x)
            cut = self._layer.threshold if threshold is None else threshold
            out = {"unsafe": value >= cut, "mode": used, "score": value, "threshold": cut}
        elif used == "max":
            # the call's threshold is for the mode it asked; a fallback keeps the pack's
            cut = f.decision.max.threshold if threshold is None or used != asked else threshold
            top = max(deciding, key=lambda c: cats[c]["score"]) if deciding else None
            value = cats[top]["score"] if top else 0.0
            out = {"unsafe": top is not None and value >= cut, "mode": used, "score": value,
                   "threshold": cut, "category": top}
        else:
            hit = [c for c in deciding if cats[c]["flagged"]]
            out = {"unsafe": bool(hit), "mode": "per_category", "categories": hit}
        critical = decision.get("critical")
        critical = f.decision.critical if critical is None else critical
        flagged_critical = [c for c in critical if cats.get(c, {}).get("flagged")]
        if flagged_critical:
            out["critical"] = flagged_critical
            if not out["unsafe"]:
                out["unsafe"] = True
                out["by"] = "critical"
        if used != asked:
            out["warning"] = LOCK_WARNING
        return {"categories": cats, "decision": out, "macros": macros, "z": z}

    def summary(self, versions: list[str] | None = None) -> dict:
        """The GET /v1/packs entry of this version (``versions``: every version loaded)."""
        f = self.file
        dec = f.decision
        return {
            "id": self.id, "name": f.name or self.id, "status": "available",
            "version": self.version, "versions": versions or [self.version],
            "description": f.description, "tags": list(self.raw.get("tags") or []),
            "model": self.model, "media": list(f.media), "source": self.source,
            "parameters": [{"id": k, **p.model_dump(exclude_defaults=True)}
                           for k, p in f.parameters.items()],
            "contexts": [{"id": k, "template": v} for k, v in f.contexts.items()],
            "categories": [{"id": c, "label": s.label or c, "threshold": s.threshold}
                           for c, s in f.categories.items()],
            "decision": {"mode": dec.mode, "modes": self.modes, "fallback": dec.fallback,
                         "max_threshold": dec.max.threshold if dec.max else None,
                         "critical": list(dec.critical)},
            "queries": len(f.scoring.queries), "prompts": self.prompts(),
        }


# ---- loading ---------------------------------------------------------------------------------


def _where(loc: tuple) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def pack_from_data(raw: Any, where: str = "pack", *, source: str = "",
                   draft: bool = False) -> Pack:
    """A Pack from a file's data; every problem is listed in the PackError."""
    if not isinstance(raw, dict):
        raise PackError(where, "(top level): a pack file is a JSON object")
    try:
        file = PackFile.model_validate(raw)
    except ValidationError as err:
        raise PackError(where, [f"{_where(e['loc'])}: {e['msg']}" for e in err.errors()]
                        ) from None
    problems = _problems(file, draft)
    if problems:
        raise PackError(where, problems)
    return Pack(raw, file, source=source, draft=draft)


def load_pack(path: Path, shown: str | None = None, *, source: str = "",
              draft: bool = False) -> Pack:
    """A pack file; ``shown``: how errors name it (default: its path)."""
    shown = str(path) if shown is None else shown
    try:
        if Path(path).stat().st_size > MAX_PACK_BYTES:
            raise PackError(shown, f"(file): larger than {MAX_PACK_BYTES >> 20} MiB")
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PackError(shown, f"(file): cannot read the pack: {err}") from None
    return pack_from_data(raw, shown, source=source or shown, draft=draft)


def _version_key(version: str) -> list[tuple[int, int | str]]:
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"[.+-]", version)]


def add_pack(packs: dict[str, dict[str, Pack]], pack: Pack) -> None:
    """``packs``: id -> version -> Pack, the newest version first. One id@version loads
    from one place only."""
    versions = packs.setdefault(pack.id, {})
    if pack.version in versions:
        have = versions[pack.version]
        raise PackError(pack.source, f"pack: {pack.group} also comes from {have.source}")
    versions[pack.version] = pack
    packs[pack.id] = dict(sorted(versions.items(), key=lambda kv: _version_key(kv[0]),
                                 reverse=True))


def load_packs(folder: Path, shown: str | None = None, source: str = ""
               ) -> dict[str, dict[str, Pack]]:
    """Every pack file under a folder: the *.json whose top level has "pack" or "scoring"
    (other JSON, fixtures or samples, is left alone). ``shown``: how errors name the files
    (``{shown}/{path in the folder}``)."""
    packs: dict[str, dict[str, Pack]] = {}
    for path in sorted(Path(folder).glob("**/*.json")):
        name = str(path) if shown is None else f"{shown}/{path.relative_to(folder)}"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise PackError(name, f"(file): cannot read the pack: {err}") from None
        if isinstance(data, dict) and not ({"pack", "scoring"} & set(data)):
            continue
        add_pack(packs, pack_from_data(data, name, source=source or name))
    return packs


def merge_packs(into: dict[str, dict[str, Pack]], more: dict[str, dict[str, Pack]]
                ) -> dict[str, dict[str, Pack]]:
    for versions in more.values():
        for pack in versions.values():
            add_pack(into, pack)
    return into


def official_packs() -> dict[str, dict[str, Pack]]:
    """The packs shipped in packs/: id -> version -> Pack (fresh dicts; read once)."""
    return {pack_id: dict(versions) for pack_id, versions in _official().items()}


@cache
def _official() -> dict[str, dict[str, Pack]]:
    return load_packs(OFFICIAL_DIR, shown="packs", source="official")


def find_pack(packs: dict[str, dict[str, Pack]], pack_id: str, version: str | None = None, *,
              param: str = "id", version_param: str | None = None) -> Pack:
    """A pack by id and version (default: the newest). ``param`` names the id in errors;
    ``version_param`` the version (default: ``param`` with its last "id" made "version")."""
    versions = packs.get(pack_id)
    if not versions:
        raise InvalidRequestError(f"{param}: no pack {pack_id!r}. See GET /v1/packs.",
                                  param=param, code="unknown_pack")
    if version is None:
        return next(iter(versions.values()))
    if version not in versions:
        if version_param is None:
            head, dot, last = param.rpartition(".")
            version_param = f"{head}{dot}version" if last == "id" else param
        raise InvalidRequestError(f"{version_param}: {pack_id} has no version {version!r}; "
                                  f"versions: {', '.join(versions)}.", param=version_param,
                                  code="unknown_pack_version")
    return versions[version]

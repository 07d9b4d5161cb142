"""``spinf-serve parity``: score a public fixture and hold the scores against a recorded
reference.

A fixture (``fixtures/parity/*.json.gz``) is documents and one scoring block; a reference is
what one model, scheme and device scored on it: its fingerprint and, per document, query,
combination and option, the logprob. With the reference's fingerprint the scores must be
bit-identical; with another (another scheme, device or kernel version) they are held to
tolerances: the largest |Δ logprob| and the share of questions whose top option agrees.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from . import ToolError, gzjson, load_engine

if TYPE_CHECKING:
    from ..engine import Engine

FIXTURE_FORMAT = "spinf-parity-fixture/1"
REFERENCE_FORMAT = "spinf-parity-reference/1"
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "parity"
DEFAULT_FIXTURE = FIXTURES / "mixed-12.json.gz"

# doc id -> query id -> one entry per combination: {"values": {...}, "logprobs": {option: lp}}
Scores = dict[str, dict[str, list[dict]]]
# (doc id, query id, combination index, option text)
OptionKey = tuple[str, str, int, str]


@dataclass(frozen=True)
class Fixture:
    name: str
    scoring: dict
    documents: list[dict]    # {"id", "text"}
    digest: str              # sha256 of its documents and scoring block

    def requests(self, rotation: int = 0) -> list[tuple[str, dict]]:
        """(doc id, request) for every document, the list rotated by ``rotation`` places:
        each repeat packs the documents in another order, so repeats agreeing also says
        that a document's bits do not depend on its neighbours in a pass."""
        docs = self.documents[rotation % len(self.documents):] \
            + self.documents[:rotation % len(self.documents)]
        return [(d["id"], {"text": d["text"], "scoring": self.scoring}) for d in docs]


def load_fixture(path: Path) -> Fixture:
    raw = gzjson.read(path, "fixture")
    if not isinstance(raw, dict) or raw.get("format") != FIXTURE_FORMAT:
        raise ToolError(f"fixture {path} is not a {FIXTURE_FORMAT} file")
    docs, scoring = raw.get("documents"), raw.get("scoring")
    if not (isinstance(docs, list) and docs and isinstance(scoring, dict)
            and all(isinstance(d, dict) and isinstance(d.get("id"), str)
                    and isinstance(d.get("text"), str) for d in docs)):
        raise ToolError(f"fixture {path} needs documents [{{id, text}}, ...] and a scoring block")
    if len({d["id"] for d in docs}) != len(docs):
        raise ToolError(f"fixture {path} repeats a document id")
    canonical = json.dumps({"documents": docs, "scoring": scoring}, sort_keys=True)
    return Fixture(name=str(raw.get("name", path.name)), scoring=scoring, documents=docs,
                   digest=hashlib.sha256(canonical.encode()).hexdigest())


# ---- scoring --------------------------------------------------------------------------------


def scores_of(doc_ids: Sequence[str], responses: Sequence) -> Scores:
    """The option logprobs of each document's response, keyed by ids and option texts."""
    scores: Scores = {}
    for doc_id, response in zip(doc_ids, responses, strict=True):
        if isinstance(response, Exception):
            raise ToolError(f"fixture document {doc_id!r} failed: "
                            f"{getattr(response, 'message', response)}")
        (result,) = response.results
        scores[doc_id] = {
            q.id: [{"values": c.values, "logprobs": {o.text: o.logprob for o in c.options}}
                   for c in q.combinations]
            for q in result.queries if getattr(q, "kind", None) is None}   # extraction: no options
    return dict(sorted(scores.items()))


@dataclass
class Run:
    scores: Scores
    passes: int                  # scoring repeats
    identical_repeats: bool
    first_differing_repeat: int | None = None


def score_fixture(engine: Engine, fixture: Fixture, passes: int) -> Run:
    """Every document in one ``score_batch`` (packed several to a pass), ``passes`` times,
    each repeat in another document order; the first repeat's scores, and whether every
    repeat gave the same bits."""
    first: Scores | None = None
    for repeat in range(passes):
        ids, requests = zip(*fixture.requests(rotation=repeat), strict=True)
        scores = scores_of(ids, engine.score_batch(list(requests)))
        if first is None:
            first = scores
        elif _flat(scores) != _flat(first):   # floats compared as floats: bit equality
            return Run(first, passes, identical_repeats=False, first_differing_repeat=repeat)
    assert first is not None
    return Run(first, passes, identical_repeats=True)


# ---- references -----------------------------------------------------------------------------


def reference_name(engine: Engine) -> str:
    """The conventional file name of the engine's reference: ``<model>.<device>-<scheme>``,
    e.g. gemma-3-270m.cpu-authenticamd-avx2-fp32.json.gz, gemma-3-270m.h200-bf16.json.gz."""
    device = engine.device_class.lower().removeprefix("nvidia ")
    slug = "".join(ch if ch.isalnum() else "-" for ch in device).strip("-")
    return f"{engine.model_name.rsplit('/', 1)[-1]}.{slug}-{engine.scheme}.json.gz"


def engine_identity(engine: Engine) -> dict:
    """What produced a set of scores: the fingerprint's parts that a reader can compare."""
    import torch

    from .. import __version__
    from ..engine.engine import KERNEL_VERSION

    return {"model": engine.model_name, "scheme": engine.scheme,
            "device_class": engine.device_class, "fingerprint": engine.fingerprint,
            "weights_digest": engine.checkpoint.weights_digest, "engine_version": __version__,
            "kernel_version": KERNEL_VERSION, "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def reference_of(engine: Engine, fixture: Fixture, scores: Scores) -> dict:
    return {"format": REFERENCE_FORMAT, **engine_identity(engine),
            "fixture": fixture.name, "fixture_sha256": fixture.digest, "scores": scores}


def load_reference(path: Path, fixture: Fixture) -> dict:
    ref = gzjson.read(path, "reference")
    if not isinstance(ref, dict) or ref.get("format") != REFERENCE_FORMAT:
        raise ToolError(f"reference {path} is not a {REFERENCE_FORMAT} file")
    missing = [k for k in ("model", "scheme", "device_class", "fingerprint", "scores")
               if k not in ref]
    if missing:
        raise ToolError(f"reference {path} lacks {', '.join(missing)}")
    if ref.get("fixture_sha256") != fixture.digest:
        raise ToolError(f"reference {path} was recorded on another fixture than "
                        f"{fixture.name!r} (fixture_sha256 differs)")
    return ref


# ---- comparing ------------------------------------------------------------------------------


def _flat(scores: Scores) -> dict[OptionKey, float]:
    try:
        return {(doc, query, i, option): float(lp)
                for doc, queries in scores.items() for query, combos in queries.items()
                for i, combo in enumerate(combos) for option, lp in combo["logprobs"].items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        raise ToolError("reference scores are not {doc: {query: [{logprobs: {option: "
                        "logprob}}]}}") from None


def _top1(flat: dict[OptionKey, float]) -> dict[tuple[str, str, int], str]:
    """Each question's (document, query, combination) best option (the first of a tie)."""
    best: dict[tuple[str, str, int], tuple[float, str]] = {}
    for (doc, query, i, option), lp in flat.items():
        question = (doc, query, i)
        if question not in best or lp > best[question][0]:
            best[question] = (lp, option)
    return {q: option for q, (_, option) in best.items()}


def _delta(ours: float, theirs: float) -> float:
    """|Δ|; 0 for equal floats (-inf against -inf too), inf where NaN makes it undefined."""
    if ours == theirs:
        return 0.0
    delta = abs(ours - theirs)
    return math.inf if math.isnan(delta) else delta


@dataclass
class Comparison:
    mode: str                   # "bit-identity" (same fingerprint) | "tolerance"
    options: int
    differing: int              # options whose logprob is not the reference's bits
    max_abs_delta: float
    top1_agreement: float
    questions: int
    ok: bool
    tolerances: dict = field(default_factory=dict)


def compare(scores: Scores, ref_scores: Scores, *, same_fingerprint: bool,
            max_abs_delta: float, min_top1: float) -> Comparison:
    ours, theirs = _flat(scores), _flat(ref_scores)
    if ours.keys() != theirs.keys():
        gone = sorted(theirs.keys() - ours.keys()) or sorted(ours.keys() - theirs.keys())
        raise ToolError(f"reference does not score the same options as the fixture (e.g. "
                        f"document {gone[0][0]!r}, query {gone[0][1]!r}, option {gone[0][3]!r})")
    deltas = [_delta(ours[k], theirs[k]) for k in ours]
    differing = sum(1 for d in deltas if d != 0.0)
    worst = max(deltas, default=0.0)
    top_ours, top_theirs = _top1(ours), _top1(theirs)
    agree = sum(top_ours[q] == top_theirs[q] for q in top_ours) / max(len(top_ours), 1)
    if same_fingerprint:
        return Comparison("bit-identity", len(ours), differing, worst, agree, len(top_ours),
                          ok=differing == 0)
    ok = worst <= max_abs_delta and agree >= min_top1
    return Comparison("tolerance", len(ours), differing, worst, agree, len(top_ours), ok=ok,
                      tolerances={"max_abs_delta": max_abs_delta, "min_top1": min_top1})


# ---- the command ----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    fixture_path = Path(args.fixture) if args.fixture else DEFAULT_FIXTURE
    fixture = load_fixture(fixture_path)
    if args.reference is None and args.record is None:
        raise ToolError("give --reference R to compare with (fixtures/parity/ holds the "
                        "recorded ones) or --record OUT to write one")
    ref = load_reference(Path(args.reference), fixture) if args.reference else None
    engine = load_engine(args)   # after the files: a bad path fails before the model loads
    scored = score_fixture(engine, fixture, args.passes)
    ours = engine_identity(engine)
    if args.record:
        gzjson.write(Path(args.record), reference_of(engine, fixture, scored.scores))
    report: dict = {"fixture": str(fixture_path), "documents": len(fixture.documents),
                    "passes": scored.passes, "identical_repeats": scored.identical_repeats,
                    "first_differing_repeat": scored.first_differing_repeat, "run": ours}
    if args.record:
        report["recorded"] = str(args.record)
    ok = scored.identical_repeats
    if ref is not None:
        comparison = compare(scored.scores, ref["scores"],
                             same_fingerprint=ref["fingerprint"] == engine.fingerprint,
                             max_abs_delta=args.max_abs_delta, min_top1=args.min_top1)
        report["reference"] = {"path": str(args.reference),
                               **{k: v for k, v in ref.items() if k not in ("scores", "format")}}
        report["comparison"] = asdict(comparison)
        ok = ok and comparison.ok
    report["ok"] = ok
    if args.json:
        print(json.dumps(report))
    else:
        _print_report(report)
    return 0 if ok else 1


def _print_report(report: dict) -> None:
    out = sys.stdout
    run_id, ref = report["run"], report.get("reference")
    rows = [("", "this run", "reference" if ref else "")]
    for key in ("model", "scheme", "device_class", "fingerprint", "kernel_version", "threads"):
        rows.append((key, str(run_id[key]), str(ref.get(key, "-")) if ref else ""))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, width, strict=True)).rstrip(),
              file=out)
    repeats = ("identical" if report["identical_repeats"] else
               f"DIFFER (repeat {report['first_differing_repeat'] + 1} of {report['passes']})")
    print(f"fixture   {report['fixture']}: {report['documents']} documents, scored "
          f"{report['passes']} time(s): {repeats}", file=out)
    if "recorded" in report:
        print(f"recorded  {report['recorded']}", file=out)
    comparison = report.get("comparison")
    if comparison:
        c = comparison
        if c["mode"] == "tolerance":
            t = c["tolerances"]
            rule = (f"fingerprints differ: |Δ logprob| <= {t['max_abs_delta']:g} and top-1 "
                    f"agreement >= {t['min_top1']:g}")
        else:
            rule = "same fingerprint: every bit must match"
        print(f"compare   {c['mode']} ({rule})", file=out)
        print(f"result    {c['differing']} of {c['options']} logprobs differ, max |Δ logprob| "
              f"{c['max_abs_delta']:.3g}, top-1 agreement {c['top1_agreement']:.4f} over "
              f"{c['questions']} questions", file=out)
    print("PASS" if report["ok"] else "FAIL", file=out)

"""Fitting a pack's constants on hand-computable data: metrics, fits, thresholds, the fitted
pack (it loads, its lock holds, the client decides it the same), the command without a model."""

from __future__ import annotations

import base64
import json
import math
import random
import struct

import pytest
from spinf_client import packs as client

from spinf_worker import calibrate as cal
from spinf_worker.packs import find_pack, official_packs, pack_from_data

DRAFT = {
    "pack": "acme/topics", "version": "1.0.0", "model": "google/gemma-3-270m",
    "contexts": {"text": "Text:\n\n{X}"},
    "scoring": {"queries": [
        {"id": "qa", "template": "\n\nAbout A?{?}", "options": [" yes", " no"]},
        {"id": "qb", "template": "\n\nAbout B?{?}", "options": [" yes", " no"]},
        {"id": "kind", "template": "\n\nKind:{?}", "options": [" a", " b", " c"]}]},
    "reads": [
        {"id": "qa", "query": "qa", "kind": "pair", "category": "a"},
        {"id": "kind_a", "query": "kind", "kind": "option", "option": 0, "category": "a"},
        {"id": "qb", "query": "qb", "kind": "pair", "category": "b"},
        {"id": "kind_bc", "query": "kind", "kind": "set", "unsafe": [1, 2], "category": "b"},
        {"id": "kind_any", "query": "kind", "kind": "any", "category": "topic"}],
    "categories": {"a": {"labels": ["Alpha"]}, "b": {}, "topic": {"threshold": None}},
    "decision": {"mode": "micro_layer", "critical": ["b"]},
}


def result(p: dict[str, list[float]]) -> list[dict]:
    """Result queries in the hosted shape from option probabilities."""
    return [{"id": qid, "combinations": [{"values": {}, "options": [
        {"text": f" o{i}", "logprob": math.log(x), "p": round(x, 6), "floor_p": None}
        for i, x in enumerate(ps)], "residual": 0.0, "floor_residual": None}]}
        for qid, ps in p.items()]


def synthetic(n: int, seed: int, positive: float = 0.0) -> tuple[list[list[dict]], list[set]]:
    """``n`` texts; a share ``positive`` of them is about A (high yes to qa, kind a)."""
    rng = random.Random(seed)
    out, labels = [], []
    for _ in range(n):
        is_a = rng.random() < positive
        pa = min(max(rng.gauss(0.8 if is_a else 0.2, 0.1), 0.01), 0.99)
        pb = min(max(rng.gauss(0.3, 0.1), 0.01), 0.99)
        k = [rng.random() + (2.0 if is_a else 0.0), rng.random(), rng.random()]
        out.append(result({"qa": [pa, 1 - pa], "qb": [pb, 1 - pb],
                           "kind": [x / sum(k) for x in k]}))
        labels.append({"a"} if is_a else set())
    return out, labels


def test_brier_ece_precision_recall_by_hand():
    scores, labels = [0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]
    assert cal.brier(scores, labels) == pytest.approx((0.01 + 0.16 + 0.4225 + 0.04) / 4)
    # bins of 0.1: [0.1] -> |0.1 - 0|; [0.35] -> |0.35 - 1|; [0.4] -> 0.4; [0.8] -> 0.2
    assert cal.ece(scores, labels) == pytest.approx((0.1 + 0.65 + 0.4 + 0.2) / 4)
    assert cal.reliability([1.0, 0.0], [1, 0], bins=4) == [(0.0, 0.0, 1), (1.0, 1.0, 1)]
    assert cal.precision_recall(scores, labels, 0.35) == (pytest.approx(2 / 3), 1.0)
    assert cal.precision_recall(scores, labels, 0.9) == (1.0, 0.0)   # nothing flagged


def test_thresholds_meet_targets():
    scores = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    labels = [0, 0, 1, 0, 1, 1, 0, 1]
    assert cal.fit_threshold(scores, labels, target_precision=0.75) == 0.5
    assert cal.fit_threshold(scores, labels, target_recall=0.75) == 0.5
    assert cal.fit_threshold(scores, labels, target_recall=1.0) == 0.3
    assert cal.fit_threshold(scores, labels) == 0.3      # best F1: P 4/6, R 1
    with pytest.raises(ValueError):
        cal.fit_threshold(scores, labels, target_precision=0.5, target_recall=0.5)


def test_quantile_is_numpys_linear():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert cal.quantile(xs, 0.0) == 1.0 and cal.quantile(xs, 1.0) == 4.0
    assert cal.quantile(xs, 0.5) == 2.5
    assert cal.quantile(xs, 0.9) == pytest.approx(3.7)


def test_platt_fit_recovers_a_known_map():
    rng = random.Random(0)
    macros = [rng.uniform(-4, 4) for _ in range(4000)]
    labels = [int(rng.random() < 1 / (1 + math.exp(-(1.5 * m - 0.5)))) for m in macros]
    a, b = cal.fit_platt(macros, labels)
    assert a == pytest.approx(1.5, abs=0.15) and b == pytest.approx(-0.5, abs=0.15)
    with pytest.raises(ValueError, match="both positive and negative"):
        cal.fit_platt([0.1, 0.2], [1, 1])


def test_reads_are_normalised_on_normal_traffic():
    draft = pack_from_data(DRAFT, draft=True)
    normal, _ = synthetic(300, seed=1)
    raw = json.loads(json.dumps(DRAFT))
    answers = [draft.answers(q) for q in normal]
    cal.fit_reads(raw, answers)
    reads = {r["id"]: r for r in raw["reads"]}
    # a pair read: logit of the yes share; its mean and sd on this traffic
    values = [math.log(a[("qa", None)][0] / a[("qa", None)][1]) for a in answers]
    assert reads["qa"]["mean"] == pytest.approx(sum(values) / len(values))
    assert reads["qa"]["sd"] == pytest.approx(cal._sd(values))
    assert "mu" not in reads["qa"]
    logs = [[math.log(x) for x in a[("kind", None)]] for a in answers]
    assert reads["kind_a"]["mu"] == pytest.approx(sum(r[0] for r in logs) / len(logs))
    assert reads["kind_bc"]["mu"] == pytest.approx([sum(c) / len(c) for c in zip(*logs, strict=True)])
    # an option read minus its mu has mean 0 by construction
    assert reads["kind_a"]["mean"] == pytest.approx(0.0, abs=1e-9)


def test_calibrate_fits_a_pack_that_loads_and_decides_as_the_client():
    draft = pack_from_data(DRAFT, draft=True)
    normal, _ = synthetic(400, seed=2)
    labelled, labels = synthetic(300, seed=3, positive=0.4)
    pack, fitted = cal.calibrate(draft, normal, labelled=labelled, labels=labels,
                                 record={"normal": {"n": 400}})
    assert pack.lock_ok and pack.raw["calibration"] == {"normal": {"n": 400}}
    assert fitted.platt == {"a": "labels", "b": "default", "topic": "default"}
    assert fitted.thresholds == {"a": "labels", "b": "rate"}
    assert fitted.layer == "labels"
    cats = pack.raw["categories"]
    assert cats["b"]["platt"] == list(cal.DEFAULT_PLATT)
    assert cats["a"]["platt"][0] > 0             # more "about A" -> a higher score
    assert cats["topic"]["threshold"] is None    # reported only, as the draft says
    for spec in cats.values():
        q = spec["normal_quantiles"]
        assert q["levels"] == cal.LEVELS and q["values"] == sorted(q["values"])
    # the default threshold flags about RATE of normal traffic
    flagged = [pack.evaluate(q, None)["categories"]["b"]["flagged"] for q in normal]
    assert sum(flagged) / len(flagged) == pytest.approx(cal.RATE, abs=0.01)
    modes = set(pack.modes)
    assert modes == {"max", "per_category", "micro_layer"}
    for q in labelled[:50]:
        for mode in modes:
            want = client.evaluate(pack.raw, client.answers_from_result(q, pack.raw), mode)
            got = pack.evaluate(q, {"mode": mode})
            assert got["decision"]["unsafe"] == want["decision"]["unsafe"]
            assert got["categories"]["a"]["score"] == round(want["categories"]["a"]["score"], 6)
    # the labelled part separates A: precision and recall well above chance
    rep = cal.report(pack, labelled, labels)
    assert rep["categories"]["a"]["precision"] > 0.8 and rep["categories"]["a"]["recall"] > 0.8
    assert "Platt maps fitted on labels: a" in cal.format_report(rep, fitted)


def test_without_labels_the_micro_layer_is_equal_weights():
    draft = pack_from_data(DRAFT, draft=True)
    normal, _ = synthetic(200, seed=4)
    pack, fitted = cal.calibrate(draft, normal)
    assert fitted.layer == "equal weights" and set(fitted.platt.values()) == {"default"}
    ml = pack.raw["decision"]["micro_layer"]
    raw = base64.b64decode(ml["weights"])
    weights = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert ml["inputs"] == ["c:a", "c:b"]
    assert weights[:3] == (0.5, 0.5, 0.0) and "not fitted on labels" in ml["description"]
    values = sorted(client.evaluate(pack.raw, client.answers_from_result(q, pack.raw))
                    ["decision"]["score"] for q in normal)
    assert weights[3] == pytest.approx(cal.quantile(values, 1 - cal.RATE), rel=1e-5)
    assert client.lock_of(pack.raw) == ml["lock"]


def test_unfitted_constants_make_a_score_the_answers_p():
    draft = pack_from_data({**DRAFT, "categories": {
        "a": {"threshold": 0.7}, "b": {}, "topic": {"threshold": None}}}, draft=True)
    pack = cal.unfitted(draft)
    assert pack.file.decision.mode == "per_category" and pack.file.decision.micro_layer is None
    q = result({"qa": [0.9, 0.1], "qb": [0.2, 0.8], "kind": [0.5, 0.25, 0.25]})
    out = pack.evaluate(q, None)
    # a: the mean of logit(0.9) and ln 0.5 (an option read minus mu 0)
    macro = (math.log(9) + math.log(0.5)) / 2
    assert out["categories"]["a"]["score"] == round(1 / (1 + math.exp(-macro)), 6)
    assert out["categories"]["a"]["percentile"] is None
    assert [pack.file.categories[c].threshold for c in ("a", "b", "topic")] == [0.7, 0.5, None]


def test_official_packs_record_what_was_fitted():
    for versions in official_packs().values():
        for pack in versions.values():
            record = pack.raw["calibration"]
            assert record["model"] == pack.model
            assert ("normal" in record) == any(
                "normal_quantiles" in c for c in pack.raw["categories"].values())
    moderation = find_pack(official_packs(), "spinf/moderation")
    assert "equal weights" in moderation.raw["decision"]["micro_layer"]["description"]


def test_the_command_fits_stored_results_without_a_model(tmp_path, capsys):
    from spinf_worker.cli import main

    normal, _ = synthetic(100, seed=5)
    (tmp_path / "draft.json").write_text(json.dumps(DRAFT))
    (tmp_path / "normal.jsonl").write_text("".join(
        json.dumps({"id": i, "text": f"text {i}"}) + "\n" for i in range(100)))
    (tmp_path / "scores.jsonl").write_text("".join(
        json.dumps({"queries": q}) + "\n" for q in normal))
    out = tmp_path / "fitted.json"
    assert main(["calibrate", "--pack", str(tmp_path / "draft.json"), "--normal",
                 str(tmp_path / "normal.jsonl"), "--scores", str(tmp_path / "scores.jsonl"),
                 "-o", str(out)]) == 0
    assert "acme/topics@1.0.0: fitted on 100 normal texts" in capsys.readouterr().out
    fitted = pack_from_data(json.loads(out.read_text()))
    assert fitted.lock_ok and fitted.raw["calibration"]["normal"]["n"] == 100
    assert fitted.raw["calibration"]["context"] == "text"
    assert main(["calibrate", "--pack", "acme/nope", "--normal",
                 str(tmp_path / "normal.jsonl"), "-o", str(out)]) == 2
    assert "no pack 'acme/nope'" in capsys.readouterr().err


def test_texts_are_scored_in_the_context_as_the_api_runs_the_pack():
    draft = pack_from_data(DRAFT, draft=True)
    calls = []

    def score(contents, scoring):
        calls.append((contents, scoring))
        return [[] for _ in contents]

    out = cal.score_texts(score, draft, ["one", "two", "three"], chunk=2)
    assert out == [[], [], []]
    assert [c for c, _ in calls] == [["Text:\n\none", "Text:\n\ntwo"], ["Text:\n\nthree"]]
    scoring = calls[0][1]
    assert scoring == {"queries": draft.queries(), "case_insensitive": False}
    assert all(q["group"] == "acme/topics@1.0.0" for q in scoring["queries"])

"""Calibration math on hand-computable data: metrics, fits, thresholds, the calibrated pack."""

from __future__ import annotations

import json
import math

import pytest

from spinf_worker import calibrate as cal
from spinf_worker.packs import FittedOn, Pack, category_scores

FITTED_ON = FittedOn(name="d.jsonl", sha256="0" * 64, n=8, date="2026-11-30")

PACK = Pack.model_validate({
    "id": "acme/topics", "version": "1.0.0",
    "questions": [{"id": "qa", "category": "a", "template": "A?{?}", "options": [" y", " n"],
                   "positive": " y"},
                  {"id": "qb", "category": "b", "template": "B?{?}", "options": [" y", " n"],
                   "positive": " y"}],
    "categories": [{"id": "a", "labels": ["Alpha"]}, {"id": "b"}],
    "decision": {"rules": [{"label": "is_a", "when": {"a": 0.5}}], "default": "other"}})


def test_brier_ece_precision_recall_by_hand():
    scores, labels = [0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]
    assert cal.brier(scores, labels) == pytest.approx((0.01 + 0.16 + 0.4225 + 0.04) / 4)
    # bins of 0.1: [0.1] -> |0.1 - 0|; [0.35] -> |0.35 - 1|; [0.4] -> 0.4; [0.8] -> 0.2
    assert cal.ece(scores, labels) == pytest.approx((0.1 + 0.65 + 0.4 + 0.2) / 4)
    # two bins: [0.1, 0.4, 0.35] mean 0.28333 vs 1/3; [0.8] vs 1
    assert cal.ece(scores, labels, bins=2) == pytest.approx((3 * abs(0.85 / 3 - 1 / 3) + 0.2) / 4)
    assert cal.reliability([1.0, 0.0], [1, 0], bins=4) == [(0.0, 0.0, 1), (1.0, 1.0, 1)]
    assert cal.precision_recall(scores, labels, 0.35) == (pytest.approx(2 / 3), 1.0)
    assert cal.precision_recall(scores, labels, 0.5) == (1.0, 0.5)
    assert cal.precision_recall(scores, labels, 0.9) == (1.0, 0.0)   # nothing flagged


def test_accuracy_and_pairs():
    cats = [{"a": 0.9, "b": 0.2}, {"a": 0.6, "b": 0.7}, {"a": 0.1, "b": 0.3}, {"a": 1, "b": 1}]
    labels = [{"a"}, {"a"}, {"b"}, {"a", "b"}]      # the last one has two: not counted
    assert cal.accuracy(cats, labels, ["a", "b"]) == (pytest.approx(2 / 3), 3)
    scores, ys = cal.pairs(cats[:2], labels[:2], ["a", "b"])
    assert scores == [0.9, 0.6, 0.2, 0.7] and ys == [1, 1, 0, 0]


def test_thresholds_meet_targets():
    scores = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    labels = [0, 0, 1, 0, 1, 1, 0, 1]
    # precision >= 0.75 first holds at t = 0.5 (3 of 4 above), the lowest such t
    assert cal.fit_threshold(scores, labels, target_precision=0.75) == 0.5
    # recall >= 0.75: t = 0.5 keeps 3 of the 4 positives; 0.6 keeps 2
    assert cal.fit_threshold(scores, labels, target_recall=0.75) == 0.5
    assert cal.fit_threshold(scores, labels, target_recall=1.0) == 0.3
    # best F1: t = 0.3 -> P 4/6, R 1 -> F1 0.8
    assert cal.fit_threshold(scores, labels) == 0.3
    with pytest.raises(ValueError):
        cal.fit_threshold(scores, labels, target_precision=0.5, target_recall=0.5)


def test_platt_fit_recovers_a_known_map():
    # labels drawn (deterministically) with P(y=1) = sigmoid(2 logit(s) - 1)
    scores, labels = [], []
    for i in range(1, 100):
        s = i / 100
        true = 1 / (1 + math.exp(-(2 * math.log(s / (1 - s)) - 1)))
        positives = round(true * 40)
        scores += [s] * 40
        labels += [1] * positives + [0] * (40 - positives)
    fitted = cal.fit_platt(scores, labels)
    assert fitted.a == pytest.approx(2.0, abs=0.05) and fitted.b == pytest.approx(-1.0, abs=0.05)
    with pytest.raises(ValueError):
        cal.fit_platt([0.1, 0.2], [1, 1])


def test_isotonic_fit_is_monotone_and_exact_on_sorted_data():
    fitted = cal.fit_isotonic([0.1, 0.2, 0.3, 0.4], [0, 1, 0, 1])
    # pools the violating pair (0.2, 0.3) to 0.5
    assert [fitted.apply(s) for s in (0.1, 0.2, 0.3, 0.4)] == pytest.approx([0, 0.5, 0.5, 1])
    assert fitted.apply(0.0) == 0 and fitted.apply(1.0) == 1


def test_calibrate_writes_a_valid_bumped_pack(tmp_path):
    # qa's p is informative but too high; qb is never the label
    scored = [{"qa": (p, 0.5), "qb": (0.5, 0.5)} for p in (0.9, 0.85, 0.8, 0.7, 0.95, 0.6)]
    labels = [{"a"}, {"a"}, set(), set(), {"a"}, set()]
    out = cal.calibrate(PACK, scored, labels, ["a"], method="isotonic", fitted_on=FITTED_ON,
                        target={"precision": 1.0})
    assert out.version == "1.0.1" and out.calibration.fitted_on == FITTED_ON
    assert set(out.calibration.categories) == {"a"} and out.calibration.target == {
        "precision": 1.0}
    assert out.calibration.thresholds == {"a": 1.0}           # the three positives map to 1
    assert category_scores(out, scored[0])["a"] == 1.0
    assert category_scores(out, scored[3])["a"] == 0.0
    again = Pack.model_validate_json(out.model_dump_json(exclude_defaults=True))
    assert again == out
    question = cal.calibrate(PACK, scored, labels, ["a"], level="question",
                             fitted_on=FITTED_ON)
    assert set(question.calibration.questions) == {"qa"} and not question.calibration.categories


def test_read_labelled_and_split(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"title": "T", "description": "D", "label_name": "Alpha"},
            {"text": "x", "label_name": ["b", "zz"]}, {"text": "y"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = cal.read_labelled(path, cal.label_map(PACK), label_field="label_name")
    assert data.texts == ["T\n\nD", "x", "y"]
    assert data.labels == [{"a"}, {"b"}, set()] and data.unmapped == {"zz": 1}
    assert len(data.sha256) == 64 and data.name == "d.jsonl"
    assert cal.read_labelled(path, cal.label_map(PACK, {"zz": "a"}),
                             label_field="label_name", limit=2).labels == [{"a"}, {"a", "b"}]
    fit, held = cal.split(10, 0.5, seed=1)
    assert len(fit) == 5 and sorted(fit + held) == list(range(10))
    assert cal.split(10, 0.5, seed=1) == (fit, held)


def test_reliability_plot_and_report(tmp_path):
    scored = [{"qa": (p, 0.5), "qb": (1 - p, 0.5)} for p in (0.9, 0.2, 0.8, 0.3, 0.7, 0.1)]
    labels = [{"a"}, {"b"}, {"a"}, {"b"}, {"b"}, {"b"}]
    out = cal.calibrate(PACK, scored, labels, ["a", "b"], fitted_on=FITTED_ON)
    report = cal.before_after(PACK, out, scored, labels, ["a", "b"])
    assert report["before"]["accuracy"] == pytest.approx(5 / 6)
    assert report["after"]["brier"] < report["before"]["brier"]
    assert "accuracy (top-1)" in cal.format_report(report)
    png = cal.reliability_plot(report, tmp_path / "r" / "plot.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_calibrates_a_pack_file(tmp_path, tiny_dir, capsys):
    """spinf-serve calibrate end to end on the tiny model: the calibrated pack loads, the
    report and the plot are written."""
    from spinf_worker.cli import main
    from spinf_worker.packs import load_pack

    pack_path = tmp_path / "topics.json"
    pack_path.write_text(PACK.model_dump_json())
    data = tmp_path / "labelled.jsonl"
    data.write_text("".join(json.dumps({"text": f"document number {i} about {'ab'[i % 2]}",
                                        "label": "Alpha" if i % 2 == 0 else "b"}) + "\n"
                            for i in range(12)))
    out = tmp_path / "calibrated.json"
    assert main(["calibrate", "--pack", str(pack_path), "--data", str(data), "--model",
                 str(tiny_dir), "--device", "cpu", "--target-recall", "0.5", "-o", str(out),
                 "--report-dir", str(tmp_path / "report")]) == 0
    calibrated = load_pack(out)
    assert calibrated.version == "1.0.1" and calibrated.calibration.fitted_on.n == 6
    assert calibrated.calibration.target == {"recall": 0.5}
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["held_out_docs"] == 6 and set(report["categories"]) == {"a", "b"}
    assert (tmp_path / "report" / "reliability.png").stat().st_size > 1000
    assert "Brier" in capsys.readouterr().out

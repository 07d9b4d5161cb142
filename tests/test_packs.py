"""Prompt pack format, loading errors, category arithmetic and decisions (no model)."""

from __future__ import annotations

import json
import math

import pytest

from spinf_worker.errors import InvalidRequestError
from spinf_worker.packs import (
    PackError,
    category_scores,
    combine,
    decide,
    find_pack,
    load_pack,
    load_packs,
    official_packs,
)

GOOD = {"id": "acme/tiny", "version": "1.2.0",
        "questions": [{"id": "a", "category": "c", "template": "Q?{?}", "options": [" y", " n"],
                       "positive": " y"},
                      {"id": "b", "category": "c", "template": "R?{?}", "options": [" y", " n"],
                       "positive": " y", "weight": 3}],
        "categories": [{"id": "c", "combine": "weighted"}],
        "decision": {"rules": [{"label": "block", "when": {"c": 0.5}}], "default": "allow"}}


def write(tmp_path, data, name="pack.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_official_packs_load():
    packs = official_packs()
    triage = packs["spinf/support-triage"]
    assert triage.summary()["questions"] == len(triage.questions) >= 8


@pytest.mark.parametrize("change, where, reason", [
    (lambda d: d.update(id="NoSlash"), "id", "pattern"),
    (lambda d: d.update(version="1.2"), "version", "pattern"),
    (lambda d: d["questions"][0].update(positive=" maybe"), "questions.0", "positive"),
    (lambda d: d["questions"][0].update(template="no slot"), "questions.0", "slot"),
    (lambda d: d["questions"][1].update(category="zz"), "(top level)", "category 'zz'"),
    (lambda d: d["questions"][0].update(optoins=[" y"]), "questions.0.optoins", "xtra"),
    (lambda d: d["decision"]["rules"][0]["when"].update(zz=0.1), "(top level)", "unknown category"),
])
def test_bad_pack_names_file_field_and_reason(tmp_path, change, where, reason):
    data = json.loads(json.dumps(GOOD))
    change(data)
    path = write(tmp_path, data)
    with pytest.raises(PackError) as caught:
        load_pack(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: {where}:")
    assert reason in message


def test_highest_version_wins_and_unknown_packs_are_4xx(tmp_path):
    write(tmp_path, GOOD, "a.json")
    write(tmp_path, {**GOOD, "version": "1.10.0"}, "b.json")
    packs = load_packs(tmp_path)
    assert find_pack(packs, "acme/tiny").version == "1.10.0"
    with pytest.raises(InvalidRequestError) as caught:
        find_pack(packs, "acme/tiny", "1.2.0")
    assert caught.value.code == "unknown_pack" and caught.value.param == "packs"


def test_combinations():
    assert combine([0.2, 0.6], [1, 1], "max") == 0.6
    assert combine([0.2, 0.6], [1, 1], "mean") == pytest.approx(0.4)
    assert combine([0.2, 0.6], [1, 3], "weighted") == pytest.approx(0.5)
    assert combine([0.5, 0.5], [1, 1], "noisy_or") == pytest.approx(0.75)


def test_categories_and_decision(tmp_path):
    pack = load_pack(write(tmp_path, GOOD))
    cats = category_scores(pack, {"a": (0.25, 0.1), "b": (0.75, 0.5)})
    assert cats == {"c": pytest.approx(0.625)}
    decision = decide(pack, cats)
    assert decision["label"] == "block"
    assert decision["reasons"] == [{"category": "c", "score": pytest.approx(0.625),
                                    "threshold": 0.5}]
    assert decide(pack, {"c": 0.49})["label"] == "allow"
    lift = load_pack(write(tmp_path, {**GOOD, "categories": [{"id": "c", "on": "lift",
                                                               "combine": "max"}]}, "l.json"))
    assert category_scores(lift, {"a": (0.25, 0.5), "b": (0.75, 0.5)}) == {"c": 0.25}


def test_cli_lists_packs_and_names_a_bad_one(tmp_path, capsys):
    from spinf_worker.cli import main

    assert main(["packs", "--json", "--packs", str(tmp_path)]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "spinf/support-triage" in {row["id"] for row in listed}
    bad = write(tmp_path, {**GOOD, "version": "x"})
    assert main(["packs", "--packs", str(tmp_path)]) == 2
    assert str(bad) in capsys.readouterr().err


def test_pack_scores_equal_plain_queries(tiny_engine):
    """A pack's questions ride in the same read; their scores equal the same questions sent
    as plain queries, and the categories and decision follow from them."""
    pack = official_packs()["spinf/support-triage"]
    text = "I was charged twice for September and I want my money back now, or I leave."
    with_pack = tiny_engine.score({"text": text, "scoring": {"queries": [
        {"id": "mine", "template": "\n\nAny refund?{?}", "options": [" yes", " no"]}]},
        "packs": [{"id": pack.id}]})
    plain = tiny_engine.score({"text": text, "scoring": {"queries": [
        {"id": q.id, "template": q.template, "options": q.options} for q in pack.questions]}})
    assert [q.id for q in with_pack.queries] == ["mine"]
    result = with_pack.packs[0]
    assert (result["id"], result["version"]) == (pack.id, pack.version)
    for question, plain_q in zip(result["questions"], plain.queries, strict=True):
        positive = next(o for o in plain_q.combinations[0].options if o.text == " yes")
        assert question["p"] == pytest.approx(positive.p, abs=1e-6)
        assert question["floor_p"] == positive.floor_p    # the same cached floor
    scores = {q["id"]: (q["p"], q["floor_p"]) for q in result["questions"]}
    assert result["categories"] == category_scores(pack, scores)
    assert result["decision"] == decide(pack, result["categories"])
    only = tiny_engine.score({"text": text, "scoring": {"queries": [
        {"id": "mine", "template": "\n\nAny refund?{?}", "options": [" yes", " no"]}]},
        "packs": [{"id": pack.id, "categories": ["billing"]}]}).packs[0]
    assert set(only["categories"]) == {"billing"}
    assert {q["category"] for q in only["questions"]} == {"billing"}


def test_published_json_schema_is_current():
    """docs/prompt-pack.schema.json is the format's JSON Schema; regenerate it when it changes:
    python -c "import json; from spinf_worker.packs import Pack; print(json.dumps(
    Pack.model_json_schema(), indent=1, sort_keys=True))" > docs/prompt-pack.schema.json"""
    from pathlib import Path

    from spinf_worker.packs import Pack

    path = Path(__file__).resolve().parents[1] / "docs" / "prompt-pack.schema.json"
    assert json.loads(path.read_text()) == Pack.model_json_schema()


FITTED_ON = {"name": "labelled.jsonl", "sha256": "ab" * 32, "n": 100, "date": "2026-11-30"}


def test_platt_and_isotonic_apply():
    from spinf_worker.packs import Isotonic, Platt, logit

    identity = Platt(method="platt", a=1.0, b=0.0)
    assert identity.apply(0.3) == pytest.approx(0.3)
    # a = 2: the odds are squared; b = ln 3: the odds are tripled
    assert Platt(method="platt", a=2.0, b=0.0).apply(0.75) == pytest.approx(0.9)
    assert Platt(method="platt", a=1.0, b=math.log(3)).apply(0.5) == pytest.approx(0.75)
    assert logit(0.0) == pytest.approx(-logit(1.0)) and abs(logit(0.0)) < 20   # clipped
    iso = Isotonic(method="isotonic", x=[0.2, 0.4, 0.8], y=[0.0, 0.5, 0.9])
    assert [iso.apply(s) for s in (0.0, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0)] == pytest.approx(
        [0.0, 0.0, 0.25, 0.5, 0.7, 0.9, 0.9])
    steps = Isotonic(method="isotonic", x=[0.5, 0.5], y=[0.1, 0.6])
    assert steps.apply(0.49) == 0.1 and steps.apply(0.51) == 0.6


def test_calibration_applies_to_questions_then_categories(tmp_path):
    data = json.loads(json.dumps(GOOD))
    data["calibration"] = {
        "fitted_on": FITTED_ON,
        "questions": {"a": {"method": "isotonic", "x": [0.0, 1.0], "y": [0.0, 0.5]}},
        "categories": {"c": {"method": "platt", "a": 1.0, "b": math.log(3)}},
        "thresholds": {"c": 0.8}}
    data["decision"]["rules"] = [{"label": "block", "when": {"c": "fitted"}},
                                 {"label": "review", "when": {"c": 0.5}}]
    pack = load_pack(write(tmp_path, data))
    # a: 0.5 -> 0.25 by its isotonic map; weighted (1, 3): (0.25 + 3 * 0.75) / 4 = 0.625;
    # the category map triples the odds: 0.625 -> 5/6
    cats = category_scores(pack, {"a": (0.5, 0.1), "b": (0.75, 0.5)})
    assert cats == {"c": pytest.approx(5 / 6)}
    assert decide(pack, cats)["reasons"] == [{"category": "c", "score": pytest.approx(5 / 6),
                                              "threshold": 0.8}]
    assert decide(pack, {"c": 0.7})["label"] == "review"
    raw = pack.uncalibrated()
    assert raw.calibration is None and [r.label for r in raw.decision.rules] == ["review"]
    assert category_scores(raw, {"a": (0.5, 0.1), "b": (0.75, 0.5)}) == {"c": 0.6875}
    assert pack.summary()["calibrated"] and pack.summary()["fitted_on"]["n"] == 100


@pytest.mark.parametrize("calibration, where, reason", [
    ({"categories": {"c": {"method": "platt", "a": "x", "b": 0}}}, "calibration.categories.c.a",
     "valid number"),
    ({"categories": {"c": {"method": "spline"}}}, "calibration.categories.c", "tag"),
    ({"questions": {"a": {"method": "isotonic", "x": [0.1, 0.2], "y": [0.9, 0.1]}}},
     "calibration.questions.a", "y must be non-decreasing"),
    ({"questions": {"zz": {"method": "platt", "a": 1, "b": 0}}}, "(top level)",
     "unknown question 'zz'"),
    ({"thresholds": {"zz": 0.5}}, "(top level)", "unknown category 'zz'"),
    ({"fitted_on": {**FITTED_ON, "sha256": "xyz"}}, "calibration.fitted_on.sha256", "pattern"),
])
def test_bad_calibration_names_the_field(tmp_path, calibration, where, reason):
    data = json.loads(json.dumps(GOOD))
    data["calibration"] = {"fitted_on": FITTED_ON, **calibration}
    path = write(tmp_path, data)
    with pytest.raises(PackError) as caught:
        load_pack(path)
    assert str(caught.value).startswith(f"{path}: {where}:")
    assert reason in str(caught.value)


def test_fitted_threshold_needs_a_calibration(tmp_path):
    data = json.loads(json.dumps(GOOD))
    data["decision"]["rules"][0]["when"] = {"c": "fitted"}
    with pytest.raises(PackError, match="decision.rules.0: category 'c' has no fitted"):
        load_pack(write(tmp_path, data))

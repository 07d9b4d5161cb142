"""Prompt pack format, loading errors, category arithmetic and decisions (no model)."""

from __future__ import annotations

import json

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
    assert {"id": "spinf/support-triage"}.items() <= listed[0].items()
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
    for question, plain_q in zip(result["questions"], plain.queries):
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

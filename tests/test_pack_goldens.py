"""The official packs on a few documents: their recorded result queries on the default model
(CPU, fp32) and the categories and decision the pack makes of them.

Goldens are written by scripts/record_pack_goldens.py; a pack whose version moved needs them
re-recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from spinf_client import packs as client

from spinf_worker.packs import find_pack, official_packs

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures" / "packs"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "golden.json").exists())
TOLERANCE = 1e-5


def load(name: str) -> dict:
    return json.loads((FIXTURES / name / "golden.json").read_text())


def test_every_official_pack_has_a_golden():
    assert {f"spinf/{name}" for name in NAMES} >= set(official_packs()) - {
        "spinf/support-triage"}


@pytest.mark.parametrize("name", NAMES)
def test_golden_decisions(name):
    """The pack, as it is now, decides the recorded answers as recorded, and as the client."""
    golden = load(name)
    pack = find_pack(official_packs(), golden["pack"])
    assert pack.version == golden["version"], "the pack changed: re-record its golden"
    for doc in golden["docs"]:
        assert pack.evaluate(doc["queries"], None) == doc["packs"], doc["id"]
        theirs = client.evaluate(pack.raw, client.answers_from_result(doc["queries"], pack.raw))
        assert theirs["decision"]["unsafe"] == doc["packs"]["decision"]["unsafe"], doc["id"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_pack_golden_scores(name, default_engine):
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from record_pack_goldens import read_docs

    from spinf_worker.calibrate import engine_scorer, score_texts

    golden = load(name)
    pack = find_pack(official_packs(), golden["pack"], golden["version"])
    docs = read_docs(name)
    got = score_texts(engine_scorer(default_engine), pack, [d["text"] for d in docs],
                      context=golden["context"])
    for mine, doc in zip(got, golden["docs"], strict=True):
        want = {q["id"]: q for q in doc["queries"]}
        assert [q["id"] for q in mine] == list(want)
        for q in mine:
            for combo, expected in zip(q["combinations"], want[q["id"]]["combinations"],
                                       strict=True):
                assert combo["values"] == expected["values"]
                assert [o["p"] for o in combo["options"]] == pytest.approx(
                    [o["p"] for o in expected["options"]], abs=TOLERANCE), (doc["id"], q["id"])
        assert pack.evaluate(mine, None)["decision"]["unsafe"] == \
            doc["packs"]["decision"]["unsafe"], doc["id"]

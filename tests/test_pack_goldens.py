"""The official packs on the default model (CPU, fp32) against their recorded outputs.

Goldens are written by scripts/record_pack_goldens.py; a pack whose version moved needs them
re-recorded."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from spinf_worker.packs import official_packs

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures" / "packs"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "golden.json").exists())
TOLERANCE = 1e-5


def test_every_official_pack_has_a_golden():
    assert {f"spinf/{name}" for name in NAMES} >= set(official_packs()) - {
        "spinf/support-triage"}


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_pack_golden(name, default_engine):
    sys.path.insert(0, str(ROOT / "scripts"))
    from record_pack_goldens import outputs, read_docs, requests

    golden = json.loads((FIXTURES / name / "golden.json").read_text())
    pack = official_packs()[golden["pack"]]
    assert pack.version == golden["version"], "the pack changed: re-record its golden"
    docs = read_docs(name)
    got = outputs(default_engine.score_batch(requests(pack, docs)), docs)
    for mine, want in zip(got, golden["docs"], strict=True):
        assert mine["id"] == want["id"]
        assert mine["questions"].keys() == want["questions"].keys()
        for qid, (p, floor_p) in want["questions"].items():
            assert mine["questions"][qid] == pytest.approx([p, floor_p], abs=TOLERANCE), qid
        assert mine["categories"] == pytest.approx(want["categories"], abs=TOLERANCE)
        assert mine["decision"]["label"] == want["decision"]["label"], mine["id"]
        assert ([r["category"] for r in mine["decision"]["reasons"]]
                == [r["category"] for r in want["decision"]["reasons"]])

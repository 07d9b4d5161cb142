"""The offline CLI end to end on the default model, in a subprocess like a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_score_file_end_to_end(tmp_path, default_checkpoint):
    lines = [
        json.dumps({"id": "a", "text": "I was charged twice for September. Please refund one."}),
        "{not json",
        json.dumps({"custom_id": "b", "messages": [{"role": "user", "content": "The app crashes."}],
                    "scoring": {"queries": [{"id": "bug", "template": "\n\nIs this a bug report?{?}",
                                             "options": [" Yes", " No"]}]}}),
        json.dumps({"id": "c", "text": "Hello", "scoring": {"queries": [
            {"id": "bad", "template": "no slot here", "options": [" a"]}]}}),
        json.dumps({"id": "d", "text": "Where is my parcel? It is five days late."}),
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "spinf_worker.cli", "score", str(src), "-o", str(out),
         "--queries", str(ROOT / "fixtures" / "support_queries.json"), "--device", "cpu"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("custom_id") for r in rows] == ["a", None, "b", "c", "d"]
    assert "JSON" in rows[1]["error"]["message"]
    assert rows[3]["error"]["type"] == "invalid_request"
    assert rows[3]["error"]["param"] == "scoring.queries.0.template"
    assert "2 line(s) failed" in proc.stderr
    assert "doc" in proc.stderr                     # the progress bar
    first = rows[0]
    assert first["object"] == "score" and first["model"] == "google/gemma-3-270m"
    (result,) = first["results"]
    assert [q["id"] for q in result["queries"]] == ["topic", "refund", "urgent", "mentions"]
    topic = result["queries"][0]["combinations"][0]
    assert sum(o["p"] for o in topic["options"]) == pytest.approx(1.0, abs=1e-6)
    assert len(result["queries"][3]["combinations"]) == 4
    assert [q["id"] for q in rows[2]["results"][0]["queries"]] == ["bug"]
    # the same document through the Python API gives the same numbers
    from spinf_worker.engine import Engine

    engine = Engine(default_checkpoint, device="cpu")
    direct = engine.score({"text": "I was charged twice for September. Please refund one.",
                           "scoring": json.loads((ROOT / "fixtures" / "support_queries.json").read_text())})
    assert [o.logprob for o in direct.results[0].queries[1].combinations[0].options] == \
           [o["logprob"] for o in result["queries"][1]["combinations"][0]["options"]]


def test_score_with_a_pack_from_a_directory(tmp_path, tiny_dir):
    """`score --packs DIR`: a pack of that directory answers lines that name it, alone."""
    pack = {"pack": "acme/refunds", "version": "1.0.0", "model": "google/gemma-3-270m",
            "contexts": {"text": "{X}"},
            "scoring": {"queries": [{"id": "refund", "template": "\n\nRefund?{?}",
                                     "options": [" yes", " no"]}]},
            "reads": [{"id": "refund", "query": "refund", "kind": "pair", "mean": 0.0,
                       "sd": 1.0, "category": "money"}],
            "categories": {"money": {"platt": [1.0, 0.0], "threshold": 0.5}},
            "decision": {"mode": "per_category"}}
    (tmp_path / "packs").mkdir()
    (tmp_path / "packs" / "refunds.json").write_text(json.dumps(pack))
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "text": "Charged twice.",
                               "scoring": {"packs": [{"id": "acme/refunds"}]}}) + "\n")
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "spinf_worker.cli", "score", str(src), "-o", str(out), "-q",
         "--model", str(tiny_dir), "--device", "cpu", "--packs", str(tmp_path / "packs")],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    row = json.loads(out.read_text())
    (result,) = row["results"]
    assert result["queries"] == [] and result["packs"][0]["id"] == "acme/refunds"
    assert set(result["packs"][0]["categories"]) == {"money"}
    bad = subprocess.run(
        [sys.executable, "-m", "spinf_worker.cli", "score", str(src), "--model", str(tiny_dir),
         "--packs", str(tmp_path / "nowhere")], capture_output=True, text=True, cwd=ROOT,
        timeout=600)
    assert bad.returncode == 2 and "nowhere" in bad.stderr


def test_score_keeps_roots_and_the_same_figures(tmp_path, tiny_dir):
    """`score --root-cache-mib`: lines asking one question each about the same text (the
    first pass keeps its root, the later ones read their questions alone) answer exactly as
    without it."""
    text = " ".join(f"Line {k}: the river rose and the bridge closed." for k in range(20))
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"l{k}", "text": text, "scoring": {"queries": [{
        "id": "q", "template": f"\n\nQuestion {k}: bad news?{{?}}",
        "options": [" yes", " no"]}]}}) + "\n" for k in range(6)))
    outs = []
    for extra in ([], ["--root-cache-mib", "16", "--max-pass-tokens", "256"]):
        out = tmp_path / f"out{len(outs)}.jsonl"
        proc = subprocess.run(
            [sys.executable, "-m", "spinf_worker.cli", "score", str(src), "-o", str(out), "-q",
             "--model", str(tiny_dir), "--device", "cpu", *extra],
            capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert proc.returncode == 0, proc.stderr
        outs.append([json.loads(line)["results"] for line in out.read_text().splitlines()])
    assert outs[0] == outs[1] and len(outs[0]) == 6


def test_load_format_flag_reaches_the_service_settings(monkeypatch):
    from spinf_worker.cli import _service_settings, build_parser

    monkeypatch.delenv("SPINF_LOAD_FORMAT", raising=False)
    parse = build_parser().parse_args
    assert _service_settings(parse(["worker", "--redis", "redis://x"])).load_format == "auto"
    args = parse(["worker", "--redis", "redis://x", "--load-format", "dummy"])
    assert _service_settings(args).load_format == "dummy"
    monkeypatch.setenv("SPINF_LOAD_FORMAT", "dummy")
    assert _service_settings(parse(["serve"])).load_format == "dummy"

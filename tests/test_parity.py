"""`spinf-serve parity | bench | models` on the real default model on the CPU: the recorded
CPU reference matches bit for bit, a changed bit or another fingerprint is judged as it
should be, the news job prints sane figures, bad paths are one line."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spinf_worker import cli
from spinf_worker.tools import gzjson
from spinf_worker.tools.parity import (
    DEFAULT_FIXTURE,
    compare,
    load_fixture,
    reference_of,
    score_fixture,
)
from tests.conftest import shared_data

ROOT = Path(__file__).resolve().parents[1]
CPU_REFERENCE = ROOT / "fixtures" / "parity" / "gemma-3-270m.cpu-authenticamd-avx2-fp32.json.gz"
# fp32 on a CPU of another vendor or ISA (another fingerprint): other kernels, nearby bits
OTHER_CPU_MAX_DELTA = 1e-3


def spinf_serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spinf_worker.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600, env=env)


def recorded() -> dict:
    return gzjson.read(CPU_REFERENCE, "reference")


def first_option(ref: dict) -> tuple[str, str, str]:
    doc = next(iter(ref["scores"]))
    query = next(iter(ref["scores"][doc]))
    return doc, query, next(iter(ref["scores"][doc][query][0]["logprobs"]))


def write_reference(tmp_path: Path, ref: dict, name: str = "ref.json.gz") -> Path:
    path = tmp_path / name
    gzjson.write(path, ref)
    return path


# (engine, fixture digest, passes) -> the Run: the in-process tests judge other references
# against the same scores, so the fixture is scored once for all of them
_RUNS: dict[tuple, object] = {}


def _scored_once(engine, fixture, passes: int):
    key = (engine.fingerprint, fixture.digest, passes)
    if key not in _RUNS:
        _RUNS[key] = score_fixture(engine, fixture, passes)
    return _RUNS[key]


def own_reference(engine) -> dict:
    """A reference as `--record` writes it, of this engine's own scores on the default fixture
    (the ones `parity_in_process` compares): the judging tests hold on any CPU, not only on
    one of the recorded reference's class."""
    fixture = load_fixture(DEFAULT_FIXTURE)
    # a copy: the tests change its scores, not the run they are judged against
    return copy.deepcopy(reference_of(engine, fixture, _scored_once(engine, fixture, 1).scores))


def parity_in_process(engine, monkeypatch, capsys, *args: str) -> tuple[int, dict]:
    """`spinf-serve parity ... --json` in this process, on the session's engine (no model
    load), the fixture scored once for every test that calls it."""
    monkeypatch.setattr("spinf_worker.tools.parity.load_engine", lambda args: engine)
    monkeypatch.setattr("spinf_worker.tools.parity.score_fixture", _scored_once)
    code = cli.main(["parity", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_parity_against_the_recorded_cpu_reference():
    """Bit for bit on a CPU of the reference's class (same fingerprint); on another vendor or
    ISA the fingerprint differs and the scores are held to fp32's tolerance."""
    from spinf_worker.engine.engine import cpu_class

    ref = recorded()
    same_class = cpu_class() == ref["device_class"]
    proc = spinf_serve("parity", "--reference", str(CPU_REFERENCE), "--passes", "2",
                       "--device", "cpu", "--threads", str(ref["threads"]), "--json",
                       "--max-abs-delta", str(OTHER_CPU_MAX_DELTA), "--min-top1", "1.0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["identical_repeats"] and report["passes"] == 2
    assert report["run"]["device_class"] == cpu_class()
    assert (report["run"]["fingerprint"] == ref["fingerprint"]) == same_class
    comparison = report["comparison"]
    options = sum(len(c["logprobs"]) for q in ref["scores"].values() for cs in q.values()
                  for c in cs)
    assert comparison["options"] == options > 0
    assert comparison["top1_agreement"] == 1.0
    if same_class:
        assert comparison["mode"] == "bit-identity"
        assert comparison["differing"] == 0 and comparison["max_abs_delta"] == 0.0
    else:
        assert comparison["mode"] == "tolerance"
        assert comparison["max_abs_delta"] <= OTHER_CPU_MAX_DELTA


def test_one_changed_bit_fails_the_bit_identity(tmp_path, default_engine, monkeypatch, capsys):
    ref = own_reference(default_engine)                 # it claims this engine's bits
    assert ref["fingerprint"] == default_engine.fingerprint
    doc, query, option = first_option(ref)
    logprobs = ref["scores"][doc][query][0]["logprobs"]
    logprobs[option] = math.nextafter(logprobs[option], 0.0)   # one ulp
    code, report = parity_in_process(default_engine, monkeypatch, capsys,
                                     "--reference", str(write_reference(tmp_path, ref)))
    assert code == 1 and not report["ok"]
    assert report["comparison"]["mode"] == "bit-identity"
    assert report["comparison"]["differing"] == 1
    assert 0 < report["comparison"]["max_abs_delta"] < 1e-12


def test_another_fingerprint_is_held_to_tolerances(tmp_path, default_engine, monkeypatch,
                                                   capsys):
    ref = own_reference(default_engine)
    ref["fingerprint"] = "fp_0000000000"
    doc, query, option = first_option(ref)
    ref["scores"][doc][query][0]["logprobs"][option] += 0.01
    code, report = parity_in_process(default_engine, monkeypatch, capsys,
                                     "--reference", str(write_reference(tmp_path, ref)),
                                     "--max-abs-delta", "0.05")
    assert code == 0 and report["ok"], report
    comparison = report["comparison"]
    assert comparison["mode"] == "tolerance"
    assert comparison["differing"] >= 1
    assert comparison["max_abs_delta"] == pytest.approx(0.01, abs=1e-6)
    assert comparison["tolerances"] == {"max_abs_delta": 0.05, "min_top1": 0.9}


def test_tolerances_judge_deltas_and_top1():
    """The tolerance rule itself, on the recorded scores: past |Δ| or past top-1 fails."""
    ref = recorded()["scores"]
    shifted = copy.deepcopy(ref)
    doc, query, option = first_option(recorded())
    shifted[doc][query][0]["logprobs"][option] -= 2.0
    judged = compare(shifted, ref, same_fingerprint=False, max_abs_delta=0.5, min_top1=0.0)
    assert not judged.ok and judged.max_abs_delta == pytest.approx(2.0)
    assert compare(shifted, ref, same_fingerprint=False, max_abs_delta=2.5, min_top1=0.0).ok
    reversed_best = copy.deepcopy(ref)   # every question's options in reverse order of logprob
    for queries in reversed_best.values():
        for combos in queries.values():
            for combo in combos:
                lps = combo["logprobs"]
                ranked = sorted(lps, key=lps.get)
                combo["logprobs"] = dict(zip(ranked, sorted(lps.values(), reverse=True),
                                             strict=True))
    judged = compare(reversed_best, ref, same_fingerprint=False, max_abs_delta=math.inf,
                     min_top1=0.9)
    assert not judged.ok and judged.top1_agreement < 0.9


def test_repeats_that_differ_are_reported():
    """--passes: a repeat whose bits move (here: a stand-in engine that adds an ulp on its
    second call) makes the run fail, naming that repeat."""
    from spinf_worker.protocol import ScoreResponse

    fixture, ref = load_fixture(DEFAULT_FIXTURE), recorded()["scores"]
    by_text = {d["text"]: d["id"] for d in fixture.documents}

    class ShiftingEngine:
        calls = 0

        def score_batch(self, requests):
            self.calls += 1
            return [self.response(by_text[r["text"]]) for r in requests]

        def response(self, doc: str) -> ScoreResponse:
            queries = [{"id": q, "combinations": [
                {"values": c["values"], "residual": 0.0, "floor_residual": None,
                 "options": [{"text": t, "p": 0.5, "floor_p": None,
                              "logprob": lp if self.calls == 1 else math.nextafter(lp, 0.0)}
                             for t, lp in c["logprobs"].items()]} for c in combos]}
                       for q, combos in ref[doc].items()]
            return ScoreResponse.model_validate({
                "id": "scr_x", "created": 0, "model": "m", "system_fingerprint": "fp_x",
                "results": [{"input_id": "0", "queries": queries}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                          "prompt_tokens_details": {}, "inputs": 1, "content": {},
                          "scoring": {}, "processed_tokens": 0}})

    run = score_fixture(ShiftingEngine(), fixture, passes=3)
    assert not run.identical_repeats and run.first_differing_repeat == 1
    assert run.scores == ref          # the first repeat's scores are what is reported
    steady = score_fixture(ShiftingEngine(), fixture, passes=1)
    assert steady.identical_repeats


@pytest.mark.slow
def test_bench_prints_sane_figures():
    data = shared_data("news_articles.jsonl").parent
    proc = spinf_serve("bench", "--docs", "2", "--doc-tokens", "64", "--no-floors",
                       "--device", "cpu", "--data", str(data), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["docs"] == 2 and report["questions_per_doc"] == 56
    assert report["questions"] == 2 * 56
    assert report["tokens_read"] > 2 * 56 and report["passes"] >= 1
    for key in ("wall_s", "questions_per_s", "docs_per_s", "tokens_per_s", "peak_rss_mib"):
        assert report[key] > 0, key
    assert report["questions_per_s"] == pytest.approx(report["questions"] / report["wall_s"],
                                                      rel=0.01)
    assert report["fingerprint"].startswith("fp_") and report["scheme"] == "fp32"


def test_models_lists_the_default(default_checkpoint):
    proc = spinf_serve("models", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["default"] == "google/gemma-3-270m" and info["default_converted"]
    (default,) = [m for m in info["models"] if m["source"] == "default"]
    assert default["name"] == "google/gemma-3-270m" and default["loads"]
    assert default["family"] == "Gemma 3" and default["size_bytes"] > 100 * 2**20
    assert Path(default["path"]) == default_checkpoint.path
    human = spinf_serve("models")
    assert human.returncode == 0 and "google/gemma-3-270m" in human.stdout


def test_models_says_why_a_cached_model_would_not_load(tmp_path):
    models = tmp_path / "cache" / "models"
    (models / "gguf-unfinished").mkdir(parents=True)     # no conversion marker, no files
    odd = models / "gguf-odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    (odd / "tokenizer.json").write_text("{}")
    (odd / "spinf-source.json").write_text(json.dumps({"source": "/models/odd.gguf"}))
    env = {**os.environ, "SPINF_CACHE_DIR": str(tmp_path / "cache"),
           "HF_HUB_CACHE": str(tmp_path / "hub")}
    proc = spinf_serve("models", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    found = {m["path"].rsplit("/", 1)[-1]: m for m in json.loads(proc.stdout)["models"]}
    assert set(found) == {"gguf-unfinished", "gguf-odd"}
    assert not found["gguf-unfinished"]["loads"]
    assert "incomplete" in found["gguf-unfinished"]["problem"]
    assert found["gguf-odd"]["name"] == "/models/odd.gguf"
    assert not found["gguf-odd"]["loads"] and "not supported" in found["gguf-odd"]["problem"]


def _not_gzip_json(tmp_path: Path) -> Path:
    path = tmp_path / "broken.json.gz"
    path.write_bytes(b"\x1f\x8b not really gzip")
    return path


def _other_fixture_reference(tmp_path: Path) -> Path:
    ref = recorded()
    ref["fixture_sha256"] = "0" * 64
    return write_reference(tmp_path, ref, "other.json.gz")


@pytest.mark.parametrize(("make_args", "says"), [
    (lambda t: ["parity", "--fixture", str(t / "absent.json.gz"), "--reference",
                str(CPU_REFERENCE)], "cannot read fixture"),
    (lambda t: ["parity", "--reference", str(t / "absent.json.gz")], "cannot read reference"),
    (lambda t: ["parity", "--fixture", str(_not_gzip_json(t)), "--reference",
                str(CPU_REFERENCE)], "is not gzip JSON"),
    (lambda t: ["parity", "--fixture", str(CPU_REFERENCE), "--reference", str(CPU_REFERENCE)],
     "is not a spinf-parity-fixture/1 file"),
    (lambda t: ["parity", "--reference", str(_other_fixture_reference(t))],
     "recorded on another fixture"),
    (lambda t: ["parity"], "give --reference"),
    (lambda t: ["bench", "--data", str(t / "no-data")], "no news_articles.jsonl"),
])
def test_bad_paths_are_one_line_errors(tmp_path, make_args, says):
    proc = spinf_serve(*make_args(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spinf-serve: "), proc.stderr
    assert says in lines[0] and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_bench_names_absent_questions(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "news_articles.jsonl").write_text(json.dumps({"text": "An article."}) + "\n")
    proc = spinf_serve("bench", "--data", str(data), "--questions", str(tmp_path / "q.json"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"spinf-serve: cannot read the news questions "
                                   f"{tmp_path / 'q.json'}: No such file or directory")

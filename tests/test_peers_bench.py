"""benchmarks/peers_gpu.py on the CPU: the shared random weights read the same by transformers
and the engine, the report's merge of the parts' figures, the sweeps' points (the spinf and
transformers sides on a tiny model, the vLLM side on a stand-in for its engine) and their
plot."""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import peers_gpu  # noqa: E402


def test_shared_weights_read_alike_by_transformers_and_the_engine(tmp_path):
    from transformers import Gemma3ForCausalLM

    from spinf_worker.models.loader import load_checkpoint
    from spinf_worker.tools.news_job import build_requests, checked, load_questions

    tokenizer_dir = load_checkpoint(None, load_format="dummy").path
    peers_gpu.write_weights(tmp_path, peers_gpu.SHAPES["tiny"], tokenizer_dir, seed=3)
    checkpoint = load_checkpoint(str(tmp_path))
    engine = peers_gpu.spinf_engine(checkpoint, "fp32", "cpu")
    questions = load_questions()
    questions = {"queries": questions["queries"][:6]}
    doc = "The council voted on Tuesday to rebuild the harbour wall before the winter storms."
    response = checked(engine.score_batch(build_requests([doc], questions)))[0]
    ours = [o.logprob for q in response.results[0].queries for o in q.combinations[0].options]

    model = Gemma3ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tok = checkpoint.tokenizer
    content = tok.encode(doc, add_special_tokens=False).ids
    theirs = []
    with torch.no_grad():
        for q in questions["queries"]:
            prefix = tok.encode(q["template"].split("{?}")[0], add_special_tokens=False).ids
            logits = model(torch.tensor([[2, *content, *prefix]])).logits[0, -1]
            logprobs = torch.log_softmax(logits.float(), -1)
            for option in q["options"]:
                (token,) = tok.encode(option, add_special_tokens=False).ids
                theirs.append(logprobs[token].item())
    assert len(ours) == len(theirs) == 12
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4
    assert len(set(ours)) > 1    # random weights that tell options apart


def part(part: str, **figures) -> dict:
    return {"date": "2026-12-03", "commit": "abc1234", "part": part, "docs": 24, **figures}


def test_report_merges_the_parts_with_a_ratio_per_comparison(tmp_path, capsys):
    parts = [
        part("spinf", spinf_fp8_questions_per_s=2000.0, spinf_bf16_questions_per_s=1100.0,
             spinf_bf16_warm_questions_per_s=2100.0),
        part("vllm-bf16", scheme="bf16", vllm_bf16_default_cold_questions_per_s=500.0,
             vllm_bf16_default_warm_questions_per_s=680.0,
             vllm_bf16_nodetok_cold_questions_per_s=750.0,
             vllm_bf16_nodetok_warm_questions_per_s=1300.0),
        part("vllm-fp8", scheme="fp8", vllm_fp8_default_cold_questions_per_s=640.0,
             vllm_fp8_default_warm_questions_per_s=600.0,
             vllm_fp8_nodetok_cold_questions_per_s=940.0,
             vllm_fp8_nodetok_warm_questions_per_s=1100.0),
        part("agree-vllm", scheme="bf16", agree_docs=4, prompt_logprobs_options=448,
             prompt_logprobs_max_abs_dlogprob=0.03, prompt_logprobs_mean_abs_dlogprob=0.004,
             prompt_logprobs_top1_agreement=0.99, top20_questions=224, top20_both_options=0),
        part("serve", vllm_serve_bf16_cold_questions_per_s=400.0,
             spinf_serve_bf16_questions_per_s=1000.0),
    ]
    for p in parts:
        (tmp_path / f"{p['date']}-peers-{p['part']}-{p['commit']}.json").write_text(json.dumps(p))
    (tmp_path / "2026-12-03-peers-spinf-other.json").write_text(
        json.dumps(part("spinf", commit="other", spinf_fp8_questions_per_s=1.0)))
    results = tmp_path / "results"
    args = type("Args", (), {"out": tmp_path, "results": results, "commit": "abc1234"})()
    peers_gpu.run_report(args)
    row = json.loads((results / "2026-12-03-peers-abc1234.json").read_text())
    assert sorted(row["parts"]) == ["agree-vllm", "serve", "spinf", "vllm-bf16", "vllm-fp8"]
    ratio = row["ratio"]
    assert ratio["fp8_default_cold"]["ratio"] == round(2000 / 640, 2)
    assert ratio["fp8_vs_vllm_best_cold"]["vllm_run"] == "vllm_fp8_nodetok_cold"
    assert ratio["fp8_vs_vllm_best_cold"]["ratio"] == round(2000 / 940, 2)
    assert ratio["bf16_default_warm"]["ratio"] == round(1100 / 680, 2)
    assert ratio["bf16_best_warm"]["vllm"] == 1300.0
    assert ratio["bf16_warm_vs_best_warm"]["ratio"] == round(2100 / 1300, 2)
    assert "fp8_warm_vs_best_warm" not in ratio        # no fp8 warm figure of ours
    assert row["parts"]["vllm-fp8"]["scheme"] == "fp8"
    out = capsys.readouterr().out
    assert "| fp8, logprobs=20 | 640.0 | 600.0 | 2000.0 |  |" in out
    assert "| bf16, logprobs=20 | 500.0 | 680.0 | 1100.0 | 2100.0 |" in out
    assert "top-1 agreement 0.99 over 448 options" in out
    assert "vllm_serve_bf16_cold 400.0 q/s, spinf_serve_bf16 1000.0 q/s" in out


def test_report_without_parts_says_so(tmp_path):
    args = type("Args", (), {"out": tmp_path, "results": tmp_path, "commit": None})()
    with pytest.raises(SystemExit, match="no peers part"):
        peers_gpu.run_report(args)


# --- sweeps -----------------------------------------------------------------------------------

def run_main(monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["peers_gpu.py", *argv])
    peers_gpu.main()


def only_file(directory: Path, pattern: str) -> dict:
    (path,) = directory.glob(pattern)
    return json.loads(path.read_text())


def test_sweep_points_ask_the_asked_counts_of_distinct_questions(tmp_path):
    from spinf_worker.models.loader import load_checkpoint

    args = argparse.Namespace(
        tokenizer=load_checkpoint(None, load_format="dummy").path, questions=peers_gpu.ROOT
        / "benchmarks" / "news_questions.json", data=peers_gpu.ROOT.parent / "shared" / "data",
        docs=2, doc_tokens=470, out=tmp_path, commit="abc1234", tiny=True,
        question_counts=peers_gpu.SWEEP_QUESTIONS, lengths=[256, 1024], sweep_tokens=2048,
        length_docs=None)
    job = peers_gpu.Job(args, "sweep-test")
    points = peers_gpu.sweep_points(job)
    by_questions = [(label, docs, queries) for label, docs, queries in points
                    if label["sweep"] == "questions"]
    assert [label["questions_per_doc"] for label, _, _ in by_questions] == [7, 14, 28, 56, 112, 224]
    for label, docs, queries in by_questions:
        n = label["questions_per_doc"]
        assert len(queries) == len({q["id"] for q in queries}) == n
        assert len({q["template"] for q in queries}) == n    # each read, none shared
        assert docs == job.docs and len(docs) == 2
    lengths = [(label, docs, queries) for label, docs, queries in points
               if label["sweep"] == "length"]
    assert [(label["doc_tokens"], len(docs)) for label, docs, _ in lengths] == [(256, 8), (1024, 4)]
    for label, docs, queries in lengths:
        assert len(queries) == label["questions_per_doc"] == 56
        assert len(set(docs)) == len(docs)
        for doc in docs:
            assert abs(len(job.encode(doc)) - label["doc_tokens"]) <= 0.05 * label["doc_tokens"]
    # the vLLM prompts of a point: one per (document, question)
    label, docs, queries = by_questions[1]
    prompts = job.prompts(docs=docs, queries=queries)
    assert len(prompts) == 2 * 14 and all(p[0] == 2 for p in prompts)
    args.length_docs = 1
    assert {len(docs) for label, docs, _ in peers_gpu.sweep_points(job)
            if label["sweep"] == "length"} == {1}


def test_spinf_tiny_warm_keeps_roots_and_every_figure(tmp_path, monkeypatch):
    """The spinf part with --root-cache-mib: the job again on kept roots, its responses
    those of the cold calls (the part stops otherwise)."""
    run_main(monkeypatch, "spinf", "--tiny", "--docs", "2", "--doc-tokens", "64",
             "--root-cache-mib", "16", "--out", str(tmp_path), "--commit", "abc1234")
    row = only_file(tmp_path, "*-peers-spinf-abc1234.json")
    assert row["spinf_fp32_warm_same_as_cold"] is True
    assert row["spinf_fp32_warm_kept_roots"] >= 2
    assert row["spinf_fp32_warm_questions_per_s"] > 0


def test_sweep_spinf_tiny_writes_its_points(tmp_path, monkeypatch):
    run_main(monkeypatch, "sweep-spinf", "--tiny", "--docs", "1", "--doc-tokens", "64",
             "--question-counts", "7",
             "--lengths", "32", "--sweep-tokens", "64", "--out", str(tmp_path),
             "--commit", "abc1234")
    row = only_file(tmp_path, "*-peers-sweep-spinf-abc1234.json")
    assert row["part"] == "sweep-spinf" and row["model"] == "tiny"
    points = row["points"]
    assert [(p["sweep"], p["questions_per_doc"], p["doc_tokens"], p["docs"]) for p in points] == [
        ("questions", 7, 64, 1), ("length", 56, 32, 4)]
    for p in points:
        assert p["side"] == "spinf" and p["scheme"] == "fp32"
        assert p["questions"] == p["docs"] * p["questions_per_doc"] and p["questions_per_s"] > 0


def test_sweep_hf_tiny_writes_its_points(tmp_path, monkeypatch):
    run_main(monkeypatch, "sweep-hf", "--tiny", "--docs", "1", "--doc-tokens", "64",
             "--question-counts", "7",
             "--lengths", "32", "--sweep-tokens", "64", "--batch-tokens", "2048",
             "--out", str(tmp_path), "--commit", "abc1234")
    points = only_file(tmp_path, "*-peers-sweep-hf-abc1234.json")["points"]
    assert [(p["sweep"], p["docs"], p["questions"]) for p in points] == [
        ("questions", 1, 7), ("length", 1, 56)]    # --length-docs 1 by default
    assert all(p["side"] == "hf" and p["questions_per_s"] > 0 for p in points)


class StandInLLM:
    """vLLM's offline engine as far as peers_gpu uses it."""

    def __init__(self, **settings):
        self.settings, self.calls, self.resets = settings, [], 0
        StandInLLM.last = self

    def generate(self, prompts, params, use_tqdm=True):
        assert max(len(p["prompt_token_ids"]) for p in prompts) < self.settings["max_model_len"]
        self.calls.append((len(prompts), params.settings["detokenize"], self.resets))
        return [SimpleNamespace(outputs=[SimpleNamespace(logprobs=[{7: -0.1}])],
                                num_cached_tokens=5) for _ in prompts]

    def reset_prefix_cache(self):
        self.resets += 1
        return True


@pytest.fixture
def stand_in_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.__version__, vllm.LLM = "0.0-stand-in", StandInLLM
    vllm.SamplingParams = lambda **settings: SimpleNamespace(settings=settings)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "0")


def test_sweep_vllm_times_every_point_cold_and_warm(tmp_path, monkeypatch, stand_in_vllm):
    run_main(monkeypatch, "sweep-vllm", "--scheme", "fp8", "--docs", "1", "--question-counts",
             "7", "112", "--lengths", "600", "--sweep-tokens", "600", "--repeat", "2",
             "--out", str(tmp_path), "--model-dir", str(tmp_path / "models"),
             "--commit", "abc1234")
    row = only_file(tmp_path, "*-peers-sweep-vllm-fp8-abc1234.json")
    llm = StandInLLM.last
    assert llm.settings["quantization"] == "fp8" and llm.settings["load_format"] == "dummy"
    assert row["max_model_len"] == llm.settings["max_model_len"]
    assert row["max_model_len"] % 256 == 0 and row["max_model_len"] > 600
    points = row["points"]
    assert [(p["sweep"], p["requests"]) for p in points] == [
        ("questions", 7), ("questions", 112), ("length", 4 * 56)]
    for p in points:
        for mode in ("default", "nodetok"):
            for state in ("cold", "warm"):
                assert p[f"{mode}_{state}_questions_per_s"] > 0
                assert len(p[f"{mode}_{state}_seconds"]) == 2
    assert "default_first_s" in points[0] and "default_first_s" not in points[1]
    # per point and mode: (the first point: an untimed call), two cold after a reset each, two warm
    first = [(7, True, 0), (7, True, 1), (7, True, 2), (7, True, 2), (7, True, 2),
             (7, False, 2), (7, False, 3), (7, False, 4), (7, False, 4), (7, False, 4)]
    assert llm.calls[:10] == first
    assert [c[:2] for c in llm.calls[10:18]] == [(112, True)] * 4 + [(112, False)] * 4
    assert len(llm.calls) == 10 + 8 + 8


def test_vllm_part_keeps_its_figures_names(tmp_path, monkeypatch, stand_in_vllm):
    run_main(monkeypatch, "vllm", "--scheme", "bf16", "--docs", "1", "--out", str(tmp_path),
             "--model-dir", str(tmp_path / "models"), "--commit", "abc1234")
    row = only_file(tmp_path, "*-peers-vllm-bf16-abc1234.json")
    assert StandInLLM.last.settings["max_model_len"] == 2048
    for mode in ("default", "nodetok"):
        assert f"vllm_bf16_{mode}_first_s" in row
        for state in ("cold", "warm"):
            assert row[f"vllm_bf16_{mode}_{state}_questions_per_s"] > 0
            assert row[f"vllm_bf16_{mode}_{state}_cached_tokens"] == [5 * 56] * 3
    assert row["requests"] == 56


def sweep_part(side: str, points: list[dict], **figures) -> dict:
    return part(f"sweep-{side}", points=points, doc_tokens=470, **figures)


def test_report_merges_the_sweep_parts_and_draws_them(tmp_path, capsys):
    pytest.importorskip("matplotlib")

    def at(sweep, x, **figures):
        return {"sweep": sweep, "questions_per_doc": x if sweep == "questions" else 56,
                "doc_tokens": x if sweep == "length" else 470, **figures}

    spinf = [at(s, x, side="spinf", scheme=scheme, questions_per_s=q * x)
             for scheme, q in (("fp8", 20.0), ("bf16", 10.0))
             for s, x in (("questions", 7), ("questions", 56), ("length", 256), ("length", 8192))]
    vllm = {scheme: [at(s, x, side="vllm", scheme=scheme, default_cold_questions_per_s=5.0 * x,
                        default_warm_questions_per_s=6.0 * x,
                        nodetok_cold_questions_per_s=7.0 * x,
                        nodetok_warm_questions_per_s=8.0 * x if x != 56 else 1.0)
                     for s, x in (("questions", 7), ("questions", 56), ("length", 256))]
            for scheme in ("bf16", "fp8")}
    hf = [at("questions", 7, side="hf", scheme="bf16", questions_per_s=3.0),
          at("length", 8192, side="hf", scheme="bf16", error="out of memory")]
    parts = [sweep_part("spinf", spinf, device="NVIDIA H100 80GB HBM3",
                        model="gemma-3-12b shape, random weights"),
             sweep_part("vllm-bf16", vllm["bf16"], scheme="bf16"),
             sweep_part("vllm-fp8", vllm["fp8"], scheme="fp8"),
             sweep_part("hf", hf, docs=2)]
    for p in parts:
        (tmp_path / f"{p['date']}-peers-{p['part']}-{p['commit']}.json").write_text(json.dumps(p))
    results = tmp_path / "results"
    args = type("Args", (), {"out": tmp_path, "results": results, "commit": "abc1234"})()
    peers_gpu.run_report(args)
    assert not (results / "2026-12-03-peers-abc1234.json").exists()    # no part of the job
    row = json.loads((results / "2026-12-03-peers-sweeps-abc1234.json").read_text())
    assert len(row["points"]) == 8 + 3 + 3 + 2
    series = row["series"]
    assert list(series) == ["spinf-serve fp8", "spinf-serve bf16", "vLLM bf16 default, cold",
                            "vLLM bf16 best warm", "vLLM fp8 default, cold", "vLLM fp8 best warm",
                            "transformers bf16"]
    assert series["spinf-serve fp8"]["length"] == [[256, 5120.0], [8192, 163840.0]]
    assert series["vLLM fp8 best warm"]["questions"] == [[7, 56.0], [56, 336.0]]
    assert series["transformers bf16"] == {"questions": [[7, 3.0]]}    # the OOM point: no line
    png = (results / "2026-12-03-peers-sweeps-abc1234.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    out = capsys.readouterr().out
    assert ("| questions per document | spinf-serve fp8 | spinf-serve bf16 | vLLM bf16 default, "
            "cold | vLLM bf16 best warm | vLLM fp8 default, cold | vLLM fp8 best warm | "
            "transformers bf16 |") in out
    assert "| 7 | 140 | 70.0 | 35.0 | 56.0 | 35.0 | 56.0 | 3.0 |" in out
    assert "| 8192 | 163,840 | 81,920 |  |  |  |  |" in out    # no transformers column

"""benchmarks/peers_gpu.py on the CPU: the shared random weights read the same by transformers
and the engine, and the report's merge of the parts' figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

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
        part("spinf", spinf_fp8_questions_per_s=2000.0, spinf_bf16_questions_per_s=1100.0),
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
    assert row["parts"]["vllm-fp8"]["scheme"] == "fp8"
    out = capsys.readouterr().out
    assert "| fp8, logprobs=20 | 640.0 | 600.0 | 2000.0 |" in out
    assert "top-1 agreement 0.99 over 448 options" in out
    assert "vllm_serve_bf16_cold 400.0 q/s, spinf_serve_bf16 1000.0 q/s" in out


def test_report_without_parts_says_so(tmp_path):
    args = type("Args", (), {"out": tmp_path, "results": tmp_path, "commit": None})()
    with pytest.raises(SystemExit, match="no peers part"):
        peers_gpu.run_report(args)

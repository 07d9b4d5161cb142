"""fp8 with static activation scales on the CPU: the offline calibration (`spinf-serve quantize
fp8-static`) against transformers' own forward hooks on the same texts, the scheme's exact
reference path against an independent reimplementation of the same quantised arithmetic on
transformers' Gemma 3, bit-identical scores alone vs packed, and the command's bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from .conftest import TINY_BOS, TINY_CORPUS
from .test_batch_invariance import assert_invariant
from .test_engine_parity import NEWS, QUERIES, oracle_scores, prefix_of, score

ROOT = Path(__file__).resolve().parents[1]
FP8 = torch.float8_e4m3fn
# transformers' projections -> the engine's linear layer reading the same input
HF_INPUTS = {"self_attn.q_proj": "self_attn.qkv_proj", "self_attn.k_proj": "self_attn.qkv_proj",
             "self_attn.v_proj": "self_attn.qkv_proj", "self_attn.o_proj": "self_attn.o_proj",
             "mlp.gate_proj": "mlp.gate_up_proj", "mlp.up_proj": "mlp.gate_up_proj",
             "mlp.down_proj": "mlp.down_proj"}
# |Δlogprob| of the CPU path against the float64 reimplementation on transformers' stack: both
# round the same activations to the same fp8 values, so what is left is fp32 against float64
# sums and fp32 differences outside the linear layers (the fp32 parity TOL is 1e-4), plus,
# rarely, an activation that falls on an fp8 rounding boundary in one stack and not the other
# (one e4m3 step, 1/8 of its binade, in one of K terms). Measured 1.9e-6 on the tiny model.
STATIC_REF_TOL = 1e-3
TINY_FP8_LOGPROB_TOL = 0.2   # fp8-static vs fp32 on the tiny random model: measured 0.054


def calibration_texts() -> list[str]:
    return [line for line in TINY_CORPUS.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def calibrated(tiny_dir, tmp_path_factory) -> Path:
    """The tiny model's scales, calibrated by the command on the corpus's lines."""
    from spinf_worker.cli import main

    out = tmp_path_factory.mktemp("fp8-static")
    data = out / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in calibration_texts()))
    assert main(["quantize", "fp8-static", str(tiny_dir), "--data", str(data),
                 "--out", str(out), "--device", "cpu"]) == 0
    return out


@pytest.fixture(scope="module")
def static_engine(tiny_dir, calibrated):
    from spinf_worker.engine import Engine, EngineSettings

    return Engine.load(str(tiny_dir), device="cpu", settings=EngineSettings(
        scheme="fp8-static", fp8_scales=str(calibrated / "fp8-static-scales.safetensors")))


def stored_scales(calibrated: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k.removesuffix(".input_scale"): v
            for k, v in load_file(calibrated / "fp8-static-scales.safetensors").items()}


@contextmanager
def input_amax(model) -> Iterator[dict[str, float]]:
    """max|x| of every linear input of transformers' ``model`` over the forwards run inside,
    as its forward pre-hooks see them, keyed by the engine's layer reading the same input."""
    amax: dict[str, float] = {}

    def hook(name):
        def keep(module, args):
            amax[name] = max(amax.get(name, 0.0), args[0].detach().abs().max().item())
        return keep

    hooks = [m.register_forward_pre_hook(hook(f"layers.{name.split('.')[2]}."
                                              + HF_INPUTS[name.split(".", 3)[3]]))
             for name, m in model.named_modules()
             if name.count(".") == 4 and name.split(".", 3)[3] in HF_INPUTS]
    try:
        yield amax
    finally:
        for h in hooks:
            h.remove()


def test_calibrated_scales_follow_the_rule(calibrated, tiny_oracle, tiny_dir):
    """Every linear input's scale is max|x| * fp32(1/448), max|x| over the texts' rows as
    transformers' own forward hooks see them (BOS + the text's tokens, one text a forward)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    with input_amax(tiny_oracle) as amax, torch.no_grad():
        for text in calibration_texts():
            ids = [TINY_BOS, *tok.encode(text, add_special_tokens=False).ids]
            tiny_oracle(torch.tensor([ids]))
    scales = stored_scales(calibrated)
    assert set(scales) == set(amax) and len(scales) == 4 * 4
    recipe = json.loads((calibrated / "recipe-fp8-static.json").read_text())
    inv = torch.tensor(1.0, dtype=torch.float32) / 448.0
    for name, s in scales.items():
        assert s.dtype == torch.float32 and s.dim() == 0
        # the rule, to the bit, from the amax the command recorded
        recorded = torch.tensor(recipe["layers"][name]["amax"], dtype=torch.float32)
        assert torch.equal(s, recorded * inv), name
        # that amax is transformers' (fp32 stacks agree to ~1e-6 relative)
        assert recorded.item() == pytest.approx(amax[name], rel=1e-4), name
    assert recipe["calibration"]["documents"] == len(calibration_texts())


def _static_oracle(tiny_dir, scales: dict[str, torch.Tensor]):
    """transformers' Gemma 3 with every body projection replaced by the scheme's arithmetic,
    written here from its definition: weights e4m3 per output channel (amax / 448), inputs
    e4m3 by their static scale, products summed in float64, scaled back."""
    from transformers import Gemma3ForCausalLM

    model = Gemma3ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()

    def quantised(proj, s):
        w = proj.weight.detach().float()
        ws = w.abs().amax(dim=1) / 448.0
        wq = (w / ws[:, None]).clamp(-448, 448).to(FP8).double() * ws.double()[:, None]

        def forward(x):
            xq = (x.float() / s).clamp(-448, 448).to(FP8).double() * s.double()
            return (xq @ wq.t()).float()
        return forward

    for name, m in model.named_modules():
        if name.count(".") == 4 and name.split(".", 3)[3] in HF_INPUTS:
            layer = name.split(".")[2]
            m.forward = quantised(m, scales[f"layers.{layer}." + HF_INPUTS[name.split(".", 3)[3]]])
    return model


def test_static_scheme_matches_an_independent_reference(static_engine, tiny_engine, tiny_dir,
                                                        calibrated):
    oracle = _static_oracle(tiny_dir, stored_scales(calibrated))
    layer = static_engine.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == FP8 and layer.input_scale.dim() == 0
    assert static_engine.scheme == "fp8-static"
    assert static_engine.fingerprint != tiny_engine.fingerprint
    worst = vs_fp32 = 0.0
    fp32 = score(tiny_engine, NEWS, QUERIES, case_insensitive=False)
    results = score(static_engine, NEWS, QUERIES, case_insensitive=False)
    for query, result, ref in zip(QUERIES, results, fp32, strict=True):
        for combo, ref_combo in zip(result.combinations, ref.combinations, strict=True):
            prefix = prefix_of(query, combo.values)
            for option, ref_option in zip(combo.options, ref_combo.options, strict=True):
                [want], _ = oracle_scores(static_engine, oracle, NEWS, prefix, [option.text])
                worst = max(worst, abs(option.logprob - want))
                vs_fp32 = max(vs_fp32, abs(option.logprob - ref_option.logprob))
    print(f"fp8-static vs its float64 reference: max |Δlogprob| {worst:.2e}; "
          f"vs fp32: {vs_fp32:.4f}")
    assert worst <= STATIC_REF_TOL, worst
    assert 0 < vs_fp32 <= TINY_FP8_LOGPROB_TOL, vs_fp32   # quantised, and not far off


def test_static_scheme_alone_vs_packed(static_engine):
    assert_invariant(static_engine, {"text": NEWS * 2, "scoring": {"queries": QUERIES}}, seed=5)


def test_scales_next_to_the_checkpoint_and_bad_files(tiny_dir, calibrated, tmp_path):
    import shutil

    from spinf_worker.engine import Engine, EngineSettings

    with pytest.raises(ValueError, match="needs activation scales"):
        Engine.load(str(tiny_dir), device="cpu", settings=EngineSettings(scheme="fp8-static"))
    beside = tmp_path / "model"
    shutil.copytree(tiny_dir, beside)
    shutil.copy(calibrated / "fp8-static-scales.safetensors", beside)
    engine = Engine.load(str(beside), device="cpu", settings=EngineSettings(scheme="fp8-static"))
    assert engine.model.layers[3].mlp.down_proj.input_scale is not None
    from safetensors.torch import save_file

    partial = stored_scales(calibrated)
    partial.pop("layers.1.mlp.down_proj")
    save_file({k + ".input_scale": v for k, v in partial.items()}, str(tmp_path / "p.st"))
    with pytest.raises(ValueError, match="lack 1 of the model's 16 linear layers"):
        Engine.load(str(tiny_dir), device="cpu", settings=EngineSettings(
            scheme="fp8-static", fp8_scales=str(tmp_path / "p.st")))
    from spinf_worker.quant.fp8_static import save_scales

    save_scales(tmp_path / "other.st", stored_scales(calibrated), {"weights_digest": "0" * 64})
    with pytest.raises(ValueError, match="calibrated on other weights"):
        Engine.load(str(tiny_dir), device="cpu", settings=EngineSettings(
            scheme="fp8-static", fp8_scales=str(tmp_path / "other.st")))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spinf_worker.cli", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_quantize_bad_input_is_one_line(tiny_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a"}\n{not json\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    queries = tmp_path / "q.json"
    queries.write_text('["not a scoring block"]')
    cases = [
        (["--data", str(tmp_path / "nowhere.jsonl")], "cannot read"),
        (["--data", str(data)], ":2:"),
        (["--data", str(empty)], "no texts to calibrate on"),
        (["--data", str(empty), "--queries", str(queries)], "expected a scoring block"),
    ]
    for extra, words in cases:
        proc = _cli("quantize", "fp8-static", str(tiny_dir), "--out", str(tmp_path / "o"),
                    "--device", "cpu", *extra)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and words in proc.stderr, proc.stderr
        assert proc.stderr.startswith("spinf-serve: ")
    bad = _cli("score", "-", "--model", str(tiny_dir), "--device", "cpu",
               "--quant", "fp8-static", "--fp8-scales", str(tmp_path / "none.safetensors"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "does not exist" in bad.stderr


def test_scales_flag_reaches_the_service_and_its_worker_processes(monkeypatch):
    from spinf_worker.cli import _service_settings, build_parser
    from spinf_worker.worker_pool import WorkerPool

    monkeypatch.delenv("SPINF_FP8_SCALES", raising=False)
    parse = build_parser().parse_args
    assert _service_settings(parse(["worker", "--redis", "redis://x"])).fp8_scales is None
    settings = _service_settings(parse(["worker", "--redis", "redis://x", "--quant",
                                        "fp8-static", "--fp8-scales", "s.safetensors"]))
    assert (settings.quant, settings.fp8_scales) == ("fp8-static", "s.safetensors")
    pool = WorkerPool(settings, ["cpu"], None)
    _, env = pool._command(pool.children[0])
    assert env["SPINF_QUANT"] == "fp8-static" and env["SPINF_FP8_SCALES"] == "s.safetensors"
    monkeypatch.setenv("SPINF_FP8_SCALES", "t.safetensors")
    assert _service_settings(parse(["serve"])).fp8_scales == "t.safetensors"


def test_calibration_with_questions_reads_every_row_scoring_reads(tiny_dir, tiny_oracle,
                                                                  tiny_engine, tmp_path):
    """With --queries the recorded amax is that of every sequence the prefix tree stands
    for (content + a question's text + an option's first tokens, and the same on empty
    content for the floors), in transformers' own forward."""
    from spinf_worker.cli import main

    texts = calibration_texts()[:3]
    queries = [q for q in QUERIES if "values" not in q][:3]
    data, block = tmp_path / "data.jsonl", tmp_path / "q.json"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    block.write_text(json.dumps({"queries": queries, "case_insensitive": False}))
    assert main(["quantize", "fp8-static", str(tiny_dir), "--data", str(data),
                 "--queries", str(block), "--out", str(tmp_path), "--device", "cpu"]) == 0
    recipe = json.loads((tmp_path / "recipe-fp8-static.json").read_text())

    enc = tiny_engine.presenter.encode
    with input_amax(tiny_oracle) as amax, torch.no_grad():
        for root in [[TINY_BOS, *enc(t)] for t in texts] + [[TINY_BOS]]:
            for query in queries:
                ctx = root + list(enc(query["template"].split("{?}")[0]))
                for option in query["options"]:
                    tiny_oracle(torch.tensor([ctx + list(enc(option))[:-1]]))
    assert set(recipe["layers"]) == set(amax)
    for name, layer in recipe["layers"].items():
        assert layer["amax"] == pytest.approx(amax[name], rel=1e-4), name

"""fp8 checkpoints as published on the Hub (compressed-tensors, llm-compressor's "FP8" and
"FP8-dynamic"), on the CPU: tiny random Gemma 3 and Llama whose body linear layers are written
here in that layout (float8_e4m3fn codes, fp32 weight scales per channel or per tensor, static
per-tensor input scales calibrated on the dense model or none), loaded through the project's
loader and scored by the engine.

Oracles: the engine on the same model's dequantised weights quantised at load by the fp8
schemes themselves (bit for bit: the codes below are chosen so that re-quantising the
dequantised weights gives them back), an independent float64 W8A8 reference on transformers'
stack, and compressed-tensors' own decompression where that package is installed.

The layout below is written from the format, not from spinf_worker/quant/fp8_checkpoint.py,
so a misread layout fails here."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from spinf_worker.errors import UnsupportedModelError

from .test_engine_parity import NEWS, QUERIES, score, worst_option_gap
from .test_families import _randomise
from .test_fp8_static import HF_INPUTS
from .test_gptq import BODY, assert_config_refused, build

FP8 = torch.float8_e4m3fn
INV_448 = torch.tensor(1 / 448.0, dtype=torch.float32)
# transformers' projections -> the engine's fused linear layer and its parts' row order
FUSED = {"self_attn.qkv_proj": (("q_proj", "k_proj", "v_proj"), False),
         "mlp.gate_up_proj": (("gate_proj", "up_proj"), True)}
# the engine's scheme and the quant_method's activation arguments, per variant
ACTIVATIONS = {"static": {"num_bits": 8, "type": "float", "strategy": "tensor",
                          "dynamic": False, "symmetric": True},
               "dynamic": {"num_bits": 8, "type": "float", "strategy": "token",
                           "dynamic": True, "symmetric": True}}
IGNORED = "model.layers.1.mlp.down_proj"   # kept dense in the "ignore" case
# |Δlogprob| of the engine against the float64 W8A8 reference on transformers' stack: the
# same fp8 values, but fp32 against float64 sums upstream put an activation now and then on
# the other side of an e4m3 rounding boundary (one step, 1/8 of its binade; per token, the
# row's scale too), which these small random models carry to the scores. Measured 1.4e-06 to
# 6.9e-03 over the cases below; the fp8 quantisation itself moves them 2.9e-02 to 6.5e-02. The
# layer-by-layer test holds each layer to rounding on the same inputs.
FP8_REF_TOL = 1e-2


def quantization_config(strategy: str, activations: str, ignore: list[str]) -> dict:
    """As llm-compressor writes it (RedHatAI's FP8 / FP8-dynamic models)."""
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "global_compression_ratio": None,
            "kv_cache_scheme": None, "sparsity_config": {},
            "config_groups": {"group_0": {
                "targets": ["Linear"], "output_activations": None,
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                            "dynamic": False, "symmetric": True, "group_size": None,
                            "block_structure": None, "actorder": None, "observer": "minmax"},
                "input_activations": dict(ACTIVATIONS[activations])}},
            "ignore": ignore}


def fp8_weight(w: torch.Tensor, strategy: str, pow2: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [out, in] -> (e4m3 codes, fp32 scale [out, 1] or [1]). Scales are bf16 values (8
    significant bits), so ``code * scale`` (4 + 8 bits) is exact in fp32; every row's largest
    code is ±448, so quantising the dequantised weight again per channel (scale =
    amax / 448) gives back these codes and scales exactly. ``pow2``: powers of two, so that
    ``code * scale`` is exact in bf16 too (the GPU's dense weights)."""
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax()
    scale = (amax / 448.0).to(torch.bfloat16).float()
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    codes = (w / scale).clamp(-448, 448).to(FP8).float()
    rows = torch.arange(w.shape[0])
    top = w.abs().argmax(dim=1)
    codes[rows, top] = 448.0 * torch.sign(w[rows, top])     # each row reaches the top code
    return codes.to(FP8), scale.reshape(-1, 1) if strategy == "channel" else scale.reshape(1)


def calibrate(model, tokens: list[int]) -> dict[str, torch.Tensor]:
    """Each body projection's input amax on ``tokens``, through forward hooks, times 1.25
    (headroom: the scored rows are other rows) -> the static scale amax / 448."""
    amax: dict[str, float] = {}

    def hook(name):
        def keep(module, args):
            amax[name] = max(amax.get(name, 0.0), args[0].detach().abs().max().item())
        return keep

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in model.named_modules()
               if name.rpartition(".")[2] in BODY]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for h in handles:
        h.remove()
    return {name: torch.tensor([a * 1.25 / 448.0], dtype=torch.float32)
            for name, a in amax.items()}


def write_case(root: Path, tokenizer_dir: Path, family: str, strategy: str, activations: str,
               *, ignore_layer: bool = False, k_scale_factor: float = 1.0,
               pow2: bool = False) -> dict:
    """The dense model on the dequantised weights and the same model as a compressed-tensors
    checkpoint; returns both directories and the tensors written per layer."""
    from tokenizers import Tokenizer

    model = build(family).eval()
    _randomise(model, 11)
    ignore = ["lm_head"] + ([IGNORED] if ignore_layer else [])
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    layers = {}
    with torch.no_grad():
        # body projections of std 1/sqrt(in) and embeddings / head of std 0.015: activations
        # and logits stay O(1), so a row's scores are not chaotic in its rounding
        for name, module in model.named_modules():
            leaf = name.rpartition(".")[2]
            if leaf in BODY:
                module.weight.mul_(1 / (0.15 * module.weight.shape[1] ** 0.5))
            elif leaf in ("embed_tokens", "lm_head"):
                module.weight.mul_(0.1)
    scales = calibrate(model, [model.config.bos_token_id, *tok.encode(NEWS * 2).ids])
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rpartition(".")[2] not in BODY:
                continue
            if name in ignore:       # stored as published: bf16
                module.weight.copy_(module.weight.to(torch.bfloat16).float())
                continue
            codes, scale = fp8_weight(module.weight, strategy, pow2)
            module.weight.copy_(codes.float() * scale.reshape(-1, 1))
            tensors = {"weight": codes, "weight_scale": scale}
            if activations == "static":
                tensors["input_scale"] = scales[name] * (
                    k_scale_factor if name.endswith("k_proj") else 1.0)
            layers[name] = tensors
    dense_dir, ct_dir = root / "dense", root / "fp8"
    model.save_pretrained(dense_dir)
    shutil.copy(tokenizer_dir / "tokenizer.json", dense_dir / "tokenizer.json")
    shutil.copytree(dense_dir, ct_dir)
    weights = load_file(ct_dir / "model.safetensors")
    for name, tensors in layers.items():
        weights.update({f"{name}.{leaf}": t.contiguous() for leaf, t in tensors.items()})
    if ignore_layer:
        weights[f"{IGNORED}.weight"] = weights[f"{IGNORED}.weight"].to(torch.bfloat16)
    save_file(weights, ct_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((ct_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config(strategy, activations, ignore)
    (ct_dir / "config.json").write_text(json.dumps(config, indent=2))
    return dict(family=family, strategy=strategy, activations=activations, dense_dir=dense_dir,
                ct_dir=ct_dir, layers=layers)


def engine_scales(layers: dict[str, dict]) -> dict[str, torch.Tensor]:
    """The engine's module name -> the static scale its fused GEMM reads: the largest of its
    parts' (they share one input)."""
    out = {}
    for name, tensors in layers.items():
        layer, _, proj = name.removeprefix("model.").partition(".self_attn.")
        if not proj:
            layer, _, proj = name.removeprefix("model.").partition(".mlp.")
            proj = "mlp." + proj
        else:
            proj = "self_attn." + proj
        fused = f"{layer}.{HF_INPUTS[proj]}"
        s = tensors["input_scale"].reshape(())
        out[fused] = torch.maximum(out[fused], s) if fused in out else s
    return out


CASES = [("gemma3", "channel", "static"), ("llama", "tensor", "static"),
         ("llama", "channel", "dynamic"), ("gemma3", "tensor", "dynamic")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c))
def case(request, tmp_path_factory, tiny_tokenizer_dir):
    from spinf_worker.engine import Engine

    info = write_case(tmp_path_factory.mktemp("fp8ckpt"), tiny_tokenizer_dir, *request.param)
    info["engine"] = Engine.load(str(info["ct_dir"]), device="cpu")
    return info


def joined(layers: dict, prefix: str, fused: str, leaf: str) -> torch.Tensor:
    """A fused projection's stored rows (``leaf``: weight codes as bytes, or per-channel
    scales), joined as the engine's layout says: q|k|v concatenated, gate|up interleaved."""
    names, interleave = FUSED[fused]
    parts = []
    for part in names:
        t = layers[f"{prefix}.{fused.split('.')[0]}.{part}"][leaf]
        out = t.shape[0] if leaf == "weight" else layers[
            f"{prefix}.{fused.split('.')[0]}.{part}"]["weight"].shape[0]
        parts.append(t.view(torch.uint8) if leaf == "weight" else t.reshape(-1).expand(out))
    return torch.stack(parts, dim=1).flatten(0, 1) if interleave else torch.cat(parts)


def test_fp8_checkpoint_served_as_stored(case):
    """The engine's fp8 layers hold the checkpoint's codes byte for byte, its weight scales
    (a per-tensor one on every channel) and its static input scales; the LM head and
    embeddings stay dense; auto picks the checkpoint's own scheme on the CPU."""
    engine, layers = case["engine"], case["layers"]
    static = case["activations"] == "static"
    assert engine.scheme == ("fp8-static" if static else "fp8")
    assert engine.checkpoint.quantization == (
        f"compressed-tensors fp8 weights per {case['strategy']}, activations "
        + ("static per tensor" if static else "dynamic per token"))
    model = engine.model
    for i, block in enumerate(model.layers):
        for fused, module in (("self_attn.qkv_proj", block.self_attn.qkv_proj),
                              ("mlp.gate_up_proj", block.mlp.gate_up_proj)):
            prefix = f"model.layers.{i}"
            assert module.weight.dtype == FP8
            assert torch.equal(module.weight.view(torch.uint8),
                               joined(layers, prefix, fused, "weight")), fused
            assert torch.equal(module.weight_scale, joined(layers, prefix, fused, "weight_scale"))
            first = layers[f"{prefix}.{fused.split('.')[0]}.{FUSED[fused][0][0]}"]
            if static:
                assert torch.equal(module.input_scale, first["input_scale"].reshape(()))
            else:
                assert module.input_scale is None
        down = layers[f"model.layers.{i}.mlp.down_proj"]
        assert torch.equal(block.mlp.down_proj.weight.view(torch.uint8),
                           down["weight"].view(torch.uint8))
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    assert head.dtype == torch.float32


def test_fp8_checkpoint_scores_equal_the_scheme_on_dequantised_weights(case, tmp_path):
    """Bit for bit: the engine on the checkpoint, and the engine on the dequantised dense model
    quantised at load by the same scheme (fp8-static with the same activation scales in a
    scales file, or fp8 per token)."""
    from spinf_worker.engine import Engine, EngineSettings
    from spinf_worker.quant.fp8_static import save_scales

    settings = EngineSettings(scheme="fp8")
    if case["activations"] == "static":
        path = tmp_path / "scales.safetensors"
        save_scales(path, engine_scales(case["layers"]), {})
        settings = EngineSettings(scheme="fp8-static", fp8_scales=str(path))
    dense = Engine.load(str(case["dense_dir"]), device="cpu", settings=settings)
    got, want = score(case["engine"], NEWS, QUERIES), score(dense, NEWS, QUERIES)
    for a, b in zip(got, want, strict=True):
        assert a.model_dump() == b.model_dump()


def w8a8_reference(model_dir: Path, layers: dict, activations: str, ignored=()):
    """transformers' model with every quantised projection replaced by W8A8 arithmetic
    written here from its definition: inputs e4m3 by the stored static scale, or per token by
    amax * fp32(1/448); weights the stored codes times their scales; products summed in
    float64."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()

    def quantised(proj, tensors):
        w = tensors["weight"].double() * tensors["weight_scale"].double().reshape(-1, 1)
        bias = None if proj.bias is None else proj.bias.detach().double()

        def forward(x):
            xf = x.float()
            if activations == "static":
                s = tensors["input_scale"].reshape(())
            else:
                # the engine's per-token rule: amax * fp32(1/448) (one multiplication,
                # the same in torch and Triton); amax / 448 differs from it by an ulp at times
                s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) * INV_448
            y = (xf / s).clamp(-448, 448).to(FP8).double() * s.double() @ w.t()
            return (y if bias is None else y + bias).float()
        return forward

    for name, module in model.named_modules():
        if name in layers:
            module.forward = quantised(module, layers[name])
    return model


def worst_gap(engine, oracle) -> float:
    return worst_option_gap(engine, oracle, NEWS, QUERIES)


def test_fp8_checkpoint_layers_compute_the_stored_arithmetic(case):
    """Each fused linear layer on the same input rows: the stored codes times their scales,
    the input quantised by each part's stored scale (or per token), products summed in
    float64 (fp32's sums of exact products differ from it by rounding only)."""
    from spinf_worker.tiles import ROW_TILE

    gen = torch.Generator().manual_seed(3)
    model, layers = case["engine"].model, case["layers"]
    for i, block in enumerate(model.layers):
        for fused, module in (("self_attn.qkv_proj", block.self_attn.qkv_proj),
                              ("mlp.gate_up_proj", block.mlp.gate_up_proj)):
            parent, _ = fused.split(".")
            names, interleave = FUSED[fused]
            parts = [layers[f"model.layers.{i}.{parent}.{p}"] for p in names]
            x = torch.randn(ROW_TILE, module.weight.shape[1], generator=gen) * 3
            outs = []
            for tensors in parts:
                w = tensors["weight"].double() * tensors["weight_scale"].double().reshape(-1, 1)
                if case["activations"] == "static":
                    s = tensors["input_scale"].reshape(())
                else:
                    s = x.abs().amax(dim=-1, keepdim=True) * INV_448
                outs.append((x / s).clamp(-448, 448).to(FP8).double() * s.double() @ w.t())
            want = (torch.stack(outs, dim=2).flatten(1, 2) if interleave
                    else torch.cat(outs, dim=1))
            if module.bias is not None:
                want = want + module.bias.double()
            got = module(x).double()
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), \
                (i, fused, (got - want).abs().max().item())


def test_fp8_checkpoint_matches_an_independent_w8a8_reference(case):
    """Within FP8_REF_TOL of the float64 W8A8 reference on transformers' stack (the same fp8
    values, sums in float64), and well away from the unquantised model: the activations are
    quantised."""
    worst = worst_gap(case["engine"], w8a8_reference(case["dense_dir"], case["layers"],
                                                     case["activations"]))
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        case["dense_dir"], dtype=torch.float32, attn_implementation="eager").eval()
    unquantised = worst_gap(case["engine"], plain)
    print(f"fp8 checkpoint {case['family']} {case['strategy']} {case['activations']}: "
          f"max |Δlogprob| vs float64 W8A8 reference {worst:.2e}, vs the dequantised "
          f"weights unquantised {unquantised:.2e}")
    assert worst <= FP8_REF_TOL, worst
    assert unquantised > 2 * FP8_REF_TOL, unquantised


def test_fp8_checkpoint_dequantised_schemes(case):
    """fp32 serves the dequantised weights: the same bits as the dense checkpoint's engine;
    schemes that would quantise them again are refused."""
    from spinf_worker.engine import Engine, EngineSettings
    from spinf_worker.models.build import pick_scheme

    fp32 = Engine.load(str(case["ct_dir"]), device="cpu", settings=EngineSettings(scheme="fp32"))
    dense = Engine.load(str(case["dense_dir"]), device="cpu")
    for a, b in zip(score(fp32, NEWS, QUERIES), score(dense, NEWS, QUERIES), strict=True):
        assert a.model_dump() == b.model_dump()
    fmt = case["engine"].checkpoint.stored_format
    for scheme in ("int8", "int4"):
        with pytest.raises(ValueError, match=f"scheme {scheme} does not apply to a "
                                             "compressed-tensors fp8"):
            pick_scheme(scheme, torch.device("cpu"), fmt)


def test_compressed_tensors_decompresses_to_the_loaders_weights(case):
    """compressed-tensors (llm-compressor's own library) as transformers runs it: its
    decompressed weights equal the loader's dequantised ones bit for bit."""
    pytest.importorskip("compressed_tensors")
    from spinf_worker.models.loader import load_checkpoint, text_weights

    model = transformers.AutoModelForCausalLM.from_pretrained(
        case["ct_dir"], dtype=torch.float32,
        quantization_config=transformers.CompressedTensorsConfig(run_compressed=False))
    theirs = text_weights(model.state_dict(), tied=model.config.tie_word_embeddings)
    ours = load_checkpoint(str(case["ct_dir"])).stored
    assert ours.keys() == case["layers"].keys()
    for name in case["layers"]:
        assert torch.equal(ours[name].dense(), theirs[name + ".weight"]), name


def test_ignored_layers_stay_dense(tmp_path, tiny_tokenizer_dir):
    """A module on the ignore list is stored in bf16 and served so (fp32 activations on the
    CPU, its bf16 values exactly); the rest is fp8; the scores follow the W8A8 reference
    with that layer plain."""
    from spinf_worker.engine import Engine

    info = write_case(tmp_path, tiny_tokenizer_dir, "llama", "channel", "static",
                      ignore_layer=True)
    engine = Engine.load(str(info["ct_dir"]), device="cpu")
    down = engine.model.layers[1].mlp.down_proj
    assert down.weight.dtype == torch.float32 and down.input_scale is None
    stored = load_file(info["ct_dir"] / "model.safetensors")[f"{IGNORED}.weight"]
    assert stored.dtype == torch.bfloat16 and torch.equal(down.weight, stored.float())
    assert engine.model.layers[0].mlp.down_proj.weight.dtype == FP8
    assert IGNORED not in info["layers"]
    worst = worst_gap(engine, w8a8_reference(info["dense_dir"], info["layers"], "static"))
    assert worst <= FP8_REF_TOL, worst


def test_fused_parts_with_different_input_scales(tmp_path, tiny_tokenizer_dir, caplog):
    """q, k and v read one input, which the fused GEMM quantises once: where the checkpoint's
    scales differ the largest is served, and the parts' scales are logged."""
    from spinf_worker.engine import Engine, EngineSettings
    from spinf_worker.quant.fp8_static import save_scales

    info = write_case(tmp_path, tiny_tokenizer_dir, "gemma3", "channel", "static",
                      k_scale_factor=2.0)
    with caplog.at_level(logging.WARNING, logger="spinf_worker.models.build"):
        engine = Engine.load(str(info["ct_dir"]), device="cpu")
    k_scale = info["layers"]["model.layers.0.self_attn.k_proj"]["input_scale"].reshape(())
    assert torch.equal(engine.model.layers[0].self_attn.qkv_proj.input_scale, k_scale)
    assert "layers.0.self_attn.qkv_proj" in caplog.text and "differ" in caplog.text
    scales = engine_scales(info["layers"])
    save_scales(tmp_path / "s.safetensors", scales, {})
    dense = Engine.load(str(info["dense_dir"]), device="cpu", settings=EngineSettings(
        scheme="fp8-static", fp8_scales=str(tmp_path / "s.safetensors")))
    for a, b in zip(score(engine, NEWS, QUERIES), score(dense, NEWS, QUERIES), strict=True):
        assert a.model_dump() == b.model_dump()


def _group(**change) -> dict:
    cfg = quantization_config("channel", "static", ["lm_head"])
    group = cfg["config_groups"]["group_0"]
    for key, value in change.items():
        part, _, leaf = key.partition("__")
        group[part][leaf] = value
    return cfg


BAD = [
    (_group(weights__type="int"), "compressed-tensors int8 weights"),
    (_group(weights__num_bits=4), "compressed-tensors float4 weights"),
    (_group(weights__strategy="block", weights__block_structure=[128, 128]),
     "fp8 weight strategy 'block'"),
    (_group(weights__strategy="group", weights__group_size=128), "fp8 weight strategy 'group'"),
    (_group(weights__symmetric=False), "asymmetric fp8 weights"),
    (_group(input_activations__strategy="token"), "strategy 'token', dynamic False"),
    ({**_group(), "format": "pack-quantized"}, "format 'pack-quantized'"),
    ({**_group(), "sparsity_config": {"format": "sparse-24-bitmask",
                                      "sparsity_structure": "2:4"}},
     "sparsity 2:4 (sparse-24-bitmask)"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     "block-wise scales (weight_block_size [128, 128]"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
]


@pytest.mark.parametrize(("qcfg", "named"), BAD, ids=[b[1] for b in BAD])
def test_unsupported_fp8_config(qcfg, named, tmp_path, tiny_tokenizer_dir):
    """A clear one-line error naming what is unsupported, before any weight is read (the
    directory has none); ``spinf-serve models`` says the same from the config alone."""
    assert_config_refused(tmp_path, tiny_tokenizer_dir, "llama", "Llama", qcfg, named)


def test_weight_only_fp8_refused(tmp_path, tiny_tokenizer_dir):
    from spinf_worker.models.loader import load_checkpoint

    cfg = _group()
    cfg["config_groups"]["group_0"]["input_activations"] = None
    config = build("llama").config.to_dict()
    config["quantization_config"] = cfg
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(tiny_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(UnsupportedModelError, match="weight-only"):
        load_checkpoint(str(tmp_path))


def test_bad_fp8_tensors_refused(tmp_path, tiny_tokenizer_dir):
    """A fused projection quantised only in part, and an fp8 weight without its scale."""
    from spinf_worker.engine import Engine

    info = write_case(tmp_path / "a", tiny_tokenizer_dir, "llama", "channel", "static")
    weights = load_file(info["ct_dir"] / "model.safetensors")
    v = "model.layers.0.self_attn.v_proj"
    dense = load_file(info["dense_dir"] / "model.safetensors")[v + ".weight"]
    for leaf in ("weight_scale", "input_scale"):
        weights.pop(f"{v}.{leaf}")
    save_file({**weights, v + ".weight": dense}, info["ct_dir"] / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="quantises only some of q_proj"):
        Engine.load(str(info["ct_dir"]), device="cpu")
    save_file({**weights}, info["ct_dir"] / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=f"{v}.weight is float8_e4m3fn without"):
        Engine.load(str(info["ct_dir"]), device="cpu")


def test_scales_file_replaces_stored_scales_and_dummy_weights(tmp_path, tiny_tokenizer_dir):
    """``--fp8-scales FILE`` given for a checkpoint with its own static scales: the file's are
    served (on the stored codes); ``--load-format dummy``: random weights of the shapes in the
    checkpoint's own scheme."""
    from spinf_worker.engine import Engine, EngineSettings
    from spinf_worker.quant.fp8_static import save_scales

    info = write_case(tmp_path, tiny_tokenizer_dir, "llama", "channel", "static")
    scales = {name: s * 2 for name, s in engine_scales(info["layers"]).items()}
    save_scales(tmp_path / "s.safetensors", scales, {})
    engine = Engine.load(str(info["ct_dir"]), device="cpu", settings=EngineSettings(
        scheme="fp8-static", fp8_scales=str(tmp_path / "s.safetensors")))
    module = engine.model.layers[1].mlp.down_proj
    assert torch.equal(module.input_scale, scales["layers.1.mlp.down_proj"])
    stored = info["layers"]["model.layers.1.mlp.down_proj"]["weight"]
    assert torch.equal(module.weight.view(torch.uint8), stored.view(torch.uint8))
    dummy = Engine.load(str(info["ct_dir"]), device="cpu", load_format="dummy")
    assert dummy.scheme == "fp8-static"
    assert dummy.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8
    assert score(dummy, NEWS, QUERIES[:1])

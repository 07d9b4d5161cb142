"""GPTQ int4 checkpoints on the CPU: tiny random Llama, Qwen3 and Gemma 3 whose body linear
layers are written here in GPTQ's packed layout (random 4-bit codes, fp16 scales, zeros; group
size 32 and 128; symmetric or not; the old ``gptq`` and the ``gptq_v2`` zero convention),
loaded through the project's loader and scored by the engine. The oracle is transformers
running the same model unquantised with the dequantised weights.

The packing below is written from the format (transformers / optimum / GPTQModel), not from
spinf_worker/quant/gptq.py, so a misread layout fails here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from spinf_worker.errors import UnsupportedModelError
from spinf_worker.quant.gptq_config import GptqFormat

from .test_engine_parity import NEWS, QUERIES, check_against_oracle, score
from .test_families import SMALL, _randomise

# hidden 256 and intermediate 384: every projection has 2+ groups of 128 and 8+ of 32
SHAPE = {**SMALL, "hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 2,
         "head_dim": 64}
BODY = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WORD = 1 << 32
GPTQ_G128 = GptqFormat(group_size=128, sym=True, v2=False)


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 with the same bits."""
    words = words % WORD
    return torch.where(words >= 1 << 31, words - WORD, words).to(torch.int32)


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [8n, m] -> [n, m] words (int64, unsigned): row 8i+k in bits 4k..4k+3."""
    codes = codes.to(torch.int64).reshape(-1, 8, codes.shape[1])
    return sum(codes[:, k] << (4 * k) for k in range(8))


def gptq_layer(out: int, d_in: int, group: int, sym: bool, v2: bool, gen: torch.Generator
               ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One layer's GPTQ tensors and its dequantised fp32 weight [out, in]."""
    groups = d_in // group
    codes = torch.randint(0, 16, (d_in, out), generator=gen)
    zeros = (torch.full((groups, out), 8) if sym
             else torch.randint(0, 16, (groups, out), generator=gen))
    scales = ((0.5 + torch.rand(groups, out, generator=gen)) * 0.3 / d_in ** 0.5).half()
    g_idx = torch.arange(d_in) // group
    dense = (scales.float()[g_idx] * (codes - zeros[g_idx]).float()).T.contiguous()
    qzeros = pack_rows(zeros.T).T                     # packed along the outputs
    if not v2:
        qzeros = qzeros - 0x11111111                  # GPTQModel's v2 -> v1: one int32 subtraction
    tensors = {"qweight": to_int32(pack_rows(codes)), "qzeros": to_int32(qzeros),
               "scales": scales, "g_idx": g_idx.to(torch.int32)}
    return tensors, dense


def build(family: str):
    if family == "llama":       # biases and a separate LM head (kept unquantised, as GPTQ does)
        cfg = transformers.LlamaConfig(**SHAPE, attention_bias=True, mlp_bias=True,
                                       tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(cfg)
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**SHAPE, tie_word_embeddings=True)
        return transformers.Qwen3ForCausalLM(cfg)
    cfg = transformers.Gemma3TextConfig(**SHAPE, query_pre_attn_scalar=64, sliding_window=16,
                                        layer_types=["sliding_attention", "full_attention"])
    return transformers.Gemma3ForCausalLM(cfg)


# (family, group size, sym, checkpoint format)
CASES = [("llama", 128, True, "gptq"), ("qwen3", 32, False, "gptq_v2"),
         ("qwen3", 128, False, "gptq"), ("gemma3", 32, False, "gptq")]


def write_case(root: Path, tokenizer_dir: Path, family: str, group: int, sym: bool, fmt: str
               ) -> tuple[Path, Path, dict]:
    """The dense model with the dequantised weights (the oracle's) and the same model as a
    GPTQ checkpoint; returns both directories and the GPTQ tensors written."""
    gen = torch.Generator().manual_seed(group + 7 * len(family))
    model = build(family)
    _randomise(model, 5)
    packed = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rpartition(".")[2] not in BODY:
                continue
            tensors, dense = gptq_layer(*module.weight.shape, group, sym, fmt == "gptq_v2", gen)
            module.weight.copy_(dense)
            if module.bias is not None:        # GPTQ checkpoints keep biases in fp16
                module.bias.copy_(module.bias.half().float())
                tensors["bias"] = module.bias.half()
            packed[name] = tensors
    dense_dir, gptq_dir = root / "dense", root / "gptq"
    model.save_pretrained(dense_dir)
    shutil.copy(tokenizer_dir / "tokenizer.json", dense_dir / "tokenizer.json")
    shutil.copytree(dense_dir, gptq_dir)
    weights = load_file(gptq_dir / "model.safetensors")
    for name, tensors in packed.items():
        weights.pop(f"{name}.weight")
        weights.pop(f"{name}.bias", None)
        weights.update({f"{name}.{leaf}": t.contiguous() for leaf, t in tensors.items()})
    save_file(weights, gptq_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((gptq_dir / "config.json").read_text())
    config["quantization_config"] = transformers.GPTQConfig(
        bits=4, group_size=group, desc_act=False, sym=sym, format=fmt).to_dict()
    (gptq_dir / "config.json").write_text(json.dumps(config, indent=2))
    return dense_dir, gptq_dir, packed


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(map(str, c)))
def case(request, tmp_path_factory, tiny_tokenizer_dir):
    from spinf_worker.engine import Engine

    root = tmp_path_factory.mktemp("gptq")
    dense_dir, gptq_dir, packed = write_case(root, tiny_tokenizer_dir, *request.param)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(
        dense_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return dict(param=request.param, dense_dir=dense_dir, gptq_dir=gptq_dir, packed=packed,
                oracle=oracle, engine=Engine.load(str(gptq_dir), device="cpu"))


def test_gptq_checkpoint_as_written(case):
    """The tensors are GPTQ's: int32 words, fp16 scales; a symmetric old-format checkpoint's
    zeros are 7 in every nibble (0x77777777), as in published checkpoints."""
    _, group, sym, fmt = case["param"]
    tensors = case["packed"]["model.layers.0.self_attn.q_proj"]
    assert tensors["qweight"].dtype == torch.int32 and tensors["qweight"].shape == (32, 256)
    assert tensors["scales"].dtype == torch.float16 and tensors["scales"].shape[0] == 256 // group
    if sym and fmt == "gptq":
        assert (tensors["qzeros"] == 0x77777777).all()


def test_gptq_weights_dequantised_exactly(case):
    """Every weight the loader gives equals the dense checkpoint's, bit for bit."""
    from spinf_worker.models.loader import load_checkpoint

    family, group, sym, fmt = case["param"]
    gptq, dense = load_checkpoint(str(case["gptq_dir"])), load_checkpoint(str(case["dense_dir"]))
    assert gptq.quantization == f"gptq int4 g{group} {'sym' if sym else 'asym'} {fmt}"
    assert dense.quantization is None
    assert gptq.weights.keys() == dense.weights.keys()
    for name, tensor in dense.weights.items():
        assert torch.equal(gptq.weights[name], tensor), name


def test_gptq_packed_layers_give_every_body_layer(case):
    """The packed weights the int4 scheme serves (CUDA: kernels/int4_matmul.py, held equal to
    the bf16 GEMM on these dense weights in tests/gpu): every body layer of the built model,
    fused projections joined in the model's column order, dequantises to exactly the weight the
    model holds; the LM head and embeddings have none."""
    from spinf_worker.models.build import build_model
    from spinf_worker.models.loader import load_checkpoint

    ckpt = load_checkpoint(str(case["gptq_dir"]))
    model = build_model(ckpt, "cpu", "fp32").model
    names = {module: name for name, module in model.named_modules()}
    body = model.body_linears()
    assert body
    for module in body:
        packed = model.stored_weight(ckpt.stored, names[module])
        assert packed is not None, names[module]
        assert packed.shape == tuple(module.weight.shape)
        assert torch.equal(packed.dense(), module.weight), names[module]
    assert model.stored_weight(ckpt.stored, "lm_head") is None


def test_int4_scheme_refused_where_it_cannot_run():
    from spinf_worker.models.build import pick_scheme

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="int4 runs on CUDA only"):
        pick_scheme("int4", cpu, GPTQ_G128)
    with pytest.raises(ValueError, match="serves GPTQ int4 checkpoints"):
        pick_scheme("int4", cpu, None)
    assert pick_scheme("int4", cpu.__class__("cuda"), None, random=True) == "int4"


def test_gptq_scores_equal_dequantised_oracle(case):
    """|Δlogprob| <= 1e-4 against transformers on the dequantised weights, and the same bits
    as the engine on the dense checkpoint."""
    from spinf_worker.engine import Engine

    engine = case["engine"]
    assert engine.scheme == "fp32"
    worst = check_against_oracle(engine, case["oracle"], NEWS, QUERIES)
    print(f"GPTQ {case['param']}: max |Δlogprob| vs transformers {worst:.2e}")
    dense = Engine.load(str(case["dense_dir"]), device="cpu")
    for got, want in zip(score(engine, NEWS, QUERIES), score(dense, NEWS, QUERIES), strict=True):
        assert got.model_dump() == want.model_dump()


BAD = [({"desc_act": True}, "act-order (desc_act: true)"),
       ({"bits": 8}, "GPTQ bits 8"),
       ({"checkpoint_format": "marlin"}, "GPTQ checkpoint format 'marlin'"),
       ({"group_size": 64}, "GPTQ group_size 64"),
       ({"group_size": -1}, "GPTQ group_size -1"),
       ({"quant_method": "awq"}, "quant_method 'awq'"),
       ({"dynamic": {"-:.*down_proj": {}}}, "per-module overrides (dynamic)")]


@pytest.mark.parametrize(("change", "named"), BAD, ids=[b[1] for b in BAD])
def test_gptq_unsupported_config(change, named, tmp_path, tiny_tokenizer_dir):
    """A clear one-line error naming what is unsupported, before any weight is read (the
    directory has none); ``spinf-serve models`` says the same from the config alone."""
    qcfg = transformers.GPTQConfig(bits=4, group_size=128).to_dict()
    qcfg.update(change)
    assert_config_refused(tmp_path, tiny_tokenizer_dir, "qwen3", "Qwen3", qcfg, named)


def assert_config_refused(path: Path, tokenizer_dir: Path, family: str, label: str,
                          qcfg: dict, named: str) -> None:
    """A tiny ``family`` config with ``qcfg`` as its quantization_config (no weights) is
    refused in one line naming ``named``, by the loader and by ``spinf-serve models``."""
    from spinf_worker.models.loader import load_checkpoint
    from spinf_worker.tools.model_cache import check_dir

    config = build(family).config.to_dict()
    config["quantization_config"] = qcfg
    (path / "config.json").write_text(json.dumps(config))
    shutil.copy(tokenizer_dir / "tokenizer.json", path / "tokenizer.json")
    with pytest.raises(UnsupportedModelError) as err:
        load_checkpoint(str(path))
    assert named in err.value.message and "\n" not in err.value.message
    assert err.value.message.startswith("quantised checkpoint not supported: ")
    assert check_dir(path) == (label, err.value.message)


def test_gptq_not_requantised():
    from spinf_worker.models.build import pick_scheme

    cpu = torch.device("cpu")
    assert pick_scheme("auto", cpu, GPTQ_G128) == "fp32"
    with pytest.raises(ValueError, match="int8 does not apply to a gptq int4"):
        pick_scheme("int8", cpu, GPTQ_G128)

"""Model families (Llama, Qwen3, Gemma 4 text) against transformers on tiny random checkpoints
written by ``save_pretrained``, through the real Engine; the registry's errors; the int8 scheme.

The tiny models use conftest's tiny Gemma-shaped tokenizer (so its vocabulary size) and
larger-than-init random weights, so a wrong norm, bias, RoPE or sharing rule cannot hide behind
near-uniform logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from spinf_worker.errors import ModelNotFoundError, UnsupportedModelError

from .conftest import tiny_tokenizer
from .test_engine_parity import NEWS, QUERIES, TOL, check_against_oracle
from .test_loader import add_shape

VOCAB = tiny_tokenizer().get_vocab_size()
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=2,
             eos_token_id=1, pad_token_id=0)
CHAT = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"


def _randomise(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if not p.is_floating_point() or "rotary" in name or "embed_scale" in name:
                continue
            if "norm" in name or "layer_scalar" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def _write(model, path: Path, tokenizer_dir: Path, **save) -> Path:
    model.save_pretrained(path, **save)
    shutil.copy(tokenizer_dir / "tokenizer.json", path / "tokenizer.json")
    return path


def tiny_llama(path: Path, tokenizer_dir: Path) -> Path:
    """Llama 3.1-style: llama3 RoPE scaling, attention and MLP biases, separate LM head,
    sharded safetensors, a chat template in tokenizer_config.json."""
    cfg = transformers.LlamaConfig(
        **SMALL, num_hidden_layers=3, head_dim=8, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 512})
    model = transformers.LlamaForCausalLM(cfg)
    _randomise(model, 1)
    _write(model, path, tokenizer_dir, max_shard_size="100KB")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT}))
    return path


def tiny_smollm(path: Path, tokenizer_dir: Path) -> Path:
    """SmolLM2-style: tied head, linear RoPE scaling, no biases."""
    cfg = transformers.LlamaConfig(
        **SMALL, num_hidden_layers=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 100_000.0, "factor": 2.0})
    model = transformers.LlamaForCausalLM(cfg)
    _randomise(model, 2)
    return _write(model, path, tokenizer_dir)


def tiny_qwen3(path: Path, tokenizer_dir: Path) -> Path:
    """Qwen3 with qk-norm and sliding windows (window 16) on the last two of four layers."""
    cfg = transformers.Qwen3Config(
        **SMALL, num_hidden_layers=4, head_dim=16, use_sliding_window=True, sliding_window=16,
        max_window_layers=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    model = transformers.Qwen3ForCausalLM(cfg)
    _randomise(model, 3)
    _write(model, path, tokenizer_dir)
    (path / "chat_template.jinja").write_text(CHAT)
    return path


def tiny_gemma4(path: Path, tokenizer_dir: Path) -> Path:
    """Gemma 4 text: sliding/global layers (window 16), global head dim 32 with proportional
    RoPE, per-layer input embeddings, the last two layers KV-shared (double-wide MLPs),
    attention_k_eq_v with one global KV head, final logit soft-capping."""
    cfg = transformers.Gemma4TextConfig(
        **SMALL, num_hidden_layers=6, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
        use_double_wide_mlp=True, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB, sliding_window=16, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention"] * 3)
    model = transformers.Gemma4ForCausalLM(cfg)
    _randomise(model, 4)
    return _write(model, path, tokenizer_dir)


BUILDERS = {"llama": tiny_llama, "smollm": tiny_smollm, "qwen3": tiny_qwen3,
            "gemma4": tiny_gemma4}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    return {name: build(tmp_path_factory.mktemp(f"tiny-{name}"), tiny_tokenizer_dir)
            for name, build in BUILDERS.items()}


@pytest.fixture(scope="module")
def engines(family_dirs):
    from spinf_worker.engine import Engine

    return {name: Engine.load(str(path), device="cpu") for name, path in family_dirs.items()}


@pytest.fixture(scope="module")
def oracles(family_dirs):
    return {name: transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
        for name, path in family_dirs.items()}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_family_parity(family, engines, oracles):
    """Multi-token options, a placeholder grid and a bare slot, float32, |Δlogprob| <= 1e-4."""
    check_against_oracle(engines[family], oracles[family], NEWS, QUERIES)


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_family_content_longer_than_window(family, engines, oracles):
    engine = engines[family]
    assert engine.config.sliding_window == 16
    assert len(engine.presenter.encode(NEWS * 2)) > 5 * engine.config.sliding_window
    check_against_oracle(engine, oracles[family], NEWS * 2, QUERIES[1:3])


def test_family_configs(engines):
    from spinf_worker.models.gemma4 import Gemma4Model
    from spinf_worker.models.llama import NO_WINDOW, LlamaModel
    from spinf_worker.models.qwen3 import Qwen3Model

    llama, qwen, gemma = engines["llama"], engines["qwen3"], engines["gemma4"]
    assert type(llama.model) is LlamaModel and llama.model.lm_head is not None
    assert llama.config.rope["rope_type"] == "llama3" and llama.config.sliding_window == NO_WINDOW
    assert llama.model.layers[0].mlp.gate_up_proj.bias is not None
    assert engines["smollm"].model.lm_head is None
    assert type(qwen.model) is Qwen3Model
    assert qwen.config.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
    assert type(gemma.model) is Gemma4Model
    assert gemma.config.head_dims == (16, 32) * 3 and gemma.config.kv_heads == (2, 1) * 3
    assert [gemma.config.kv_source(i) for i in range(6)] == [None] * 4 + [2, 3]
    assert gemma.model.layers[3].self_attn.v_proj is None      # k_eq_v on a global layer
    assert not hasattr(gemma.model.layers[5].self_attn, "k_proj")


def test_loading_local_dirs(family_dirs):
    from spinf_worker.models.loader import load_checkpoint

    llama = load_checkpoint(str(family_dirs["llama"]))
    assert len(list(family_dirs["llama"].glob("model-*-of-*.safetensors"))) > 1   # sharded
    assert "lm_head.weight" in llama.weights and llama.config["model_type"] == "llama"
    assert llama.chat_template == CHAT                               # tokenizer_config.json
    qwen = load_checkpoint(str(family_dirs["qwen3"]))
    assert qwen.chat_template == CHAT                                # chat_template.jinja
    assert "lm_head.weight" not in qwen.weights                      # tied
    gemma = load_checkpoint(str(family_dirs["gemma4"]))
    assert gemma.config["model_type"] == "gemma4_text"
    assert "model.embed_tokens_per_layer.weight" in gemma.weights
    assert (gemma.bos_token_id, gemma.eos_token_id) == (2, 1)


def test_chat_presentation(family_dirs):
    from spinf_worker.engine import Engine, EngineSettings

    engine = Engine.load(str(family_dirs["qwen3"]), device="cpu",
                         settings=EngineSettings(presentation="chat"))
    text = engine.presenter.present([{"role": "user", "content": "hello"}])
    assert text == "<user>hello\n"       # BOS comes as an id, never as text
    assert engine.score({"messages": [{"role": "user", "content": "hello"}],
                         "scoring": {"queries": QUERIES[1:2]}}).results[0].queries


def test_unsupported_architecture(family_dirs, tmp_path):
    from spinf_worker.engine import Engine
    from spinf_worker.models.registry import family_for

    path = tmp_path / "mistral"
    shutil.copytree(family_dirs["smollm"], path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as err:
        Engine.load(str(path), device="cpu")
    assert "'mistral' is not supported" in err.value.message
    for name in ("Gemma 3", "Gemma 4", "Llama", "Qwen3"):
        assert name in err.value.message
    assert isinstance(err.value, ModelNotFoundError) and err.value.status == 400
    assert err.value.code == "model_not_supported"
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        family_for({"model_type": "gemma4_text"}).config(
            {"model_type": "gemma4_text", "enable_moe_block": True})
    with pytest.raises(UnsupportedModelError, match="RoPE type 'yarn'"):
        family_for({"model_type": "llama"}).config(
            {**json.loads((family_dirs["smollm"] / "config.json").read_text()),
             "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})


def test_missing_files(family_dirs, tmp_path):
    from spinf_worker.engine import Engine

    path = tmp_path / "no-weights"
    path.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(family_dirs["qwen3"] / name, path / name)
    with pytest.raises(ModelNotFoundError, match="has no model.safetensors"):
        Engine.load(str(path), device="cpu")
    shard = next(family_dirs["llama"].glob("model-00001-*.safetensors"))
    sharded = tmp_path / "missing-shard"
    shutil.copytree(family_dirs["llama"], sharded)
    (sharded / shard.name).unlink()
    with pytest.raises(ModelNotFoundError, match=f"has no {shard.name}"):
        Engine.load(str(sharded), device="cpu")
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Engine.load(str(tmp_path / "nowhere"), device="cpu")


# --- int8 weight-only -------------------------------------------------------------------------

# max |Δp| int8 vs fp32: 0.027 measured on the default model over NEWS x QUERIES (and see
# quantizations/google--gemma-3-270m/calibration-int8.json for the news job).
INT8_P_TOL = 0.05
INT8_LOGPROB_TOL = 0.4     # the news job's max |Δlogprob| was 0.309
TINY_INT8_LOGPROB_TOL = 0.03   # tiny random Gemma 3: measured max |Δlogprob| 0.0052


def _int8(path_or_ckpt):
    from spinf_worker.engine import Engine, EngineSettings
    from spinf_worker.models.loader import load_checkpoint

    ckpt = load_checkpoint(str(path_or_ckpt)) if isinstance(path_or_ckpt, Path) else path_or_ckpt
    return Engine(ckpt, device="cpu", settings=EngineSettings(scheme="int8"))


def _max_deltas(a, b) -> tuple[float, float, bool]:
    """(max |Δlogprob|, max |Δp|, same top-1 everywhere) between two responses."""
    dlp = dp = 0.0
    same = True
    for qa, qb in zip(a.results[0].queries, b.results[0].queries, strict=True):
        for ca, cb in zip(qa.combinations, qb.combinations, strict=True):
            for oa, ob in zip(ca.options, cb.options, strict=True):
                dlp, dp = max(dlp, abs(oa.logprob - ob.logprob)), max(dp, abs(oa.p - ob.p))
            pa, pb = [o.p for o in ca.options], [o.p for o in cb.options]
            same &= pa.index(max(pa)) == pb.index(max(pb))
    return dlp, dp, same


# the options as written: the tolerances below were measured on them
REQUEST = {"messages": [{"role": "user", "content": NEWS}],
           "scoring": {"queries": QUERIES, "case_insensitive": False}}


def test_int8_tiny_close_and_batch_invariant(tiny_dir, tiny_engine):
    engine = _int8(tiny_dir)
    layer = engine.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8
    assert qkv.weight_scale.shape == (qkv.weight.shape[0],)     # per output channel
    assert engine.model.embed_tokens.weight.dtype == torch.float32     # the head stays
    assert engine.scheme == "int8" and engine.fingerprint != tiny_engine.fingerprint
    alone = engine.score(REQUEST)
    dlp, _, _ = _max_deltas(alone, tiny_engine.score(REQUEST))
    print(f"int8 vs fp32 on the tiny Gemma 3: max |Δlogprob| {dlp:.4f}")
    assert dlp <= TINY_INT8_LOGPROB_TOL, dlp
    others = [{"text": f"Report {i}: " + NEWS[i * 7:], "scoring": {"queries": QUERIES[:2]}}
              for i in range(5)]
    packed = engine.score_batch([*others[:3], REQUEST, *others[3:]])[3]
    assert alone.model_dump()["results"] == packed.model_dump()["results"]   # bit-identical


def test_int8_other_stacks(family_dirs):
    """int8 on the other stacks (biases, KV sharing, PLE projections) equals fp32 run on the
    dequantised weights: the scheme changes the weights and nothing else."""
    from spinf_worker.engine import Engine
    from spinf_worker.models.layers import Linear
    from spinf_worker.quant.int8 import quantize_weight_int8

    request = {"text": NEWS, "scoring": {"queries": QUERIES[:3], "case_insensitive": False}}
    for name in ("llama", "gemma4"):
        ref = Engine.load(str(family_dirs[name]), device="cpu")
        with torch.no_grad():
            for m in ref.model.modules():
                if isinstance(m, Linear) and m is not ref.model.lm_head:
                    q, scale = quantize_weight_int8(m.weight)
                    m.weight.copy_(q.float() * scale[:, None])
        dlp, _, _ = _max_deltas(_int8(family_dirs[name]).score(request), ref.score(request))
        assert dlp <= TOL, (name, dlp)


@pytest.mark.slow
def test_int8_default_model_close_to_fp32(default_checkpoint, default_engine):
    dlp, dp, same = _max_deltas(_int8(default_checkpoint).score(REQUEST),
                                default_engine.score(REQUEST))
    print(f"int8 vs fp32 on the default model: max |Δlogprob| {dlp:.4f}, max |Δp| {dp:.4f}, "
          f"same top-1 everywhere: {same}")
    assert dp <= INT8_P_TOL, dp
    assert dlp <= INT8_LOGPROB_TOL, dlp


def test_gguf_of_another_architecture(tmp_path):
    """GGUF conversion covers Gemma 3, Llama and Qwen3: other architectures get a clear error."""
    import gguf
    import numpy as np

    from spinf_worker.models.loader import load_checkpoint

    path = tmp_path / "tiny-phi3.gguf"
    writer = gguf.GGUFWriter(path, "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelNotFoundError, match="'phi3' is not supported.*Hugging Face dir"):
        load_checkpoint(str(path), cache_dir=tmp_path / "cache")


def test_cli_score_quant(tiny_dir, tmp_path):
    from spinf_worker.cli import main

    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "text": NEWS}) + "\n")
    (tmp_path / "q.json").write_text(json.dumps(QUERIES[1:2]))
    out = tmp_path / "out.jsonl"
    assert main(["score", str(source), "--model", str(tiny_dir), "--device", "cpu", "-q",
                 "--quant", "int8", "--queries", str(tmp_path / "q.json"),
                 "-o", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["custom_id"] == "a"
    assert len(row["results"][0]["queries"][0]["combinations"][0]["options"]) == 2


# --- Llama / Qwen3 GGUFs (byte-level BPE vocabularies) -----------------------------------------

GGUF_TEXTS = [NEWS, "Prices rose 3.25% in 2024; the bank's rate is 4,500 bps.\n\nWho acted?",
              "  two spaces, tabs\tand émojis 😀 日本語", " yes", " no", "Answer:"]


def _bpe_tokenizer(pre: str):
    """A small byte-level BPE trained here, split the way the named GGUF pre-tokenizer does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from spinf_worker.models.gguf_llama import _pre_tokenizer

    tok = Tokenizer(models.BPE(ignore_merges=pre == "llama-bpe"))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = __import__("tokenizers").decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|bos|>", "<|eos|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([NEWS * 3, *GGUF_TEXTS, *(q["template"] for q in QUERIES)], trainer)
    return tok


def _llama_cpp_permute(w, heads: int):
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def write_bpe_gguf(path: Path, model, tok, pre: str, arch: str) -> None:
    """What llama.cpp's converter writes for a Llama 3 / Qwen3 checkpoint (all float32)."""
    import gguf
    import numpy as np

    c = model.config
    spec = json.loads(tok.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny {arch}")
    add_shape(writer, c)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(2)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
    layer_names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                   "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    rope = c.rope_parameters
    if rope.get("rope_type") == "llama3":   # llama.cpp's per-angle factors
        inv = 1.0 / rope["rope_theta"] ** (np.arange(0, c.head_dim, 2) / c.head_dim)
        old, low, high = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                          rope["high_freq_factor"])
        factors = []
        for wavelen in 2 * np.pi / inv:
            if wavelen < old / high:
                factors.append(1.0)
            elif wavelen > old / low:
                factors.append(rope["factor"])
            else:
                smooth = (old / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        parts = hf_name.split(".")
        values = tensor.float().numpy()
        if parts[1] == "layers":
            part = layer_names[".".join(parts[3:-1])]
            if arch == "llama" and part in ("attn_q", "attn_k"):
                values = _llama_cpp_permute(values, c.num_attention_heads if part == "attn_q"
                                            else c.num_key_value_heads)
            writer.add_tensor(f"blk.{parts[2]}.{part}.{parts[-1]}", values)
        else:
            key = parts[0] if parts[0] == "lm_head" else parts[1]
            writer.add_tensor(f"{names[key]}.{parts[-1]}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch, pre", [("llama", "llama-bpe"), ("qwen3", "qwen2"),
                                       ("llama", "smollm")])
def test_bpe_gguf_round_trip(arch, pre, tmp_path):
    """A Llama 3.1-style (llama3 RoPE factors, permuted q/k) and a Qwen3 GGUF convert into
    the same weights and tokenizer, and score like the HF directory they came from."""
    from spinf_worker.engine import Engine
    from spinf_worker.models.loader import load_checkpoint

    tok = _bpe_tokenizer(pre)
    shape = dict(SMALL, vocab_size=tok.get_vocab_size(), bos_token_id=0, eos_token_id=1,
                 pad_token_id=2, head_dim=8)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**shape, num_hidden_layers=2, tie_word_embeddings=False,
                                       rope_parameters={
                                           "rope_type": "llama3", "rope_theta": 500_000.0,
                                           "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192})
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**shape, num_hidden_layers=2, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(cfg)
    _randomise(model, 5)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    tok.save(str(hf_dir / "tokenizer.json"))
    write_bpe_gguf(tmp_path / "tiny.gguf", model, tok, pre, arch)

    ckpt = load_checkpoint(str(tmp_path / "tiny.gguf"), cache_dir=tmp_path / "cache")
    reference = load_checkpoint(str(hf_dir))
    assert set(ckpt.weights) == set(reference.weights)
    for name, tensor in reference.weights.items():
        assert torch.equal(ckpt.weights[name], tensor), name
    for text in GGUF_TEXTS:
        assert ckpt.tokenizer.encode(text).ids == tok.encode(text).ids, text
        assert ckpt.tokenizer.decode(tok.encode(text).ids) == text
    assert ckpt.config["rope_parameters"]["rope_type"] == ("llama3" if arch == "llama"
                                                           else "default")
    request = {"text": NEWS, "scoring": {"queries": QUERIES[:3]}}
    got = Engine(ckpt, device="cpu").score(request)
    want = Engine(reference, device="cpu").score(request)
    assert got.model_dump()["results"] == want.model_dump()["results"]


def test_gemma4_released_config_shape():
    """A Gemma 4 E2B-style config.json (as published: global_head_dim, no per_layer_config),
    inside its multimodal wrapper."""
    from spinf_worker.models.registry import family_for

    layer_types = (["sliding_attention"] * 4 + ["full_attention"]) * 7
    raw = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
           "text_config": {
               "model_type": "gemma4_text", "hidden_size": 1536, "intermediate_size": 6144,
               "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 1,
               "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": None,
               "attention_k_eq_v": False, "sliding_window": 512, "vocab_size": 262144,
               "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256,
               "num_kv_shared_layers": 20, "use_double_wide_mlp": True,
               "final_logit_softcapping": 30.0, "layer_types": layer_types,
               "rope_parameters": {
                   "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                      "partial_rotary_factor": 0.25},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}}
    family = family_for(raw)
    cfg = family.config(raw)
    assert family.name == "Gemma 4"
    assert cfg.head_dims[3:5] == (256, 512) and set(cfg.kv_heads) == {1}
    assert cfg.kv_source(14) is None and cfg.kv_source(15) == 13 and cfg.kv_source(19) == 14
    with torch.device("meta"):
        model = family.build(cfg)
    assert model.layers[15].mlp.up_proj.weight.shape == (12288, 1536)   # double-wide
    assert model.layers[14].self_attn.v_proj.weight.shape == (512, 1536)


@pytest.mark.parametrize("interleave", [False, True])
@torch.no_grad()
def test_fused_projections_compute_the_parts(interleave):
    """A fused projection (q|k|v, gate|up: one Linear from the start, the checkpoint's parts
    joined at load) computes each part's columns (one after another, or alternating), and the
    Gemma MLP reads gate and up back from the interleaved layout."""
    import torch.nn.functional as F

    from spinf_worker.models.gemma3 import MLP, Gemma3Config
    from spinf_worker.models.layers import Linear, join_parts

    torch.manual_seed(0)
    parts = [Linear(64, 96) for _ in range(2)]
    for p in parts:
        torch.nn.init.normal_(p.weight)
    x = torch.randn(128, 64)
    fused = Linear(64, 192)
    fused.weight.copy_(join_parts([p.weight for p in parts], interleave))
    out = fused(x)
    got = [out[:, 0::2], out[:, 1::2]] if interleave else list(out.split(96, dim=1))
    for g, p in zip(got, parts, strict=True):
        torch.testing.assert_close(g, p(x))
    mlp = MLP(Gemma3Config(hidden_size=64, intermediate_size=96))
    mlp.gate_up_proj.weight.copy_(join_parts([p.weight for p in parts], interleave=True))
    torch.nn.init.normal_(mlp.down_proj.weight, std=0.1)
    plain = mlp.down_proj(F.gelu(parts[0](x), approximate="tanh") * parts[1](x))
    torch.testing.assert_close(mlp(x), plain)

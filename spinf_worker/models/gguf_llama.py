"""GGUF -> Hugging Face directory for llama.cpp's ``llama`` (Llama 2/3.x, SmolLM2) and ``qwen3``
architectures with a byte-level BPE ("gpt2") vocabulary.

What differs from the Gemma 3 route (gguf_convert.py): llama.cpp stores Llama's q/k
projections permuted for its interleaved RoPE (undone here; Qwen3's are stored as they are),
norms as plain ``w``, ``ffn_norm`` is the post-attention norm, Llama 3.1+'s RoPE scaling is a
``rope_freqs`` tensor of per-angle factors (turned back into ``llama3`` parameters), and the
tokenizer is byte-level BPE whose pre-tokenizer is named by ``tokenizer.ggml.pre``.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from .gguf_common import f32, shape_config, write_hf_files
from .layers import rope_inv_freq

ARCHITECTURES = ("llama", "qwen3")

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# Pre-tokenizer splits by llama.cpp's name for them (the regexes of the models' tokenizer.json).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
           r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("llama-bpe", "llama3", "qwen2", "smollm")
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str):
    if pre == "smollm":   # SmolLM2: every digit alone, then GPT-2's byte-level split
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    regex = _QWEN2 if pre == "qwen2" else _LLAMA3
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_bpe_tokenizer(tokens: list[str], token_types: list[int], merges: list[str],
                        pre: str) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` from GGUF vocabulary fields, no post-processor."""
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported "
                         f"(supported: {', '.join(PRE_TOKENIZERS)})")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    # Llama 3 takes a whole word from the vocabulary before merging, as its tokenizer.json says.
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=pairs, ignore_merges=pre in ("llama-bpe",
                                                                                "llama3")))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, token_types, strict=True) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, token_types, strict=True) if kind == _USER_DEFINED])
    return tokenizer


def unpermute_qk(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (halves -> interleaved pairs per head)."""
    dim = weights.shape[0] // heads // 2
    return (weights.reshape(heads, dim, 2, *weights.shape[1:]).swapaxes(2, 1)
            .reshape(weights.shape))


def read_weights(reader: gguf.GGUFReader, arch: str, heads: int, kv_heads: int
                 ) -> tuple[dict[str, torch.Tensor], np.ndarray | None]:
    """HF-named float32 tensors, and llama.cpp's ``rope_freqs`` factors if the file has them."""
    weights, rope_freqs = {}, None
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        if tensor.name == "rope_freqs.weight":
            rope_freqs = values
            continue
        base, _, suffix = tensor.name.rpartition(".")
        match = _LAYER_TENSOR.fullmatch(tensor.name)
        if base in _GLOBAL_NAMES:
            name = f"{_GLOBAL_NAMES[base]}.{suffix}"
        elif match and match.group(2) in _LAYER_NAMES:
            layer, part, suffix = match.groups()
            name = f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
            if arch == "llama" and part in ("attn_q", "attn_k"):
                values = unpermute_qk(values, heads if part == "attn_q" else kv_heads)
        else:
            continue
        weights[name] = torch.from_numpy(np.array(values, dtype=np.float32, copy=True))
    return weights, rope_freqs


def llama3_rope(rope_freqs: np.ndarray, theta: float, head_dim: int) -> dict:
    """The ``llama3`` RoPE parameters that give llama.cpp's per-angle factors; Llama 3.1 and
    3.2 use low/high frequency factors 1 and 4 over an original context of 8192."""
    params = {"rope_type": "llama3", "rope_theta": theta, "factor": f32(rope_freqs.max()),
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    base = rope_inv_freq(head_dim, {"rope_type": "default", "rope_theta": theta})
    want = base / torch.from_numpy(rope_freqs.astype(np.float32))
    if not torch.allclose(rope_inv_freq(head_dim, params), want, rtol=1e-4, atol=0):
        raise ValueError("the file's rope_freqs factors match no llama3 RoPE scaling")
    return params


def hf_config(meta, arch: str, weights: dict, vocab_size: int, rope_freqs) -> dict:
    shape = shape_config(meta, vocab_size, default_context=8192)
    head_dim = shape["head_dim"]
    theta = f32(meta.arch_get("rope.freq_base", 10_000.0 if arch == "llama" else 1_000_000.0))
    rope = {"rope_type": "default", "rope_theta": theta}
    if meta.arch_get("rope.scaling.type") == "linear":
        rope = {"rope_type": "linear", "rope_theta": theta,
                "factor": f32(meta.arch_get("rope.scaling.factor"))}
    elif rope_freqs is not None and not np.all(rope_freqs == 1):
        rope = llama3_rope(rope_freqs, theta, head_dim)
    elif meta.arch_get("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"RoPE scaling {meta.arch_get('rope.scaling.type')!r} is not supported")
    return {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen3ForCausalLM"],
        "model_type": arch,
        **shape,
        "hidden_act": "silu",
        "rope_theta": theta,
        "rope_parameters": rope,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in weights,
        "mlp_bias": "model.layers.0.mlp.up_proj.bias" in weights,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "dtype": "float32",
    }


def convert_bpe_model(reader: gguf.GGUFReader, meta, gguf_path: Path, out_dir: Path) -> dict:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json."""
    arch = meta.arch
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} is not supported "
                         f"for {arch} (expected a byte-level BPE 'gpt2' vocabulary)")
    tokens = list(meta.get("tokenizer.ggml.tokens"))
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type")]
    tokenizer = build_bpe_tokenizer(tokens, types, list(meta.get("tokenizer.ggml.merges") or []),
                                    meta.get("tokenizer.ggml.pre", "llama-bpe"))
    heads = int(meta.arch_get("attention.head_count"))
    weights, rope_freqs = read_weights(reader, arch, heads,
                                       int(meta.arch_get("attention.head_count_kv", heads)))
    config = hf_config(meta, arch, weights, len(tokens), rope_freqs)
    if config["bos_token_id"] is None:   # the root needs a first token; Qwen's is <|endoftext|>
        config["bos_token_id"] = config["pad_token_id"] or config["eos_token_id"]
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    del weights

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", arch == "llama"))
    write_hf_files(out_dir, meta, tokenizer, tokens, config, add_bos,
                   {"tokenizer_class": "PreTrainedTokenizerFast"})
    return {"name": meta.get("general.name") or Path(gguf_path).stem, "architecture": arch}


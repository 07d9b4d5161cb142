"""Turn a Gemma 3 GGUF file (llama.cpp's format) into a Hugging Face style directory
(Llama and Qwen3 GGUFs go through gguf_llama.py).

The output is what `transformers` itself would load: `model.safetensors` (float32, HF names and
semantics), `config.json`, `tokenizer.json`, `tokenizer_config.json` and `generation_config.json`.
Quantised tensors are dequantised with the `gguf` package, so the numbers are exactly what
llama.cpp's blocks encode. This runs once per GGUF; the loader caches the result.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, normalizers
from tokenizers.models import BPE

from .gguf_common import GGUFMetadata, f32, shape_config, token_text, write_hf_files

SUPPORTED_ARCHITECTURES = ("gemma3",)
BPE_ARCHITECTURES = ("llama", "qwen3")   # gguf_llama.py

# llama.cpp tensor names -> HF parameter names.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# SentencePiece token types as GGUF stores them.
_CONTROL, _USER_DEFINED = 3, 4


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF parameter name for a GGUF tensor, or None for tensors we do not use."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, suffix = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    return None


def read_weights(reader: gguf.GGUFReader) -> dict[str, torch.Tensor]:
    """Dequantise every tensor to float32 under its HF name.

    GGUF lists dimensions innermost first, but the numpy array the reader gives is already
    row-major (out_features, in_features), which is torch's Linear layout: no transpose needed.
    Gemma computes RMSNorm as x * (1 + w) and llama.cpp's converter stores 1 + w, so we take the
    1 back off every norm weight (including the q/k norms). Gemma's q/k are not permuted.
    """
    weights = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        if name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        weights[name] = torch.from_numpy(np.array(values, dtype=np.float32, copy=True))
    return weights


def text_config(meta: GGUFMetadata, tensor_names: set[str], vocab_size: int) -> dict:
    """A config.json for Gemma3ForCausalLM, readable by transformers and by our engine."""
    shape = shape_config(meta, vocab_size, default_context=32768)
    layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
    heads, head_dim = shape["num_attention_heads"], shape["head_dim"]
    rope_theta = f32(meta.arch_get("rope.freq_base", 1_000_000.0))
    # Gemma 3 GGUFs carry no local rope base; the architecture fixes it at 10k.
    rope_local = f32(meta.arch_get("rope.freq_base_swa", 10_000.0))

    # Every 6th layer attends globally unless the file spells the pattern out per layer.
    pattern = meta.arch_get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        layer_types = ["sliding_attention" if s else "full_attention" for s in pattern]
    else:
        layer_types = ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
                       for i in range(layers)]

    # llama.cpp scales queries by 1/sqrt(head_dim), except for the 27B (62 layers), which uses
    # hidden/heads; transformers expresses that as query_pre_attn_scalar.
    query_scalar = hidden // heads if layers == 62 else head_dim

    full_rope = {"rope_type": "default", "rope_theta": rope_theta}
    scaling = None
    if meta.arch_get("rope.scaling.type") == "linear":
        # Larger Gemma 3s stretch only the global layers' rope.
        scaling = {"rope_type": "linear", "factor": f32(meta.arch_get("rope.scaling.factor"))}
        full_rope.update(scaling)

    def softcap(key):
        value = meta.arch_get(key)
        return None if value is None else f32(value)

    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **shape,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": query_scalar,
        "sliding_window": int(meta.arch_get("attention.sliding_window", 512)),
        "layer_types": layer_types,
        # Plain keys for our engine; rope_parameters is what transformers 5 reads.
        "rope_theta": rope_theta,
        "rope_local_base_freq": rope_local,
        "rope_scaling": scaling,
        "rope_parameters": {
            "full_attention": full_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": rope_local},
        },
        "final_logit_softcapping": softcap("final_logit_softcapping"),
        "attn_logit_softcapping": softcap("attn_logit_softcapping"),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": "lm_head.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id", 2),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id", 1),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", 0),
        "dtype": "float32",
    }


def sentencepiece_pieces(tokens: list[str]) -> list[str]:
    """Vocabulary as the tokenizer sees it. The GGUF stores runs of 2+ spaces with real spaces,
    but text reaches the model with spaces already turned into '▁', so respell those."""
    return ["\u2581" * len(t) if len(t) > 1 and not t.strip(" ") else t for t in tokens]


def derive_merges(pieces: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary.

    SentencePiece BPE joins, at each step, the adjacent pair whose joined piece ranks best. Gemma
    ranks pieces by their position in the vocabulary (not by the stored scores), so every way of
    cutting a piece into two known pieces becomes a merge at that piece's rank; ties within one
    piece put the longer left part first, as transformers does.
    """
    merges = []
    for piece in pieces:
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def build_tokenizer(tokens: list[str], token_types: list[int], unk_id: int) -> Tokenizer:
    """A `tokenizers` BPE equal to Gemma's: byte fallback, spaces as '▁', no dummy prefix.

    It has no post-processor, so it never adds BOS/EOS on its own.
    """
    pieces = sentencepiece_pieces(tokens)
    vocab = {piece: i for i, piece in enumerate(pieces)}
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=derive_merges(pieces, vocab),
                              unk_token=pieces[unk_id], fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    # Control tokens (<bos>, <start_of_turn>, ...) are special; user-defined ones ("\n\n",
    # "<table>", ...) must still be matched whole in raw text, like llama.cpp does.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, token_types, strict=True) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, token_types, strict=True)
                          if kind == _USER_DEFINED and t in vocab])
    return tokenizer


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict:
    """Write an HF-layout checkpoint for `gguf_path` into `out_dir` (which must exist).

    Returns a small summary: {"name": general.name or the file stem, "architecture": ...}.
    """
    reader = gguf.GGUFReader(gguf_path)
    meta = GGUFMetadata(reader)
    if meta.arch in BPE_ARCHITECTURES:
        from .gguf_llama import convert_bpe_model

        return convert_bpe_model(reader, meta, gguf_path, out_dir)
    if meta.arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {meta.arch!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES + BPE_ARCHITECTURES)}); Gemma 4 "
                         "and other checkpoints load from a Hugging Face directory "
                         "(config.json, *.safetensors, tokenizer.json)")
    if meta.get("tokenizer.ggml.model") != "llama":
        raise ValueError(f"GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} is not supported "
                         "(expected a SentencePiece 'llama' vocabulary)")

    tokens = meta.get("tokenizer.ggml.tokens")
    token_types = [int(t) for t in meta.get("tokenizer.ggml.token_type")]
    weights = read_weights(reader)
    config = text_config(meta, set(weights), vocab_size=len(tokens))
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    del weights

    unk_id = meta.get("tokenizer.ggml.unknown_token_id", 3)
    tokenizer = build_tokenizer(tokens, token_types, unk_id)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    write_hf_files(out_dir, meta, tokenizer, tokens, config, add_bos, {
        "tokenizer_class": "GemmaTokenizer",
        "unk_token": token_text(meta, tokens, "tokenizer.ggml.unknown_token_id"),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))})
    return {"name": meta.get("general.name") or Path(gguf_path).stem, "architecture": meta.arch}

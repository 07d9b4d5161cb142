"""What both GGUF routes share (gguf_convert.py for Gemma 3, gguf_llama.py for Llama and
Qwen3): typed metadata, the header's shape keys, and writing the HF directory's JSON files."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from tokenizers import processors


class GGUFMetadata:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader: gguf.GGUFReader):
        self.fields = reader.fields
        self.arch = self.get("general.architecture")

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return value.item() if isinstance(value, np.generic) else value

    def arch_get(self, key: str, default=None):
        return self.get(f"{self.arch}.{key}", default)


def f32(value: float) -> float:
    """GGUF stores floats as float32; report the shortest decimal that is the same float32."""
    return float(str(np.float32(value)))


def shape_config(meta: GGUFMetadata, vocab_size: int, default_context: int) -> dict:
    """The config.json keys every architecture's GGUF header gives the same way: sizes,
    layers, heads, context length, RMSNorm epsilon."""
    hidden = int(meta.arch_get("embedding_length"))
    heads = int(meta.arch_get("attention.head_count"))
    return {
        "hidden_size": hidden,
        "intermediate_size": int(meta.arch_get("feed_forward_length")),
        "num_hidden_layers": int(meta.arch_get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.arch_get("attention.head_count_kv", heads)),
        "head_dim": int(meta.arch_get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(meta.arch_get("context_length", default_context)),
        "rms_norm_eps": f32(meta.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": vocab_size,
    }


def token_text(meta, tokens: list[str], key: str) -> str | None:
    token_id = meta.get(key)
    return None if token_id is None else tokens[token_id]


def write_hf_files(out_dir: Path, meta, tokenizer, tokens: list[str], config: dict,
                   add_bos: bool, tokenizer_fields: dict) -> None:
    """tokenizer.json, tokenizer_config.json (with ``tokenizer_fields``), config.json and
    generation_config.json of a converted GGUF."""
    if add_bos and config["bos_token_id"] is not None:
        # Like the hub's tokenizer.json, so transformers' AutoTokenizer on this directory adds
        # BOS by default; our loader drops the post-processor again.
        bos = tokens[config["bos_token_id"]]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, config["bos_token_id"])])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": token_text(meta, tokens, "tokenizer.ggml.bos_token_id"),
        "eos_token": token_text(meta, tokens, "tokenizer.ggml.eos_token_id"),
        "pad_token": token_text(meta, tokens, "tokenizer.ggml.padding_token_id"),
        "add_bos_token": add_bos,
        "model_max_length": config["max_position_embeddings"],
        **tokenizer_fields,
    }
    chat_template = meta.get("tokenizer.chat_template")
    if chat_template:
        tokenizer_config["chat_template"] = chat_template
    generation_config = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    for filename, content in (("config.json", config),
                              ("tokenizer_config.json", tokenizer_config),
                              ("generation_config.json", generation_config)):
        (out_dir / filename).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")

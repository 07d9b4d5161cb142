"""Shared fixtures: the real default model, and a tiny random Gemma 3 written by transformers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def default_checkpoint():
    from spinf_worker.models.loader import load_checkpoint

    return load_checkpoint(None)


@pytest.fixture(scope="session")
def default_engine(default_checkpoint):
    from spinf_worker.engine import Engine

    return Engine(default_checkpoint, device="cpu")


@pytest.fixture(scope="session")
def default_oracle(default_checkpoint):
    """transformers' own Gemma 3 on the same converted weights: the independent reference."""
    from transformers import Gemma3ForCausalLM

    model = Gemma3ForCausalLM.from_pretrained(default_checkpoint.path, dtype=torch.float32,
                                              attn_implementation="eager")
    return model.eval()


def write_tiny_gemma3(path: Path, tokenizer_dir: Path, *, sliding_window: int = 16,
                      seed: int = 0) -> Path:
    """A random 4-layer Gemma 3 (real vocabulary, so the real tokenizer works) saved by
    transformers, with non-trivial norm weights so a norm bug cannot hide behind zeros."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=262144, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=sliding_window, max_position_embeddings=4096,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        bos_token_id=2, eos_token_id=1, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, default_checkpoint) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), default_checkpoint.path)


@pytest.fixture(scope="session")
def tiny_engine(tiny_dir):
    from spinf_worker.engine import Engine

    return Engine.load(str(tiny_dir), device="cpu")


@pytest.fixture(scope="session")
def tiny_oracle(tiny_dir):
    from transformers import Gemma3ForCausalLM

    return Gemma3ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32,
                                             attn_implementation="eager").eval()


def oracle_logprob(model, ids: list[int], n_context: int) -> float:
    """Sum of log P(ids[j] | ids[:j]) for j >= n_context, from one plain forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(logprobs[j - 1, ids[j]].item() for j in range(n_context, len(ids)))

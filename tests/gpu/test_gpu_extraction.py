"""Extraction slots on CUDA (skipped without CUDA): the decoding steps' attention kernel against
a float64 reference, a beam's bits independent of the other beams and slots of its step, and
an engine's answers bit-identical for a document alone and packed with others, bf16 and fp8."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ..conftest import TINY_BOS, TINY_EOS, TINY_PAD, tiny_vocab_size
from ..decode_steps import STEPS, close_to_reference, slots_alone_as_in_their_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from spinf_worker.engine import Engine, EngineSettings
    from spinf_worker.models.loader import Checkpoint

SLOTS = [
    {"id": "month", "template": "\n\nQ: Which month is named?\nA:{*}", "top_k": 4,
     "max_tokens": 6},
    {"id": "who", "template": "\n\nQ: Who acted?\nA:{*}", "top_k": 4, "max_tokens": 6},
    {"id": "count", "template": "\n\nQ: What is the first number?\nA:{n}", "top_k": 4,
     "max_tokens": 6},
    {"id": "money", "template": "\n\nQ: What sum of money?\nA:{$}", "top_k": 4,
     "max_tokens": 8},
    {"id": "topic", "template": "\n\nTopic: {?}", "options": [" business", " sports"]},
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "window"),
                         [(16, 8, 256, 64), (4, 1, 256, None), (32, 16, 128, 40),
                          (8, 2, 512, None)])
def test_decode_attention_equals_reference(heads, kv_heads, dim, window, dtype):
    err = close_to_reference(heads, kv_heads, dim, window, dtype, "cuda")
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), err


@pytest.mark.parametrize("beam_slot", STEPS)
@pytest.mark.parametrize("window", [None, 50])
def test_a_slots_bits_do_not_depend_on_its_step(window, beam_slot):
    """(A slot's beams are always decoded together, in their own order: a document alone or
    packed holds all of them.)"""
    slots_alone_as_in_their_step(window, beam_slot, "cuda")


def _engine(tokenizer_dir: Path, scheme: str) -> Engine:
    from tokenizers import Tokenizer

    config = dict(model_type="gemma3_text", vocab_size=tiny_vocab_size(tokenizer_dir),
                  hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=64,
                  query_pre_attn_scalar=64, max_position_embeddings=4096,
                  layer_types=["sliding_attention"] * 5 + ["full_attention"],
                  bos_token_id=TINY_BOS, eos_token_id=TINY_EOS, pad_token_id=TINY_PAD)
    checkpoint = Checkpoint(name="random", config=config, weights=None,
                            tokenizer=Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")),
                            bos_token_id=TINY_BOS, eos_token_id=TINY_EOS, chat_template=None,
                            weights_digest="random", path=Path("."))
    return Engine(checkpoint, device="cuda", settings=EngineSettings(scheme=scheme))


def _documents() -> list[str]:
    rng = random.Random(3)
    text = ("the company reported 12 sales in May and 30 dollars of profit while the minister "
            "said the vote in September would be close and 7 teams played")
    words = text.split()
    # some longer than the window, one of a few words
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 150))) for _ in range(9)]


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_extraction_answers_alone_equal_packed(tiny_tokenizer_dir, scheme):
    """Every figure of a document's response (answers, their p, mass, option logprobs) is
    the same alone and packed with eight others, in either order."""
    engine = _engine(tiny_tokenizer_dir, scheme)
    requests = [{"text": text, "scoring": {"queries": SLOTS, "case_insensitive": False}}
                for text in _documents()]

    def figures(response) -> list:
        return response.model_dump(mode="json")["results"][0]["queries"]

    packed = [figures(r) for r in engine.score_batch(requests)]
    backwards = [figures(r) for r in engine.score_batch(requests[::-1])][::-1]
    assert packed == backwards
    answered = [c["answers"] for doc in packed for q in doc[:4] for c in q["combinations"]]
    assert sum(bool(a) for a in answered) >= len(answered) // 2   # the slots were decoded
    for k in (0, 4, 8):
        assert figures(engine.score_batch([requests[k]])[0]) == packed[k], k

"""Extraction slots on CUDA (skipped without CUDA): the decoding steps' attention kernel against
a float64 reference, a beam's bits independent of the other beams and slots of its step, and
an engine's answers bit-identical for a document alone and packed with others, bf16 and fp8."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ..conftest import TINY_BOS, TINY_EOS, TINY_PAD, tiny_vocab_size

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from spinf_worker.engine import Engine, EngineSettings
    from spinf_worker.kernels.decode_attention import decode_attention
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


def _step(heads: int, kv_heads: int, dim: int, lens: list[int], beam_slot: list[int],
          generated: int, seed: int):
    """A decoding step's inputs on the device: kept K/V, per-slot contexts, beams."""
    gen = torch.Generator().manual_seed(seed)
    rows_kept = 400
    kept_k, kept_v = torch.randn(2, rows_kept, kv_heads, dim, generator=gen).unbind(0)
    width = max(lens)
    ctx_rows = torch.zeros(len(lens), width, dtype=torch.long)
    ctx_pos = torch.zeros(len(lens), width, dtype=torch.long)
    for s, n in enumerate(lens):
        ctx_rows[s, :n] = torch.randperm(rows_kept, generator=gen)[:n]
        ctx_pos[s, :n] = torch.arange(n)
    n = len(beam_slot)
    q_pos = torch.tensor([lens[s] + generated for s in beam_slot])
    gen_pos = torch.stack([torch.arange(lens[s], lens[s] + generated + 1) for s in beam_slot])
    q = torch.randn(n, heads, dim, generator=gen)
    gen_k, gen_v = torch.randn(2, n, generated + 1, kv_heads, dim, generator=gen).unbind(0)
    return [t.cuda() for t in (q, kept_k, kept_v, gen_k, gen_v, ctx_rows, ctx_pos,
                               torch.tensor(lens), gen_pos, torch.tensor(beam_slot), q_pos)]


def _reference(q, kept_k, kept_v, gen_k, gen_v, ctx_rows, ctx_pos, lens, gen_pos, beam_slot,
               q_pos, window, scale) -> torch.Tensor:
    """Each beam by itself in float64: softmax over its context's keys and its own tokens."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // kept_k.shape[1]
    for b in range(q.shape[0]):
        s = int(beam_slot[b])
        rows = ctx_rows[s, :int(lens[s])]
        keys = torch.cat((kept_k[rows], gen_k[b])).double()
        values = torch.cat((kept_v[rows], gen_v[b])).double()
        pos = torch.cat((ctx_pos[s, :int(lens[s])], gen_pos[b]))
        seen = (q_pos[b] - pos < window) if window else torch.ones_like(pos, dtype=torch.bool)
        for h in range(q.shape[1]):
            scores = keys[:, h // group] @ q[b, h].double() * scale
            scores = scores.masked_fill(~seen, float("-inf"))
            out[b, h] = torch.softmax(scores, 0) @ values[:, h // group]
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "window"),
                         [(16, 8, 256, 64), (4, 1, 256, None), (32, 16, 128, 40),
                          (8, 2, 512, None)])
def test_decode_attention_equals_reference(heads, kv_heads, dim, window, dtype):
    args = _step(heads, kv_heads, dim, [70, 130, 9], [0, 0, 1, 2, 1, 0], 3, seed=heads + dim)
    args = [t.to(dtype) if t.is_floating_point() else t for t in args]
    out = torch.zeros_like(args[0])
    decode_attention(*args, window, 0.0625, out)
    want = _reference(*[t.cpu() for t in args], window, 0.0625)
    err = float((out.double().cpu() - want).norm() / want.norm())
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), err


@pytest.mark.parametrize("window", [None, 50])
def test_a_beams_bits_do_not_depend_on_its_step(window):
    """A beam alone (its slot alone, its context at its own width) and among other beams and
    slots with longer and shorter contexts: bit-identical."""
    q, kept_k, kept_v, gen_k, gen_v, ctx_rows, ctx_pos, lens, gen_pos, beam_slot, q_pos = (
        _step(16, 8, 256, [33, 300, 120, 7], [2, 1, 0, 2, 3, 1, 2], 4, seed=5))
    args = (kept_k, kept_v)
    out = torch.zeros_like(q)
    decode_attention(q, *args, gen_k, gen_v, ctx_rows, ctx_pos, lens, gen_pos, beam_slot,
                     q_pos, window, 0.0625, out)
    for b in (0, 4, 6):
        s = int(beam_slot[b])
        n = int(lens[s])
        alone = torch.zeros_like(q[b:b + 1])
        decode_attention(q[b:b + 1], *args, gen_k[b:b + 1], gen_v[b:b + 1],
                         ctx_rows[s:s + 1, :n], ctx_pos[s:s + 1, :n], lens[s:s + 1],
                         gen_pos[b:b + 1], torch.zeros_like(beam_slot[:1]), q_pos[b:b + 1],
                         window, 0.0625, alone)
        assert torch.equal(alone[0], out[b]), b


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

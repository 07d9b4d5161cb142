"""POST /v1/completions end to end: the official openai SDK against a real uvicorn on
loopback, real Redis and a real worker on the tiny model; token logprobs checked against
transformers on the same ids; bad bodies answered 400 in the envelope with nothing queued."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI

from spinf_worker.completions import CompletionResponse

from ..conftest import WAIT_S
from .live import InProcessWorker, LiveServer
from .test_api import assert_error, entries_added

TEXT = "I was charged twice for September, please refund one."
TOL = 1e-4


def oracle_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] fp32 log-softmax of one plain transformers forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def string_ids(engine, text: str) -> list[int]:
    """BOS + the text's tokens, with the checkpoint's tokenizer (what the server reads)."""
    return [engine.checkpoint.bos_token_id,
            *engine.checkpoint.tokenizer.encode(text, add_special_tokens=False).ids]


def assert_matches_oracle(choice, ids: list[int], reference: torch.Tensor, engine,
                          top_n: int) -> None:
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        assert abs(lp.token_logprobs[j] - reference[j - 1, ids[j]].item()) <= TOL, j
        values, indices = reference[j - 1].topk(top_n)
        top = lp.top_logprobs[j]
        expected = {}
        for value, token in zip(values.tolist(), indices.tolist(), strict=True):
            expected.setdefault(engine.checkpoint.tokenizer.decode(
                [token], skip_special_tokens=False), value)
        assert top.keys() == expected.keys(), j
        assert all(abs(top[k] - expected[k]) <= TOL for k in top), j


def test_sdk_echo_logprobs_equal_transformers(tiny_engine, tiny_oracle, settings):
    ids_prompt = [tiny_engine.checkpoint.bos_token_id, *range(10, 40)]
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings):
        client = OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=WAIT_S)
        out = client.completions.create(model=tiny_engine.model_name, prompt=TEXT, echo=True,
                                        logprobs=5, max_tokens=0)
        CompletionResponse.model_validate(out.model_dump())
        assert out.object == "text_completion" and out.id.startswith("cmpl-")
        assert out.system_fingerprint == tiny_engine.fingerprint
        ids = string_ids(tiny_engine, TEXT)
        choice = out.choices[0]
        assert choice.text == TEXT and choice.finish_reason == "length"
        assert_matches_oracle(choice, ids, oracle_logprobs(tiny_oracle, ids), tiny_engine, 5)
        # text_offset: each token (after BOS) is the text at its offset
        for token, at in zip(choice.logprobs.tokens[1:], choice.logprobs.text_offset[1:],
                             strict=True):
            assert TEXT[at:at + len(token)] == token
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0

        # token ids, and a list of prompts (strings and ids): one choice each, in order
        both = client.completions.create(model=tiny_engine.model_name,
                                         prompt=[ids_prompt, ids], echo=True, logprobs=3,
                                         max_tokens=0)
        assert [c.index for c in both.choices] == [0, 1]
        assert_matches_oracle(both.choices[0], ids_prompt,
                              oracle_logprobs(tiny_oracle, ids_prompt), tiny_engine, 3)
        # the same ids as a string prompt or as ids: the same figures, bit for bit
        assert both.choices[1].logprobs.token_logprobs == choice.logprobs.token_logprobs

        # greedy decoding: each token is transformers' argmax, with its logprob
        greedy = client.completions.create(model=tiny_engine.model_name, prompt=TEXT,
                                           logprobs=2, max_tokens=3)
        sequence = list(ids)
        lp = greedy.choices[0].logprobs
        assert len(lp.tokens) == 3 and greedy.usage.completion_tokens == 3
        for step in range(3):
            reference = oracle_logprobs(tiny_oracle, sequence)[-1]
            token = int(reference.argmax())
            assert lp.tokens[step] == tiny_engine.checkpoint.tokenizer.decode(
                [token], skip_special_tokens=False)
            assert abs(lp.token_logprobs[step] - reference[token].item()) <= TOL
            sequence.append(token)
        assert greedy.choices[0].text == "".join(lp.tokens)
        assert greedy.choices[0].finish_reason == "length"
        assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]

        # a generated token's logprob is the one its text gets as an echoed prompt
        again = client.completions.create(model=tiny_engine.model_name, prompt=sequence,
                                          echo=True, logprobs=0, max_tokens=0)
        assert again.choices[0].logprobs.token_logprobs[-3:] == lp.token_logprobs

        # a stop string cuts the text where it starts
        first = lp.tokens[0]
        stopped = client.completions.create(model=tiny_engine.model_name, prompt=TEXT,
                                            max_tokens=3, stop=[first], echo=True)
        assert stopped.choices[0].text == TEXT
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].logprobs is None


BAD = [
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "stream": True}, "stream"),
    ({"prompt": "x", "max_tokens": 1, "temperature": 0.7}, "temperature"),
    ({"prompt": "x", "max_tokens": 1, "top_p": 0.5}, "top_p"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "max_tokens": 17}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "logit_bias": {"5": 100}}, "logit_bias"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "presence_penalty": 1}, "presence_penalty"),
    ({}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt[0]"),
    ({"prompt": ["a", 3.5]}, "prompt[1]"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
]


def test_bad_bodies_are_400_in_the_envelope_and_nothing_is_queued(tiny_engine, settings):
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings):
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        for body, param in BAD:
            assert_error(client.post("/completions", json=body), 400, "invalid_field", param)
        assert_error(client.post("/completions", content=b"[1, 2"), 400, "invalid_json")
        assert_error(client.post("/completions", json=["x"]), 400, "invalid_field")
        assert_error(client.post("/completions", json={"prompt": "x", "model": "gpt-4"}), 400,
                     "model_not_served", "model")
        # past the model's context (4,096 positions): counted here, with the model's tokenizer
        long_ids = [tiny_engine.checkpoint.bos_token_id, *[10] * 4095]
        assert_error(client.post("/completions", json={"prompt": long_ids, "max_tokens": 1}),
                     400, "content_too_long", "prompt")
        assert_error(client.post("/completions", json={
            "prompt": ["short", "word " * 5000], "max_tokens": 0}),
            400, "content_too_long", "prompt[1]")
        assert entries_added(settings) == 0
        # at the limit it is scored
        ok = client.post("/completions", json={"prompt": long_ids, "max_tokens": 0,
                                                "echo": True, "logprobs": 1})
        assert ok.status_code == 200, ok.text
        assert len(ok.json()["choices"][0]["logprobs"]["token_logprobs"]) == 4096
        # an id outside the vocabulary: the worker's 400 (the API does not know the size)
        assert_error(client.post("/completions", json={"prompt": [1, 10 ** 9]}), 400,
                     "invalid_field", "prompt")


@pytest.fixture(scope="module")
def eos_second(tiny_dir, tiny_engine, tiny_oracle, tmp_path_factory) -> tuple[Path, int]:
    """The tiny model, with EOS made the greedy choice after TEXT and one token. The random
    model never ranks EOS first, so EOS's row of the (tied) embedding becomes c times the row
    of the token greedy decoding picks second (B): its logit is c times B's, above every
    other at step two, below the first pick (A) at step one. Returns the checkpoint's
    directory and A."""
    from safetensors.torch import load_file, save_file

    ids = string_ids(tiny_engine, TEXT)
    with torch.no_grad():
        first = tiny_oracle(torch.tensor([ids])).logits[0, -1].float()
        a = int(first.argmax())
        second = tiny_oracle(torch.tensor([[*ids, a]])).logits[0, -1].float()
    b = int(second.argmax())
    assert a != b and second[b] > 0
    c = (1 + first[a] / first[b]).item() / 2 if first[b] > 0 else 2.0
    path = tmp_path_factory.mktemp("tiny-eos-second")
    for f in tiny_dir.iterdir():
        shutil.copy(f, path / f.name)
    weights = load_file(tiny_dir / "model.safetensors")
    eos = tiny_engine.checkpoint.eos_token_id
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            weights[name][eos] = c * weights[name][b]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path, a


def test_greedy_decoding_stops_at_eos(eos_second, settings):
    """Greedy decoding that reaches EOS before max_tokens ends there: finish_reason "stop",
    EOS counted and in the logprobs (with its logprob) but not in the text; the same prompt
    cut by max_tokens first ends "length". The figures are transformers' on the same
    weights."""
    from transformers import Gemma3ForCausalLM

    from spinf_worker.engine import Engine

    path, a = eos_second
    engine = Engine.load(str(path), device="cpu")
    oracle = Gemma3ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    ids = string_ids(engine, TEXT)
    eos = engine.checkpoint.eos_token_id
    first, second = (oracle_logprobs(oracle, seq)[-1] for seq in (ids, [*ids, a]))
    assert int(first.argmax()) == a and int(second.argmax()) == eos
    piece = engine.checkpoint.tokenizer.decode([a], skip_special_tokens=False)
    with LiveServer(settings) as server, InProcessWorker(engine, settings):
        client = OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=WAIT_S)
        out = client.completions.create(model=engine.model_name, prompt=TEXT, logprobs=2,
                                        max_tokens=8)
        echoed = client.completions.create(model=engine.model_name, prompt=TEXT, echo=True,
                                           logprobs=0, max_tokens=8)
        cut = client.completions.create(model=engine.model_name, prompt=TEXT, max_tokens=1)
    [choice] = out.choices
    assert choice.finish_reason == "stop" and choice.text == piece
    assert choice.logprobs.tokens == [piece, "<eos>"]
    assert all(abs(got - want) <= TOL for got, want in zip(
        choice.logprobs.token_logprobs, [first[a].item(), second[eos].item()], strict=True))
    assert choice.logprobs.text_offset == [0, len(piece)]
    assert out.usage.completion_tokens == 2 < 8
    [echo] = echoed.choices
    assert echo.finish_reason == "stop" and echo.text == TEXT + piece
    assert echo.logprobs.tokens[-2:] == [piece, "<eos>"]
    assert echo.logprobs.token_logprobs[-2:] == choice.logprobs.token_logprobs
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].text == piece

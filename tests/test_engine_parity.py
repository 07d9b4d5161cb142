"""Parity of the packed read-once tree with transformers, one plain sequence per option:
``[BOS] + tok(content) + tok(template prefix) + tok(option)``, float32, max |Δ| <= 1e-4."""

from __future__ import annotations

import json
import math

import pytest

from .conftest import oracle_logprob, shared_data

TOL = 1e-4

NEWS = ("The central bank raised its benchmark rate by half a point on Tuesday, the third "
        "increase this year, citing stubborn inflation in services and a tight labour market. "
        "Shares of regional lenders fell while the currency touched a two-month high.")

QUERIES = [
    {"id": "topic", "template": "\n\nTopic (business, sports, science or politics):{?}",
     "options": [" business", " sports", " science", " politics"]},
    {"id": "tone", "template": "\n\nIs the tone of this article negative?\nAnswer:{?}",
     "options": [" yes", " no"]},
    # multi-token options (each option a sub-branch of its own)
    {"id": "actor", "template": "\n\nWho acted? The{?}",
     "options": [" central bank", " stock exchange of London", " government"]},
    # a placeholder grid: 2 x 2 combinations
    {"id": "about", "template": "\n\nDoes the article mention {thing} in {place}?{?}",
     "values": {"thing": ["rates", "football"], "place": ["the text", "the title"]},
     "options": [" Yes", " No"]},
    # no template text before the slot: the root's last token predicts the option
    {"id": "bare", "template": "{?}", "options": [" The", " A"]},
]


def check_against_oracle(engine, oracle, content: str, queries: list[dict]) -> float:
    response = engine.score({"messages": [{"role": "user", "content": content}],
                             "scoring": {"queries": queries}})
    enc = engine.presenter.encode
    bos = engine.checkpoint.bos_token_id
    worst = 0.0
    for query, result in zip(queries, response.queries, strict=True):
        for combo in result.combinations:
            prefix = query["template"].split("{?}")[0]
            for name, value in combo.values.items():
                prefix = prefix.replace("{" + name + "}", value)
            oracle_lps, floor_lps = [], []
            for option in combo.options:
                for root, sink in (([bos, *enc(content)], oracle_lps), ([bos], floor_lps)):
                    ctx = root + list(enc(prefix))
                    sink.append(oracle_logprob(oracle, ctx + list(enc(option.text)), len(ctx)))
            for option, want in zip(combo.options, oracle_lps, strict=True):
                worst = max(worst, abs(option.logprob - want))
            # p and floor_p are softmaxes of the same logprobs; residual the mass outside
            z = sum(math.exp(v) for v in oracle_lps)
            fz = sum(math.exp(v) for v in floor_lps)
            for option, want, fwant in zip(combo.options, oracle_lps, floor_lps, strict=True):
                assert option.p == pytest.approx(math.exp(want) / z, abs=TOL)
                assert option.floor_p == pytest.approx(math.exp(fwant) / fz, abs=TOL)
            assert combo.residual == pytest.approx(1 - z, abs=TOL)
            assert [o.text for o in combo.options] == query["options"]
    assert worst <= TOL, f"max |Δlogprob| = {worst}"
    return worst


def test_tiny_random_gemma3_parity(tiny_engine, tiny_oracle):
    check_against_oracle(tiny_engine, tiny_oracle, NEWS, QUERIES)


def test_tiny_sliding_window_longer_than_window(tiny_engine, tiny_oracle):
    # window 16 on the tiny model; the content is ~10x longer, so local layers must mask by position
    assert len(tiny_engine.presenter.encode(NEWS * 3)) > 8 * tiny_engine.config.sliding_window
    check_against_oracle(tiny_engine, tiny_oracle, NEWS * 3, QUERIES[:3])


def test_tiny_multi_turn_messages_parity(tiny_engine, tiny_oracle):
    messages = [{"role": "user", "content": "My card was charged twice."},
                {"role": "assistant", "content": "Which month?"},
                {"role": "user", "content": "September."}]
    response = tiny_engine.score({"messages": messages, "scoring": {"queries": QUERIES[1:2]}})
    presented = tiny_engine.presenter.present(messages)
    assert "charged twice" in presented and "September." in presented
    enc = tiny_engine.presenter.encode
    ctx = [tiny_engine.checkpoint.bos_token_id, *enc(presented), *enc(QUERIES[1]["template"][:-3])]
    for option in response.queries[0].combinations[0].options:
        want = oracle_logprob(tiny_oracle, ctx + list(enc(option.text)), len(ctx))
        assert abs(option.logprob - want) <= TOL


@pytest.mark.slow
def test_default_model_parity(default_engine, default_oracle):
    check_against_oracle(default_engine, default_oracle, NEWS, QUERIES)


@pytest.mark.slow
def test_default_model_content_longer_than_window(default_engine, default_oracle):
    articles = [json.loads(line)
                for line in shared_data("news_articles.jsonl").read_text().splitlines()]
    text = next(a["text"] for a in articles
                if len(default_engine.presenter.encode(a["text"])) > 700)
    ids = default_engine.presenter.encode(text)[:700]
    text = default_engine.checkpoint.tokenizer.decode(list(ids))
    assert len(default_engine.presenter.encode(text)) > default_engine.config.sliding_window
    check_against_oracle(default_engine, default_oracle, text, QUERIES[1:3])

"""Parity of the packed read-once tree with transformers, one plain sequence per option:
``[BOS] + tok(content) + tok(template prefix) + tok(option)``, float32, max |Δ| <= 1e-4.

``case_insensitive: false`` scores each option as written; the default (true) sums an
option's probability over its case and leading-space spellings that are single tokens, and
is checked against the oracle's logsumexp of those spellings."""

from __future__ import annotations

import json
import math

import pytest

from .conftest import oracle_logprob, oracle_next_logprobs, shared_data

TOL = 1e-4

NEWS = ("The central bank raised its benchmark rate by half a point on Tuesday, the third "
        "increase this year, citing stubborn inflation in services and a tight labour market. "
        "Shares of regional lenders fell while the currency touched a two-month high.")

QUERIES = [
    {"id": "topic", "template": "\n\nTopic (business, sports, science or politics):{?}",
     "options": [" business", " sports", " science", " politics"]},
    {"id": "tone", "template": "\n\nIs the tone of this article negative?\nAnswer:{?}",
     "options": [" yes", " no"]},
    # multi-token options (each option a sub-branch of its own; at most 5 tokens)
    {"id": "actor", "template": "\n\nWho acted? The{?}",
     "options": [" central bank", " regional lenders", " the markets"]},
    # a placeholder grid: 2 x 2 combinations
    {"id": "about", "template": "\n\nDoes the article mention {thing} in {place}?{?}",
     "combinations": "all",
     "values": {"thing": ["rates", "football"], "place": ["the text", "the title"]},
     "options": [" Yes", " No"]},
    # no template text before the slot: the root's last token predicts the option
    {"id": "bare", "template": "{?}", "options": [" The", " A"]},
]


def score(engine, content: str, queries: list[dict], **scoring):
    """The one input's query results of scoring ``content``."""
    response = engine.score({"messages": [{"role": "user", "content": content}],
                             "scoring": {"queries": queries, **scoring}})
    [result] = response.results
    assert result.input_id == "0"
    return result.queries


def prefix_of(query: dict, values: dict[str, str]) -> str:
    prefix = query["template"].split("{?}")[0]
    for name, value in values.items():
        prefix = prefix.replace("{" + name + "}", value)
    return prefix


def spellings(engine, option: str) -> list[str]:
    """The hosted rule, written out here: the option itself, and its lower / Capitalised /
    UPPER forms with and without a leading space that are single tokens."""
    base = option.strip()
    forms = (base.lower(), base[:1].upper() + base[1:].lower(), base.upper())
    found = [option]
    for form in forms:
        for s in (" " + form, form):
            if s not in found and len(engine.presenter.encode(s)) == 1:
                found.append(s)
    return found


def logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def oracle_scores(engine, oracle, content: str, prefix: str, strings: list[str]
                  ) -> tuple[list[float], list[float]]:
    """Each string's logprob after content + prefix, and after empty content + prefix
    (strings of one token read from one forward of the context: their spellings share it)."""
    enc = engine.presenter.encode
    bos = engine.checkpoint.bos_token_id
    on_content, on_empty = [], []
    for root, sink in (([bos, *enc(content)], on_content), ([bos], on_empty)):
        ctx = root + list(enc(prefix))
        following = None
        for s in strings:
            ids = list(enc(s))
            if len(ids) == 1:
                if following is None:
                    following = oracle_next_logprobs(oracle, ctx)
                sink.append(following[ids[0]].item())
            else:
                sink.append(oracle_logprob(oracle, ctx + ids, len(ctx)))
    return on_content, on_empty


def worst_option_gap(engine, oracle, content: str, queries: list[dict]) -> float:
    """max |Δ option logprob| of the engine's scores against the oracle's (options as given),
    asserting nothing: for schemes measured against more than one oracle."""
    worst = 0.0
    for query, result in zip(queries, score(engine, content, queries, case_insensitive=False),
                             strict=True):
        for combo in result.combinations:
            prefix = prefix_of(query, combo.values)
            for option in combo.options:
                [want], _ = oracle_scores(engine, oracle, content, prefix, [option.text])
                worst = max(worst, abs(option.logprob - want))
    return worst


def check_against_oracle(engine, oracle, content: str, queries: list[dict], *,
                         case_insensitive: bool = False) -> float:
    results = score(engine, content, queries, case_insensitive=case_insensitive)
    worst = 0.0
    for query, result in zip(queries, results, strict=True):
        assert result.id == query["id"]
        for combo in result.combinations:
            prefix = prefix_of(query, combo.values)
            wants, floor_wants, masses, floor_masses = [], [], [], []
            for option in query["options"]:
                strings = spellings(engine, option) if case_insensitive else [option]
                lps, floor_lps = oracle_scores(engine, oracle, content, prefix, strings)
                wants.append(logsumexp(lps))
                floor_wants.append(logsumexp(floor_lps))
                masses.append(sum(math.exp(v) for v in lps))
                floor_masses.append(sum(math.exp(v) for v in floor_lps))
            assert [o.text for o in combo.options] == query["options"]
            for option, want in zip(combo.options, wants, strict=True):
                worst = max(worst, abs(option.logprob - want))
            # p and floor_p are softmaxes of the same logprobs; the residuals the mass outside
            z, fz = sum(math.exp(v) for v in wants), sum(math.exp(v) for v in floor_wants)
            for option, want, fwant in zip(combo.options, wants, floor_wants, strict=True):
                assert option.p == pytest.approx(math.exp(want) / z, abs=TOL)
                assert option.floor_p == pytest.approx(math.exp(fwant) / fz, abs=TOL)
            assert combo.residual == pytest.approx(1 - sum(masses), abs=TOL)
            assert combo.floor_residual == pytest.approx(1 - sum(floor_masses), abs=TOL)
    assert worst <= TOL, f"max |Δlogprob| = {worst}"
    return worst


def test_tiny_random_gemma3_parity(tiny_engine, tiny_oracle):
    check_against_oracle(tiny_engine, tiny_oracle, NEWS, QUERIES)


def test_tiny_case_insensitive_parity(tiny_engine, tiny_oracle):
    # the tiny vocabulary has single-token spellings of several options (" a", "business")
    assert any(len(spellings(tiny_engine, o)) > 1 for q in QUERIES for o in q["options"])
    check_against_oracle(tiny_engine, tiny_oracle, NEWS, QUERIES, case_insensitive=True)


def test_case_insensitive_is_the_default(tiny_engine):
    default = score(tiny_engine, NEWS, QUERIES)
    assert default == score(tiny_engine, NEWS, QUERIES, case_insensitive=True)
    assert default != score(tiny_engine, NEWS, QUERIES, case_insensitive=False)


def test_tiny_sliding_window_longer_than_window(tiny_engine, tiny_oracle):
    # window 16 on the tiny model; the content is ~10x longer, so local layers must mask by position
    assert len(tiny_engine.presenter.encode(NEWS * 3)) > 8 * tiny_engine.config.sliding_window
    check_against_oracle(tiny_engine, tiny_oracle, NEWS * 3, QUERIES[:3])


def test_tiny_multi_turn_messages_parity(tiny_engine, tiny_oracle):
    messages = [{"role": "user", "content": "My card was charged twice."},
                {"role": "assistant", "content": "Which month?"},
                {"role": "user", "content": "September."}]
    response = tiny_engine.score({"messages": messages, "scoring": {
        "queries": QUERIES[1:2], "case_insensitive": False}})
    presented = tiny_engine.presenter.present(messages)
    assert "charged twice" in presented and "September." in presented
    enc = tiny_engine.presenter.encode
    ctx = [tiny_engine.checkpoint.bos_token_id, *enc(presented), *enc(QUERIES[1]["template"][:-3])]
    for option in response.results[0].queries[0].combinations[0].options:
        want = oracle_logprob(tiny_oracle, ctx + list(enc(option.text)), len(ctx))
        assert abs(option.logprob - want) <= TOL


@pytest.mark.slow
def test_default_model_parity(default_engine, default_oracle):
    check_against_oracle(default_engine, default_oracle, NEWS, QUERIES)


@pytest.mark.slow
def test_default_model_case_insensitive_parity(default_engine, default_oracle):
    # Gemma's vocabulary holds " yes", "Yes", " YES", ... each as one token
    assert len(spellings(default_engine, " yes")) == 6
    check_against_oracle(default_engine, default_oracle, NEWS, QUERIES[:2] + QUERIES[3:],
                         case_insensitive=True)


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


def test_case_sensitive_scores_are_the_runners_own_bits(tiny_engine):
    """``case_insensitive: false`` answers what the runner reads out for the options as
    written, bit for bit: one branch per combination, nothing summed."""
    from spinf_worker.engine.layout import Branch, DocTree

    enc = tiny_engine.presenter.encode
    branches, expected = [], []
    for query in QUERIES:
        grid = ([{}] if "values" not in query else
                [{"thing": t, "place": p} for t in query["values"]["thing"]
                 for p in query["values"]["place"]])
        for values in grid:
            branches.append(Branch(list(enc(prefix_of(query, values))),
                                   [list(enc(o)) for o in query["options"]]))
            expected.append((query["id"], values))
    root = tiny_engine.presenter.root_ids([{"role": "user", "content": NEWS}])
    [raw] = tiny_engine.runner.run([DocTree(root, branches).flatten(tiny_engine.pad_id)])
    results = {q.id: q for q in score(tiny_engine, NEWS, QUERIES, case_insensitive=False)}
    combos = [c for query in QUERIES for c in results[query["id"]].combinations]
    assert [(qid, c.values) for (qid, _), c in zip(expected, combos, strict=True)] == \
        [(qid, values) for qid, values in expected]
    for b, combo in enumerate(combos):
        assert [o.logprob for o in combo.options] == raw.branch(b).tolist()
        assert combo.residual == float(raw.residual[b])


def test_case_insensitive_sums_the_case_sensitive_spellings(tiny_engine):
    """An option's case-insensitive logprob is the logsumexp of its spellings' logprobs, each
    scored as written; p renormalises those sums and the residual is the mass outside all."""
    query = QUERIES[4]   # " The" / " A": " the", "The", " a", "a", "A" are single tokens
    folded = score(tiny_engine, NEWS, [query])[0].combinations[0]
    strings = [spellings(tiny_engine, o) for o in query["options"]]
    assert all(len(s) > 1 for s in strings)
    written = score(tiny_engine, NEWS, [{**query, "options": [s for ss in strings for s in ss]}],
                    case_insensitive=False)[0].combinations[0]
    by_text = {o.text: o.logprob for o in written.options}
    sums = [logsumexp([by_text[s] for s in ss]) for ss in strings]
    assert [o.logprob for o in folded.options] == pytest.approx(sums, rel=1e-12)
    total = sum(math.exp(v) for v in sums)
    assert [o.p for o in folded.options] == pytest.approx([math.exp(v) / total for v in sums])
    assert folded.residual == pytest.approx(written.residual, abs=1e-9)
    assert [o.text for o in folded.options] == query["options"]

"""Extraction slots decoded from the same read, against transformers on the same ids: searched
answers carry P(tokens) x P(end), generated ones follow greedy decoding or their seeds."""

from __future__ import annotations

import math

import pytest
import torch

from spinf_worker.engine.decode import Sampling, SlotDecoder, SlotJob
from spinf_worker.engine.layout import Branch, DocTree
from spinf_worker.extract_values import NUMBER, number_complete, number_prefix_ok

from .conftest import oracle_logprob, oracle_next_logprobs

CONTENT = ("Invoice 4411. The customer was charged twice in September for 12.50 dollars each "
           "time, and asked for a refund of the second charge.")
MONTH = '\n\nQ: Which month?\nA: "'
QUOTE_STOPS = ('"', "\n")


def _pass_with_slot(engine, prefix_text: str, extra_scored: bool = True):
    enc = engine.presenter.encode
    root = [engine.checkpoint.bos_token_id, *enc(CONTENT)]
    prefix = list(enc(prefix_text))
    scored = Branch(list(enc("\n\nIs it about billing?\nAnswer:")), [list(enc(" yes")),
                                                                      list(enc(" no"))])
    branches = [scored, Branch(prefix, [])] if extra_scored else [scored]
    flat = DocTree(root, branches).flatten(engine.pad_id)
    pending = engine.runner.launch([flat])
    scores = engine.runner.finish(pending)[0]
    return root + prefix, flat, pending, scores


def _job(flat, pending, **settings) -> SlotJob:
    _, context, _ = flat.extract[1]
    rows = torch.tensor(context)
    return SlotJob(rows + pending.keep_base[0], flat.positions[rows], pending.first[(0, 1)],
                   **settings)


def _decode(engine, prefix_text: str, **settings):
    """The answers of one slot after ``prefix_text``, and the ids it was read after."""
    context, flat, pending, _ = _pass_with_slot(engine, prefix_text)
    decoder = SlotDecoder(engine.model, engine.checkpoint.tokenizer,
                          engine.checkpoint.eos_token_id, engine.pad_id)
    return decoder.decode([_job(flat, pending, **settings)], pending.kept)[0], context


def _pieces(engine) -> list[str]:
    tok = engine.checkpoint.tokenizer
    return [tok.decode([i], skip_special_tokens=False) for i in range(tok.get_vocab_size())]


def _special(engine) -> set[int]:
    tok = engine.checkpoint.tokenizer
    return ({i for i, t in tok.get_added_tokens_decoder().items() if t.special}
            | {engine.checkpoint.eos_token_id})


def test_slot_branch_leaves_scores_unchanged(tiny_engine):
    *_, with_slot = _pass_with_slot(tiny_engine, MONTH, True)
    *_, without = _pass_with_slot(tiny_engine, MONTH, False)
    assert torch.equal(with_slot.logprobs[0], without.logprobs[0])


MODELS = [("tiny_engine", "tiny_oracle"),
          pytest.param("default_engine", "default_oracle", marks=pytest.mark.slow)]


@pytest.mark.parametrize("engine_name, oracle_name", MODELS)
def test_greedy_generation_equals_transformers_greedy(engine_name, oracle_name, request):
    engine, oracle = request.getfixturevalue(engine_name), request.getfixturevalue(oracle_name)
    found, context = _decode(engine, MONTH, stops=QUOTE_STOPS, max_tokens=6, sample=Sampling())
    (answer,) = found
    ids = torch.tensor([context])
    with torch.no_grad():
        greedy = oracle.generate(ids, max_new_tokens=6, do_sample=False,
                                 pad_token_id=0)[0, ids.shape[1]:].tolist()
    # greedy decoding with the end as one event: transformers' tokens until the answer ends
    assert answer.tokens == greedy[: len(answer.tokens)]
    assert abs(answer.logprob - oracle_logprob(oracle, context + answer.tokens,
                                               len(context))) <= 1e-4
    assert answer.finish == ("length" if len(answer.tokens) == 6 else "stop")


def test_generation_past_the_first_steps_buffers_equals_transformers_greedy(default_engine,
                                                                           default_oracle):
    """20 tokens: the steps' key and value buffers (engine/decode.DecodePlan) grow twice on
    the way, the tokens already generated kept where they are. (The tiny random model ends
    its answers at once: its special tokens together outweigh any one token.)"""
    found, context = _decode(default_engine, "\n\nSummary:", stops=(), max_tokens=20,
                             sample=Sampling())
    (answer,) = found
    ids = torch.tensor([context])
    with torch.no_grad():
        greedy = default_oracle.generate(ids, max_new_tokens=20, do_sample=False,
                                         pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert len(answer.tokens) > 16 and answer.tokens == greedy[: len(answer.tokens)]
    assert abs(answer.logprob - oracle_logprob(default_oracle, context + answer.tokens,
                                               len(context))) <= 1e-4


@pytest.mark.parametrize("engine_name, oracle_name", MODELS)
def test_text_answers_carry_the_probability_that_they_end(engine_name, oracle_name, request):
    """P(answer) = P(its tokens) x P(the next token ends it: starts with a stop, or is
    special); or, where a stop came inside its last token, P(its tokens)."""
    engine, oracle = request.getfixturevalue(engine_name), request.getfixturevalue(oracle_name)
    found, context = _decode(engine, MONTH, stops=QUOTE_STOPS, max_tokens=4, beam_width=4,
                             candidates=3)
    assert found
    assert [f.logprob for f in found] == sorted((f.logprob for f in found), reverse=True)
    pieces, special = _pieces(engine), _special(engine)
    ends = [i for i, p in enumerate(pieces) if i in special or p.startswith(QUOTE_STOPS)]
    tok = engine.checkpoint.tokenizer
    for f in found:
        assert f.text.strip() and '"' not in f.text and "\n" not in f.text
        assert 1 <= len(f.tokens) <= 4 and f.finish == "stop"
        want = oracle_logprob(oracle, context + f.tokens, len(context))
        if tok.decode(f.tokens) == f.text:   # ended by the next token
            following = oracle_next_logprobs(oracle, context + f.tokens)
            want += float(torch.logsumexp(following[ends], 0))
        assert abs(f.logprob - want) <= 1e-4, f.text


@pytest.mark.parametrize("engine_name, oracle_name", MODELS)
def test_number_answers_end_where_the_grammar_cannot_go_on(engine_name, oracle_name, request):
    """P(answer) = P(its tokens) x (1 - P(a next token that keeps it a number's prefix))."""
    engine, oracle = request.getfixturevalue(engine_name), request.getfixturevalue(oracle_name)
    found, context = _decode(engine, "\n\nAmount charged:", max_tokens=5, beam_width=4,
                             candidates=4, grammar=NUMBER)
    assert found
    pieces = _pieces(engine)
    scales = "thousandmillionbilliontrillion"
    chars = set("0123456789 ,.-+()%\u2212\u00a0\u202f" + scales + scales.upper())
    maybe = [(i, p) for i, p in enumerate(pieces) if p and set(p) <= chars]
    for f in found:
        assert number_complete(f.text) and engine.checkpoint.tokenizer.decode(f.tokens) == f.text
        going_on = [i for i, p in maybe if number_prefix_ok(f.text + p)]
        read = oracle_logprob(oracle, context + f.tokens, len(context))
        next_lp = oracle_next_logprobs(oracle, context + f.tokens)
        end = math.log1p(-min(1.0, float(next_lp[going_on].exp().sum())))
        want = read + end
        assert abs(f.logprob - want) <= 1e-4, f.text


def test_searched_answers_stay_within_max_tokens(tiny_engine):
    for max_tokens in (1, 3):
        found, _ = _decode(tiny_engine, MONTH, stops=QUOTE_STOPS, max_tokens=max_tokens,
                           beam_width=6, candidates=6)
        assert found and all(1 <= len(f.tokens) <= max_tokens for f in found)


def _sampled(engine, *, stops=(), max_tokens=6, **sampling) -> list:
    found, _ = _decode(engine, "\n\nSummary:", stops=stops, max_tokens=max_tokens,
                       sample=Sampling(**sampling))
    return found


def test_sampling_repeats_with_its_seed(tiny_engine):
    def tokens(seed: int) -> list[int]:
        return _sampled(tiny_engine, temperature=1.0, seed=seed)[0].tokens

    assert tokens(7) == tokens(7)
    assert len({tuple(tokens(seed)) for seed in range(6)}) > 1


def test_n_sequences_are_independent_and_reproducible(tiny_engine):
    three = _sampled(tiny_engine, temperature=1.0, seed=7, n=3)
    assert [f.sequence for f in three] == [0, 1, 2]
    assert len({tuple(f.tokens) for f in three}) > 1
    # sequence j draws from its own stream (seed, j): asking for fewer changes nothing
    one = _sampled(tiny_engine, temperature=1.0, seed=7, n=1)
    two = _sampled(tiny_engine, temperature=1.0, seed=7, n=2)
    assert one[0].tokens == three[0].tokens
    assert [f.tokens for f in two] == [f.tokens for f in three[:2]]


@pytest.mark.parametrize("engine_name", ["tiny_engine", pytest.param(
    "default_engine", marks=pytest.mark.slow)])
def test_a_tiny_nucleus_is_greedy(engine_name, request):
    engine = request.getfixturevalue(engine_name)
    greedy = _sampled(engine, stops=QUOTE_STOPS)[0].tokens
    for seed in range(3):
        drawn = _sampled(engine, stops=QUOTE_STOPS, temperature=1.5, top_p=1e-9, seed=seed)
        assert drawn[0].tokens == greedy


def test_top_k_one_draws_the_best_continuation_or_ends(tiny_engine, tiny_oracle):
    """With top_k 1 a token is the most likely one that goes on (no special token), or the
    sequence ends; transformers says which is the most likely."""
    special = sorted(_special(tiny_engine))
    context, *_ = _pass_with_slot(tiny_engine, "\n\nSummary:")
    lengths = set()
    for seed in range(6):
        (answer,) = _sampled(tiny_engine, temperature=2.0, top_k=1, seed=seed)
        lengths.add(len(answer.tokens))
        for j, token in enumerate(answer.tokens):
            next_lp = oracle_next_logprobs(tiny_oracle, context + answer.tokens[:j])
            next_lp[special] = -math.inf
            assert token == int(torch.argmax(next_lp))
    assert max(lengths) >= 1


def test_finish_reasons(tiny_engine):
    # The random tiny model: its six special tokens together (the end) outweigh any one
    # token, so greedy ends before the first.
    greedy = _sampled(tiny_engine, max_tokens=3)[0]
    assert (greedy.text, greedy.tokens, greedy.finish) == ("", [], "stop")
    sampled = _sampled(tiny_engine, max_tokens=3, temperature=1.0, seed=1, n=6)
    assert len(sampled) == 6
    for f in sampled:
        assert f.finish == ("length" if len(f.tokens) == 3 else "stop")
        assert len(f.tokens) <= 3
    assert any(f.finish == "length" for f in sampled)
    # a stop text that the first token starts with ends the sequence before it
    first = tiny_engine.checkpoint.tokenizer.decode(sampled[0].tokens[:1])
    again = _sampled(tiny_engine, stops=(first,), max_tokens=3, temperature=1.0, seed=1, n=6)
    assert first not in again[0].text and all(first not in f.text for f in again)


def test_rows_logsumexp_alone_and_pairwise():
    from spinf_worker.engine.decode import _logsumexp_rows, _pairwise_logsumexp

    x = torch.randn(5, 37).log_softmax(-1)[:, :29]
    x[3] = -math.inf
    rows = _logsumexp_rows(x)
    assert rows.dtype == torch.float64 and rows[3] == -math.inf
    for i in (0, 1, 2, 4):      # on the CPU: torch.logsumexp of the row, to the bit
        assert rows[i] == float(torch.logsumexp(x[i], 0))
    pairwise = _pairwise_logsumexp(x)          # the CUDA way, checked here on its values
    assert pairwise[3] == -math.inf
    assert torch.allclose(pairwise[[0, 1, 2, 4]], x[[0, 1, 2, 4]].double().logsumexp(1),
                          rtol=0, atol=1e-12)
    assert _pairwise_logsumexp(x[:, :1])[0] == x[0, 0]
    assert _logsumexp_rows(x[:, :0]).tolist() == [-math.inf] * 5


def test_a_slot_answers_alone_as_beside_slots_of_other_lengths(default_engine):
    """A slot decoded beside slots whose contexts are longer or shorter (other documents of
    its pass) gives the answers it gives alone, bit for bit: its products' shapes are its own
    (DecodePlan: its context padded to its own width, beams in fixed tiles)."""
    from .test_engine_parity import NEWS
    from .test_root_merge import COUNT

    def asked(text: str) -> dict:
        return {"messages": [{"role": "user", "content": text}],
                "scoring": {"queries": [COUNT]}}

    short, long = asked("Rates rose twice, then 3 more times."), asked(NEWS)
    for mine, other in ((short, long), (long, short)):
        alone = default_engine.score(mine).results
        assert alone[0].queries[0].combinations[0].answers      # something was decoded
        for batch in ([other, mine], [mine, other]):
            together = default_engine.score_batch(batch)[batch.index(mine)]
            assert together.results == alone

"""Extraction slots decoded from the same read, against transformers on the same ids."""

from __future__ import annotations

import pytest
import torch

from spinf_worker.engine.decode import SlotDecoder, SlotJob
from spinf_worker.engine.layout import Branch, DocTree

from .conftest import oracle_logprob

CONTENT = ("Invoice 4411. The customer was charged twice in September for 12.50 dollars each "
           "time, and asked for a refund of the second charge.")


def _pass_with_slot(engine, prefix_text: str, extra_scored: bool):
    enc = engine.presenter.encode
    root = [engine.checkpoint.bos_token_id, *enc(CONTENT)]
    prefix = list(enc(prefix_text))
    scored = Branch(list(enc("\n\nIs it about billing?\nAnswer:")), [list(enc(" yes")),
                                                                      list(enc(" no"))])
    branches = [scored, Branch(prefix, [])] if extra_scored else [scored]
    flat = DocTree(root, branches).flatten(engine.pad_id)
    pending = engine.runner.launch([flat])
    scores = engine.runner.finish(pending)[0]
    return root, prefix, flat, pending, scores


def _jobs(engine, flat, pending, **kwargs) -> SlotJob:
    _, context, _ = flat.extract[1]
    rows = torch.tensor(context)
    return SlotJob(rows + pending.keep_base[0], flat.positions[rows], pending.first[(0, 1)],
                   **kwargs)


def _decoder(engine) -> SlotDecoder:
    return SlotDecoder(engine.model, engine.checkpoint.tokenizer,
                       engine.checkpoint.eos_token_id, engine.pad_id)


def test_slot_branch_leaves_scores_unchanged(tiny_engine):
    *_, with_slot = _pass_with_slot(tiny_engine, '\n\nQ: Which month?\nA: "', True)
    *_, without = _pass_with_slot(tiny_engine, '\n\nQ: Which month?\nA: "', False)
    assert torch.equal(with_slot.logprobs[0], without.logprobs[0])


MODELS = [("tiny_engine", "tiny_oracle"),
          pytest.param("default_engine", "default_oracle", marks=pytest.mark.slow)]


@pytest.mark.parametrize("engine_name, oracle_name", MODELS)
def test_greedy_slot_equals_transformers_greedy(engine_name, oracle_name, request):
    engine, oracle = request.getfixturevalue(engine_name), request.getfixturevalue(oracle_name)
    root, prefix, flat, pending, _ = _pass_with_slot(engine, '\n\nQ: Which month?\nA: "', True)
    job = _jobs(engine, flat, pending, stops=('"', "\n"), max_tokens=6, beam_width=1,
                candidates=1)
    found = _decoder(engine).decode([job], pending.kept)[0]
    assert len(found) == 1
    ids = torch.tensor([root + prefix])
    with torch.no_grad():
        greedy = oracle.generate(ids, max_new_tokens=6, do_sample=False,
                                 pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert found[0].tokens == greedy[: len(found[0].tokens)]
    context = root + prefix
    want = oracle_logprob(oracle, context + found[0].tokens, len(context))
    assert abs(found[0].logprob - want) <= 1e-4


@pytest.mark.parametrize("engine_name, oracle_name", MODELS)
def test_beam_candidates_carry_sequence_logprobs(engine_name, oracle_name, request):
    engine, oracle = request.getfixturevalue(engine_name), request.getfixturevalue(oracle_name)
    root, prefix, flat, pending, _ = _pass_with_slot(engine, "\n\nThe month was", True)
    job = _jobs(engine, flat, pending, max_tokens=4, beam_width=4, candidates=3)
    found = _decoder(engine).decode([job], pending.kept)[0]
    assert 1 <= len(found) <= 3
    assert [f.logprob for f in found] == sorted((f.logprob for f in found), reverse=True)
    context = root + prefix
    for f in found:
        assert abs(f.logprob - oracle_logprob(oracle, context + f.tokens, len(context))) <= 1e-4


def test_sampled_generation_repeats_with_its_seed(tiny_engine):
    def generate(seed: int) -> list[int]:
        *_, flat, pending, _ = _pass_with_slot(tiny_engine, "\n\nSummary:", True)
        job = _jobs(tiny_engine, flat, pending, stops=(), max_tokens=6, beam_width=1,
                    candidates=1, sample=(1.0, seed))
        return _decoder(tiny_engine).decode([job], pending.kept)[0][0].tokens

    assert generate(7) == generate(7)
    assert len({tuple(generate(seed)) for seed in range(6)}) > 1


def test_constrained_slot_emits_only_allowed_text(tiny_engine):
    *_, flat, pending, _ = _pass_with_slot(tiny_engine, "\n\nAmount charged:", True)
    digits = set("0123456789., ")
    job = _jobs(tiny_engine, flat, pending, max_tokens=4, beam_width=3, candidates=3,
                allowed=lambda text: set(text) <= digits,
                complete=lambda text: any(c.isdigit() for c in text))
    found = _decoder(tiny_engine).decode([job], pending.kept)[0]
    assert found
    for f in found:
        assert set(f.text) <= digits and any(c.isdigit() for c in f.text)

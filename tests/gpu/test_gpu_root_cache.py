"""Kept roots on CUDA (skipped without CUDA; engine/root_cache.py, kernels/flex_tree.KeptKeys):
documents sent again run as their branch rows on their roots' kept keys and values, and every
figure of every response is the one the engine gives without kept roots, bf16 and fp8, with
kept and unkept documents in one pass, in either order; documents with extraction slots decode
from their kept roots and answer as without them."""

from __future__ import annotations

import pytest
import torch

from .test_gpu_extraction import SLOTS, _documents, _engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from spinf_worker.engine.root_cache import RootCache

QUERIES = [
    {"id": "topic", "template": "\n\nTopic: {?}", "options": [" business", " sports"]},
    {"id": "vote", "template": "\n\nQ: Is there a vote?\nA:{?}", "options": [" yes", " no"]},
    {"id": "who", "template": "\n\nQ: Who acted? The{?}",
     "options": [" company", " minister", " teams played"]},
]


def _figures(response) -> list:
    return response.model_dump(mode="json")["results"][0]["queries"]


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_kept_roots_keep_every_figure(tiny_tokenizer_dir, scheme):
    engine = _engine(tiny_tokenizer_dir, scheme)
    texts = _documents()
    first = [{"text": t, "scoring": {"queries": QUERIES[:1]}} for t in texts]
    again = [{"text": t, "scoring": {"queries": QUERIES[1:]}} for t in texts]
    want_first = [_figures(r) for r in engine.score_batch(first)]
    want_again = [_figures(r) for r in engine.score_batch(again)]
    launched = []
    launch = engine.runner.launch

    def logged(docs, *args):
        launched.append([d.kept_root is not None for d in docs])
        return launch(docs, *args)

    engine.runner.launch = logged
    engine.roots = RootCache(256 << 20)
    # half the documents' roots kept, then all of them asked again with others' beside
    assert [_figures(r) for r in engine.score_batch(first[::2])] == want_first[::2]
    assert len(engine.roots) >= len(first[::2])
    launched.clear()
    mixed = [again[k] if k % 2 == 0 else first[k] for k in range(len(texts))]
    want_mixed = [want_again[k] if k % 2 == 0 else want_first[k] for k in range(len(texts))]
    assert [_figures(r) for r in engine.score_batch(mixed)] == want_mixed
    assert [_figures(r) for r in engine.score_batch(mixed[::-1])][::-1] == want_mixed
    assert any(kept for docs in launched for kept in docs)
    # every root is kept now: all of them on kept roots, alone and packed
    assert [_figures(r) for r in engine.score_batch(again)] == want_again
    for k in (0, 5):
        assert _figures(engine.score_batch([again[k]])[0]) == want_again[k]


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_extraction_slots_on_kept_roots_answer_as_without(tiny_tokenizer_dir, scheme):
    engine = _engine(tiny_tokenizer_dir, scheme)
    texts = _documents()
    first = [{"text": t, "scoring": {"queries": QUERIES[:1]}} for t in texts]
    slots = [{"text": t, "scoring": {"queries": SLOTS, "case_insensitive": False}}
             for t in texts]
    want = [_figures(r) for r in engine.score_batch(slots)]
    engine.roots = RootCache(256 << 20)
    engine.score_batch(first[::2])                 # half the roots kept
    assert [_figures(r) for r in engine.score_batch(slots)] == want
    assert [_figures(r) for r in engine.score_batch(slots[::-1])][::-1] == want
    for k in (0, 3):
        assert _figures(engine.score_batch([slots[k]])[0]) == want[k]

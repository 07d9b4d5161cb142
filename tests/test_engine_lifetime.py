"""An engine is freed as soon as the last reference goes: no reference cycle keeps a model's
weights alive until the cyclic collector happens to run (on a GPU that is a whole model's
memory held twice while the next engine loads)."""

from __future__ import annotations

import gc
import weakref

from spinf_worker.engine import Engine


def test_an_engine_is_freed_without_the_cyclic_collector(tiny_dir):
    gc.collect()
    gc.disable()
    try:
        engine = Engine.load(str(tiny_dir), device="cpu")
        engine.score({"text": "A short note.", "scoring": {"queries": [
            {"id": "q", "template": "\n\nIs it short?\nAnswer:{?}", "options": [" yes", " no"]}]}})
        model, weight = weakref.ref(engine.model), weakref.ref(engine.model.embed_tokens.weight)
        del engine
        assert model() is None and weight() is None
    finally:
        gc.enable()


def test_warm_up_on_the_cpu_compiles_nothing_and_changes_no_score(tiny_dir):
    """A service warms its engine up before it serves (serve.load_engine): on the CPU there
    is no pass size to compile, and the engine answers as a cold one does."""
    request = {"text": "A short note.", "scoring": {"queries": [
        {"id": "q", "template": "\n\nIs it short?\nAnswer:{?}", "options": [" yes", " no"]}]}}
    cold = Engine.load(str(tiny_dir), device="cpu").score(request)
    engine = Engine.load(str(tiny_dir), device="cpu")
    assert engine.warm_up() == []
    warm = engine.score(request)
    assert warm.results[0].model_dump() == cold.results[0].model_dump()

"""A decision model behind the real server (uvicorn, Redis, an in-process worker): its
manifest listed by GET /v1/models, its options scored over its codes, and what it does not do
refused with a 4xx in the hosted envelope before anything is queued."""

from __future__ import annotations

import httpx
import pytest

from api.models import ModelList

from ..conftest import WAIT_S
from ..test_decision_model import CODES, DECIDER, with_manifest
from . import live
from .live import InProcessWorker, stream_length
from .test_api import assert_error

api_server = live.api_server  # the fixture, for pytest to find


@pytest.fixture(scope="module")
def decider_engine(tiny_dir, tmp_path_factory):
    from spinf_worker.engine import Engine

    path = with_manifest(tiny_dir, tmp_path_factory.mktemp("decider-api"), DECIDER)
    return Engine.load(str(path), device="cpu")


def test_models_lists_the_manifest(decider_engine, api_server, settings):
    with InProcessWorker(decider_engine, settings):
        reply = httpx.get(f"{api_server.v1}/models", timeout=WAIT_S).json()
        (model,) = ModelList.model_validate(reply).models
        assert (model.id, model.name, model.status) == ("test/tiny-decider", "tiny decider",
                                                        "available")
        assert model.base_model == "test/tiny-gemma3" and model.family == "gemma3_text"
        assert "decider" in model.aliases and model.capabilities == ["score"]
        assert model.media == [] and model.limits["max_content_tokens"] == 512
        assert not model.features.extraction and not model.features.generation
        found = httpx.get(f"{api_server.v1}/models/decider", timeout=WAIT_S)
        assert found.status_code == 200 and found.json()["id"] == "test/tiny-decider"


def test_a_decision_model_scores_and_refuses_over_http(decider_engine, api_server, settings):
    body = {"model": "decider", "messages": [{"role": "user", "content": "Rates rose."}]}
    with InProcessWorker(decider_engine, settings):
        scored = httpx.post(f"{api_server.v1}/score", timeout=WAIT_S, json={
            **body, "scoring": {"queries": [{"id": "q", "template": "Risk class{?}",
                                             "options": CODES}]}})
        assert scored.status_code == 200, scored.text
        options = scored.json()["results"][0]["queries"][0]["combinations"][0]["options"]
        assert abs(sum(o["p"] for o in options) - 1) < 1e-4
        queued = stream_length(settings)
        for query, code, param in [
            ({"id": "x", "template": "Name:{*}"}, "extraction_disabled",
             "scoring.queries.0.template"),
            ({"id": "x", "template": "Say:{*}", "generate": True}, "generation_disabled",
             "scoring.queries.0.generate"),
            ({"id": "x", "template": "Q{?}", "options": ["A", "yes"]}, "invalid_field",
             "scoring.queries.0.options.1"),
        ]:
            reply = httpx.post(f"{api_server.v1}/score", timeout=WAIT_S,
                               json={**body, "scoring": {"queries": [query]}})
            assert_error(reply, 400, code, param)
        reply = httpx.post(f"{api_server.v1}/completions", timeout=WAIT_S,
                           json={"model": "decider", "prompt": "Rates", "max_tokens": 1})
        assert_error(reply, 400, "completions_not_supported", "model")
        assert stream_length(settings) == queued      # nothing refused was queued

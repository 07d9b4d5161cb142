"""Bad input raises a typed error with a clear message; nothing is half-scored."""

from __future__ import annotations

import pytest

from spinf_worker.engine import Engine, EngineSettings
from spinf_worker.errors import ContextLengthError, InvalidRequestError, ModelNotFoundError

YES_NO = [" yes", " no"]


def request(template="\n\nOK?{?}", options=YES_NO, values=None, text="Some content.", **extra):
    query = {"id": "q", "template": template, "options": options}
    if values is not None:
        query["values"] = values
    return {"text": text, "scoring": {"queries": [query]}, **extra}


@pytest.mark.parametrize("bad, error, param, fragment", [
    (request(template="no slot"), InvalidRequestError, "scoring.queries.0.template", "no scored slot"),
    (request(template="{?} and {?}"), InvalidRequestError, "scoring.queries.0.template", "2 scored slots"),
    (request(options=[]), InvalidRequestError, "scoring.queries.0.options", None),
    (request(options=[" yes", " yes"]), InvalidRequestError, "scoring.queries.0.options.1", "duplicate"),
    (request(template="Is it {x}?{?}"), InvalidRequestError, None, "{x}"),
    (request(model="no-such/model"), ModelNotFoundError, "model", "no-such/model"),
    (request(packs=[{"id": "spinf/no-such-pack"}]), InvalidRequestError, "packs", "spinf/no-such-pack"),
])
def test_bad_requests(tiny_engine, bad, error, param, fragment):
    with pytest.raises(error) as info:
        tiny_engine.score(bad)
    if param is not None:
        assert info.value.param == param
    if fragment is not None:
        assert fragment in info.value.message
    body = info.value.to_openai()["error"]
    assert set(body) == {"message", "type", "param", "code"}


def test_grid_cap_is_configurable(tiny_dir):
    engine = Engine.load(str(tiny_dir), device="cpu", settings=EngineSettings(max_combinations=8))
    values = {"a": [str(i) for i in range(3)], "b": [str(i) for i in range(3)]}
    with pytest.raises(InvalidRequestError) as info:
        engine.score(request(template="{a} {b}{?}", values=values))
    assert "9" in info.value.message and "8" in info.value.message
    ok = engine.score(request(template="{a}{?}", values={"a": ["x", "y"]}))
    assert [c.values for c in ok.queries[0].combinations] == [{"a": "x"}, {"a": "y"}]


def test_content_longer_than_context(tiny_engine):
    limit = tiny_engine.config.max_position_embeddings
    with pytest.raises(ContextLengthError) as info:
        tiny_engine.score(request(text="word " * (limit + 10)))
    assert str(limit) in info.value.message
    assert info.value.code == "content_too_long"


def test_batch_keeps_good_requests(tiny_engine):
    results = tiny_engine.score_batch([request(), request(options=[]), request(text="Other.")])
    assert isinstance(results[1], InvalidRequestError)
    assert results[0].queries[0].id == "q" and results[2].queries[0].id == "q"


def test_unknown_model_offline_is_clear(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as info:
        Engine.load("someone/not-a-real-model")
    assert "someone/not-a-real-model" in info.value.message

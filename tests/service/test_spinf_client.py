"""The hosted API's own client, spinf-client 0.3.1, unmodified, against a live server on the
default model: a real uvicorn on loopback, real Redis, a real worker."""

from __future__ import annotations

import math

import pytest
from spinf_client import SpinfClient, SpinfError, answers, query, text

from ..conftest import WAIT_S
from .live import InProcessWorker, LiveServer

pytestmark = pytest.mark.slow

NEWS = "Apple sold 3.5 million iPhones in the quarter, up from 3.1 million a year before."
DIRECTION = query("dir", "\n\nDid iPhone sales go{?}", options=[" up", " down"])
UNITS = query("units", "\n\nQ: How many iPhones were sold?\nA:{n}")
COMPANY = query("co", '\n\nThe company in this news is "{*}"', top_k=3)


@pytest.fixture
def client(default_engine, settings):
    with LiveServer(settings) as server, InProcessWorker(default_engine, settings):
        # the client's default model name is the hosted "spinf-12b": an alias here too
        with SpinfClient(base_url=server.url, timeout_s=WAIT_S, tries=1) as spinf:
            yield spinf


def test_score_one_content_with_the_clients_defaults(client, default_engine):
    out = client.score(content=[text(NEWS)], queries=[DIRECTION, UNITS, COMPANY])
    assert out["object"] == "score" and out["id"].startswith("scr_")
    assert out["model"] == "spinf-12b"
    assert out["system_fingerprint"] == default_engine.fingerprint
    assert out["system_fingerprint"].startswith("fp_") and len(out["system_fingerprint"]) == 13
    (result,) = out["results"]
    assert result["input_id"] == "0"
    assert [q["id"] for q in result["queries"]] == ["dir", "units", "co"]
    options = result["queries"][0]["combinations"][0]["options"]
    assert [o["text"] for o in options] == [" up", " down"]
    assert math.isclose(sum(o["p"] for o in options), 1.0, rel_tol=1e-9)
    assert all(0 < o["floor_p"] < 1 for o in options)
    # the numbers are the engine's for the same body, sent directly
    direct = default_engine.score({"messages": [{"role": "user", "content": [text(NEWS)]}],
                                   "scoring": {"queries": [DIRECTION]}})
    assert options == direct.model_dump(mode="json")["results"][0]["queries"][0][
        "combinations"][0]["options"]
    units = answers(out, "units")
    assert units["answers"] and all("value" in a and 0 < a["p"] <= 1 for a in units["answers"])
    assert units["mass"] >= sum(a["p"] for a in units["answers"]) - 1e-12
    company = answers(out, "co")
    assert 1 <= len(company["answers"]) <= 3
    assert out["usage"]["billed_tokens"] == 0 and out["usage"]["inputs"] == 1


def test_score_many_inputs_with_their_own_queries(client):
    out = client.score(
        inputs=[{"id": "a", "content": [text(NEWS)]},
                {"id": "b", "content": [text("The bakery raised bread prices again.")],
                 "query_ids": [], "queries": [query("up", "\n\nDid prices rise?{?}",
                                                    options=[" yes", " no"])]}],
        queries=[DIRECTION], case_insensitive=False, empty_floor=False)
    a, b = out["results"]
    assert (a["input_id"], b["input_id"]) == ("a", "b")
    assert [q["id"] for q in a["queries"]] == ["dir"]
    assert [q["id"] for q in b["queries"]] == ["up"]
    combination = b["queries"][0]["combinations"][0]
    assert combination["floor_residual"] is None
    assert all(o["floor_p"] is None for o in combination["options"])
    assert out["usage"]["inputs"] == 2


def test_bad_requests_raise_the_envelopes_code(client):
    with pytest.raises(SpinfError) as bad_template:
        client.score(content=[text(NEWS)], queries=[query("x", "Q:{?} trailing", [" a"])])
    assert bad_template.value.status == 400
    assert bad_template.value.code == "invalid_template"
    with pytest.raises(SpinfError) as duplicate:
        client.score(content=[text(NEWS)], queries=[DIRECTION, DIRECTION])
    assert duplicate.value.code == "duplicate_id"
    with pytest.raises(SpinfError) as unknown:
        client.score(inputs=[{"id": "a", "content": [text(NEWS)], "query_ids": ["nope"]}],
                     queries=[DIRECTION])
    assert (unknown.value.code, unknown.value.param) == ("unknown_query_id",
                                                         "inputs.0.query_ids.0")

"""The hosted API's own client, spinf-client 0.3.1, unmodified, against a live server on the
default model: a real uvicorn on loopback, real Redis, a real worker."""

from __future__ import annotations

import math

import pytest
from spinf_client import SpinfClient, SpinfError, answers, pack, pack_result, query, text
from spinf_client.moderation import PACK_ID

from ..conftest import WAIT_S
from .live import InProcessWorker, LiveServer

pytestmark = pytest.mark.slow

NEWS = "Apple sold 3.5 million iPhones in the quarter, up from 3.1 million a year before."
DIRECTION = query("dir", "\n\nDid iPhone sales go{?}", options=[" up", " down"])
UNITS = query("units", "\n\nQ: How many iPhones were sold?\nA:{n}")
COMPANY = query("co", '\n\nThe company in this news is "{*}"', top_k=3)


# a pack of ~100 questions on a loaded 2-core machine: generous, never a speed assertion
SLOW_S = 10 * WAIT_S


@pytest.fixture
def client(default_engine, settings):
    settings = settings.model_copy(update={"sync_timeout_s": SLOW_S})
    # the client's default model name is the hosted "spinf-12b": an alias here too
    with LiveServer(settings) as server, InProcessWorker(default_engine, settings), \
            SpinfClient(base_url=server.url, timeout_s=SLOW_S, tries=1) as spinf:
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


def test_models_lists_the_served_model_and_its_aliases(client, default_engine):
    models = client.models()
    (entry,) = models["models"]
    assert entry["id"] == default_engine.model_name
    assert {"spinf-12b", "spinf-31b"} <= set(entry["aliases"])
    assert entry["status"] == "available"
    assert models["object"] == "list" and models["data"][0]["id"] == entry["id"]


def test_packs_listed_and_read(client):
    listed = client.list_packs()
    ids = {p["id"] for p in listed["packs"]}
    assert PACK_ID in ids and "sources" in listed
    pack_file = client.get_pack(PACK_ID)
    assert pack_file["pack"] == PACK_ID and set(pack_file["contexts"]) >= {"ai", "forum"}
    assert len(pack_file["categories"]) == 22
    assert client.get_pack(PACK_ID, pack_file["version"]) == pack_file
    with pytest.raises(SpinfError) as missing:
        client.get_pack("spinf/no-such-pack")
    assert (missing.value.status, missing.value.code) == (404, "unknown_pack")
    with pytest.raises(SpinfError) as old:
        client.get_pack(PACK_ID, "0.0.0-none")
    assert (old.value.status, old.value.code) == (404, "unknown_pack_version")


def test_moderate_hosted_and_from_the_pack_file(client):
    """moderate() both ways: the server runs the pack (scoring.packs) and the client runs the
    pack file's queries itself and decides with its own evaluator: the same categories."""
    texts = ["Immigrants are vermin and should be thrown out.", "Lovely weather for a picnic."]
    hosted = client.moderate(texts, context="forum", include_queries=True)
    assert [m.id for m in hosted] == ["0", "1"]
    for m in hosted:
        assert len(m.categories) == 22 and m.context == "forum"
        assert all(0 <= c.score <= 1 for c in m.categories.values())
        assert isinstance(m.unsafe, bool) and m.raw
    pack_file = client.get_pack(PACK_ID, hosted[0].version)
    local = client.moderate(texts, context="forum", pack_file=pack_file)
    for h, own in zip(hosted, local, strict=True):
        assert own.unsafe == h.unsafe
        for name, category in h.categories.items():
            assert own.categories[name].score == pytest.approx(category.score, abs=2e-6)
        # re-deciding the stored raw answers locally gives the server's decision
        again = h.redecide(pack_file)
        assert again.unsafe == h.unsafe
        assert {c: v.score for c, v in again.categories.items()} == pytest.approx(
            {c: v.score for c, v in h.categories.items()}, abs=2e-6)


def test_a_pack_next_to_the_callers_queries(client):
    out = client.score(content=[text(NEWS)], queries=[DIRECTION],
                       packs=[pack(PACK_ID, mode="max", threshold=0.9)])
    (result,) = out["results"]
    assert [q["id"] for q in result["queries"]] == ["dir"]   # the pack's raw queries hidden
    found = pack_result(out)
    assert found["decision"]["mode"] == "max" and len(found["categories"]) == 22
    alone = client.score(content=[text(NEWS)], packs=[pack(PACK_ID, mode="max", threshold=0.9)])
    # the pack's answers do not depend on the caller's queries
    assert pack_result(alone) == found
    with pytest.raises(SpinfError) as unknown:
        client.score(content=[text(NEWS)], packs=[pack("spinf/no-such-pack")])
    assert unknown.value.code == "unknown_pack"

"""Prompt packs in the hosted format: loading (precise errors), contexts, decision overrides,
and the evaluator against spinf-client's own (an independent implementation of the same
semantics) for every official pack and a pack that uses every feature of the format."""

from __future__ import annotations

import copy
import json
import math
import random

import pytest
from spinf_client import packs as client

from spinf_worker.calibrate import encode_weights
from spinf_worker.errors import InvalidRequestError
from spinf_worker.packs import (
    LOCK_WARNING,
    PackError,
    find_pack,
    load_pack,
    load_packs,
    lock_of,
    official_packs,
    pack_from_data,
)

YES_NO = [" Yes", " No"]


def _with_lock(raw: dict) -> dict:
    raw["decision"]["micro_layer"]["lock"] = lock_of(raw)
    return raw


def feature_pack() -> dict:
    """Parameters, two contexts, F combinations (a list and "all"), every read kind, views,
    requires, decides false, percentiles, a hidden micro-layer over c: and r: inputs."""
    raw = {
        "pack": "acme/features", "version": "1.2.0", "model": "google/gemma-3-270m",
        "answers": "logprob",
        "parameters": {"brand": {"label": "Brand"},
                       "site": {"label": "Site", "required": False}},
        "contexts": {"post": "On {site}, about {brand}:\n\n{X}", "plain": "{X}\n(end)"},
        "scoring": {"queries": [
            {"id": "yes", "template": "\n\nQuestion: Is it {F}?\nAnswer:{?}", "options": YES_NO,
             "combinations": [{"F": "rude"}, {"F": "cruel"}, {"F": "kind"}]},
            {"id": "kind", "template": "\n\nWhich kind?{?}",
             "options": [" none", " rude", " cruel", " odd"], "empty_floor": False},
            {"id": "grid", "template": "\n\n{F} or not?{?}", "options": [" no", " yes"],
             "combinations": "all", "values": {"F": ["Spam", "Scam"]}},
        ], "empty_floor": True, "case_insensitive": True},
        "reads": [
            {"id": "rude", "query": "yes", "F": "rude", "kind": "pair", "mean": -1.0, "sd": 1.5,
             "category": "abuse", "view": "direct"},
            {"id": "cruel", "query": "yes", "F": "cruel", "kind": "pair", "mean": -2.0,
             "sd": 1.0, "category": "abuse", "view": "direct"},
            {"id": "not_kind", "query": "yes", "F": "kind", "kind": "pair", "sign": -1,
             "mean": 0.5, "sd": 2.0, "category": "abuse", "view": "tone"},
            {"id": "kind_any", "query": "kind", "kind": "any", "mu": [-0.2, -2.0, -3.0, -2.5],
             "mean": 0.1, "sd": 0.8, "category": "abuse", "view": "tone"},
            {"id": "kind_set", "query": "kind", "kind": "set", "unsafe": [1, 2],
             "mu": [-0.2, -2.0, -3.0, -2.5], "mean": -0.3, "sd": 1.1, "category": "cruelty"},
            {"id": "kind_odd", "query": "kind", "kind": "option", "option": 3, "mu": -2.5,
             "mean": 0.0, "sd": 1.0, "category": "odd"},
            {"id": "spam", "query": "grid", "F": "Spam", "kind": "pair", "sign": -1,
             "mean": -1.0, "sd": 1.0, "category": "spam"},
            {"id": "scam", "query": "grid", "F": "Scam", "kind": "pair", "sign": -1,
             "mean": -1.5, "sd": 1.2, "category": "spam"},
        ],
        "categories": {
            "abuse": {"label": "Abuse", "platt": [1.3, -2.0], "threshold": 0.4,
                      "aggregate": "views",
                      "normal_quantiles": {"levels": [0.0, 0.5, 0.9, 1.0],
                                           "values": [0.01, 0.1, 0.3, 0.9]}},
            "cruelty": {"platt": [0.9, -1.0], "threshold": 0.5, "requires": ["abuse"]},
            "odd": {"platt": [1.0, -1.5], "threshold": 0.3, "decides": False},
            "spam": {"platt": [1.1, -0.5], "threshold": None},
        },
        "decision": {
            "mode": "micro_layer", "fallback": "max", "max": {"threshold": 0.6},
            "critical": ["cruelty"],
            "micro_layer": {"inputs": ["c:abuse", "c:cruelty", "r:kind_odd"], "hidden": 2,
                            "weights": encode_weights([0.5, -0.3, 1.1, 0.2, -0.4, 0.8,
                                                       0.1, -0.1, 1.5, -0.7, 0.2, 0.3]),
                            "lock": ""}},
    }
    return _with_lock(raw)


def linear_pack() -> dict:
    """A linear micro-layer, the API's p as answers, per_category fallback."""
    raw = feature_pack()
    raw["answers"] = "p"
    raw["decision"]["fallback"] = "per_category"
    del raw["decision"]["max"]
    raw["decision"]["micro_layer"].update(
        inputs=["c:abuse", "r:spam"], hidden=0, weights=encode_weights([0.7, 0.4, -0.2, 0.1]))
    return _with_lock(raw)


def random_result(raw: dict, rng: random.Random) -> list[dict]:
    """One input's result queries in the hosted shape, for the pack's queries (and one of
    the caller's own, which the pack must ignore)."""
    out = [{"id": "callers_own", "combinations": [{"values": {}, "options": [
        {"text": " a", "logprob": -0.1, "p": 0.9, "floor_p": None}], "residual": 0.1,
        "floor_residual": None}]}]
    for q in raw["scoring"]["queries"]:
        combos = q.get("combinations")
        values = [{"F": v} for v in q["values"]["F"]] if combos == "all" else combos or [{}]
        combinations = []
        for value in values:
            # sometimes near-certain answers: the clips and the 6-decimal p grid matter there
            spread = rng.choice([1.0, 3.0, 12.0])
            logits = [rng.gauss(0.0, spread) for _ in q["options"]]
            residual = rng.uniform(0.0, 0.2)
            top = max(logits)
            total = sum(math.exp(x - top) for x in logits)
            logprobs = [x - top - math.log(total) + math.log(1 - residual) for x in logits]
            combinations.append({"values": value, "options": [
                {"text": text, "logprob": lp, "p": round(math.exp(lp), 6),
                 "floor_p": round(rng.random(), 6)}
                for text, lp in zip(q["options"], logprobs, strict=True)],
                "residual": round(residual, 6), "floor_residual": 0.05})
        out.append({"id": q["id"], "combinations": combinations})
    return out


def rounded(value):
    """The client's output as the API returns it: floats at 6 decimals."""
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def oracle(raw: dict, queries: list[dict], decision: dict | None) -> dict:
    d = decision or {}
    out = client.evaluate(raw, client.answers_from_result(queries, raw), d.get("mode"),
                          d.get("threshold"), d.get("thresholds"), d.get("critical"))
    return rounded(out)


def overrides(pack) -> list[dict | None]:
    """Decision overrides a call may send: every mode, thresholds, critical lists."""
    cats = list(pack.file.categories)
    first, last = cats[0], cats[-1]
    out: list[dict | None] = [None, {}, {"critical": []}, {"critical": [last, first]},
                              {"thresholds": {first: 0.0}}, {"thresholds": {first: None}},
                              {"thresholds": {c: 0.05 for c in cats}, "critical": cats}]
    for mode in ("max", "per_category", "micro_layer"):
        out.append({"mode": mode})
        out.append({"mode": mode, "thresholds": {last: 0.2}, "critical": [first]})
    out += [{"mode": "max", "threshold": 0.0}, {"mode": "max", "threshold": 1.0},
            {"mode": "micro_layer", "threshold": -0.5}, {"mode": "micro_layer", "threshold": 3}]
    return [d for d in out if _allowed(pack, d)]


def _allowed(pack, decision: dict | None) -> bool:
    try:
        pack.check_decision(decision, "decision")
    except InvalidRequestError:
        return False
    return True


def _official() -> list:
    return [p for versions in official_packs().values() for p in versions.values()]


@pytest.mark.parametrize("pack", _official(), ids=lambda p: p.group)
def test_official_packs_decide_as_the_client(pack):
    rng = random.Random(pack.group)
    for _ in range(25):
        queries = random_result(pack.raw, rng)
        for decision in overrides(pack):
            assert pack.evaluate(queries, decision) == oracle(pack.raw, queries, decision), \
                decision


@pytest.mark.parametrize("make", [feature_pack, linear_pack])
def test_every_feature_decides_as_the_client(make):
    pack = pack_from_data(make())
    assert pack.lock_ok
    rng = random.Random(make.__name__)
    seen_modes, seen_by, flagged_views = set(), set(), 0
    for _ in range(200):
        queries = random_result(pack.raw, rng)
        for decision in overrides(pack):
            mine = pack.evaluate(queries, decision)
            assert mine == oracle(pack.raw, queries, decision), decision
            seen_modes.add(mine["decision"]["mode"])
            seen_by.add(mine["decision"].get("by"))
            flagged_views += bool(mine["categories"]["abuse"]["flagged"])
    assert seen_modes == set(pack.modes) and "critical" in seen_by and flagged_views


def test_an_edited_pack_falls_back_as_the_client():
    raw = feature_pack()
    raw["scoring"]["queries"][1]["template"] = "\n\nWhich kind is it?{?}"   # lock now stale
    pack = pack_from_data(raw)
    assert not pack.lock_ok
    rng = random.Random(7)
    for _ in range(50):
        queries = random_result(raw, rng)
        for decision in (None, {"mode": "micro_layer", "threshold": 0.1},
                         {"thresholds": {"abuse": 0.1}}):
            mine = pack.evaluate(queries, decision)
            assert mine == oracle(raw, queries, decision)
            assert mine["decision"]["mode"] == "max"
            assert mine["decision"]["warning"] == LOCK_WARNING
            assert mine["decision"]["threshold"] == 0.6   # the call's cut was for micro_layer
    # thresholds and the critical list are outside the lock: editing them keeps it
    raw = feature_pack()
    raw["categories"]["abuse"]["threshold"] = 0.9
    raw["decision"]["critical"] = []
    assert pack_from_data(raw).lock_ok


def test_answers_from_logprobs_or_p():
    raw = linear_pack()
    queries = random_result(raw, random.Random(1))
    by_p = pack_from_data(raw)
    by_logprob = pack_from_data({**raw, "answers": "logprob"})
    key = ("kind", None)
    options = next(q for q in queries if q["id"] == "kind")["combinations"][0]["options"]
    assert by_p.answers(queries)[key] == [o["p"] for o in options]
    total = sum(math.exp(o["logprob"]) for o in options)
    assert by_logprob.answers(queries)[key] == pytest.approx(
        [math.exp(o["logprob"]) / total for o in options], rel=1e-12)
    assert ("callers_own", None) not in by_p.answers(queries)
    assert by_p.answers(queries)[("grid", "Scam")]
    with pytest.raises(ValueError, match="no result for query"):
        by_p.evaluate([q for q in queries if q["id"] != "grid"], None)


def test_a_hand_computed_read_and_score():
    raw = linear_pack()
    pack = pack_from_data(raw)
    queries = random_result(raw, random.Random(3))
    p = {(q["id"], c["values"].get("F")): [o["p"] for o in c["options"]]
         for q in queries for c in q["combinations"]}
    spam_p, scam_p = p[("grid", "Spam")], p[("grid", "Scam")]

    def no_share(ps):   # sign -1: the logit of the second option's share
        a, b = max(ps[0], 1e-9), max(ps[1], 1e-9)
        share = min(max(a / (a + b), 1e-6), 1 - 1e-6)
        return -math.log(share / (1 - share))

    macro = ((no_share(spam_p) + 1.0) / 1.0 + (no_share(scam_p) + 1.5) / 1.2) / 2
    score = 1 / (1 + math.exp(-(1.1 * macro - 0.5)))
    got = pack.evaluate(queries, None)["categories"]["spam"]
    assert got == {"score": round(score, 6), "percentile": None, "flagged": None}


# ---- loading ---------------------------------------------------------------------------------


def test_official_packs_load():
    packs = official_packs()
    assert set(packs) == {"spinf/moderation", "spinf/brand-safety", "spinf/news-signals",
                          "spinf/product-listings", "spinf/reviews", "spinf/support-triage"}
    moderation = find_pack(packs, "spinf/moderation")
    assert list(moderation.contexts) == ["ai", "forum"]
    cats = moderation.file.categories
    assert len(cats) == 22
    assert {"sexual", "child", "violence", "selfharm", "hate", "harassment", "extremism",
            "weapons", "drugs", "crime", "fraud", "hacking", "privacy", "spam", "profanity",
            "gore", "gibberish", "general"} < set(cats)
    assert moderation.file.decision.critical == ["selfharm", "child"]
    for pack in _official():
        assert pack.source == "official"
        assert pack.file.decision.micro_layer is None or pack.lock_ok, pack.group
        assert pack.file.description


def write(tmp_path, raw, name="p.json"):
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize(("edit", "field", "reason"), [
    (lambda r: r.pop("model"), "model", "Field required"),
    (lambda r: r.update(pack="Acme"), "pack", "should match pattern"),
    (lambda r: r["contexts"].update(post="no slot"), "contexts.post", "exactly one {X}"),
    (lambda r: r["contexts"].update(post="{X} {who}"), "contexts.post",
     "{who} is not a parameter"),
    (lambda r: r["scoring"]["queries"][1].update(template="Which?{?} then"),
     "scoring.queries.1.template", "one {?}, at its end"),
    (lambda r: r["scoring"]["queries"][1].update(options=[" a", " a"]),
     "scoring.queries.1.options", "options repeat"),
    (lambda r: r["scoring"]["queries"][1].update(group="x"), "scoring.queries.1.group",
     "Extra inputs are not permitted"),
    (lambda r: r["scoring"]["queries"][0].update(combinations=[{"G": "x"}]),
     "scoring.queries.0.combinations", "each names exactly ['F']"),
    (lambda r: r["reads"][0].update(F="mean"), "reads.0.F", "not a value of F"),
    (lambda r: r["reads"][0].update(query="nope"), "reads.0.query", "not in scoring.queries"),
    (lambda r: r["reads"][0].update(category="nope"), "reads.0.category", "not a category"),
    (lambda r: r["reads"][0].update(sd=0), "reads.0.sd", "greater than 0"),
    (lambda r: r["reads"][3].update(mu=[0.0]), "reads.3.mu", "one number per option (4)"),
    (lambda r: r["reads"][4].update(unsafe=[0, 1, 2, 3]), "reads.4.unsafe", "not all"),
    (lambda r: r["reads"][5].update(option=9), "reads.5.option", "below 4"),
    (lambda r: r["reads"][0].update(kind="pair", query="kind", F=None), "reads.0.kind",
     "two options"),
    (lambda r: r["categories"]["abuse"].update(threshold=1.5), "categories.abuse.threshold",
     "less than or equal to 1"),
    (lambda r: r["categories"]["abuse"].update(requires=["abuse"]),
     "categories.abuse.requires", "not another category"),
    (lambda r: r["categories"].update(lonely={"platt": [1, 0]}), "categories.lonely",
     "no read feeds it"),
    (lambda r: r["categories"]["spam"].pop("platt"), "categories.spam.platt", "[a, b]"),
    (lambda r: r["decision"].update(mode="vote"), "decision.mode", "Input should be"),
    (lambda r: r["decision"].update(critical=["nope"]), "decision.critical.0",
     "not a category"),
    (lambda r: r["decision"].pop("max"), "decision.max", "needed by mode or fallback max"),
    (lambda r: r["decision"]["micro_layer"].update(inputs=["c:abuse", "x:y"]),
     "decision.micro_layer.inputs.1", "not c:<category> or r:<read id>"),
    (lambda r: r["decision"]["micro_layer"].update(weights=encode_weights([1.0])),
     "decision.micro_layer.weights", "1 floats for 3 inputs and 2 hidden units (12 expected)"),
    (lambda r: r["decision"]["micro_layer"].update(lock="md5:1"), "decision.micro_layer.lock",
     "should match pattern"),
])
def test_load_errors_name_the_file_the_field_and_the_reason(tmp_path, edit, field, reason):
    raw = feature_pack()
    edit(raw)
    path = write(tmp_path, raw)
    with pytest.raises(PackError) as err:
        load_pack(path)
    assert str(err.value).startswith(f"{path}: ")
    assert any(p.startswith(f"{field}: ") and reason in p for p in err.value.problems), \
        err.value.problems


def test_unreadable_files_and_drafts(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(PackError, match=r"bad.json: \(file\): cannot read the pack"):
        load_pack(path)
    with pytest.raises(PackError, match="a pack file is a JSON object"):
        pack_from_data([1, 2])
    draft = feature_pack()
    for read in draft["reads"]:
        read.pop("mean"), read.pop("sd"), read.pop("mu", None)
    for spec in draft["categories"].values():
        spec.pop("platt")
    del draft["decision"]["micro_layer"]
    with pytest.raises(PackError, match="mean and sd are needed"):
        pack_from_data(draft)
    pack = pack_from_data(draft, draft=True)   # a pack before calibrate: its request side
    assert pack.queries() and not pack.lock_ok
    with pytest.raises(ValueError, match="is a draft"):
        pack.evaluate(random_result(draft, random.Random(0)), None)


def test_a_folder_of_packs_by_id_and_version(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path, feature_pack(), "a.json")
    write(tmp_path / "sub", {**feature_pack(), "version": "1.10.0"}, "b.json")
    write(tmp_path, {"not": "a pack"}, "sample.json")    # other JSON is left alone
    packs = load_packs(tmp_path)
    assert list(packs) == ["acme/features"]
    assert list(packs["acme/features"]) == ["1.10.0", "1.2.0"]     # newest first
    assert find_pack(packs, "acme/features").version == "1.10.0"
    assert find_pack(packs, "acme/features", "1.2.0").version == "1.2.0"
    write(tmp_path, feature_pack(), "again.json")
    with pytest.raises(PackError, match="acme/features@1.2.0 also comes from"):
        load_packs(tmp_path)


def test_find_pack_errors():
    packs = official_packs()
    with pytest.raises(InvalidRequestError) as err:
        find_pack(packs, "acme/nope", param="scoring.packs.0.id")
    assert (err.value.code, err.value.param) == ("unknown_pack", "scoring.packs.0.id")
    with pytest.raises(InvalidRequestError) as err:
        find_pack(packs, "spinf/moderation", "9.9.9", param="scoring.packs.0.id")
    assert (err.value.code, err.value.param) == ("unknown_pack_version",
                                                 "scoring.packs.0.version")
    assert "versions: " in err.value.message


# ---- the request side ------------------------------------------------------------------------


def test_queries_run_in_the_packs_group_with_its_floor():
    pack = pack_from_data(feature_pack())
    assert pack.group == "acme/features@1.2.0" and pack.case_insensitive is True
    queries = pack.queries()
    assert [q["id"] for q in queries] == ["yes", "kind", "grid"]
    assert all(q["group"] == pack.group for q in queries)
    assert [q["empty_floor"] for q in queries] == [True, False, True]   # a query's own wins
    assert queries == client.request_scoring(pack.raw)["queries"]
    assert pack.prompts() == 3 + 1 + 2


def test_wrap_fills_contexts_and_parameters():
    raw = feature_pack()
    pack = pack_from_data(raw)
    assert pack.wrap(None, {"brand": "Kestrel", "site": "a forum"}) == (
        "On a forum, about Kestrel:\n\n", "")
    assert pack.wrap("plain", {"brand": 3}) == ("", "\n(end)")
    parts = client.wrap(raw, "TEXT", "post", {"brand": "K"})
    assert pack.wrap("post", {"brand": "K"}) == (parts[0]["text"], "")
    for context, params, param, says in [
            ("chat", {"brand": "K"}, "scoring.packs.0.context", "one of post, plain"),
            ("post", {}, "inputs.0.parameters", "needs the parameter 'brand'"),
            ("post", {"brand": "K", "extra": 1}, "inputs.0.parameters", "no parameter 'extra'")]:
        with pytest.raises(InvalidRequestError) as err:
            pack.wrap(context, params, context_param="scoring.packs.0.context",
                      parameters_param="inputs.0.parameters")
        assert (err.value.code, err.value.param) == ("invalid_field", param)
        assert says in err.value.message


@pytest.mark.parametrize(("decision", "code", "param"), [
    ([], "invalid_field", "d"),
    ({"mode": "vote"}, "invalid_field", "d.mode"),
    ({"why": 1}, "invalid_field", "d.why"),
    ({"mode": "per_category", "threshold": 0.5}, "invalid_field", "d.threshold"),
    ({"mode": "max", "threshold": 1.5}, "invalid_field", "d.threshold"),
    ({"threshold": "high"}, "invalid_field", "d.threshold"),
    ({"thresholds": {"nope": 0.5}}, "unknown_category", "d.thresholds.nope"),
    ({"thresholds": {"abuse": 2}}, "invalid_field", "d.thresholds.abuse"),
    ({"thresholds": [0.5]}, "invalid_field", "d.thresholds"),
    ({"critical": "abuse"}, "invalid_field", "d.critical"),
    ({"critical": ["abuse", "nope"]}, "unknown_category", "d.critical.1"),
])
def test_check_decision_codes(decision, code, param):
    pack = pack_from_data(feature_pack())
    with pytest.raises(InvalidRequestError) as err:
        pack.check_decision(decision, "d")
    assert (err.value.code, err.value.param) == (code, param)


def test_check_decision_accepts_what_the_api_accepts():
    pack = pack_from_data(feature_pack())
    for decision in (None, {}, {"mode": "max", "threshold": 0.2},
                     {"threshold": -4.0},          # the pack's mode: micro_layer, unbounded
                     {"thresholds": {"abuse": None, "spam": 0.1}, "critical": []}):
        pack.check_decision(decision, "d")
    linear = pack_from_data(linear_pack())
    with pytest.raises(InvalidRequestError):      # no max block: no max mode
        linear.check_decision({"mode": "max"}, "d")


def test_summary_is_the_listing_entry():
    pack = pack_from_data(feature_pack(), source="local:/srv/packs")
    s = pack.summary(["1.2.0", "1.0.0"])
    assert s["id"] == "acme/features" and s["versions"] == ["1.2.0", "1.0.0"]
    assert s["status"] == "available" and s["model"] == "google/gemma-3-270m"
    assert s["contexts"][0] == {"id": "post", "template": "On {site}, about {brand}:\n\n{X}"}
    assert s["categories"][0] == {"id": "abuse", "label": "Abuse", "threshold": 0.4}
    assert s["decision"] == {"mode": "micro_layer", "modes": ["max", "per_category",
                                                              "micro_layer"],
                             "fallback": "max", "max_threshold": 0.6, "critical": ["cruelty"]}
    assert s["parameters"][1] == {"id": "site", "label": "Site", "required": False}
    assert s["source"] == "local:/srv/packs" and s["queries"] == 3 and s["prompts"] == 6
    assert pack.summary()["versions"] == ["1.2.0"]
    json.dumps(s)


def test_raw_is_the_file_as_loaded(tmp_path):
    raw = feature_pack()
    raw["listing"] = {"tags": ["demo"]}        # unknown top-level fields are kept
    pack = load_pack(write(tmp_path, raw))
    assert pack.raw == raw
    assert copy.deepcopy(pack.raw) == json.loads(json.dumps(raw))


# ---- over HTTP -------------------------------------------------------------------------------


def test_packs_routes_through_the_official_client(tmp_path):
    """GET /v1/packs and /v1/packs/{id} on the real app (uvicorn, Redis), read with
    spinf-client: its list_packs() / get_pack(), then its own evaluator on the file."""
    import uuid

    import redis
    from spinf_client import SpinfClient, SpinfError

    from spinf_worker.queue.settings import ServiceSettings

    from .conftest import WAIT_S
    from .service.live import LiveServer

    url = "redis://127.0.0.1:6379/0"
    try:
        redis.Redis.from_url(url).ping()
    except redis.ConnectionError as err:
        pytest.fail(f"this test needs Redis at {url}: {err}")
    write(tmp_path, feature_pack(), "a.json")
    write(tmp_path, {**feature_pack(), "version": "1.3.0"}, "b.json")
    settings = ServiceSettings(redis_url=url, prefix=f"spinf-test-{uuid.uuid4().hex[:10]}",
                               packs=[str(tmp_path)])
    with LiveServer(settings) as server:
        api = SpinfClient(base_url=server.url, timeout_s=WAIT_S, tries=1)
        listing = api.list_packs()
        assert listing["sources"] == ["official", str(tmp_path)]
        by_id = {p["id"]: p for p in listing["packs"]}
        assert by_id["acme/features"]["versions"] == ["1.3.0", "1.2.0"]
        assert by_id["acme/features"]["version"] == "1.3.0"
        assert by_id["spinf/moderation"]["source"] == "official"
        assert len(by_id["spinf/moderation"]["categories"]) == 22

        assert api.get_pack("acme/features")["version"] == "1.3.0"
        older = api.get_pack("acme/features", "1.2.0")
        assert older == feature_pack()
        moderation = api.get_pack()          # the client's default: spinf/moderation
        queries = random_result(moderation, random.Random(0))
        mine = find_pack(official_packs(), "spinf/moderation").evaluate(queries, None)
        assert oracle(moderation, queries, None) == mine

        for args, code, param in [(("acme/nope",), "unknown_pack", "id"),
                                  (("acme/features", "9"), "unknown_pack_version", "version")]:
            with pytest.raises(SpinfError) as err:
                api.get_pack(*args)
            assert (err.value.status, err.value.code, err.value.param) == (404, code, param)

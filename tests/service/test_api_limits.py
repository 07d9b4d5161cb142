"""Every limit the worker enforces is checked by the API first: a request over one is answered
4xx with the worker's code, in the hosted envelope, and nothing is queued; a request at
exactly the limit is queued and scored. A real uvicorn, real Redis, the tiny model's worker
(whose registration names the model; the API reads its tokenizer.json).

The tiny tokenizer writes each digit as one token and " " as one: " 1234" is 5 tokens,
"7" * n is n tokens, " a" * n is n tokens (tests/conftest.py)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis as redis_sync

from spinf_worker.queue.keys import Keys

from ..conftest import WAIT_S
from .live import InProcessWorker, LiveServer, stream_length, wait_for
from .test_api import assert_error, entries_added

YES_NO = [" yes", " no"]
CONTEXT = 4096   # the tiny model's max_position_embeddings
MODERATION = "spinf/moderation"


def query(template="\nQ:{?}", options=YES_NO, **fields):
    return {"id": "q", "template": template, "options": options, **fields}


def body(*queries, text="Some content.", **extra):
    return {"text": text, "scoring": {"queries": list(queries) or [query()]}, **extra}


# (request, status, code, param, a fragment of the message)
OVER = [
    # the fault: one option of ~1,250 tokens in a 10 KB request
    (body(query(options=[" yes", " " + "1234567890" * 125]), text="x" * 8000),
     400, "option_too_long", "scoring.queries.0.options.1", "is 1251 tokens"),
    (body(query(options=[" 12345", " no"])), 400, "option_too_long",
     "scoring.queries.0.options.0", "is 6 tokens; options are 1-5"),
    (body(query(options=[" 123"]), limits={"max_option_tokens": 3}), 400, "option_too_long",
     "scoring.queries.0.options.0", "options are 1-3"),
    (body(query(template="7" * 257 + "{?}")), 400, "template_too_long",
     "scoring.queries.0.template", "257 tokens; the limit is 256"),
    (body(query(template="{x}{?}", combinations=[{"x": "7"}, {"x": "7" * 200}]),
          limits={"max_query_tokens": 100}),
     400, "template_too_long", "scoring.queries.0.combinations.1", "200 tokens"),
    ({"inputs": [{"id": "a", "messages": [{"content": "x"}]},
                 {"id": "b", "messages": [{"content": "x"}],
                  "queries": [query(id="own", options=[" 123456"])]}],
      "scoring": {"queries": [query()]}},
     400, "option_too_long", "inputs.1.queries.0.options.0", "7 tokens"),
    (body(query(template="\nAnswer: {?}", options=["yes", "no"])), 400, "option_boundary",
     "scoring.queries.0.options.0", "merges with the end of the template"),
    (body(text=" a" * 4097), 400, "content_too_long", "messages",
     "content is 4,097 tokens; the limit is 4,096"),
    ({"inputs": [{"id": "short", "messages": [{"content": " a" * 50}]},
                 {"id": "long", "messages": [{"content": " a" * 51}]}],
      "scoring": {"queries": [query()]}, "limits": {"max_content_tokens": 50}},
     400, "content_too_long", "inputs.1", "'long': content is 51 tokens; the limit is 50"),
    # within the content limit, past the model's context with the question ("\nQ:" is 3)
    (body(text=" a" * 4093), 400, "content_too_long", "messages",
     f"the model's context is {CONTEXT} tokens"),
    (body(limits={"max_processed_tokens": 10}), 413, "request_too_large", "inputs",
     "over 10 processed tokens"),
    # counts and grids the protocol checks (as before)
    (body(*[{"id": f"x{i}", "template": "\nA:{*}", "max_tokens": 1} for i in range(11)]),
     400, "too_many_extractions", "scoring.queries", "11 extraction slots"),
    (body(query(), query(id="r"), query(id="s"), limits={"max_prompts_per_input": 2}),
     400, "too_many_prompts", "scoring.queries", "3 prompts"),
    (body(query(template="{a}{b}{?}", combinations="all",
                values={"a": [str(i) for i in range(77)], "b": [str(i) for i in range(13)]})),
     400, "too_many_combinations", "scoring.queries.0.combinations", "1,001 combinations"),
    # packs: the worker's own checks of a call's packs
    ({**body(), "scoring": {"queries": [query()], "packs": [{"id": "spinf/nope"}]}},
     400, "unknown_pack", "scoring.packs.0.id", None),
    ({**body(), "scoring": {"queries": [query(group=f"{MODERATION}@0.2.0")],
                            "packs": [{"id": MODERATION}]}},
     400, "reserved_group", "inputs.0.queries", "query group of a pack"),
    ({**body(), "scoring": {"queries": [query()], "case_insensitive": True,
                            "packs": [{"id": MODERATION}]}},
     400, "pack_conflict", "scoring.case_insensitive", "differs from the packs'"),
]


def _ids(case) -> str:
    return f"{case[2]}-{case[3]}"


@pytest.fixture
def served(tiny_engine, settings):
    """(an httpx client on /v1, the settings) with the tiny model's worker registered."""
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings), \
            httpx.Client(base_url=server.v1, timeout=WAIT_S) as client:
        yield client, settings


def _streams_empty(settings) -> None:
    assert entries_added(settings) == 0
    assert stream_length(settings) == 0


@pytest.mark.parametrize("request_body, status, code, param, fragment", OVER,
                         ids=[_ids(c) for c in OVER])
def test_over_a_limit_is_refused_at_the_api_and_nothing_is_queued(
        served, request_body, status, code, param, fragment):
    client, settings = served
    for route, headers in (("/score", {}), ("/score", {"Prefer": "respond-async"}),
                           ("/jobs", {}), ("/chat/completions", {})):
        error = assert_error(client.post(route, json=request_body, headers=headers),
                             status, code, param)
        if fragment is not None:
            assert fragment in error["message"], error
    _streams_empty(settings)


def test_requests_at_each_limit_are_queued_and_scored(served):
    """Exactly at each limit the API queues the request and the worker scores it (the API
    never refuses what the worker accepts)."""
    client, settings = served
    extractions = [{"id": f"x{i}", "template": f"\nA{i}:{{*}}", "max_tokens": 1}
                   for i in range(10)]
    grid = query(template="{a}{b}{?}", combinations="all",
                 values={"a": [str(i) for i in range(40)], "b": [str(i) for i in range(25)]})
    at_limit = [
        body(query(options=[" 1234", " no"])),                      # 5 tokens
        body(query(options=[" 12"]), limits={"max_option_tokens": 3}),
        body(query(template="7" * 256 + "{?}")),                    # 256 tokens
        body(query(template="{x}{?}", combinations=[{"x": "7"}, {"x": "7" * 100}]),
             limits={"max_query_tokens": 100}),
        body(text=" a" * 50, limits={"max_content_tokens": 50}),
        body(text=" a" * 4092),                     # 4,092 + "\nQ:" ends at position 4,095
        body(*extractions),                                         # 10 extraction slots
        body(query(), query(id="r"), limits={"max_prompts_per_input": 2}),
        body(grid),                                                 # 1,000 combinations
        {**body(), "scoring": {"queries": [query()], "packs": [{"id": MODERATION}]}},
    ]
    for n, request_body in enumerate(at_limit, 1):
        response = client.post("/score", json=request_body)
        assert response.status_code == 200, (n, response.text)
        assert entries_added(settings) == n

    # processed tokens: exactly the request's is accepted, one fewer is 413
    processed = client.post("/score", json=body()).json()["usage"]["processed_tokens"]
    fine = client.post("/score", json=body(limits={"max_processed_tokens": processed}))
    assert fine.status_code == 200, fine.text
    queued = entries_added(settings)
    assert_error(client.post("/score", json=body(limits={"max_processed_tokens":
                                                          processed - 1})),
                 413, "request_too_large", "inputs")
    assert entries_added(settings) == queued


def _register(settings, model: str) -> None:
    """A worker registration (no worker reads the streams: what is queued stays)."""
    client = redis_sync.Redis.from_url(settings.redis_url)
    try:
        client.hset(Keys(settings.prefix).workers, "registered-only", json.dumps({
            "model": model, "heartbeat_ms": int(time.time() * 1000), "status": "available"}))
    finally:
        client.close()


def test_with_the_tokenizer_but_no_worker_reading_nothing_is_queued(tiny_dir, settings):
    """The registration alone tells the API the model; an over-long option is refused and
    the streams stay empty, while a good request waits there."""
    _register(settings, str(tiny_dir))
    with LiveServer(settings) as server:
        over = body(query(options=[" " + "1234567890" * 125]), text="x" * 8000)
        assert_error(httpx.post(f"{server.v1}/score", json=over, timeout=WAIT_S,
                                headers={"Prefer": "respond-async"}),
                     400, "option_too_long", "scoring.queries.0.options.0")
        _streams_empty(settings)
        good = httpx.post(f"{server.v1}/score", json=body(), timeout=WAIT_S,
                          headers={"Prefer": "respond-async"})
        assert good.status_code == 202, good.text
        assert stream_length(settings) == 1


def test_the_served_models_tokenizer_is_loaded_before_any_request(tiny_dir, settings):
    """A starting API loads the tokenizer of the model its workers serve on its own, so the
    first request to each API process does not wait for it; one that starts before any
    worker has registered loads it once one has."""
    with LiveServer(settings) as server:
        tokenizers = server.app.state.services.tokenizers
        assert tokenizers.loaded(str(tiny_dir)) is None
        _register(settings, str(tiny_dir))
        served = wait_for(lambda: tokenizers.loaded(str(tiny_dir)),
                          what="the tokenizer to be loaded")
        assert len(served.encode(" 1234")) == 5


def test_without_the_tokenizer_the_token_limits_are_the_workers(tiny_engine, settings):
    """A model whose tokenizer is not on the API's machine: what needs no tokenizer is still
    refused at the API; token limits are left to the worker, which refuses the job (its
    error is the same), and nothing is refused that a worker would score."""
    _register(settings, "someone/not-on-this-machine")
    with LiveServer(settings) as server, httpx.Client(base_url=server.v1,
                                                        timeout=WAIT_S) as client:
        unknown_pack = {**body(), "scoring": {"queries": [query()],
                                              "packs": [{"id": "spinf/nope"}]}}
        assert_error(client.post("/jobs", json=unknown_pack), 400, "unknown_pack")
        _streams_empty(settings)
        over = body(query(options=[" 12345"]))
        accepted = client.post("/jobs", json=over)
        assert accepted.status_code == 202, accepted.text
        assert stream_length(settings) == 1
        with InProcessWorker(tiny_engine, settings):
            job = wait_for(lambda: (lambda j: j if j["status"] == "failed" else None)(
                client.get(f"/jobs/{accepted.json()['id']}").json()), what="the job to fail")
            # a call waiting for its result gets the worker's refusal, in the envelope
            assert_error(client.post("/score", json=over), 400, "option_too_long",
                         "scoring.queries.0.options.0")
        assert job["status_code"] == 400
        assert (job["error"]["code"], job["error"]["param"]) == (
            "option_too_long", "scoring.queries.0.options.0")
        assert entries_added(settings) == 2


def test_a_request_over_the_pass_budget_is_scored_in_a_pass_of_its_own(tiny_engine, settings):
    """A document over the worker's pass budget is never packed with others: it waits at
    the head of the queue with three small requests, and is scored alone, the small ones
    together in the next pass (Worker._dispatch; the engine's packer does the same within a
    batch: tests/test_request_limits.py)."""
    settings = settings.model_copy(update={"max_pass_tokens": 512})
    big = body(text=" a" * 600)                        # 601 + 3 rows: 640 padded, over 512
    small = [body(text=f"Small {i}.") for i in range(3)]   # 128 rows each: all three fit
    with LiveServer(settings) as server, httpx.Client(base_url=server.v1,
                                                        timeout=WAIT_S) as client:
        ids = []
        for request_body in (big, *small):
            response = client.post("/jobs", json=request_body)
            assert response.status_code == 202, response.text
            ids.append(response.json()["id"])
        with InProcessWorker(tiny_engine, settings):
            for job_id in ids:
                wait_for(lambda job_id=job_id: client.get(f"/jobs/{job_id}").json()["status"]
                         == "succeeded", what="the jobs to finish")
    redis = redis_sync.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        stats = redis.hgetall(Keys(settings.prefix).stats)
    finally:
        redis.close()
    assert (int(stats["passes"]), int(stats["docs"])) == (2, 4), stats

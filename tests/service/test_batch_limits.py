"""A batch's lines get the checks of the synchronous routes as they are queued: a line over a
limit the API checks (with the served model's tokenizer) is an error line with the code
/v1/score answers for the same body, and is never queued; the other lines are scored. A real
uvicorn, real Redis, the tiny model's worker (the API reads its tokenizer.json).

The tiny tokenizer writes each digit as one token and " " as one (tests/conftest.py)."""

from __future__ import annotations

import json

import httpx
import redis as redis_sync

from spinf_worker.queue.keys import Keys

from ..conftest import WAIT_S
from .live import InProcessWorker, LiveServer
from .test_api import assert_error, entries_added
from .test_batches import batch_in, lines_of, upload

QUERY = {"id": "q", "template": "\nQ:{?}", "options": [" yes", " no"]}


def body(text: str = "Some content.", query: dict | None = None, **extra) -> dict:
    return {"text": text, "scoring": {"queries": [{**QUERY, **(query or {})}]}, **extra}


# custom_id -> (body, status, code) of a line over a limit
OVER = {
    "long-option": (body(query={"options": [" 12345", " no"]}), 400, "option_too_long"),
    "long-template": (body(query={"template": "7" * 257 + "{?}"}), 400, "template_too_long"),
    "boundary": (body(query={"template": "\nAnswer: {?}", "options": ["yes", "no"]}), 400,
                 "option_boundary"),
    "long-content": (body(text=" a" * 4097), 400, "content_too_long"),
    "too-large": (body(limits={"max_processed_tokens": 10}), 413, "request_too_large"),
    "unknown-pack": ({**body(), "scoring": {"queries": [QUERY],
                                            "packs": [{"id": "spinf/nope"}]}},
                     400, "unknown_pack"),
}


def line(custom_id: str, request: dict, url: str = "/v1/score") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": request})


def job_records_of(settings, custom_ids: set[str]) -> list[str]:
    """custom_ids of the job records under the test's prefix that name one of ``custom_ids``."""
    client = redis_sync.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        found = []
        for key in client.scan_iter(match=Keys(settings.prefix).job("*"), count=1000):
            if client.type(key) == "hash" and client.hget(key, "custom_id") in custom_ids:
                found.append(client.hget(key, "custom_id"))
        return found
    finally:
        client.close()


def test_lines_over_a_limit_are_error_lines_with_the_sync_code_and_never_queued(
        tiny_engine, settings):
    rows = [line("ok-0", body("Document zero."))]
    for custom_id, (request, _status, _code) in OVER.items():
        rows += [line(custom_id, request), line(f"ok-{len(rows)}", body(f"Doc {len(rows)}."))]
    good = [json.loads(r)["custom_id"] for r in rows if json.loads(r)["custom_id"]
            .startswith("ok-")]
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings), \
            httpx.Client(base_url=server.v1, timeout=WAIT_S) as client:
        sync = {custom_id: assert_error(client.post("/score", json=request), status, code)
                for custom_id, (request, status, code) in OVER.items()}
        assert entries_added(settings) == 0
        batch = client.post("/batches", json={
            "input_file_id": upload(client, "\n".join(rows).encode())["id"],
            "endpoint": "/v1/score"}).json()
        done = batch_in(client, batch["id"], "completed")
        assert done["request_counts"] == {"total": len(rows), "completed": len(good),
                                          "failed": len(OVER)}
        assert sorted(x["custom_id"] for x in lines_of(client, done["output_file_id"])) \
            == sorted(good)
        errors = {e["custom_id"]: e for e in lines_of(client, done["error_file_id"])}
        assert set(errors) == set(OVER)
        for custom_id, (_request, status, code) in OVER.items():
            error = errors[custom_id]
            assert error["error"]["code"] == code
            assert error["error"]["line"] == rows.index(line(custom_id, OVER[custom_id][0])) + 1
            # answered by the API while queueing (no job, so no request id), as /v1/score
            response = error["response"]
            assert response["status_code"] == status and response["request_id"] is None
            assert response["body"]["error"]["code"] == code
            assert response["body"]["error"]["param"] == sync[custom_id]["param"]
        # only the good lines ever reached the streams
        assert entries_added(settings) == len(good)
        assert job_records_of(settings, set(OVER)) == []


def test_chat_lines_get_the_same_checks(tiny_engine, settings):
    request, _status, code = OVER["long-option"]
    chat = {"messages": [{"role": "user", "content": "Some content."}],
            "scoring": request["scoring"]}
    ok = {"messages": [{"role": "user", "content": "Fine."}], "scoring": body()["scoring"]}
    rows = [line("bad", chat, "/v1/chat/completions"), line("ok", ok, "/v1/chat/completions")]
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings), \
            httpx.Client(base_url=server.v1, timeout=WAIT_S) as client:
        batch = client.post("/batches", json={
            "input_file_id": upload(client, "\n".join(rows).encode())["id"],
            "endpoint": "/v1/chat/completions"}).json()
        done = batch_in(client, batch["id"], "completed")
        (error,) = lines_of(client, done["error_file_id"])
        assert error["custom_id"] == "bad" and error["error"]["code"] == code
        assert error["response"]["request_id"] is None
        assert entries_added(settings) == 1

"""Bodies that used to reach a 500, or the worker: answered 400 at the API, nothing queued; in
a batch file, an error line while the file's other lines are scored. A real uvicorn on
loopback, real Redis, a real worker on the tiny model."""

from __future__ import annotations

import json

import httpx

from ..conftest import WAIT_S
from .live import InProcessWorker, LiveServer
from .test_api import assert_error, entries_added
from .test_batches import batch_in, lines_of, score_line, upload

QUERY = {"id": "refund", "template": "\nRefund?{?}", "options": [" yes", " no"]}
DEEP = "[" * 2000 + "]" * 2000          # past any parser's nesting limit
NESTED = "[" * 1000 + "]" * 1000        # within it: a field error, never a RecursionError


def body(text: str = "I was charged twice.", option: str = " yes") -> str:
    """A request's JSON text; escapes are kept as written (a lone surrogate stays one)."""
    return ('{"text": "' + text + '", "scoring": {"queries": [{"id": "refund", "template": '
            '"\\nRefund?{?}", "options": ["' + option + '", " no"]}]}}')


def test_bad_json_is_400_before_anything_is_queued(settings):
    with LiveServer(settings) as server:   # no worker: a queued job would only wait
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S,
                              headers={"content-type": "application/json"})
        for bad in [
                '{"text": "x", "scoring": ' + DEEP + "}",       # nested 2,000 deep
                body(text="a\\ud800b"),                         # a lone surrogate in text
                body(option=" y\\udc00es"),                      # ... and in an option
                body().replace('"text"', '"deadline_s": Infinity, "text"'),
                body().replace('"text"', '"deadline_s": 1e400, "text"')]:
            for path in ("/score", "/jobs"):
                assert_error(client.post(path, content=bad.encode()), 400, "invalid_json")
        nested = '{"text": "x", "scoring": {"queries": ' + NESTED + "}}"
        assert_error(client.post("/score", content=nested.encode()), 400, "invalid_field")
        # a finite but absurd deadline is a field error, not an overflow
        absurd = {**json.loads(body()), "deadline_s": 1e308}
        assert_error(client.post("/jobs", json=absurd), 400, "invalid_field", "deadline_s")
        # a surrogate pair is a character like any other
        ok = client.post("/score", content=body(text="smile \\ud83d\\ude00").encode(),
                         headers={"Prefer": "respond-async"})
        assert ok.status_code == 202, ok.text
        assert entries_added(settings) == 1


def test_bad_lines_in_a_batch_file_are_error_lines_and_the_rest_is_scored(tiny_engine,
                                                                           settings):
    good = [json.dumps(score_line(f"ok-{i}", f"Document {i}.")) for i in range(3)]
    line = '{"custom_id": "%s", "method": "POST", "url": "/v1/score", "body": '
    deep = line.replace("%s", "deep") + DEEP + "}"
    lone = line.replace("%s", "lone") + body(text="a\\ud800b") + "}"
    content = "\n".join([good[0], deep, good[1], lone, good[2]]).encode()
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings):
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        batch = client.post("/batches", json={"input_file_id": upload(client, content)["id"],
                                              "endpoint": "/v1/score"}).json()
        done = batch_in(client, batch["id"], "completed")
        assert done["request_counts"] == {"total": 5, "completed": 3, "failed": 2}
        assert sorted(line["custom_id"] for line in lines_of(client, done["output_file_id"])) \
            == ["ok-0", "ok-1", "ok-2"]
        errors = lines_of(client, done["error_file_id"])
        assert all(e["error"]["code"] == "invalid_json" for e in errors)
        assert len(errors) == 2

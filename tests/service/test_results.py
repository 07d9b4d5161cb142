"""JobResult: the stored JSON keeps the shapes readers relied on before it existed."""

from __future__ import annotations

import json

from spinf_worker.errors import InvalidRequestError
from spinf_worker.queue.results import JobResult, normalize_error


def test_stored_json_is_the_documented_shape():
    ok = JobResult.ok({"id": "score-1", "queries": [], "system_fingerprint": None})
    assert ok.to_json() == json.dumps({"status_code": 200, "body": {
        "id": "score-1", "queries": [], "system_fingerprint": None}})   # nulls inside kept
    failed = JobResult.failed(InvalidRequestError("bad", param="scoring"))
    assert json.loads(failed.to_json()) == {"status_code": 400, "error": {
        "type": "invalid_request", "code": "invalid_field", "message": "bad",
        "param": "scoring"}}
    assert json.loads(JobResult.expired().to_json())["error"]["code"] == "deadline_exceeded"
    dead = JobResult.dead_letter(3)
    assert dead.status_code == 500 and dead.error_code == "dead_letter"
    assert "3 attempts" in dead.error["message"]
    for result in (ok, failed, dead):
        assert JobResult.from_json(result.to_json()) == result


def test_readers_helpers():
    ok = JobResult.from_json(b'{"status_code": 200, "body": {}}')
    assert ok.succeeded and ok.openai_error is None and ok.error_code is None
    bare = JobResult.from_json('{"status_code": 503}')      # an error never written
    assert not bare.succeeded and bare.error_code == "unavailable"
    assert bare.openai_error == {"type": "unavailable", "code": None,
                                 "message": "the request failed", "param": None}
    enveloped = {"error": {"message": "m", "type": "t", "param": "p", "code": "c"}}
    assert normalize_error(enveloped) == enveloped["error"]
    assert normalize_error("boom")["message"] == "boom"
    # the envelope's inner object, in its key order; OpenAI's types stored before it are
    # read back as the status's hosted type
    legacy = JobResult(status_code=400, error={"message": "no", "type": "invalid_request_error",
                                               "param": "model", "code": "model_not_served"})
    assert list(legacy.openai_error) == ["type", "code", "message", "param"]
    assert legacy.openai_error["type"] == "invalid_request"
    assert JobResult.expired().openai_error["type"] == "invalid_request"
    assert JobResult.dead_letter(3).openai_error["type"] == "api_error"


def test_a_body_written_once_is_stored_and_lined_as_written():
    """A worker writes a result's body once (``body_json``) and places that text in its
    stored result and its batch line: the same values as writing each whole, and the json
    module's fallback (a lone surrogate orjson refuses) places it alike."""
    from spinf_worker import jsonio
    from spinf_worker.queue.batches import result_line

    body = {"id": "scr_1", "results": [{"p": 0.1 + 0.2, "logprob": -1e-300}], "warnings": []}
    ok = JobResult.ok(body)
    written = ok.body_json()
    assert jsonio.loads(written) == body
    assert ok.to_bytes(written) == ok.to_bytes()
    assert JobResult.from_json(ok.to_bytes(written)) == ok
    line, counter = result_line("/v1/score", "job_1", "c\ud800", ok, written)
    whole, _ = result_line("/v1/score", "job_1", "c\ud800", ok)
    assert counter == "completed"
    text = jsonio.dumps(line)                  # the custom id sends it through json
    assert json.loads(text)["response"]["body"] == body
    assert json.loads(text)["custom_id"] == "c\ud800"
    whole["id"] = line["id"]
    assert json.loads(text) == json.loads(jsonio.dumps(whole))
    failed = JobResult.failed(InvalidRequestError("bad", param="scoring"))
    assert failed.body_json() is None and failed.to_bytes(None) == failed.to_bytes()

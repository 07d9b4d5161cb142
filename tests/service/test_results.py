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

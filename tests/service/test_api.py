"""The HTTP API end to end: a real uvicorn on 127.0.0.1, real Redis, real workers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest
import redis as redis_sync

from api.models import Batch, ErrorEnvelope, Job, JobAccepted, ModelList
from spinf_worker.errors import error_type
from spinf_worker.openai_compat import ChatScoreResponse
from spinf_worker.protocol import ScoreResponse
from spinf_worker.queue.keys import GROUP, Keys

from ..conftest import WAIT_S
from . import live
from .live import ROOT, InProcessWorker, LiveServer, wait_for

api_server = live.api_server  # the fixture, for pytest to find

SPEC_MESSAGES = [{"role": "user", "content": "Customer support message:\nI was charged twice "
                                            "for September, please refund one of the charges."}]
SPEC_SCORING = {"queries": [
    {"id": "topic",
     "template": "\n\nTopic (billing, technical, account, shipping, or cancellation):{?}",
     "options": [" billing", " technical", " account", " shipping", " cancellation"]},
    {"id": "refund", "template": "\n\nIs the customer asking for a refund?\nAnswer:{?}",
     "options": [" yes", " no"]}]}
DEFAULT_MODEL = "google/gemma-3-270m"

REFUND = {"text": "I was charged twice, please refund me.",
          "scoring": {"queries": [{"id": "refund", "template": "\nRefund?{?}",
                                   "options": [" yes", " no"]}]}}


def entries_added(settings) -> int:
    """Entries ever added to the work streams (XLEN alone would miss entries a worker already
    acknowledged and deleted)."""
    client = redis_sync.Redis.from_url(settings.redis_url, decode_responses=True)
    total = 0
    try:
        for stream in Keys(settings.prefix).streams:
            if client.exists(stream):
                total += int(client.xinfo_stream(stream)["entries-added"])
    finally:
        client.close()
    return total


ULID = re.compile(r"^[0-9A-HJKMNP-TV-Z]{26}$")


def assert_error(response: httpx.Response, status: int, code: str | None = None,
                 param: str | None = None) -> dict:
    """The hosted envelope: {"error": {type, code, message, param}, "request_id"}, the id
    being the reply's X-Request-Id, a server ULID."""
    assert response.status_code == status, response.text
    body = response.json()
    ErrorEnvelope.model_validate(body)
    assert set(body) == {"error", "request_id"}
    assert list(body["error"]) == ["type", "code", "message", "param"]
    assert body["error"]["type"] == error_type(status)
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["param"] == param, body
    assert ULID.match(response.headers["x-request-id"])
    assert body["request_id"] == response.headers["x-request-id"]
    return body["error"]


def test_api_imports_no_torch():
    code = ("import sys, api.app, api.routes\n"
            "api.app.create_app\n"
            "assert 'torch' not in sys.modules, 'the API tier imported torch'\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=WAIT_S)


@pytest.mark.slow
def test_spec_example_through_http_and_the_openai_sdk(default_engine, settings):
    """The SPEC example on the default model, through POST /v1/score and through the official
    OpenAI SDK: the numbers are exactly the engine's for the same request."""
    from openai import OpenAI

    request = {"model": DEFAULT_MODEL, "messages": SPEC_MESSAGES, "scoring": SPEC_SCORING}
    expected = default_engine.score(request)  # before the worker shares the engine
    settings = settings.model_copy(update={"api_keys": ["sk-test"]})
    with LiveServer(settings) as server, InProcessWorker(default_engine, settings):
        response = httpx.post(f"{server.v1}/score", json=request, timeout=WAIT_S,
                              headers={"Authorization": "Bearer sk-test"})
        assert response.status_code == 200, response.text
        body = response.json()
        ScoreResponse.model_validate(body)
        assert body["results"] == expected.model_dump(mode="json")["results"]
        assert body["model"] == DEFAULT_MODEL
        assert body["system_fingerprint"] == default_engine.fingerprint
        assert body["usage"] == expected.usage.model_dump()

        client = OpenAI(base_url=server.v1, api_key="sk-test", max_retries=0, timeout=WAIT_S)
        completion = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=SPEC_MESSAGES, extra_body={"scoring": SPEC_SCORING})
        assert completion.model_extra["results"] == expected.model_dump(mode="json")["results"]
        first = expected.results[0].queries[0].combinations[0].options
        assert completion.choices[0].message.content == max(first, key=lambda o: o.p).text
        assert completion.choices[0].finish_reason == "stop"
        assert completion.id.startswith("scr_")       # the score response's own id
        assert completion.system_fingerprint == default_engine.fingerprint
        assert completion.usage.completion_tokens == 0
        ChatScoreResponse.model_validate(completion.model_dump())

        models = client.models.list()
        assert [m.id for m in models.data] == [DEFAULT_MODEL]


def test_bad_input_is_answered_4xx_and_never_queued(tiny_engine, settings, tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# one key a line\nkey-from-file\n")
    settings = settings.model_copy(update={"api_keys": ["key-a"], "max_body_bytes": 4096,
                                           "api_keys_file": str(keys_file)})
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings):
        client = httpx.Client(base_url=server.url, timeout=WAIT_S,
                              headers={"Authorization": "Bearer key-a"})
        score = f"{server.v1}/score"

        assert_error(httpx.post(score, json=REFUND, timeout=WAIT_S), 401, "invalid_token")
        assert_error(httpx.post(score, json=REFUND, timeout=WAIT_S,
                                headers={"Authorization": "Bearer key-b"}),
                     401, "invalid_token")
        assert_error(httpx.get(f"{server.v1}/models", timeout=WAIT_S,
                                      headers={"Authorization": "Basic a2V5LWE="}), 401)
        assert_error(client.post(score, content=b'{"text": "x", '), 400, "invalid_json")
        assert_error(client.post(score, content=b""), 400, "invalid_json")
        assert_error(client.post(score, json=["not", "an", "object"]), 400)
        assert_error(client.post(score, json={**REFUND, "model": "no/such-model"}),
                     400, "model_not_served", "model")
        bad_template = {**REFUND, "scoring": {"queries": [
            {"id": "q", "template": "Answer: {?} and {unclosed", "options": [" a"]}]}}
        assert_error(client.post(score, json=bad_template), 400,
                            param="scoring.queries.0.template")
        no_options = {**REFUND, "scoring": {"queries": [{"id": "q", "template": "A:{?}"}]}}
        assert_error(client.post(score, json=no_options), 400, "missing_value")
        assert_error(client.post(score, json={**REFUND, "text": "x" * 5000}), 413,
                     "body_too_large")
        assert_error(client.post(score, json=REFUND,
                                        headers={"X-Sync-Timeout": "soon"}),
                            400, param="X-Sync-Timeout")

        chat = f"{server.v1}/chat/completions"
        messages = [{"role": "user", "content": "hello"}]
        assert_error(client.post(chat, json={"model": "m", "messages": messages}),
                            400, "scoring_required", "scoring")
        assert_error(client.post(chat, json={"messages": messages, "stream": True,
                                                    "scoring": REFUND["scoring"]}),
                            400, param="stream")
        assert_error(client.post(f"{server.v1}/jobs",
                                        json={**REFUND, "callback": "ftp://example.com/x"}),
                            400, param="callback")
        # FastAPI's own validation (422) and routing errors, in the same shape
        assert_error(client.post(f"{server.v1}/batches", json={"endpoint": "/v1/score"}),
                            400, param="input_file_id")
        assert_error(client.get(f"{server.v1}/batches", params={"limit": 0}),
                            400, param="limit")
        assert_error(client.get(f"{server.v1}/nothing-here"), 404, "not_found")
        assert_error(client.delete(score), 405, "method_not_allowed")
        assert_error(client.get(f"{server.v1}/jobs/job_missing"), 404, "job_not_found")

        assert entries_added(settings) == 0
        # the operations routes stay open; a good key works, from the settings or the file
        assert httpx.get(f"{server.url}/health", timeout=WAIT_S).status_code == 200
        assert httpx.get(f"{server.url}/metrics", timeout=WAIT_S).status_code == 200
        for key in ("key-a", "key-from-file"):
            ok = httpx.post(score, json=REFUND, timeout=WAIT_S,
                            headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200, ok.text
        assert entries_added(settings) == 2


def test_respond_async_answers_202_then_a_worker_finishes_the_job(tiny_engine, settings):
    expected = tiny_engine.score(REFUND).model_dump(mode="json")
    with LiveServer(settings) as server:
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        response = client.post("/score", json=REFUND, headers={"Idempotency-Key": "abc-1",
                                                               "Prefer": "respond-async"})
        assert response.status_code == 202, response.text
        accepted = JobAccepted.model_validate(response.json())
        assert accepted.status == "queued" and accepted.url == f"/v1/jobs/{accepted.id}"
        assert response.headers["location"] == accepted.url
        # the same Idempotency-Key names the same job, and queues nothing new
        again = client.post("/score", json=REFUND, headers={"Idempotency-Key": "abc-1",
                                                            "Prefer": "respond-async"})
        assert again.status_code == 202 and again.json()["id"] == accepted.id
        queued = client.post("/jobs", json={**REFUND, "deadline_s": 600})
        assert queued.status_code == 202, queued.text
        assert entries_added(settings) == 2

        job = client.get(accepted.url.removeprefix("/v1")).json()
        assert job["status"] == "queued" and job["response"] is None

        with InProcessWorker(tiny_engine, settings):
            for job_id in (accepted.id, queued.json()["id"]):
                job = wait_for(lambda job_id=job_id: (
                    lambda j: j if j["status"] == "succeeded" else None)(
                        client.get(f"/jobs/{job_id}").json()), what="the job to finish")
                Job.model_validate(job)
                assert job["status_code"] == 200 and job["error"] is None
                assert job["response"]["results"] == expected["results"]
                assert job["created_at"] <= job["started_at"] <= job["finished_at"]


def test_backlog_over_the_limit_is_429_with_retry_after(settings):
    settings = settings.model_copy(update={"max_backlog": 0})
    with LiveServer(settings) as server:
        first = httpx.post(f"{server.v1}/score", json=REFUND,
                           headers={"Prefer": "respond-async"}, timeout=WAIT_S)
        assert first.status_code == 202
        second = httpx.post(f"{server.v1}/score", json=REFUND, timeout=WAIT_S)
        assert_error(second, 429, "concurrency_limit")
        assert int(second.headers["retry-after"]) > 0
        assert entries_added(settings) == 1

        # the waiting entry shows in the queue metrics, before and after workers form the group
        time.sleep(0.05)
        for group_exists in (False, True):
            if group_exists:
                client = redis_sync.Redis.from_url(settings.redis_url)
                client.xgroup_create(Keys(settings.prefix).interactive, GROUP, id="0")
                client.close()
            metrics = httpx.get(f"{server.url}/metrics", timeout=WAIT_S).text
            assert 'spinf_queue_depth{stream="interactive"} 1.0' in metrics
            assert 'spinf_queue_pending{stream="interactive"} 0.0' in metrics
            assert 'spinf_queue_depth{stream="bulk"} 0.0' in metrics
            lag = float(metrics.split('spinf_queue_lag_seconds{stream="interactive"} ')[1]
                        .split()[0])
            assert 0.05 <= lag < WAIT_S


def test_ready_models_and_metrics(tiny_engine, tiny_dir, api_server, settings):
    client = httpx.Client(base_url=api_server.url, timeout=WAIT_S)
    assert client.get("/health").json() == {"status": "ok"}
    not_ready = client.get("/ready")
    assert_error(not_ready, 503, "no_live_worker")
    assert client.get("/v1/models").json() == {"models": [], "object": "list", "data": []}
    packs = client.get("/v1/packs").json()["packs"]
    assert "spinf/support-triage" in {p["id"] for p in packs}

    with InProcessWorker(tiny_engine, settings):
        ready = client.get("/ready")
        assert ready.status_code == 200
        assert ready.json()["workers"] == 1

        models = ModelList.model_validate(client.get("/v1/models").json())
        model_id = tiny_engine.model_name
        assert [m.id for m in models.data] == [model_id]
        assert models.data[0].fingerprints == [tiny_engine.fingerprint]
        # ids hold "/": the path converter takes them whole; the bare name works too
        by_path = client.get(f"/v1/models/{model_id}")
        assert by_path.status_code == 200 and by_path.json()["id"] == model_id
        bare = client.get(f"/v1/models/{model_id.rsplit('/', 1)[-1]}")
        assert bare.status_code == 200 and bare.json()["id"] == model_id
        assert_error(client.get("/v1/models/no/such/model"), 404, "model_not_found")

        scored = client.post("/v1/score", json={**REFUND, "model": model_id.rsplit("/", 1)[-1]},
                             headers={"X-Request-Id": "trace-42"})
        assert scored.status_code == 200, scored.text
        assert ULID.match(scored.headers["x-request-id"])   # the server's id, not the caller's
        client.get("/v1/jobs/job_missing")

        text = client.get("/metrics").text
        for name in ('spinf_queue_depth{stream="interactive"}', 'spinf_queue_depth{stream="bulk"}',
                     'spinf_queue_pending{stream="interactive"}',
                     'spinf_queue_lag_seconds{stream="bulk"}', "spinf_workers_live 1.0",
                     "spinf_passes_total", "spinf_documents_total", "spinf_tokens_total",
                     "spinf_questions_total", "spinf_pass_fill_ratio",
                     "spinf_worker_gc_seconds_total",
                     "spinf_dead_letters_total", 'spinf_deliveries_total{outcome="succeeded"} 1.0',
                     'spinf_deliveries_total{outcome="dead"}', "spinf_callback_attempts_total",
                     'method="POST",route="/v1/score",status_class="2xx"',
                     'route="/v1/jobs/{job_id}",status_class="4xx"'):
            assert name in text, name
        assert "job_missing" not in text  # routes, not raw paths
        fill = float(text.split("\nspinf_pass_fill_ratio ")[1].split()[0])
        assert 0 < fill <= 1

    # a worker that stops deregisters: not ready any more
    assert_error(client.get("/ready"), 503, "no_live_worker")


def test_openapi_documents_the_shapes(api_server):
    schema = httpx.get(f"{api_server.url}/openapi.json", timeout=WAIT_S).json()
    components = schema["components"]["schemas"]
    for name in ("ScoreRequest", "ScoreResponse", "ChatScoreResponse", "ChatCompletionRequest",
                 "JobRequest", "Job", "Batch", "BatchList", "FileObject", "ErrorEnvelope"):
        assert name in components, name
    score = schema["paths"]["/v1/score"]["post"]
    assert score["requestBody"]["content"]["application/json"]["schema"]["$ref"] \
        == "#/components/schemas/ScoreRequest"
    assert {"200", "202", "400", "429", "503"} <= set(score["responses"])
    # the hosted shapes, field by field
    response = components["ScoreResponse"]["properties"]
    assert {"id", "object", "created", "model", "system_fingerprint", "results", "warnings",
            "usage", "timing"} <= set(response)
    result = components["InputResult"]["properties"]
    assert {"input_id", "queries", "packs"} <= set(result)
    assert {"text", "p", "value", "currency", "finish"} <= set(
        components["Answer"]["properties"])
    request = components["ScoreRequest"]["properties"]
    assert {"model", "messages", "inputs", "scoring", "endpoint"} <= set(request)
    assert {"queries", "empty_floor", "case_insensitive", "packs"} <= set(
        components["Scoring"]["properties"])
    assert "/v1/models/{model_id}" in schema["paths"]
    # every $ref resolves
    refs = {ref.rsplit("/", 1)[-1] for ref in _refs(schema)}
    assert refs <= set(components), refs - set(components)
    Batch.model_json_schema()


def _refs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_unexpected_errors_are_500_in_the_envelope(settings):
    server = LiveServer(settings)

    @server.app.get("/boom")
    async def boom():
        raise RuntimeError("secret internals")

    with server:
        response = httpx.get(f"{server.url}/boom", headers={"X-Request-Id": "r-1"},
                             timeout=WAIT_S)
        error = assert_error(response, 500, "engine_error")
        request_id = response.headers["x-request-id"]
        assert "secret" not in error["message"] and request_id in error["message"]
        assert request_id != "r-1"   # a caller's id is never taken


def test_job_body_round_trips_through_json(settings, api_server):
    """The request handed to the worker is the validated one, with job-only fields removed."""
    response = httpx.post(f"{api_server.v1}/jobs", timeout=WAIT_S,
                          json={**REFUND, "temperature": 0.2, "callback": "https://example.com/h"})
    assert response.status_code == 202
    client = redis_sync.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        keys = Keys(settings.prefix)
        [(_id, fields)] = client.xrange(keys.interactive)
        payload = json.loads(fields["payload"])
        assert payload["text"] == REFUND["text"]
        assert payload["scoring"]["queries"][0].items() >= REFUND["scoring"]["queries"][0].items()
        assert not {"temperature", "callback", "deadline_s"} & set(payload)
        assert fields["callback"] == "https://example.com/h"
        assert client.hget(keys.job(response.json()["id"]), "status") == "queued"
    finally:
        client.close()

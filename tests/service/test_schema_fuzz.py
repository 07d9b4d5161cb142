"""Schemathesis over the OpenAPI schema the live server publishes: every operation, fed
schema-derived and schema-violating requests, never answers a 5xx; every 4xx is the hosted
error envelope whose request_id is the reply's X-Request-Id; statuses, content types, headers
and bodies are the documented ones. Without a key, or with a wrong one, every protected
operation is a 401 in the same envelope.

A real uvicorn on 127.0.0.1 (every case goes over HTTP), real Redis, API keys configured and a
real worker on the tiny model, so that the requests that pass validation (the examples below)
are queued, scored and answered. Bounded and reproducible: a fixed seed, derandomized
generation, 20 generated cases at most per operation in the fuzzing phase, besides the
coverage phase's fixed boundary cases; no example database, no stateful phase (no links).

No operation is excluded: every one of the schema runs, /v0/drain included (draining only
makes /readyz answer 503, and DELETE /v0/drain ends it).

The schema is taken from create_app(...).openapi() at import, so that each operation is a test
of its own; the server fixture checks that its /openapi.json is that same document."""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis as redis_sync
import schemathesis
from schemathesis import checks
from schemathesis.config import SchemathesisConfig

from api.app import create_app
from spinf_worker.errors import error_type
from spinf_worker.queue.settings import ServiceSettings

from ..conftest import WAIT_S
from .conftest import REDIS_URL
from .live import InProcessWorker, LiveServer

KEY = "sk-fuzz"            # a tenant's API key: what /v1 is called with
TOKEN = "op-fuzz-token"    # the operator's token: what /v0 is called with
ULID = re.compile(r"^[0-9A-HJKMNP-TV-Z]{26}$")
SEED = 20250101


def config(max_examples: int, *, coverage: bool) -> SchemathesisConfig:
    return SchemathesisConfig.from_dict({
        "seed": SEED,
        # generation time says nothing about the server: a loaded CI machine must not fail it
        "suppress-health-check": ["too_slow", "data_too_large", "filter_too_much",
                                  "large_base_example"],
        "generation": {
            "max-examples": max_examples,
            "deterministic": True,       # Hypothesis' derandomize: the same cases every run
            "database": "none",          # nothing carried over from an earlier run
            "with-security-parameters": False,   # the tests send the credentials themselves
        },
        "phases": {"coverage": {"enabled": coverage}, "stateful": {"enabled": False}},
    })


# ---- the cases ---------------------------------------------------------------------------

QUERIES = [{"id": "refund", "template": "\nRefund?{?}", "options": [" yes", " no"]},
           {"id": "month", "template": "\nMonth:{*}", "max_tokens": 2}]
SCORE = {"text": "I was charged twice for September, please refund me.",
         "scoring": {"queries": QUERIES}}
MESSAGES = {"messages": [{"role": "system", "content": "You read support messages."},
                         {"role": "user", "content": [
                             {"type": "text", "text": "The parcel never arrived."}]}],
            "scoring": {"queries": QUERIES[:1]}}
INPUTS = {"inputs": [{"id": "a", "messages": [{"role": "user", "content": "Refund me."}]},
                     {"id": "b", "messages": [{"role": "user", "content": "All good."}]}],
          "scoring": {"queries": QUERIES[:1], "case_insensitive": True}}
BATCH_LINE = json.dumps({"custom_id": "one", "method": "POST", "url": "/v1/score",
                         "body": SCORE}) + "\n"
# Bodies that pass validation, for the examples phase: generated ones almost never do (the
# schema cannot say "one of text, messages or inputs", nor what a template must hold), and
# these take the queue, the worker and the reply paths.
EXAMPLES = {
    ("/v1/score", "application/json"): [SCORE, MESSAGES, INPUTS],
    ("/v1/chat/completions", "application/json"): [MESSAGES, {**SCORE, "stream": False}],
    ("/v1/jobs", "application/json"): [SCORE, INPUTS],
    ("/v1/files", "multipart/form-data"): [{"file": BATCH_LINE, "purpose": "batch"}],
}


def served_schema() -> dict:
    """The OpenAPI document the server publishes (the settings do not change it)."""
    return create_app(ServiceSettings(redis_url=REDIS_URL, api_keys=[f"{KEY} fuzz"],
                                      token=TOKEN)).openapi()


def with_examples(spec: dict) -> dict:
    spec = copy.deepcopy(spec)
    for (path, media), bodies in EXAMPLES.items():
        content = spec["paths"][path]["post"]["requestBody"]["content"][media]
        content["examples"] = {f"example{i}": {"value": body} for i, body in enumerate(bodies)}
    return spec


SPEC = served_schema()
schema = schemathesis.openapi.from_dict(with_examples(SPEC), config=config(20, coverage=True))
# Without credentials the route's work is never reached: a few cases per operation suffice.
unauthenticated = schemathesis.openapi.from_dict(SPEC, config=config(3, coverage=False))


def protected(case) -> bool:
    return bool(SPEC["paths"][case.path][case.method.lower()].get("security"))


# ---- the checks ----------------------------------------------------------------------------

def envelope_problem(status: int, content: bytes, request_ids: list[str]) -> str | None:
    """Why a 4xx reply is not the hosted envelope (None: it is); ``request_ids``: every
    X-Request-Id header of the reply."""
    try:
        body = json.loads(content)
    except ValueError:
        return f"not JSON: {content[:200]!r}"
    if not isinstance(body, dict) or set(body) != {"error", "request_id"}:
        return f"not {{error, request_id}}: {body!r}"
    error = body["error"]
    if not isinstance(error, dict) or list(error) != ["type", "code", "message", "param"]:
        return f"error is not {{type, code, message, param}}: {error!r}"
    if error["type"] != error_type(status):
        return f"type {error['type']!r} for a {status}"
    if not isinstance(error["code"], str) or not error["code"]:
        return f"code {error['code']!r}"
    if not isinstance(error["message"], str) or not error["message"] \
            or "Traceback" in error["message"]:
        return f"message {error['message']!r}"
    if error["param"] is not None and not isinstance(error["param"], str):
        return f"param {error['param']!r}"
    if len(request_ids) != 1 or not ULID.match(request_ids[0]):
        return f"X-Request-Id {request_ids!r} is not one server ULID"
    if body["request_id"] != request_ids[0]:
        return f"request_id {body['request_id']!r} is not X-Request-Id {request_ids[0]!r}"
    return None


def no_server_error(ctx, response, case) -> None:
    assert response.status_code < 500, (
        f"{response.status_code} for {case.method} {case.formatted_path}: "
        f"{response.content[:500]!r}")


def errors_in_the_envelope(ctx, response, case) -> None:
    if 400 <= response.status_code < 500:
        # schemathesis' Response: every value of a header, as a list
        problem = envelope_problem(response.status_code, response.content,
                                   response.headers.get("x-request-id", []))
        assert problem is None, (
            f"{response.status_code} for {case.method} {case.formatted_path}: {problem}")


CHECKS = [no_server_error, errors_in_the_envelope,
          # the documented statuses, content types, response headers and bodies
          checks.status_code_conformance, checks.content_type_conformance,
          checks.response_headers_conformance, checks.response_schema_conformance]


def unauthorized(ctx, response, case) -> None:
    """A protected operation is a 401 invalid_token with a Bearer challenge; the probes
    answer as they do for anyone."""
    if protected(case):
        assert response.status_code == 401, (
            f"{response.status_code} for {case.method} {case.formatted_path} without a valid "
            f"key: {response.content[:300]!r}")
        assert json.loads(response.content)["error"]["code"] == "invalid_token"
        assert response.headers.get("www-authenticate") == ["Bearer"]
    else:
        assert response.status_code not in (401, 403)


# ---- the server -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_engine, redis_url) -> Iterator[LiveServer]:
    """One server and one worker for every case, under a private prefix (deleted after)."""
    prefix = f"spinf-test-{uuid.uuid4().hex[:10]}"
    settings = ServiceSettings(redis_url=redis_url, prefix=prefix, max_wait_ms=20,
                               claim_idle_ms=1500, heartbeat_s=0.5, worker_ttl_s=WAIT_S,
                               sync_timeout_s=WAIT_S / 2, callback_backoff_s=0.2,
                               api_keys=[f"{KEY} fuzz"], token=TOKEN)
    try:
        with InProcessWorker(tiny_engine, settings), LiveServer(settings) as live:
            served = httpx.get(f"{live.url}/openapi.json", timeout=WAIT_S)
            assert served.status_code == 200, served.text
            assert served.json() == SPEC, "the live schema is not the one the cases came from"
            yield live
    finally:
        client = redis_sync.Redis.from_url(redis_url)
        try:
            for key in client.scan_iter(match=f"{prefix}:*", count=1000):
                client.delete(key)
        finally:
            client.close()


def credentials(case) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN if case.path.startswith('/v0/') else KEY}"}


# ---- the tests ------------------------------------------------------------------------------

@schema.parametrize()
def test_no_5xx_and_every_4xx_is_the_envelope(case, server):
    response = case.call(base_url=server.url, headers=credentials(case), timeout=WAIT_S)
    case.validate_response(response, checks=CHECKS)


@unauthenticated.parametrize()
def test_without_a_valid_key_every_protected_operation_is_a_401(case, server):
    # no key; a wrong one; and on /v0 a tenant's key, which is not the operator's token
    for headers in ({}, {"Authorization": "Bearer sk-not-a-key"},
                    *([{"Authorization": f"Bearer {KEY}"}] if case.path.startswith("/v0/")
                      else [])):
        response = case.call(base_url=server.url, headers=headers, timeout=WAIT_S)
        case.validate_response(response, checks=[no_server_error, errors_in_the_envelope,
                                                 unauthorized])


@pytest.mark.parametrize("part_type", [{}, []], ids=["object", "array"])
def test_unhashable_part_type_is_a_400(server, part_type):
    """Found by the run above: {"type": {}} as a content part was a 500 on /v1/score,
    /v1/chat/completions and /v1/jobs (and failed a batch's queueing task)."""
    body = {"messages": [{"role": "user", "content": [{"type": part_type}]}],
            "scoring": {"queries": QUERIES[:1]}}
    with httpx.Client(base_url=server.v1, timeout=WAIT_S,
                      headers={"Authorization": f"Bearer {KEY}"}) as client:
        for path in ("/score", "/chat/completions", "/jobs"):
            response = client.post(path, json=body)
            assert response.status_code == 400, (path, response.status_code, response.text)
            assert envelope_problem(400, response.content,
                                    response.headers.get_list("x-request-id")) is None


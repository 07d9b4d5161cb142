"""The hosted API's behaviour over HTTP: 200 with the result, Prefer: respond-async, the sync
wait's 503, packs checked before anything is queued, the reference README's example, the
chat reply. A real uvicorn on loopback, real Redis, a real worker (the tiny model; the
default one for the README's options, which the tiny tokenizer splits too finely)."""

from __future__ import annotations

import time

import httpx

from spinf_worker.protocol import ScoreResponse

from ..conftest import WAIT_S
from .live import InProcessWorker, LiveServer, wait_for
from .test_api import assert_error, entries_added

REFUND = {"messages": [{"role": "user", "content": "I was charged twice, please refund me."}],
          "scoring": {"queries": [{"id": "refund", "template": "\nRefund?{?}",
                                   "options": [" yes", " no"]}]}}

# the example of the hosted server's README: two classifications and one extraction
README_EXAMPLE = {
    "messages": [{"role": "user", "content": "Customer support message:\nI was charged twice "
                                             "for September, please refund one of the charges."}],
    "scoring": {"queries": [
        {"id": "topic",
         "template": "\n\nTopic (billing, technical, account, shipping, or cancellation):{?}",
         "options": [" billing", " technical", " account", " shipping", " cancellation"]},
        {"id": "refund", "template": "\n\nIs the customer asking for a refund?\nAnswer:{?}",
         "options": [" yes", " no"]},
        {"id": "month", "template": "\n\nQ: Which month was charged twice?\nA: \"{*}\""}]}}


def test_the_reference_readme_example_is_answered_200(default_engine, settings):
    with LiveServer(settings) as server, InProcessWorker(default_engine, settings):
        response = httpx.post(f"{server.v1}/score", json={"model": "spinf-12b", **README_EXAMPLE},
                              timeout=WAIT_S)
        assert response.status_code == 200, response.text
        body = response.json()
        ScoreResponse.model_validate(body)
        assert body["model"] == "spinf-12b" and body["id"].startswith("scr_")
        (result,) = body["results"]
        topic, refund, month = result["queries"]
        assert [o["text"] for o in topic["combinations"][0]["options"]] == [
            " billing", " technical", " account", " shipping", " cancellation"]
        assert all(o["floor_p"] is not None for o in refund["combinations"][0]["options"])
        assert month["kind"] == "text" and "answers" in month["combinations"][0]
        assert body["usage"]["scoring"]["queries"] == 2
        assert body["usage"]["extraction"]["slots"] == 1
        assert response.headers["x-request-id"] and response.headers["x-job-id"]


def test_prefer_respond_async_answers_202_then_the_job_finishes(tiny_engine, settings):
    with LiveServer(settings) as server:
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        response = client.post("/score", json=REFUND, headers={"Prefer": "respond-async"})
        assert response.status_code == 202, response.text
        job_url = response.json()["url"].removeprefix("/v1")
        assert client.get(job_url).json()["status"] == "queued"
        with InProcessWorker(tiny_engine, settings):
            job = wait_for(lambda: (j := client.get(job_url).json())["status"] == "succeeded"
                           and j, what="the job to finish")
        expected = tiny_engine.score(REFUND).model_dump(mode="json")
        assert job["response"]["results"] == expected["results"]


def test_no_result_within_the_sync_wait_is_503_with_the_job(tiny_engine, settings):
    settings = settings.model_copy(update={"sync_timeout_s": 0.2})
    with LiveServer(settings) as server:   # no worker: nothing can finish
        response = httpx.post(f"{server.v1}/score", json=REFUND, timeout=WAIT_S)
        assert_error(response, 503, "model_unavailable")
        job_id = response.headers["x-job-id"]
        assert response.headers["retry-after"]
        job = httpx.get(f"{server.v1}/jobs/{job_id}", timeout=WAIT_S).json()
        assert job["status"] == "queued"


def test_unknown_packs_are_400_before_anything_is_queued(settings):
    with LiveServer(settings) as server:   # no worker: a queued job would wait
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        for ref, code, param in [
                ({"id": "spinf/no-such-pack"}, "unknown_pack", "scoring.packs.0.id"),
                ({"id": "spinf/moderation", "version": "0.0.0-none"}, "unknown_pack_version",
                 "scoring.packs.0.version"),
                ({"id": "spinf/moderation", "context": "nowhere"}, "invalid_field",
                 "scoring.packs.0.context"),
                ({"id": "spinf/moderation", "decision": {"thresholds": {"no-such": 0.5}}},
                 "unknown_category", None)]:
            body = {**REFUND, "scoring": {"packs": [ref]}}
            assert_error(client.post("/score", json=body, headers={"Prefer": "respond-async"}),
                         400, code, param)
        assert entries_added(settings) == 0


def test_chat_completions_is_the_score_response_plus_choices(tiny_engine, settings):
    from openai import OpenAI

    expected = tiny_engine.score(REFUND).model_dump(mode="json")
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings):
        client = OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=WAIT_S)
        completion = client.chat.completions.create(
            model="spinf-12b", messages=REFUND["messages"],
            extra_body={"scoring": REFUND["scoring"]})
        assert completion.model_extra["results"] == expected["results"]
        options = expected["results"][0]["queries"][0]["combinations"][0]["options"]
        assert completion.choices[0].message.content == max(options, key=lambda o: o["p"])["text"]
        missing = httpx.post(f"{server.v1}/chat/completions", timeout=WAIT_S,
                             json={"messages": REFUND["messages"]})
        assert_error(missing, 400, "scoring_required", "scoring")


def test_timing_counts_the_wait_in_the_queue(tiny_engine, settings):
    with LiveServer(settings) as server:
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        job_url = client.post("/score", json=REFUND, headers={"Prefer": "respond-async"}
                              ).json()["url"].removeprefix("/v1")
        queued_by = time.time()           # the entry is in its stream before the 202
        queued = client.get(job_url).json()
        worker_from = time.time()         # nothing can read it before the worker starts
        with InProcessWorker(tiny_engine, settings):
            job = wait_for(lambda: (j := client.get(job_url).json())["status"] == "succeeded"
                           and j, what="the job to finish")
        timing = job["response"]["timing"]
        # it waited at least from the 202 until a worker existed to read it
        assert timing["queue_ms"] >= int((worker_from - queued_by) * 1000)
        assert timing["wall_ms"] == timing["queue_ms"] + timing["score_ms"]
        assert job["started_at"] >= queued["created_at"]

"""Bulk batches (OpenAI Batch API shape) end to end on uvicorn, Redis and the tiny engine, and
the batch bookkeeping under racing, repeating workers."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from api.models import Batch, BatchList, FileObject
from spinf_worker import jsonio
from spinf_worker.queue import batches, files
from spinf_worker.queue.producer import Producer
from spinf_worker.queue.results import JobResult

from ..conftest import WAIT_S
from .live import InProcessWorker, LiveServer, jsonl, wait_for

QUERY = {"queries": [{"id": "good", "template": "\nGood news?{?}", "options": [" yes", " no"]}]}
TEXTS = [f"Story {i}: the home team won the match by {i} points." for i in range(50)]
DOCUMENTS = 200  # each text appears four times, at different places in the passes


def score_line(custom_id: str, text: str, url: str = "/v1/score", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"text": text, "scoring": QUERY, **body}}


def upload(client: httpx.Client, content: bytes) -> dict:
    response = client.post("/files", data={"purpose": "batch"},
                           files={"file": ("docs.jsonl", content, "application/jsonl")})
    assert response.status_code == 200, response.text
    return FileObject.model_validate(response.json()).model_dump()


def batch_in(client: httpx.Client, batch_id: str, *statuses: str,
             timeout: float = WAIT_S) -> dict:
    def check():
        batch = client.get(f"/batches/{batch_id}").json()
        return batch if batch["status"] in statuses else None
    return Batch.model_validate(wait_for(check, timeout, 0.1, f"batch {statuses}")).model_dump()


def queue_empty(metrics: str) -> bool:
    return ('spinf_queue_depth{stream="bulk"} 0.0' in metrics
            and 'spinf_queue_pending{stream="bulk"} 0.0' in metrics)


def lines_of(client: httpx.Client, file_id: str) -> list[dict]:
    response = client.get(f"/files/{file_id}/content")
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines()]


def test_batch_of_200_documents_matches_the_engine_alone(tiny_engine, settings):
    alone = {text: tiny_engine.score({"text": text, "scoring": QUERY}).model_dump(mode="json")["results"]
             for text in TEXTS}
    rows = [score_line(f"doc-{i}", TEXTS[i % len(TEXTS)]) for i in range(DOCUMENTS)]
    bad_template = score_line("bad-template", "x")
    bad_template["body"]["scoring"] = {"queries": [{"id": "q", "template": "A: {?", "options":
                                                    [" a"]}]}
    invalid = [b'{"custom_id": "broken", "method": ',
               json.dumps(score_line("doc-0", "a second doc-0")).encode(),
               json.dumps(score_line("wrong-url", "x", url="/v1/chat/completions")).encode(),
               json.dumps(bad_template).encode()]
    content = jsonl(rows[:100]) + b"\n".join(invalid) + b"\n\n" + jsonl(rows[100:])

    with LiveServer(settings) as server:
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        input_file = upload(client, content)
        assert input_file["bytes"] == len(content) and input_file["purpose"] == "batch"
        assert client.get(f"/files/{input_file['id']}").json() == input_file
        assert client.get(f"/files/{input_file['id']}/content").content == content

        created = client.post("/batches", json={"input_file_id": input_file["id"],
                                                "endpoint": "/v1/score",
                                                "completion_window": "24h",
                                                "metadata": {"run": "test"}})
        assert created.status_code == 200, created.text
        batch = Batch.model_validate(created.json())
        assert batch.status == "validating" and batch.metadata == {"run": "test"}
        # no worker yet: every valid line waits in the bulk stream, nothing is lost
        wait_for(lambda: client.get(f"/batches/{batch.id}").json()["request_counts"]["total"]
                 == DOCUMENTS + len(invalid), what="the batch to be enqueued")
        assert f'spinf_queue_depth{{stream="bulk"}} {DOCUMENTS}.0' in \
            httpx.get(f"{server.url}/metrics", timeout=WAIT_S).text

        with InProcessWorker(tiny_engine, settings):
            done = batch_in(client, batch.id, "completed", "failed")

        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": DOCUMENTS + len(invalid),
                                          "completed": DOCUMENTS, "failed": len(invalid)}
        assert done["created_at"] <= done["in_progress_at"] <= done["completed_at"]
        output = lines_of(client, done["output_file_id"])
        assert len(output) == DOCUMENTS
        by_id = {line["custom_id"]: line for line in output}
        assert len(by_id) == DOCUMENTS
        for i in range(DOCUMENTS):
            line = by_id[f"doc-{i}"]
            assert line["id"].startswith("batch_req_") and line["error"] is None
            assert line["response"]["status_code"] == 200
            assert line["response"]["request_id"].startswith("job_")
            assert line["response"]["body"]["results"] == alone[TEXTS[i % len(TEXTS)]], i

        errors = {(line["custom_id"], line["error"]["code"]): line
                  for line in lines_of(client, done["error_file_id"])}
        assert set(errors) == {(None, "invalid_json"), ("doc-0", "duplicate_custom_id"),
                               ("wrong-url", "invalid_url"), ("bad-template", "invalid_template")}
        assert errors[(None, "invalid_json")]["response"] is None
        template_error = errors[("bad-template", "invalid_template")]["response"]
        assert template_error["status_code"] == 400
        assert template_error["body"]["error"]["param"] == "scoring.queries.0.template"
        assert errors[("doc-0", "duplicate_custom_id")]["error"]["line"] == 102

        output_file = client.get(f"/files/{done['output_file_id']}").json()
        assert output_file["purpose"] == "batch_output"
        assert output_file["bytes"] == len(client.get(
            f"/files/{done['output_file_id']}/content").content)

        listed = BatchList.model_validate(client.get("/batches", params={"limit": 1}).json())
        assert [b.id for b in listed.data] == [batch.id] and not listed.has_more
        # a finished batch cannot be cancelled
        refused = client.post(f"/batches/{batch.id}/cancel")
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "batch_not_cancellable"


def test_chat_completions_batch_answers_in_the_chat_shape(tiny_engine, settings):
    messages = [{"role": "user", "content": TEXTS[0]}]
    alone = tiny_engine.score({"messages": messages, "scoring": QUERY}).model_dump(mode="json")
    rows = [{"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": tiny_engine.model_name, "messages": messages, "scoring": QUERY,
                      "temperature": 0}},
            {"custom_id": "chat-2", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": messages}}]
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings):
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        input_file = upload(client, jsonl(rows))
        batch = client.post("/batches", json={"input_file_id": input_file["id"],
                                              "endpoint": "/v1/chat/completions"}).json()
        done = batch_in(client, batch["id"], "completed")
        assert done["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
        [line] = lines_of(client, done["output_file_id"])
        body = line["response"]["body"]
        # the score response plus choices, as /v1/chat/completions answers
        assert body["object"] == "score" and body["id"].startswith("scr_")
        top = max(alone["results"][0]["queries"][0]["combinations"][0]["options"],
                  key=lambda o: o["p"])
        assert body["choices"][0]["message"] == {"role": "assistant", "content": top["text"]}
        assert body["results"] == alone["results"]
        [error] = lines_of(client, done["error_file_id"])
        assert error["custom_id"] == "chat-2"
        assert error["error"]["code"] == "scoring_required"


def test_a_chat_line_of_a_reply_the_engine_wrote_as_json(tiny_engine):
    """A worker makes a /v1/chat/completions batch line from the engine's reply as it is: an
    input's result written as JSON text already (a bulk job's) is read for the choice."""
    messages = [{"role": "user", "content": TEXTS[0]}]
    reply = tiny_engine.score({"messages": messages, "scoring": QUERY})
    result = JobResult.ok(reply)
    line, counter = batches.result_line("/v1/chat/completions", "job", "chat-1", result,
                                result.body_json())
    body = json.loads(jsonio.dumps(line))["response"]["body"]
    top = max(reply.results[0].queries[0].combinations[0].options, key=lambda o: o.p)
    assert counter == "completed"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": top.text}
    assert body["results"] == reply.model_dump(mode="json")["results"]


def test_completions_batch_through_the_openai_sdk_matches_the_engine(tiny_engine, settings):
    """A batch whose endpoint is /v1/completions, through the official openai SDK: each line's
    body is the completion /v1/completions answers (the engine's figures, bit for bit); a body
    the route refuses is an error line with its 400."""
    from openai import OpenAI

    bos = tiny_engine.checkpoint.bos_token_id
    bodies = {
        "echo": {"prompt": TEXTS[0], "echo": True, "logprobs": 3, "max_tokens": 0},
        "ids": {"model": tiny_engine.model_name, "prompt": [[bos, 40, 41, 42], TEXTS[1]],
                "echo": True, "logprobs": 0, "max_tokens": 0},
        "greedy": {"prompt": TEXTS[2], "logprobs": 2, "max_tokens": 3, "temperature": 0},
    }
    refused = {"two": ({"prompt": "x", "n": 2}, "invalid_field"),
               "long": ({"prompt": [bos, *[10] * 4096], "max_tokens": 0}, "content_too_long")}
    rows = [{"custom_id": name, "method": "POST", "url": "/v1/completions", "body": body}
            for name, body in {**bodies, **{k: b for k, (b, _) in refused.items()}}.items()]
    expected = {name: tiny_engine.complete(body).model_dump(mode="json")
                for name, body in bodies.items()}
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings):
        client = OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=WAIT_S)
        upload = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                      completion_window="24h")
        assert batch.endpoint == "/v1/completions"
        batch = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status in (
            "completed", "failed") and b, what="the batch to finish")
        assert batch.status == "completed", batch
        assert batch.request_counts.model_dump() == {
            "total": len(rows), "completed": len(bodies), "failed": len(refused)}
        output = [json.loads(line) for line in
                  client.files.content(batch.output_file_id).text.splitlines()]
        errors = [json.loads(line) for line in
                  client.files.content(batch.error_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in output) == sorted(bodies)
    for line in output:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        want = expected[line["custom_id"]]
        # float equality is bit equality: logprobs, top-N, tokens, text, usage
        for key in ("model", "system_fingerprint", "choices", "usage"):
            assert body[key] == want[key], (line["custom_id"], key)
    assert {e["custom_id"]: e["error"]["code"] for e in errors} == {
        name: code for name, (_, code) in refused.items()}
    for e in errors:
        assert e["response"]["status_code"] == 400
        assert e["response"]["body"]["error"]["param"] in ("n", "prompt")


def test_cancel_gives_unanswered_lines_an_error_and_ignores_late_results(tiny_engine, settings):
    rows = [score_line(f"doc-{i}", TEXTS[i]) for i in range(30)]
    with LiveServer(settings) as server:
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        assert client.post("/batches/batch_missing/cancel").status_code == 404
        input_file = upload(client, jsonl(rows))
        batch = client.post("/batches", json={"input_file_id": input_file["id"],
                                              "endpoint": "/v1/score"}).json()
        batch_in(client, batch["id"], "in_progress")
        # cancelled once some lines are queued (on a loaded machine the first may come later)
        wait_for(lambda: client.get(f"/batches/{batch['id']}").json()["request_counts"]
                 ["total"] > 0, WAIT_S, 0.05, "a line queued")
        cancelling = client.post(f"/batches/{batch['id']}/cancel")
        assert cancelling.status_code == 200, cancelling.text
        assert cancelling.json()["status"] in ("cancelling", "cancelled")
        done = batch_in(client, batch["id"], "cancelled")
        assert done["cancelling_at"] <= done["cancelled_at"]
        assert done["output_file_id"] is None
        total = done["request_counts"]["total"]
        assert 0 < total <= 30 and done["request_counts"]["failed"] == total
        errors = lines_of(client, done["error_file_id"])
        assert len(errors) == total
        assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
        assert client.post(f"/batches/{batch['id']}/cancel").status_code == 400

        # Entries already queued are still scored: their jobs hold the results, the batch
        # does not change.
        with InProcessWorker(tiny_engine, settings):
            wait_for(lambda: queue_empty(httpx.get(f"{server.url}/metrics",
                                                   timeout=WAIT_S).text),
                     WAIT_S, 0.1, "the bulk queue to drain")
        after = client.get(f"/batches/{batch['id']}").json()
        assert after["request_counts"] == done["request_counts"]
        assert after["status"] == "cancelled"
        assert len(lines_of(client, done["error_file_id"])) == total


def test_a_custom_id_seen_on_an_invalid_line_is_refused_on_later_lines(tiny_engine, settings):
    """The first line with a custom_id is its request, valid or not: a later line with it gets
    a duplicate_custom_id error line and is never scored (only a valid first line is)."""
    bad_body = score_line("bad-first", "x")
    bad_body["body"]["scoring"] = {"queries": []}
    rows = [score_line("wrong-url-first", "x", url="/v1/embeddings"),
            score_line("wrong-url-first", TEXTS[0]),      # valid, but the id was taken
            bad_body,
            score_line("bad-first", TEXTS[1]),
            score_line("good", TEXTS[2]),
            score_line("good", TEXTS[3], url="/v1/embeddings")]   # invalid and a duplicate
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings):
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        input_file = upload(client, jsonl(rows))
        batch = client.post("/batches", json={"input_file_id": input_file["id"],
                                              "endpoint": "/v1/score"}).json()
        done = batch_in(client, batch["id"], "completed", "failed")
        assert done["request_counts"] == {"total": 6, "completed": 1, "failed": 5}, done
        [output] = lines_of(client, done["output_file_id"])
        errors = [(line["custom_id"], line["error"]["code"], line["error"]["line"])
                  for line in lines_of(client, done["error_file_id"])]
    assert output["custom_id"] == "good"
    assert sorted(errors) == [("bad-first", "duplicate_custom_id", 4),
                              ("bad-first", "empty_queries", 3),
                              ("good", "duplicate_custom_id", 6),
                              ("wrong-url-first", "duplicate_custom_id", 2),
                              ("wrong-url-first", "invalid_url", 1)]


@pytest.mark.asyncio
async def test_racing_and_repeated_results_count_once_and_finalize_once(redis, keys, settings):
    """Several workers reporting, each job reported three times (at-least-once delivery):
    every line counted once, the batch finalized once with consistent files."""
    count = 60
    content = jsonl([score_line(f"doc-{i}", TEXTS[i % len(TEXTS)]) for i in range(count)])
    input_file = await files.create_file(redis, keys, content, filename="in.jsonl",
                                         purpose="batch", ttl_s=600)
    batch = await batches.create_batch(redis, keys, input_file_id=input_file["id"],
                                       endpoint="/v1/score", completion_window="24h",
                                       metadata=None, ttl_s=600)
    await batches.enqueue_batch(redis, keys, Producer(redis, keys, settings), batch["id"])
    entries = [fields for _id, fields in await redis.xrange(keys.bulk)]
    assert len(entries) == count and {e["batch"] for e in entries} == {batch["id"]}

    def result(i: int) -> JobResult:
        if i % 10 == 0:
            return JobResult(status_code=400, error={
                "message": "no", "type": "invalid_request_error", "param": "model",
                "code": "model_not_found"})
        return JobResult.ok({"id": f"score-{i}", "queries": []})

    workers = asyncio.Semaphore(12)  # reports in flight at once, as from a dozen workers

    async def report(entry: dict) -> bool:
        async with workers:
            return await batches.record_result(redis, keys, batch["id"], entry["job"],
                                               entry["custom_id"],
                                               result(int(entry["custom_id"].split("-")[1])))

    recorded = await asyncio.gather(*[report(e) for e in entries for _ in range(3)])
    assert sum(recorded) == count

    done = await batches.get_batch(redis, keys, batch["id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": count, "completed": 54, "failed": 6}
    assert await redis.llen(keys.batch_lines(batch["id"], "out")) == 54
    assert not await redis.exists(keys.batch_pending(batch["id"]))
    out = "".join([chunk async for chunk in await files.iter_content(
        redis, keys, done["output_file_id"])])
    assert (await files.get_file(redis, keys, done["output_file_id"]))["bytes"] == len(out)
    failed = [json.loads(line) for line in await redis.lrange(
        keys.batch_lines(batch["id"], "err"), 0, -1)]
    assert {line["response"]["status_code"] for line in failed} == {400}
    assert {line["error"]["code"] for line in failed} == {"model_not_found"}

    # a report after the end changes nothing
    late = entries[1]
    assert not await batches.record_result(redis, keys, batch["id"], late["job"],
                                           late["custom_id"], result(1))
    assert (await batches.get_batch(redis, keys, batch["id"]))["request_counts"] == \
        done["request_counts"]


def test_uploads_and_batch_requests_are_checked(settings):
    settings = settings.model_copy(update={"max_file_bytes": 2000})
    with LiveServer(settings) as server:
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)

        def post_file(content: bytes, purpose: str = "batch") -> httpx.Response:
            return client.post("/files", data={"purpose": purpose},
                               files={"file": ("in.jsonl", content, "application/jsonl")})

        def chunked(content: bytes):
            # no Content-Length: the limit is enforced while the body streams in
            boundary = "spinf-boundary"
            yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
                   f"batch\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                   f"filename=\"in.jsonl\"\r\n\r\n").encode()
            yield content
            yield f"\r\n--{boundary}--\r\n".encode()

        too_big = post_file(b'{"custom_id": "x"}\n' * 200)
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == \
            "body_too_large"
        streamed = client.post("/files", content=chunked(b"x" * (2 << 20)), headers={
            "Content-Type": "multipart/form-data; boundary=spinf-boundary"})
        assert streamed.status_code == 413, streamed.text
        assert post_file(b"\xff\xfe not text").json()["error"]["code"] == "invalid_file"
        wrong_purpose = post_file(b"{}\n", purpose="fine-tune")
        assert wrong_purpose.status_code == 400
        assert wrong_purpose.json()["error"]["param"] == "purpose"
        missing = client.post("/files", data={"purpose": "batch"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "file"

        assert client.get("/files/file-missing").status_code == 404
        assert client.get("/files/file-missing/content").status_code == 404
        unknown_file = client.post("/batches", json={"input_file_id": "file-missing",
                                                     "endpoint": "/v1/score"})
        assert unknown_file.status_code == 404
        assert unknown_file.json()["error"]["code"] == "file_not_found"
        input_file = upload(client, jsonl([score_line("a", "x")]))
        for body, param in (({"endpoint": "/v1/embeddings"}, "endpoint"),
                            ({"endpoint": "/v1/score", "completion_window": "1h"},
                             "completion_window")):
            refused = client.post("/batches", json={"input_file_id": input_file["id"], **body})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param
        assert client.get("/batches/batch_missing").status_code == 404


def test_an_upload_without_a_key_is_a_401_before_its_form_is_read(settings):
    """The key is checked before the multipart form is parsed: a malformed form without a key
    was a 400 (found by test_schema_fuzz), and a well-formed one was read whole, then 401."""
    settings = settings.model_copy(update={"api_keys": ["sk-up"]})
    malformed = {"content": b"--b\r\n\xb5--b--\r\n",
                 "headers": {"Content-Type": "multipart/form-data; boundary=b"}}
    good = {"data": {"purpose": "batch"},
            "files": {"file": ("in.jsonl", jsonl([score_line("a", "x")]), "application/jsonl")}}
    with LiveServer(settings) as server:
        anonymous = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        for credentials in ({}, {"Authorization": "Bearer sk-wrong"}):
            for request in (malformed, good):
                headers = {**request.get("headers", {}), **credentials}
                refused = anonymous.post("/files", **{**request, "headers": headers})
                assert refused.status_code == 401, refused.text
                assert refused.json()["error"]["code"] == "invalid_token"
        keyed = httpx.Client(base_url=server.v1, timeout=WAIT_S,
                             headers={"Authorization": "Bearer sk-up"})
        bad = keyed.post("/files", **malformed)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_field", bad.text
        assert keyed.post("/files", **good).status_code == 200
        assert keyed.post("/files", data={"purpose": "batch"}).json()["error"]["param"] == "file"

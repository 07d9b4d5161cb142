"""Tenants: every API key belongs to one, and a tenant sees only its own jobs, files and
batches (another's id is a 404 like an unknown one); the server's token reads them all.
Idempotency-Keys are per tenant and bound to the body they were first sent with. A real
uvicorn on 127.0.0.1 and real Redis; no worker is needed for queued jobs."""

from __future__ import annotations

import httpx
import pytest
import redis as redis_sync

from api.auth import OPEN_TENANT, ApiKey, key_tenant, load_api_keys
from spinf_worker.queue.keys import Keys

from ..conftest import WAIT_S
from .live import LiveServer, jsonl, wait_for
from .test_api import REFUND, assert_error, entries_added
from .test_batches import score_line

OTHER = {**REFUND, "text": "The parcel never arrived."}
ASYNC = {"Prefer": "respond-async"}
OPERATOR = "op-token"


@pytest.fixture
def tenants(settings, tmp_path):
    """A server with keys of two tenants: acme (two keys, from the file), and a bare key
    that is a tenant of its own (from SPINF_API_KEYS); the operator's token."""
    keys_file = tmp_path / "keys"
    keys_file.write_text("# key tenant\nsk-acme-1 acme\n\n  sk-acme-2   acme  \n")
    settings = settings.model_copy(update={"api_keys": ["sk-solo"], "token": OPERATOR,
                                           "api_keys_file": str(keys_file)})
    with LiveServer(settings) as server:
        clients = {name: httpx.Client(base_url=server.v1, timeout=WAIT_S,
                                      headers={"Authorization": f"Bearer {key}"})
                   for name, key in (("acme", "sk-acme-1"), ("acme2", "sk-acme-2"),
                                     ("solo", "sk-solo"), ("operator", OPERATOR))}
        yield clients, settings
        for client in clients.values():
            client.close()


def assert_hidden(response: httpx.Response, unknown: httpx.Response, hidden_id: str,
                  unknown_id: str, code: str, param: str) -> None:
    """Another tenant's id is answered exactly as an unknown one (apart from the id)."""
    error = assert_error(response, 404, code, param)
    expected = assert_error(unknown, 404, code, param)
    assert error == {**expected, "message": expected["message"].replace(unknown_id, hidden_id)}


def test_keys_name_their_tenants(settings, tmp_path, monkeypatch):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\nold-style-key\n\nsk-1 acme\nsk-2\tacme\n")
    monkeypatch.setenv("SPINF_API_KEYS", '["env-key team.b", "env-bare"]')
    loaded = load_api_keys(type(settings)(api_keys_file=str(keys_file), token="tok"))
    assert set(loaded) == {
        ApiKey(b"env-key", "team.b"), ApiKey(b"env-bare", key_tenant("env-bare")),
        ApiKey(b"old-style-key", key_tenant("old-style-key")), ApiKey(b"sk-1", "acme"),
        ApiKey(b"sk-2", "acme"), ApiKey(b"tok", key_tenant("tok"))}
    # a bare key's tenant is a short digest, never the key
    assert key_tenant("old-style-key").startswith("key-")
    assert "old-style-key" not in key_tenant("old-style-key")
    assert key_tenant("a") != key_tenant("b")
    # the token listed with a tenant keeps it
    assert ApiKey(b"sk-1", "acme") in load_api_keys(settings.model_copy(
        update={"api_keys": ["sk-1 acme"], "token": "sk-1"}))

    for entries, problem in ((["k acme extra"], "expected"), (["k a:b"], "tenant"),
                             (["k -x"], "tenant"), (["k acme", "k other"], "another tenant")):
        with pytest.raises(ValueError, match=problem):
            load_api_keys(settings.model_copy(update={"api_keys": entries}))
    keys_file.write_text("k acme\nk\n")
    with pytest.raises(ValueError, match=rf"{keys_file.name}:2: .*another tenant"):
        load_api_keys(settings.model_copy(update={"api_keys_file": str(keys_file)}))


def test_jobs_are_visible_to_their_tenant_only(tenants):
    clients, _settings = tenants
    acme, acme2, solo, operator = (clients[n] for n in ("acme", "acme2", "solo", "operator"))
    created = acme.post("/jobs", json=REFUND)
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    scored = solo.post("/score", json=OTHER, headers=ASYNC)
    assert scored.status_code == 202, scored.text
    solo_job = scored.json()["id"]
    chat = solo.post("/chat/completions", headers=ASYNC, json={
        "messages": [{"role": "user", "content": OTHER["text"]}], "scoring": OTHER["scoring"]})
    assert chat.status_code == 202, chat.text

    for client in (acme, acme2, operator):     # the tenant's keys, and the operator
        job = client.get(f"/jobs/{job_id}")
        assert job.status_code == 200 and job.json()["status"] == "queued", job.text
        assert "tenant" not in job.json()
    for client, other_id in ((solo, job_id), (acme, solo_job), (acme2, chat.json()["id"])):
        assert_hidden(client.get(f"/jobs/{other_id}"), client.get("/jobs/job_unknown"),
                      other_id, "job_unknown", "job_not_found", "job_id")
    for other_id in (solo_job, chat.json()["id"]):
        assert operator.get(f"/jobs/{other_id}").status_code == 200


def test_idempotency_keys_are_per_tenant_and_bound_to_the_body(tenants):
    clients, settings = tenants
    acme, acme2, solo = clients["acme"], clients["acme2"], clients["solo"]
    key = {"Idempotency-Key": "order-1", **ASYNC}
    first = acme.post("/score", json=REFUND, headers=key)
    assert first.status_code == 202, first.text
    job_id = first.json()["id"]

    # the same key from another tenant, with another body, is that tenant's own new job
    theirs = solo.post("/score", json=OTHER, headers=key)
    assert theirs.status_code == 202 and theirs.json()["id"] != job_id, theirs.text
    assert solo.get(f"/jobs/{theirs.json()['id']}").status_code == 200
    assert solo.post("/score", json=OTHER, headers=key).json()["id"] == theirs.json()["id"]
    # the same key and body from the same tenant (any of its keys) is the same job
    for client in (acme, acme2):
        again = client.post("/score", json=REFUND, headers=key)
        assert again.status_code == 202 and again.json()["id"] == job_id, again.text
    assert entries_added(settings) == 2

    # the same key with another body is refused, on every route that takes one
    chat_body = {"messages": [{"role": "user", "content": "hello"}],
                 "scoring": REFUND["scoring"]}
    for path, body in (("/score", OTHER), ("/score", {**REFUND, "text": REFUND["text"] + " "}),
                       ("/chat/completions", chat_body),
                       ("/jobs", {**REFUND, "callback": "https://example.com/hook"}),
                       ("/jobs", {**REFUND, "deadline_s": 60})):
        assert_error(acme2.post(path, json=body, headers=key), 422, "idempotency_key_reused",
                     "Idempotency-Key")
    assert entries_added(settings) == 2    # nothing queued for them

    # /v1/jobs keys its jobs the same way: per tenant, bound to the body
    job_key = {"Idempotency-Key": "job-1"}
    queued = acme.post("/jobs", json={**REFUND, "deadline_s": 60}, headers=job_key)
    assert queued.status_code == 202, queued.text
    same = acme2.post("/jobs", json={**REFUND, "deadline_s": 60}, headers=job_key)
    assert same.json()["id"] == queued.json()["id"]
    assert_error(acme.post("/jobs", json={**REFUND, "deadline_s": 61}, headers=job_key), 422,
                 "idempotency_key_reused", "Idempotency-Key")
    other = solo.post("/jobs", json=OTHER, headers=job_key)
    assert other.status_code == 202 and other.json()["id"] != queued.json()["id"]
    assert entries_added(settings) == 4


def test_the_open_mode_is_one_tenant(settings):
    with LiveServer(settings) as server:
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        key = {"Idempotency-Key": "open-1", **ASYNC}
        job_id = client.post("/score", json=REFUND, headers=key).json()["id"]
        assert client.get(f"/jobs/{job_id}").status_code == 200
        assert client.post("/score", json=REFUND, headers=key).json()["id"] == job_id
        assert_error(client.post("/score", json=OTHER, headers=key), 422,
                     "idempotency_key_reused", "Idempotency-Key")
        client.close()
    stored = redis_sync.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        assert stored.hget(Keys(settings.prefix).job(job_id), "tenant") == OPEN_TENANT
    finally:
        stored.close()


def test_files_and_batches_are_visible_to_their_tenant_only(tenants):
    clients, settings = tenants
    acme, acme2, solo, operator = (clients[n] for n in ("acme", "acme2", "solo", "operator"))
    lines = [score_line(f"doc-{i}", f"Story {i}.") for i in range(3)]
    upload = acme.post("/files", data={"purpose": "batch"},
                       files={"file": ("in.jsonl", jsonl(lines), "application/jsonl")})
    assert upload.status_code == 200, upload.text
    file_id = upload.json()["id"]
    for client in (acme2, operator):
        assert client.get(f"/files/{file_id}").json() == upload.json()
        assert client.get(f"/files/{file_id}/content").content == jsonl(lines)
    for path in ("/files/{}", "/files/{}/content"):
        assert_hidden(solo.get(path.format(file_id)), solo.get(path.format("file-unknown")),
                      file_id, "file-unknown", "file_not_found", "file_id")
    # another tenant's file is no input for a batch either
    create = {"endpoint": "/v1/score", "completion_window": "24h"}
    assert_hidden(solo.post("/batches", json={**create, "input_file_id": file_id}),
                  solo.post("/batches", json={**create, "input_file_id": "file-unknown"}),
                  file_id, "file-unknown", "file_not_found", "input_file_id")

    batch = acme.post("/batches", json={**create, "input_file_id": file_id})
    assert batch.status_code == 200, batch.text
    batch_id = batch.json()["id"]
    solo_file = solo.post("/files", data={"purpose": "batch"},
                          files={"file": ("in.jsonl", jsonl(lines[:1]), "application/jsonl")})
    solo_batch = solo.post("/batches", json={**create, "input_file_id": solo_file.json()["id"]})
    assert solo_batch.status_code == 200, solo_batch.text
    solo_id = solo_batch.json()["id"]
    wait_for(lambda: acme.get(f"/batches/{batch_id}").json()["request_counts"]["total"] == 3,
             what="the batch to be queued")

    for path in ("/batches/{}", "/batches/{}/cancel"):
        method = solo.post if path.endswith("cancel") else solo.get
        assert_hidden(method(path.format(batch_id)), method(path.format("batch_unknown")),
                      batch_id, "batch_unknown", "batch_not_found", "batch_id")
    assert acme2.get(f"/batches/{batch_id}").json()["status"] == "in_progress"
    assert [b["id"] for b in solo.get("/batches").json()["data"]] == [solo_id]
    assert solo.get("/batches", params={"after": batch_id}).json()["data"] == []
    assert [b["id"] for b in acme2.get("/batches").json()["data"]] == [batch_id]
    assert [b["id"] for b in operator.get("/batches").json()["data"]] == [solo_id, batch_id]

    # the batch's jobs are its tenant's
    stored = redis_sync.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        keys = Keys(settings.prefix)
        jobs = [fields["job"] for _id, fields in stored.xrange(keys.bulk)
                if fields.get("batch") == batch_id]
    finally:
        stored.close()
    assert len(jobs) == 3
    for job_id in jobs:
        assert acme2.get(f"/jobs/{job_id}").status_code == 200
        assert solo.get(f"/jobs/{job_id}").status_code == 404

    # the files a batch produces are its tenant's too
    assert acme.post(f"/batches/{batch_id}/cancel").status_code == 200
    done = wait_for(lambda: (lambda b: b if b["status"] == "cancelled" else None)(
        acme.get(f"/batches/{batch_id}").json()), what="the batch to be cancelled")
    errors = done["error_file_id"]
    assert len(acme2.get(f"/files/{errors}/content").text.splitlines()) == 3
    assert operator.get(f"/files/{errors}").status_code == 200
    for path in ("/files/{}", "/files/{}/content"):
        assert_error(solo.get(path.format(errors)), 404, "file_not_found", "file_id")

"""Routing and authentication errors on the real app (uvicorn on loopback, real Redis): a 405
lists every method its path takes, and on every protected route the key is checked before
the body is read (an invalid body without a key is a 401, not a 400)."""

from __future__ import annotations

import re

import httpx
import pytest

from ..conftest import WAIT_S
from .live import LiveServer
from .test_api import assert_error

TOKEN = "operator-token"


@pytest.fixture
def keyed_server(settings):
    settings = settings.model_copy(update={"api_keys": ["key-a"], "token": TOKEN})
    with LiveServer(settings) as server:
        yield server


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("DELETE", "/v1/batches", {"GET", "POST"}),
    ("PUT", "/v1/batches", {"GET", "POST"}),
    ("DELETE", "/v1/batches/batch_x", {"GET"}),
    ("GET", "/v1/batches/batch_x/cancel", {"POST"}),
    ("GET", "/v0/drain", {"POST", "DELETE"}),
    ("DELETE", "/v1/score", {"POST"}),
    ("PATCH", "/v1/jobs", {"POST"}),
])
def test_a_405_allows_every_method_of_its_path(keyed_server, method, path, allowed):
    reply = httpx.request(method, keyed_server.url + path, timeout=WAIT_S,
                          headers={"Authorization": f"Bearer {TOKEN}"})
    assert_error(reply, 405, "method_not_allowed")
    assert set(reply.headers["allow"].split(", ")) - {"HEAD"} == allowed


def protected_routes(server: LiveServer) -> list[tuple[str, str]]:
    """(method, path with its parameters filled) of every /v1 and /v0 operation."""
    paths = server.app.openapi()["paths"]
    return [(method.upper(), re.sub(r"\{[^}]*\}", "x", path))
            for path, operations in paths.items() if path.startswith(("/v1", "/v0"))
            for method in operations]


def test_every_protected_route_checks_the_key_before_the_body(keyed_server):
    routes = protected_routes(keyed_server)
    assert ("POST", "/v1/batches") in routes and ("POST", "/v0/drain") in routes
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong-key"}):
            for content_type in ("application/json", "multipart/form-data; boundary=x"):
                reply = httpx.request(method, keyed_server.url + path, content=b"{",
                                      headers={**headers, "content-type": content_type},
                                      timeout=WAIT_S)
                assert reply.status_code == 401, (method, path, reply.text)
                assert_error(reply, 401, "invalid_token")


def test_a_batch_body_is_still_checked_with_a_key(keyed_server):
    client = httpx.Client(base_url=keyed_server.v1, timeout=WAIT_S,
                          headers={"Authorization": "Bearer key-a"})
    assert_error(client.post("/batches", content=b"{"), 400, "invalid_json")
    assert_error(client.post("/batches", json=[]), 400, "invalid_field")
    assert_error(client.post("/batches", json={"endpoint": "/v1/score"}), 400,
                 "invalid_field", "input_file_id")
    assert_error(client.post("/batches", json={"input_file_id": "file-x", "endpoint": "/v1/x"}),
                 400, "invalid_field", "endpoint")
    assert_error(client.post("/batches", json={"input_file_id": "file-x",
                                               "endpoint": "/v1/score", "extra": 1}),
                 400, "invalid_field", "extra")
    assert_error(client.post("/batches", json={"input_file_id": "file-x",
                                               "endpoint": "/v1/score"}),
                 404, "file_not_found", "input_file_id")

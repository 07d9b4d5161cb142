"""Routing errors on the real app (uvicorn on loopback, real Redis): a 405 lists every method
its path takes."""

from __future__ import annotations

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

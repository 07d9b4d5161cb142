"""Ingest fixtures: the real Redis with a private prefix per test (tests/service/conftest.py),
a feed server on 127.0.0.1 in a thread, a queries file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import pytest_asyncio

from spinf_worker.queue.redis_client import connect
from tests.service.conftest import keys, prefix, redis_url, settings  # noqa: F401 (fixtures)

from ..conftest import WAIT_S
from .helpers import QUERIES, FeedServer


@pytest.fixture
def feed_server():
    server = FeedServer()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def queries_file(tmp_path) -> Path:
    path = tmp_path / "queries.json"
    path.write_text(json.dumps(QUERIES))
    return path


@pytest_asyncio.fixture
async def redis(redis_url):  # noqa: F811
    client = connect(redis_url, socket_timeout=WAIT_S)
    yield client
    await client.aclose()

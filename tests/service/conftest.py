"""Service fixtures: the real Redis at 127.0.0.1:6379, one private key prefix per test."""

from __future__ import annotations

import os
import uuid

import pytest
import pytest_asyncio
import redis

from spinf_worker.queue.keys import Keys
from spinf_worker.queue.redis_client import connect
from spinf_worker.queue.settings import ServiceSettings

from ..conftest import WAIT_S

REDIS_URL = os.environ.get("SPINF_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def redis_url() -> str:
    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.ConnectionError as err:
        pytest.fail(f"tests need Redis at {REDIS_URL} (.ci/run starts one): {err}")
    return REDIS_URL


@pytest_asyncio.fixture(name="redis")
async def async_redis(redis_url):
    """The service's own asyncio client of the test Redis (queue/redis_client.connect)."""
    client = connect(redis_url, socket_timeout=WAIT_S)
    yield client
    await client.aclose()


@pytest.fixture
def prefix(redis_url):
    """A fresh key prefix; every key under it is deleted after the test."""
    name = f"spinf-test-{uuid.uuid4().hex[:10]}"
    yield name
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=f"{name}:*", count=1000):
        client.delete(key)


@pytest.fixture
def keys(prefix) -> Keys:
    return Keys(prefix)


@pytest.fixture
def settings(redis_url, prefix) -> ServiceSettings:
    """Fast timings for tests; each test may copy and adjust (model_copy(update=...)).

    What only a slow machine would trip stays generous: a worker counts as live for WAIT_S
    after its last heartbeat, and /v1/score waits for its result half the clients' timeout."""
    return ServiceSettings(redis_url=redis_url, prefix=prefix, max_wait_ms=20,
                           claim_idle_ms=1500, heartbeat_s=0.5, worker_ttl_s=WAIT_S,
                           sync_timeout_s=WAIT_S / 2, callback_backoff_s=0.2)

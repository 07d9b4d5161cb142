"""One place that decides how the service talks to Redis: timeouts, retries, health checks."""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

CONNECT_TIMEOUT_S = 5.0
# Longer than any BLOCK the service asks for (workers and reply readers block for about a
# second), so a blocking read never trips the socket timeout.
SOCKET_TIMEOUT_S = 30.0
HEALTH_CHECK_INTERVAL_S = 15
MAX_CONNECTIONS = 256
POOL_WAIT_S = 10.0   # a busy process waits this long for a pooled connection, then errors


def connect(url: str, *, client_name: str | None = None,
            socket_timeout: float = SOCKET_TIMEOUT_S) -> Redis:
    """An asyncio client for ``url`` (redis://, rediss:// or unix://) with decoded replies.

    Connections are made lazily; a dropped connection is retried a few times with jittered
    backoff before the error reaches the caller, which decides whether to wait and go on."""
    # TCP keepalive is a TCP socket's option: a unix socket's connection takes no such argument
    tcp = {} if url.startswith("unix:") else {"socket_keepalive": True}
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=POOL_WAIT_S,
        decode_responses=True,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=socket_timeout,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        **tcp,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=3),
        retry_on_error=[ConnectionError, TimeoutError],
        client_name=client_name,
    )
    return Redis.from_pool(pool)   # the client owns the pool and closes it with itself

"""One place that decides how the service talks to Redis: timeouts, retries, health checks."""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError, TimeoutError

try:   # redis-py 8.1+, whose asyncio pool takes part in maintenance notifications
    from redis.asyncio import maint_notifications as _async_maint  # noqa: F401
    from redis.maint_notifications import MaintNotificationsConfig
except ImportError:
    _POOL_CHECKS = {}
else:
    # With them on (the default, "auto", under RESP3) redis-py 8.1 skips the check that
    # replaces a pooled connection the server closed, so after a Redis restart every stale
    # connection reaches a command ("Connection closed by server"). They only serve Redis
    # Enterprise's planned maintenance; the retries below cover a moved endpoint too.
    _POOL_CHECKS = {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}

CONNECT_TIMEOUT_S = 5.0
# Longer than any BLOCK the service asks for (workers and reply readers block for about a
# second), so a blocking read never trips the socket timeout.
SOCKET_TIMEOUT_S = 30.0
# A connection idle this long is PINGed before its next command: a half-open one (no FIN
# seen, e.g. behind a load balancer) fails on the PING, which is safe to retry.
HEALTH_CHECK_INTERVAL_S = 15
MAX_CONNECTIONS = 256
POOL_WAIT_S = 10.0   # a busy process waits this long for a pooled connection, then errors
# Retries after a connection failure: jittered waits of at most 0.1, 0.2, 0.4 s, so a Redis
# that is down costs a caller under a second before the error reaches it.
RETRIES = 3
RETRY_BASE_S = 0.05
RETRY_CAP_S = 1.0


def connect(url: str, *, client_name: str | None = None,
            socket_timeout: float = SOCKET_TIMEOUT_S, retries: int = RETRIES) -> Redis:
    """An asyncio client for ``url`` (redis://, rediss:// or unix://) with decoded replies.

    Connections are made lazily. A pooled connection the server closed (a Redis restart) is
    replaced when the pool hands it out; a command that fails on a dropped connection
    (ConnectionError, TimeoutError, BusyLoadingError while a restarted Redis loads its data)
    is sent again on a new connection up to ``retries`` times with backoff, then the error
    reaches the caller, which decides whether to wait and go on.

    redis-py retries whole commands (and MULTI/EXEC blocks): one whose reply was lost after
    Redis ran it runs twice. That is harmless for reads, SETs and the workers' at-least-once
    steps; a client whose writes must not repeat passes ``retries=0``."""
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
        # the asyncio Retry: redis.retry.Retry would call the coroutine without awaiting it
        # inside its try, so it would never retry anything
        retry=Retry(ExponentialWithJitterBackoff(base=RETRY_BASE_S, cap=RETRY_CAP_S),
                    retries=retries),
        retry_on_error=[ConnectionError, TimeoutError],
        client_name=client_name,
        **_POOL_CHECKS,
    )
    return Redis.from_pool(pool)   # the client owns the pool and closes it with itself

"""Webhook callbacks: a dispatcher drains the callbacks stream and POSTs each finished job to
its callback URL, signed the Standard Webhooks way (docs/CALLBACKS.md; signatures, the SSRF
guard and the retry policy of one POST are in spinf_worker/webhooks.py).

Records it relies on (written by workers, docs/QUEUE.md):
- ``keys.callbacks``: stream entries ``{job: <id>}`` (``retry: 1`` on entries it re-adds itself);
- ``keys.job(id)``: hash with ``callback`` (the URL), ``status``, ``custom_id``, ``finished_at``;
- ``keys.result(id)``: the job's result (results.JobResult).

Retries do not block other deliveries: a delivery that has to wait goes into a sorted set of
due times (``Keys.callback_retry``), and a dispatcher moves due jobs back onto the stream with one Lua
script, so whichever dispatcher runs picks them up. The attempt count lives on the job hash
and the due time in Redis, so a restart loses neither. Delivery is at least once; receivers
dedupe on ``webhook-id``, which is the same for every attempt of a job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone

import httpx
import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from ..webhooks import (
    USER_AGENT,
    Attempt,
    CallbackRefused,
    Target,
    TargetGuard,
    backoff_s,
    classify,
    secret_bytes,
    sign_with_key,
)
from .keys import DISPATCHERS, Keys
from .results import JobResult
from .settings import ServiceSettings

log = structlog.get_logger(__name__)

CONCURRENCY = 32              # deliveries in flight per dispatcher
READ_BLOCK_MS = 500           # one XREADGROUP waits at most this long (also the stop latency)
PROMOTE_BATCH = 100           # due retries moved back onto the stream per script call
CLAIM_EVERY_S = 5.0           # how often a dispatcher looks for entries of dead dispatchers
ERROR_DELAY_S = 1.0           # after a Redis error, so an outage is no busy loop
FINAL_STATES = ("delivered", "failed", "refused")


def build_event(job_id: str, job: Mapping[str, str], result: JobResult | None) -> dict:
    """The webhook body: the job's outcome and its response (or error)."""
    if result is None:
        succeeded, body = False, None
        error = {"message": "the job's result is no longer stored", "type": "server_error"}
    else:
        succeeded, body, error = result.succeeded, result.body, result.error
    finished = job.get("finished_at")
    when = float(finished) if finished else time.time()
    return {
        "type": "score.succeeded" if succeeded else "score.failed",
        "timestamp": datetime.fromtimestamp(when, tz=timezone.utc).isoformat(),
        "data": {"id": job_id, "custom_id": job.get("custom_id"), "status": job.get("status"),
                 "response": body if succeeded else None, "error": None if succeeded else error},
    }


_PROMOTE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for _, job in ipairs(due) do
  redis.call('ZREM', KEYS[1], job)
  redis.call('XADD', KEYS[2], '*', 'job', job, 'retry', '1')
end
return #due
"""


class CallbackDispatcher:
    """Consumer ``name`` of group ``dispatchers`` on ``keys.callbacks``.

    ``redis`` must decode responses (``redis_client.connect``). Entries another dispatcher
    held for ``claim_idle_ms`` (default: 3x the HTTP timeout, at least 30 s) are taken over.
    ``transport`` replaces the HTTP transport (tests)."""

    def __init__(self, redis: Redis, keys: Keys, settings: ServiceSettings,
                 name: str | None = None, *, concurrency: int = CONCURRENCY,
                 claim_idle_ms: int | None = None,
                 transport: httpx.AsyncBaseTransport | None = None):
        if not settings.webhook_secret:
            raise ValueError("callbacks need a signing secret: set SPINF_WEBHOOK_SECRET "
                             "(spinf-serve serve generates one)")
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.concurrency = concurrency
        self.guard = TargetGuard(settings.callback_allow)
        self._key = secret_bytes(settings.webhook_secret)
        self._transport = transport
        self._promote = redis.register_script(_PROMOTE)
        self._retry_key = keys.callback_retry
        # an entry idle this long belongs to a dead dispatcher (a POST takes <= the timeout)
        self._claim_idle_ms = claim_idle_ms or int(max(30.0, 3 * settings.callback_timeout_s)
                                                   * 1000)
        self._tasks: set[asyncio.Task] = set()
        self._active_jobs: set[str] = set()
        self._active_entries: set[str] = set()
        self._log = log.bind(dispatcher=self.name)

    async def ensure_group(self) -> None:
        try:
            # from "0": entries added before the first dispatcher started are delivered too
            await self.redis.xgroup_create(self.keys.callbacks, DISPATCHERS, id="0",
                                           mkstream=True)
        except ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    async def run(self, stop: asyncio.Event) -> None:
        self._log.info("dispatcher started", stream=self.keys.callbacks)
        # No keep-alive: requests go to a pinned IP with the host name as SNI, and a pooled
        # connection keyed by that IP must not be reused for another host on the same IP.
        client = httpx.AsyncClient(
            timeout=self.settings.callback_timeout_s, follow_redirects=False, trust_env=False,
            limits=httpx.Limits(max_keepalive_connections=0), transport=self._transport,
            headers={"user-agent": USER_AGENT})
        # first our own unacknowledged entries (after a restart), paged by id, then new ones
        pending_from: str | None = "0"
        next_claim = 0.0
        group_ready = False
        try:
            while not stop.is_set():
                try:
                    if not group_ready:
                        await self.ensure_group()
                        group_ready = True
                    wait_ms = await self._promote_due()
                    if time.monotonic() >= next_claim:
                        await self._claim_stale(client)
                        next_claim = time.monotonic() + CLAIM_EVERY_S
                    free = self.concurrency - len(self._tasks)
                    if free <= 0:
                        await asyncio.wait(self._tasks, timeout=READ_BLOCK_MS / 1000,
                                           return_when=asyncio.FIRST_COMPLETED)
                        continue
                    reply = await self.redis.xreadgroup(
                        DISPATCHERS, self.name, {self.keys.callbacks: pending_from or ">"},
                        count=free, block=None if pending_from else min(wait_ms, READ_BLOCK_MS))
                    entries = reply[0][1] if reply else []
                    if pending_from is not None:
                        pending_from = entries[-1][0] if entries else None
                    for entry_id, fields in entries:
                        self._spawn(client, entry_id, fields)
                except RedisError as err:
                    self._log.warning("redis error; retrying", error=str(err))
                    group_ready = group_ready and "NOGROUP" not in str(err)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), ERROR_DELAY_S)
        finally:
            await self._drain()
            await client.aclose()
            self._log.info("dispatcher stopped")

    async def _drain(self) -> None:
        """Let deliveries in flight finish (bounded by the HTTP timeout); what is cancelled
        stays pending in the group and is delivered after a restart or a claim."""
        if self._tasks:
            _, late = await asyncio.wait(self._tasks, timeout=self.settings.callback_timeout_s + 1)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)

    async def _promote_due(self) -> int:
        """Moves due retries onto the stream; returns ms until the next one (for BLOCK)."""
        now_ms = int(time.time() * 1000)
        await self._promote(keys=[self._retry_key, self.keys.callbacks],
                            args=[now_ms, PROMOTE_BATCH])
        head = await self.redis.zrange(self._retry_key, 0, 0, withscores=True)
        if not head:
            return READ_BLOCK_MS
        return max(1, int(head[0][1]) - now_ms)

    async def _claim_stale(self, client: httpx.AsyncClient) -> None:
        cursor = "0-0"
        while True:
            free = self.concurrency - len(self._tasks)
            if free <= 0:
                return
            cursor, claimed, *_ = await self.redis.xautoclaim(
                self.keys.callbacks, DISPATCHERS, self.name, self._claim_idle_ms,
                start_id=cursor, count=free)
            for entry_id, fields in claimed:
                self._spawn(client, entry_id, fields)
            if cursor == "0-0":
                return

    def _spawn(self, client: httpx.AsyncClient, entry_id: str, fields: dict | None) -> None:
        if entry_id in self._active_entries:
            return          # claimed back while still in flight here: it is being handled
        self._active_entries.add(entry_id)
        task = asyncio.create_task(self._handle(client, entry_id, fields or {}))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: self._active_entries.discard(entry_id))

    async def _handle(self, client: httpx.AsyncClient, entry_id: str, fields: dict) -> None:
        job_id = fields.get("job")
        if job_id and job_id in self._active_jobs:
            # the same job twice at once (a repeated worker step): one delivery is enough
            await self._ack(entry_id)
            return
        if job_id:
            self._active_jobs.add(job_id)
        try:
            if job_id:
                await self._deliver(client, job_id)
            # acknowledged only once the outcome (or the next due time) is stored
            await self._ack(entry_id)
        except Exception as err:   # noqa: BLE001 - left pending: retried after a claim
            self._log.warning("callback entry left pending", entry=entry_id, job=job_id,
                              error=repr(err))
        finally:
            if job_id:
                self._active_jobs.discard(job_id)

    async def _ack(self, entry_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.keys.callbacks, DISPATCHERS, entry_id)
            pipe.xdel(self.keys.callbacks, entry_id)
            await pipe.execute()

    async def _deliver(self, client: httpx.AsyncClient, job_id: str) -> None:
        job_key = self.keys.job(job_id)
        job = await self.redis.hgetall(job_key)
        jlog = self._log.bind(job=job_id)
        if not job:
            jlog.warning("callback dropped: the job record is gone")
            await self.redis.hincrby(self.keys.stats, "callbacks_failed", 1)
            return
        url = job.get("callback")
        if not url or job.get("callback_status") in FINAL_STATES:
            return
        attempts = int(job.get("callback_attempts") or 0)
        if attempts >= self.settings.callback_max_attempts:
            await self._store(job_key, {"callback_status": "failed"},
                              clear=("callback_next_at",), counters=("callbacks_failed",))
            return
        try:
            target = await self.guard.resolve(url)
        except CallbackRefused as err:
            jlog.warning("callback refused", reason=str(err))
            await self._store(job_key, {"callback_status": "refused",
                                        "callback_last_error": str(err)},
                              clear=("callback_next_at",), counters=("callbacks_refused",))
            return

        raw = await self.redis.get(self.keys.result(job_id))
        body = json.dumps(build_event(job_id, job, JobResult.from_json(raw) if raw else None),
                          separators=(",", ":"), ensure_ascii=False).encode()
        attempt_no = attempts + 1
        # counted before the POST: a crash mid-request still uses up an attempt
        await self._store(job_key, {"callback_attempts": attempt_no})
        attempt = await self._post(client, target, f"msg_{job_id}", body)
        fields: dict = {}
        clear = ["callback_next_at"]
        for name, value in (("callback_last_status", attempt.status_code),
                            ("callback_last_error", attempt.error)):
            if value:
                fields[name] = value
            else:
                clear.append(name)
        counters = [f"callback_attempts_{attempt.bucket}"]
        jlog = jlog.bind(attempt=attempt_no, host=target.url.host, status=attempt.status_code)

        if attempt.outcome == "delivered":
            jlog.info("callback delivered")
            await self._store(job_key, {**fields, "callback_status": "delivered"}, clear=clear,
                              counters=[*counters, "callbacks_delivered"])
        elif attempt.outcome == "retry" and attempt_no < self.settings.callback_max_attempts:
            delay = backoff_s(attempt_no, self.settings.callback_backoff_s)
            if attempt.retry_after_s is not None:
                delay = max(delay, attempt.retry_after_s)
            due_ms = int((time.time() + delay) * 1000)
            jlog.info("callback will be retried", error=attempt.error, delay_s=round(delay, 3))
            clear.remove("callback_next_at")
            await self._store(job_key, {**fields, "callback_status": "pending",
                                        "callback_next_at": due_ms},
                              clear=clear, counters=counters, retry=(job_id, due_ms))
        else:
            jlog.warning("callback failed", error=attempt.error)
            await self._store(job_key, {**fields, "callback_status": "failed"}, clear=clear,
                              counters=[*counters, "callbacks_failed"])

    async def _post(self, client: httpx.AsyncClient, target: Target, msg_id: str,
                    body: bytes) -> Attempt:
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "host": target.url.netloc.decode("ascii"),
            "webhook-id": msg_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign_with_key(self._key, msg_id, timestamp, body),
        }
        extensions = {"sni_hostname": target.url.host} if target.url.scheme == "https" else {}
        try:
            response = await client.post(target.request_url(), content=body, headers=headers,
                                         extensions=extensions)
        except httpx.TransportError as err:
            return Attempt("retry", "error", None, f"{type(err).__name__}: {err}".rstrip(": "))
        return classify(response)

    async def _store(self, job_key: str, fields: Mapping, *, clear: Iterable[str] = (),
                     counters: Iterable[str] = (), retry: tuple[str, int] | None = None) -> None:
        """One transaction: the job's callback fields, stats counters, the next due time."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(job_key, mapping=dict(fields))
            if clear:
                pipe.hdel(job_key, *clear)
            # never leave a record without a TTL if it expired under us
            pipe.expire(job_key, self.settings.result_ttl_s, nx=True)
            for counter in counters:
                pipe.hincrby(self.keys.stats, counter, 1)
            if retry is not None:
                pipe.zadd(self._retry_key, {retry[0]: retry[1]})
            await pipe.execute()

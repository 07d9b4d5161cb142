"""Putting scoring jobs on the work streams, and reading back what became of them."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from .. import jsonio
from .keys import GROUP, Keys
from .results import JobResult
from .settings import ServiceSettings

PRIORITIES = ("interactive", "bulk")
# job hash fields stored as integers (the rest are strings; `error` is JSON)
_INT_FIELDS = ("created_at", "started_at", "finished_at", "deadline_ms", "callback_attempts")


@dataclass
class Submission:
    request: dict                      # a validated ScoreRequest body (JSON-able dict)
    priority: str = "interactive"      # "interactive" | "bulk"
    callback: str | None = None
    idempotency_key: str | None = None
    batch_id: str | None = None
    custom_id: str | None = None
    deadline_s: float | None = None    # seconds from now
    reply_to: str | None = None        # the waiting API instance's id (replies.py)
    # the API tenant that owns the job (api/auth.py); its idempotency keys are its own.
    # None: a job of no tenant (ingestion), which only operators read back.
    tenant: str | None = None
    job_id: str | None = None          # the id to give the job (default: a new one)

    def digest(self) -> str:
        """What makes two submissions the same job: the request and the job's own fields as
        canonical JSON (sorted keys), not the waiting instance."""
        canonical = {"request": self.request, "priority": self.priority,
                     "callback": self.callback, "batch_id": self.batch_id,
                     "custom_id": self.custom_id, "deadline_s": self.deadline_s}
        text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


class IdempotencyKeyReused(Exception):
    """The idempotency key already names a job submitted with another body."""

    def __init__(self, key: str, job_id: str):
        super().__init__(f"idempotency key {key!r} already names job {job_id} of another "
                         "request")
        self.key = key
        self.job_id = job_id


def new_job_id() -> str:
    return f"job_{uuid.uuid4().hex}"


def decode_job(job_id: str, fields: dict[str, str]) -> dict:
    job: dict = {"id": job_id, **fields}
    for name in _INT_FIELDS:
        if name in job:
            job[name] = int(float(job[name]))
    if "error" in job:
        job["error"] = json.loads(job["error"])
    return job


class Producer:
    def __init__(self, redis: Redis, keys: Keys, settings: ServiceSettings):
        self.redis = redis
        self.keys = keys
        self.settings = settings

    def _stream(self, priority: str) -> str:
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, not {priority!r}")
        return self.keys.interactive if priority == "interactive" else self.keys.bulk

    async def submit(self, sub: Submission) -> tuple[str, bool]:
        """Enqueue one job; returns (job id, created). A known idempotency key returns the
        job it already named, and nothing is enqueued; when that job was submitted with a
        different body, IdempotencyKeyReused (with the job's id) is raised instead."""
        stream = self._stream(sub.priority)
        job_id = sub.job_id or new_job_id()
        ttl = self.settings.result_ttl_s
        if sub.idempotency_key is not None:
            key = (self.keys.idempotency(sub.idempotency_key) if sub.tenant is None
                   else self.keys.tenant_idempotency(sub.tenant, sub.idempotency_key))
            digest = sub.digest()
            # SET NX decides the race between two submissions with the same key
            if not await self.redis.set(key, f"{job_id} {digest}", nx=True, ex=ttl):
                existing = await self.redis.get(key)
                if existing is not None:
                    # a value without a digest predates them: it cannot be told apart
                    existing_id, _, existing_digest = existing.partition(" ")
                    if existing_digest and existing_digest != digest:
                        raise IdempotencyKeyReused(sub.idempotency_key, existing_id)
                    return existing_id, False
                # the key expired in between: claim it for this submission
                await self.redis.set(key, f"{job_id} {digest}", ex=ttl)

        now = time.time()
        deadline_ms = (int((now + sub.deadline_s) * 1000) if sub.deadline_s is not None
                       else None)
        job = {"status": "queued", "created_at": int(now), "priority": sub.priority,
               "model": sub.request.get("model"), "batch_id": sub.batch_id,
               "custom_id": sub.custom_id, "callback": sub.callback, "deadline_ms": deadline_ms,
               "tenant": sub.tenant}
        entry = {"job": job_id, "payload": jsonio.dumps(sub.request),
                 "enqueued_ms": int(now * 1000), "deadline_ms": deadline_ms,
                 "reply": self.keys.reply(sub.reply_to) if sub.reply_to else None,
                 "batch": sub.batch_id, "custom_id": sub.custom_id, "callback": sub.callback}
        # One transaction, job hash first: a worker that sees the entry finds the hash.
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.job(job_id), mapping=_present(job))
            pipe.expire(self.keys.job(job_id), ttl)
            pipe.xadd(stream, _present(entry))   # never trimmed: that could drop work
            await pipe.execute()
        return job_id, True

    async def backlog(self) -> int:
        """Entries waiting or in flight across both work streams."""
        # every stream's groups in one round trip (each request asks before it is queued)
        async with self.redis.pipeline(transaction=False) as pipe:
            self.ask_backlog(pipe)
            replies = await pipe.execute(raise_on_error=False)
        return await self.backlog_of(replies)

    def ask_backlog(self, pipe) -> None:
        """Queue on ``pipe`` what ``backlog_of`` reads (``execute(raise_on_error=False)``):
        a caller's other reads go in the same round trip."""
        for stream in self.keys.streams:
            pipe.xinfo_groups(stream)

    async def backlog_of(self, replies: list) -> int:
        """The backlog from the replies to ``ask_backlog``'s commands."""
        total = 0
        for stream, groups in zip(self.keys.streams, replies, strict=True):
            if isinstance(groups, ResponseError):   # no stream yet
                groups = []
            elif isinstance(groups, Exception):
                raise groups
            group = next((g for g in groups if g["name"] == GROUP), None)
            if group is None or group.get("lag") is None:
                # no group yet, or Redis cannot tell the lag: acked entries are deleted, so
                # the length is what is left to do
                total += await self.redis.xlen(stream)
            else:
                total += int(group["lag"]) + int(group["pending"])
        return total

    async def get_job(self, job_id: str) -> dict | None:
        fields = await self.redis.hgetall(self.keys.job(job_id))
        return decode_job(job_id, fields) if fields else None

    async def get_result(self, job_id: str) -> JobResult | None:
        raw = await self.redis.get(self.keys.result(job_id))
        return JobResult.from_json(raw) if raw is not None else None


def _present(fields: dict) -> dict:
    """Redis stores no None: leave those fields out."""
    return {k: v for k, v in fields.items() if v is not None}

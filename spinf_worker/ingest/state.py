"""What the ingest consumer keeps in Redis so that a restart resumes where it stopped and no
item is scored or written twice (docs/INGEST.md, key table in docs/QUEUE.md).

All keys sit under ``<prefix>:{q}:ingest:<name>`` (the service's hash tag, so a Redis Cluster
keeps them in one slot with the work streams and the multi-key scripts work).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass

from redis.asyncio import Redis

from ..errors import SpinfError
from ..queue.keys import Keys

LEASE_MS = 15_000            # a consumer that stops renewing for this long is gone
LEASE_RENEW_S = 5.0


class LeaseError(SpinfError):
    """Another ingest consumer with the same name runs on this Redis."""


def digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class IngestKeys:
    keys: Keys
    name: str

    @property
    def base(self) -> str:
        return f"{self.keys.base}:ingest:{self.name}"

    @property
    def seen(self) -> str:
        """Sorted set: identity (guid / link / content hash digest) -> first seen (ms)."""
        return f"{self.base}:seen"

    @property
    def pending(self) -> str:
        """Hash: item key -> JSON record of an item claimed and not yet in every sink."""
        return f"{self.base}:pending"

    @property
    def lease(self) -> str:
        return f"{self.base}:lease"

    @property
    def reply_instance(self) -> str:
        """The reply stream workers notify (``Keys.reply``) is this consumer's own."""
        return f"ingest-{self.name}"

    def source(self, source: str) -> str:
        """Hash: a source's cursor and health (etag, last_modified, offset, errors, ...)."""
        return f"{self.base}:source:{source}"

    def sunk(self, sink_id: str) -> str:
        """Sorted set: item key -> when it was written to that sink (ms)."""
        return f"{self.base}:sunk:{sink_id}"

    def intent(self, sink_id: str) -> str:
        """Hash: item key -> where its line is about to be written (JSONL sinks)."""
        return f"{self.base}:intent:{sink_id}"


# KEYS: seen, pending. ARGV: now ms, item key, record JSON, identities...
# New only when no identity was seen: then all are remembered and the record is pending.
_CLAIM = """
for i = 4, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then return 0 end
end
for i = 4, #ARGV do redis.call('ZADD', KEYS[1], ARGV[1], ARGV[i]) end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
return 1
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


_TAKE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) and 1 or 0
end
return 0
"""


def _dead_here(holder: str) -> bool:
    """Whether the lease ``host:pid:nonce`` belongs to a process of this host that is gone."""
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class State:
    def __init__(self, redis: Redis, keys: IngestKeys):
        self.redis = redis
        self.keys = keys
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._claim = redis.register_script(_CLAIM)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self._take = redis.register_script(_TAKE)

    # ---- one consumer per name ---------------------------------------------------------

    async def acquire(self) -> None:
        if await self.redis.set(self.keys.lease, self.token, nx=True, px=LEASE_MS):
            return
        holder = await self.redis.get(self.keys.lease) or ""
        # a consumer of this machine that died (kill -9, a crash) need not be waited for
        if _dead_here(holder) and await self._take(keys=[self.keys.lease],
                                                   args=[holder, self.token, LEASE_MS]):
            return
        raise LeaseError(f"another ingest consumer named {self.keys.name!r} is running on "
                         f"this Redis ({holder}); stop it, or give this one --name")

    async def renew(self) -> bool:
        return bool(await self._renew(keys=[self.keys.lease], args=[self.token, LEASE_MS]))

    async def release(self) -> None:
        await self._release(keys=[self.keys.lease], args=[self.token])

    # ---- items ---------------------------------------------------------------------------

    async def claim(self, key: str, identities: list[str], record: dict) -> bool:
        """Remember the item and make it pending, unless any identity was seen before."""
        return bool(await self._claim(
            keys=[self.keys.seen, self.keys.pending],
            args=[now_ms(), key, json.dumps(record, separators=(",", ":")), *identities]))

    async def update(self, key: str, record: dict) -> None:
        await self.redis.hset(self.keys.pending, key, json.dumps(record, separators=(",", ":")))

    async def pending(self) -> dict[str, dict]:
        raw = await self.redis.hgetall(self.keys.pending)
        return {key: json.loads(value) for key, value in raw.items()}

    async def sunk(self, sink_id: str, keys: list[str]) -> set[str]:
        """The item keys among ``keys`` already written to the sink."""
        if not keys:
            return set()
        scores = await self.redis.zmscore(self.keys.sunk(sink_id), keys)
        return {key for key, score in zip(keys, scores, strict=True) if score is not None}

    async def done(self, keys: list[str]) -> None:
        if keys:
            await self.redis.hdel(self.keys.pending, *keys)

    async def trim(self, remember_days: float, sink_ids: list[str]) -> None:
        """Forget identities and sink marks older than ``remember_days`` (an item seen again
        after that is scored again)."""
        oldest = now_ms() - int(remember_days * 86_400_000)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(self.keys.seen, "-inf", oldest)
            for sink_id in sink_ids:
                pipe.zremrangebyscore(self.keys.sunk(sink_id), "-inf", oldest)
            await pipe.execute()

    # ---- sources -------------------------------------------------------------------------

    async def source(self, name: str) -> dict[str, str]:
        return await self.redis.hgetall(self.keys.source(name))

    async def set_source(self, name: str, fields: dict, clear: tuple[str, ...] = ()) -> None:
        present = {k: v for k, v in fields.items() if v is not None}
        gone = [*clear, *(k for k, v in fields.items() if v is None)]
        async with self.redis.pipeline(transaction=True) as pipe:
            if present:
                pipe.hset(self.keys.source(name), mapping=present)
            if gone:
                pipe.hdel(self.keys.source(name), *gone)
            await pipe.execute()

"""Synchronous answers over the queue: one reader of this API instance's reply stream feeding
a map of futures.

Workers store the result first and then add ``{job}`` to the reply stream named in the work
entry, so a notification is only a hint: ``wait`` always reads the result key, and reads it
again at the timeout in case a notification was missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from .keys import Keys
from .results import JobResult

log = structlog.get_logger()

READ_BLOCK_MS = 1000        # one XREAD waits this long; below the client's socket timeout
READ_COUNT = 100
RETRY_DELAY_S = 1.0         # after a Redis error, so a Redis outage is no busy loop
# stop(): how long the reader may take to notice; a cancellation that lands inside a Redis
# command can be absorbed by the client, and the loop then ends after its read instead
STOP_WAIT_S = READ_BLOCK_MS / 1000 + RETRY_DELAY_S + 1.0


class ReplyListener:
    def __init__(self, redis: Redis, keys: Keys, instance_id: str | None = None):
        self.redis = redis
        self.keys = keys
        self.instance_id = instance_id or uuid.uuid4().hex[:16]
        self.stream = keys.reply(self.instance_id)
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self._reader: asyncio.Task | None = None
        self._last_id = "0-0"   # the stream is this instance's own: everything in it is news
        self._stopping = False

    async def start(self) -> None:
        if self._reader is None:
            self._stopping = False
            self._reader = asyncio.create_task(self._read_forever(),
                                               name=f"replies-{self.instance_id}")

    async def stop(self) -> None:
        if self._reader is not None:
            reader, self._reader = self._reader, None
            self._stopping = True
            reader.cancel()
            await asyncio.wait([reader], timeout=STOP_WAIT_S)
            if reader.done() and not reader.cancelled():
                reader.exception()     # retrieved: it ended on the flag, or failed
        for future in self._waiting.values():
            future.cancel()
        self._waiting.clear()

    def expect(self, job_id: str) -> None:
        """Register interest in ``job_id``; call it before submitting the job."""
        if job_id not in self._waiting:
            self._waiting[job_id] = asyncio.get_running_loop().create_future()

    @contextlib.contextmanager
    def expecting(self, job_id: str) -> Iterator[None]:
        """``expect(job_id)`` for the block's length: a job submitted inside it and created
        then is waited for with ``wait(job_id, ..., fresh=True)``."""
        self.expect(job_id)
        try:
            yield
        finally:
            self._waiting.pop(job_id, None)

    async def wait(self, job_id: str, timeout: float, *, fresh: bool = False
                   ) -> JobResult | None:
        """The job's result, or None when it is not ready within ``timeout`` seconds.
        ``fresh``: the job was created after ``expect(job_id)``, so no notification of it can
        have gone unseen and its result is not read before the wait (a round trip a request
        saves)."""
        self.expect(job_id)
        future = self._waiting[job_id]
        try:
            result = None if fresh else await self._result(job_id)
            if result is not None:
                return result
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(future), timeout)
            return await self._result(job_id)
        finally:
            self._waiting.pop(job_id, None)

    async def _result(self, job_id: str) -> JobResult | None:
        raw = await self.redis.get(self.keys.result(job_id))
        return JobResult.from_json(raw) if raw is not None else None

    async def _read_forever(self) -> None:
        while not self._stopping:
            try:
                reply = await self.redis.xread({self.stream: self._last_id},
                                               count=READ_COUNT, block=READ_BLOCK_MS)
            except RedisError as err:
                log.warning("reply stream read failed", stream=self.stream, error=str(err))
                await asyncio.sleep(RETRY_DELAY_S)
                continue
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    future = self._waiting.get(fields.get("job", ""))
                    if future is not None and not future.done():
                        future.set_result(None)

"""Where items come from: RSS/Atom feeds over HTTP, JSONL files followed as they grow, and a
Redis stream another system writes into.

Every source works in two steps: ``poll()`` returns new items and remembers its next cursor
(ETag, byte offset, stream ids); the consumer claims the items (state.py), then ``commit()``
stores the cursor. A crash in between re-reads the items, and de-duplication drops them.
"""

from __future__ import annotations

import asyncio
import calendar
import json
import os
import time
from datetime import datetime, timezone

import feedparser
import httpx
import structlog
from redis.exceptions import ResponseError

from .config import Source
from .items import Item, from_mapping, plain_text
from .metrics import IngestMetrics
from .state import State, now_ms

log = structlog.get_logger("spinf.ingest")

MAX_BACKOFF_S = 3600.0       # a failing feed is still tried at least hourly
READ_BYTES = 4 * 1024 * 1024     # JSONL bytes read per poll
MAX_FEED_BYTES = 20 * 1024 * 1024    # a feed document larger than this is refused
STREAM_COUNT = 256           # stream entries per read


class SourceBase:
    def __init__(self, source: Source, state: State, metrics: IngestMetrics):
        self.source = source
        self.name = source.name
        self.state = state
        self.metrics = metrics
        self.more = False             # more is waiting: poll again at once
        self._cursor: dict = {}

    async def poll(self, *, block: bool = True) -> list[Item]:
        raise NotImplementedError

    async def commit(self) -> None:
        if self._cursor:
            await self.state.set_source(self.name, self._cursor)
            self._cursor = {}

    async def delay_s(self) -> float:
        return 0.0 if self.more else self.source.interval_s

    async def close(self) -> None:
        pass

    def _bad_item(self, where: str, error: str) -> None:
        self.metrics.failed.labels(self.name).inc()
        log.warning("unreadable item skipped", feed=self.name, at=where, error=error)


def _published(entry) -> str | None:
    parsed = entry.get("published_parsed") or entry.get("updated_parsed")
    if parsed:
        return datetime.fromtimestamp(calendar.timegm(parsed), tz=timezone.utc).isoformat()
    return entry.get("published") or entry.get("updated")


class FeedSource(SourceBase):
    """An RSS/Atom feed: conditional GET with the stored ETag / Last-Modified, the source's
    interval between polls, exponential backoff while it fails."""

    def __init__(self, source: Source, state: State, metrics: IngestMetrics,
                 client: httpx.AsyncClient):
        super().__init__(source, state, metrics)
        self.client = client
        self.errors = 0

    async def poll(self, *, block: bool = True) -> list[Item]:
        stored = await self.state.source(self.name)
        self.errors = int(stored.get("errors", 0))
        headers = {}
        if stored.get("etag"):
            headers["If-None-Match"] = stored["etag"]
        if stored.get("last_modified"):
            headers["If-Modified-Since"] = stored["last_modified"]
        try:
            async with self.client.stream("GET", self.source.target, headers=headers) as response:
                body = bytearray()
                if response.status_code == 200:
                    async for part in response.aiter_bytes():
                        body += part
                        if len(body) > MAX_FEED_BYTES:
                            return await self._failed("malformed", f"larger than "
                                                      f"{MAX_FEED_BYTES} bytes")
        except httpx.HTTPError as err:
            return await self._failed("network_error", f"{type(err).__name__}: {err}")
        if response.status_code == 304:
            await self._ok("not_modified", {})
            return []
        if response.status_code != 200:
            return await self._failed("http_error", f"HTTP {response.status_code}")
        parsed = await asyncio.to_thread(
            feedparser.parse, bytes(body),
            response_headers={"content-type": response.headers.get("content-type", "")})
        if not parsed.get("version") and not parsed.entries:
            error = parsed.get("bozo_exception") or "not an RSS or Atom document"
            return await self._failed("malformed", str(error))
        if parsed.get("bozo"):
            log.warning("feed parsed with problems", feed=self.name,
                        error=str(parsed.get("bozo_exception")))
        items = [self._item(entry) for entry in parsed.entries]
        await self._ok("ok", {"etag": response.headers.get("etag"),
                              "last_modified": response.headers.get("last-modified")})
        return [item for item in items if item is not None]

    def _item(self, entry) -> Item | None:
        full = next((c.get("value") for c in entry.get("content") or () if c.get("value")), None)
        text = plain_text(full or entry.get("summary"))
        title = plain_text(entry.get("title")) or None
        if not text and not title:
            self._bad_item(entry.get("id") or entry.get("link") or "?", "no title and no text")
            return None
        return Item(feed=self.name, title=title, text=text, link=entry.get("link"),
                    guid=entry.get("id"), published=_published(entry),
                    summary_only=full is None)

    async def _ok(self, outcome: str, cursor: dict) -> None:
        self.metrics.polls.labels(self.name, outcome).inc()
        self.metrics.last_success.labels(self.name).set(time.time())
        self.errors = 0
        # the validators are stored only once the items are claimed (commit)
        self._cursor = {**cursor, "errors": 0, "last_status": outcome, "last_ok_ms": now_ms()}
        if outcome == "not_modified":
            await self.commit()

    async def _failed(self, outcome: str, error: str) -> list[Item]:
        self.errors += 1
        self.metrics.polls.labels(self.name, outcome).inc()
        log.warning("feed poll failed", feed=self.name, outcome=outcome, error=error,
                    errors=self.errors, retry_in_s=round(await self.delay_s(), 3))
        await self.state.set_source(self.name, {"errors": self.errors, "last_status": outcome,
                                                "last_error": error[:500],
                                                "last_error_ms": now_ms()})
        return []

    async def delay_s(self) -> float:
        interval = self.source.interval_s
        if not self.errors:
            return interval
        return min(interval * 2 ** self.errors, max(interval, MAX_BACKOFF_S))


class JsonlSource(SourceBase):
    """A JSONL file followed as it grows; the byte offset of the next unread line (and the
    file's inode, to notice a replaced file) are kept in Redis."""

    async def poll(self, *, block: bool = True) -> list[Item]:
        stored = await self.state.source(self.name)
        offset = int(stored.get("offset", 0))
        try:
            stat = os.stat(self.source.target)
        except FileNotFoundError:
            self.more = False
            return []
        if stored.get("inode") not in (None, str(stat.st_ino)) or stat.st_size < offset:
            log.warning("file replaced or truncated; reading it from the start",
                        feed=self.name, path=self.source.target)
            offset = 0
        chunk = await asyncio.to_thread(self._read, offset)
        end = chunk.rfind(b"\n") + 1          # a last line still being written waits
        self.more = len(chunk) == READ_BYTES and end > 0
        items = []
        position = offset
        for raw in chunk[:end].splitlines(keepends=True):
            line_at, position = position, position + len(raw)
            if not raw.strip():
                continue
            try:
                data = json.loads(raw)
                if not isinstance(data, dict):
                    raise ValueError("the line is not a JSON object")
                items.append(from_mapping(self.name, data))
            except ValueError as err:
                self._bad_item(f"byte {line_at}", str(err))
        self._cursor = {"offset": offset + end, "inode": stat.st_ino}
        return items

    def _read(self, offset: int) -> bytes:
        with open(self.source.target, "rb") as f:
            f.seek(offset)
            return f.read(READ_BYTES)


class StreamSource(SourceBase):
    """A Redis stream another system writes articles into, read through a consumer group of
    this ingest consumer. Entries hold one JSON field (``data``/``json``/``item``) or the
    item's fields directly. Acknowledged once their items are claimed."""

    def __init__(self, source: Source, state: State, metrics: IngestMetrics, start: str):
        super().__init__(source, state, metrics)
        self.group = f"spinf-ingest-{state.keys.name}"
        self.start = start
        self._history = True          # first our own unacknowledged entries (a restart)
        self._group_ready = False
        self._ack: list[str] = []

    async def poll(self, *, block: bool = True) -> list[Item]:
        redis = self.state.redis
        stream = self.source.target
        if not self._group_ready:
            try:
                await redis.xgroup_create(stream, self.group, id=self.start, mkstream=True)
            except ResponseError as err:
                if "BUSYGROUP" not in str(err):
                    raise
            self._group_ready = True
        if self._history:
            reply = await redis.xreadgroup(self.group, "ingest", {stream: "0"},
                                           count=STREAM_COUNT)
            self._history = bool(reply and reply[0][1])
        if not self._history:
            block_ms = int(self.source.interval_s * 1000) if block else None
            reply = await redis.xreadgroup(self.group, "ingest", {stream: ">"},
                                           count=STREAM_COUNT, block=block_ms)
        entries = reply[0][1] if reply else []
        self.more = len(entries) == STREAM_COUNT
        items = []
        for entry_id, fields in entries:
            self._ack.append(entry_id)
            try:
                raw = fields.get("data") or fields.get("json") or fields.get("item")
                data = json.loads(raw) if raw else fields
                if not isinstance(data, dict):
                    raise ValueError("the entry is not a JSON object")
                items.append(from_mapping(self.name, data))
            except ValueError as err:
                self._bad_item(f"entry {entry_id}", str(err))
        return items

    async def commit(self) -> None:
        if self._ack:
            await self.state.redis.xack(self.source.target, self.group, *self._ack)
            self._ack = []

    async def delay_s(self) -> float:
        return 0.0        # the read itself blocks for the interval

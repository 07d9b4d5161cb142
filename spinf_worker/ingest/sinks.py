"""Where results go: a JSONL file, a Redis stream, a webhook. Each sink marks the items it
has written in Redis (``sunk`` sets, state.py) and skips those already marked, so a retry or a
restart never writes an item twice:

- JSONL: before a batch is appended, each line's byte offset is recorded (``intent``); after a
  crash, a recorded line found whole at its offset counts as written, and a torn last line is
  cut off before writing again.
- Redis stream: the XADD and the mark are one transaction.
- Webhook: signed and sent exactly as the service's callbacks (webhooks.py), with a
  ``webhook-id`` that is the same on every attempt: a receiver that stores the ids it has
  processed drops the repeat of a delivery that crashed before it was marked.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx
import structlog

from ..queue.settings import ServiceSettings
from ..webhooks import USER_AGENT, CallbackRefused, TargetGuard, backoff_s, classify, sign
from .config import ConfigError
from .state import State, now_ms

log = structlog.get_logger("spinf.ingest")

WEBHOOKS_AT_ONCE = 16


class SinkError(Exception):
    """A write failed; the items stay pending and the write is tried again."""


@dataclass
class Result:
    key: str              # the pending-record key (state.py)
    line: dict            # item_id, feed, title, published, link, job_id, status, response, error


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class Sink:
    def __init__(self, spec: str, state: State):
        self.spec = spec
        kind, _, self.target = spec.partition(":")
        self.id = f"{kind}-{hashlib.sha256(self.target.encode()).hexdigest()[:12]}"
        self.state = state

    async def open(self) -> None:
        """Check the target and finish what a crash interrupted."""

    async def close(self) -> None:
        pass

    async def write(self, results: list[Result]) -> None:
        todo = await self._unwritten(results)
        if todo:
            await self._write(todo)

    async def _unwritten(self, results: list[Result]) -> list[Result]:
        done = await self.state.sunk(self.id, [r.key for r in results])
        return [r for r in results if r.key not in done]

    async def _write(self, results: list[Result]) -> None:
        raise NotImplementedError

    async def _mark(self, keys: list[str], pipe=None) -> None:
        marks = dict.fromkeys(keys, now_ms())
        if pipe is not None:
            pipe.zadd(self.state.keys.sunk(self.id), marks)
            return
        await self.state.redis.zadd(self.state.keys.sunk(self.id), marks)


class JsonlSink(Sink):
    def __init__(self, spec: str, state: State):
        super().__init__(spec, state)
        self.path = Path(self.target)

    async def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        intent_key = self.state.keys.intent(self.id)
        intents = {k: json.loads(v) for k, v in (await self.state.redis.hgetall(intent_key)).items()}
        if not intents:
            return
        found = await asyncio.to_thread(self._check, intents)
        written = [key for key, ok in found.items() if ok]
        async with self.state.redis.pipeline(transaction=True) as pipe:
            if written:
                await self._mark(written, pipe)
            pipe.delete(intent_key)
            await pipe.execute()
        log.info("jsonl sink recovered", path=str(self.path), written=len(written),
                 to_write=len(intents) - len(written))

    def _check(self, intents: dict[str, dict]) -> dict[str, bool]:
        """Which recorded lines are whole at their offsets; a torn tail is cut off."""
        size = self.path.stat().st_size if self.path.exists() else 0
        whole: dict[str, bool] = {}
        cut = None
        with open(self.path, "a+b") as f:
            for key, intent in sorted(intents.items(), key=lambda kv: kv[1]["pos"]):
                pos = intent["pos"]
                f.seek(pos)
                raw = f.readline()
                ok = raw.endswith(b"\n")
                if ok:
                    try:
                        ok = json.loads(raw).get("item_id") == intent["item_id"]
                    except ValueError:
                        ok = False
                if not ok and pos < size and cut is None:
                    cut = pos
                whole[key] = ok and (cut is None or pos < cut)
            if cut is not None:
                log.warning("cutting a torn line off the sink", path=str(self.path), at=cut)
                f.truncate(cut)
        return whole

    async def _write(self, results: list[Result]) -> None:
        lines = [(_dumps(r.line) + "\n").encode() for r in results]
        with open(self.path, "ab") as f:
            pos = f.seek(0, os.SEEK_END)
            intents = {}
            for result, line in zip(results, lines, strict=True):
                intents[result.key] = _dumps({"pos": pos, "item_id": result.line["item_id"]})
                pos += len(line)
            intent_key = self.state.keys.intent(self.id)
            await self.state.redis.hset(intent_key, mapping=intents)
            await asyncio.to_thread(self._append, f, b"".join(lines))
        async with self.state.redis.pipeline(transaction=True) as pipe:
            await self._mark([r.key for r in results], pipe)
            pipe.hdel(intent_key, *intents)
            await pipe.execute()

    @staticmethod
    def _append(f, data: bytes) -> None:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class RedisStreamSink(Sink):
    """Entries ``{item_id, feed, data}`` (``data``: the whole result as JSON). On a Redis
    Cluster the stream key must carry the ``{q}`` hash tag (one transaction with the mark)."""

    async def _write(self, results: list[Result]) -> None:
        async with self.state.redis.pipeline(transaction=True) as pipe:
            for r in results:
                pipe.xadd(self.target, {"item_id": r.line["item_id"], "feed": r.line["feed"],
                                        "data": _dumps(r.line)})
            await self._mark([r.key for r in results], pipe)
            await pipe.execute()


class WebhookSink(Sink):
    """One signed POST per item, retried like callbacks (408/429/5xx/network: backoff with
    jitter, up to ``callback_max_attempts``); targets checked by the callbacks' SSRF rules."""

    def __init__(self, spec: str, state: State, settings: ServiceSettings):
        super().__init__(spec, state)
        if not settings.webhook_secret:
            raise ConfigError(f"sink {spec}: webhooks are signed: set SPINF_WEBHOOK_SECRET "
                              "(without --redis, ingest keeps one in its state dir)")
        self.settings = settings
        self.guard = TargetGuard(settings.callback_allow)
        self.client = httpx.AsyncClient(
            timeout=settings.callback_timeout_s, follow_redirects=False, trust_env=False,
            limits=httpx.Limits(max_keepalive_connections=0), headers={"user-agent": USER_AGENT})
        self._gate = asyncio.Semaphore(WEBHOOKS_AT_ONCE)

    async def open(self) -> None:
        try:
            await self.guard.resolve(self.target)
        except CallbackRefused as err:
            raise ConfigError(f"sink {self.spec}: {err}") from None

    async def close(self) -> None:
        await self.client.aclose()

    async def _write(self, results: list[Result]) -> None:
        outcomes = await asyncio.gather(*(self._deliver(r) for r in results),
                                        return_exceptions=True)
        delivered = [r.key for r, o in zip(results, outcomes, strict=True) if o is None]
        if delivered:
            await self._mark(delivered)
        errors = [o for o in outcomes if o is not None]
        if errors:
            raise SinkError(f"{len(errors)} of {len(results)} webhooks failed: {errors[0]}")

    async def _deliver(self, result: Result) -> None:
        msg_id = f"msg_ingest_{result.key.replace(':', '_')}"
        body = _dumps({"type": "ingest.failed" if result.line.get("error") else "ingest.scored",
                       "timestamp": datetime.now(timezone.utc).isoformat(),
                       "data": result.line}).encode()
        async with self._gate:
            for attempt in range(1, self.settings.callback_max_attempts + 1):
                try:
                    target = await self.guard.resolve(self.target)
                    stamp = int(time.time())
                    response = await self.client.post(target.request_url(), content=body, headers={
                        "content-type": "application/json",
                        "host": target.url.netloc.decode("ascii"), "webhook-id": msg_id,
                        "webhook-timestamp": str(stamp),
                        "webhook-signature": sign(self.settings.webhook_secret, msg_id, stamp,
                                                  body)},
                        extensions={"sni_hostname": target.url.host}
                        if target.url.scheme == "https" else {})
                    outcome = classify(response)
                except (CallbackRefused, httpx.TransportError) as err:
                    outcome = None
                    error = f"{type(err).__name__}: {err}"
                else:
                    if outcome.outcome == "delivered":
                        return None
                    error = outcome.error or f"HTTP {outcome.status_code}"
                    if outcome.outcome == "failed":
                        break
                delay = backoff_s(attempt, self.settings.callback_backoff_s)
                if outcome is not None and outcome.retry_after_s is not None:
                    delay = max(delay, outcome.retry_after_s)
                if attempt < self.settings.callback_max_attempts:
                    await asyncio.sleep(delay)
        raise SinkError(f"{self.target}: {error}")


def make_sink(spec: str, state: State, settings: ServiceSettings) -> Sink:
    kind = spec.partition(":")[0]
    if kind == "jsonl":
        return JsonlSink(spec, state)
    if kind == "redis":
        return RedisStreamSink(spec, state)
    return WebhookSink(spec, state, settings)

"""The ingest loop: poll each source, claim new items, submit them to the bulk work stream,
wait for their results and write them to every sink, then forget them.

An item's life, each step in Redis before the next (state.py):
1. claimed: its identities join ``seen`` and a pending record holds it (one script);
2. submitted: ``Producer.submit`` with an idempotency key derived from the item, so a
   repeat after a crash names the same job; the job id goes into the pending record;
3. answered: the worker stores the result and notifies this consumer's reply stream;
4. written to every sink (each skips what it has written before);
5. done: the pending record is removed.
On start the pending records are resumed from the step they reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import structlog
from redis.exceptions import RedisError

from ..queue.keys import Keys
from ..queue.producer import IdempotencyKeyReused, Producer, Submission
from ..queue.redis_client import connect
from ..queue.replies import ReplyListener
from ..queue.results import JobResult
from ..queue.settings import ServiceSettings
from .config import Settings, Source
from .items import Item
from .metrics import IngestMetrics
from .pages import PageFetcher
from .sinks import Result, Sink, SinkError, make_sink
from .sources import FeedSource, JsonlSource, SourceBase, StreamSource
from .state import LEASE_RENEW_S, IngestKeys, State, now_ms

log = structlog.get_logger("spinf.ingest")

WAIT_S = 30.0             # between checks that a job still exists while waiting for it
RETRY_MAX_S = 60.0        # Redis or a sink failing: wait at most this long between attempts
SINK_BATCH = 256
TRIM_EVERY_S = 3600.0
FEED_TIMEOUT_S = 30.0


class Consumer:
    def __init__(self, config: Settings, service: ServiceSettings, *, once: bool = False,
                 metrics: IngestMetrics | None = None):
        self.config = config
        self.service = service
        self.once = once
        self.metrics = metrics or IngestMetrics()
        self.metrics.watch_lag(self._oldest)
        self._inflight: dict[str, tuple[str, int]] = {}    # key -> (feed, first seen ms)
        self._trackers: set[asyncio.Task] = set()

    def _oldest(self) -> dict[str, int]:
        oldest = {s.name: 0 for s in self.config.sources}
        for feed, since in list(self._inflight.values()):
            oldest[feed] = min(oldest.get(feed) or since, since)
        return oldest

    # ---- lifecycle -----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop`` (or, with ``once``, until every source was read once and every new
        item is in the sinks)."""
        self.redis = connect(self.service.redis_url, client_name=f"spinf-ingest-{os.getpid()}")
        keys = Keys(self.service.prefix)
        self.state = State(self.redis, IngestKeys(keys, self.config.name))
        self.producer = Producer(self.redis, keys, self.service)
        self.listener = ReplyListener(self.redis, keys, self.state.keys.reply_instance)
        self.gate = asyncio.Semaphore(self.config.max_in_flight)
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.pages = PageFetcher(self.config.fetch_allow) if self.config.fetch_pages else None
        self.http = None
        self.sinks: list[Sink] = []
        chores: list[asyncio.Task] = []
        try:
            await self.state.acquire()
            try:
                await self._start(chores)
                await self._main(stop, chores)
            finally:
                for task in [*chores, *self._trackers]:
                    task.cancel()
                await asyncio.gather(*chores, *self._trackers, return_exceptions=True)
                with contextlib.suppress(RedisError):
                    await self.state.release()
        finally:
            await self._close()

    async def _start(self, chores: list[asyncio.Task]) -> None:
        self.sinks = [make_sink(spec, self.state, self.service) for spec in self.config.sinks]
        for sink in self.sinks:
            await sink.open()
        await self.listener.start()
        chores += [asyncio.create_task(self._sink_loop(), name="ingest-sinks"),
                   asyncio.create_task(self._chores(), name="ingest-chores")]
        pending = await self.state.pending()
        if pending:
            log.info("resuming pending items", count=len(pending))
        for key, record in pending.items():
            await self.gate.acquire()
            self._spawn(key, record)
        log.info("ingest started", name=self.config.name, sources=len(self.config.sources),
                 sinks=list(self.config.sinks), once=self.once)

    async def _main(self, stop: asyncio.Event, chores: list[asyncio.Task]) -> None:
        self.http = _feed_client()
        readers = [asyncio.create_task(self._follow(self._source(s), stop), name=s.name)
                   for s in self.config.sources]
        stopped = asyncio.ensure_future(stop.wait())
        try:
            # readers and chores only end early by failing (with once, readers end when read)
            watched = [*chores, stopped] + ([] if self.once else readers)
            if self.once:
                watched.append(asyncio.ensure_future(asyncio.gather(*readers)))
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            for task in [*chores, *readers]:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()
            if self.once:
                while self._trackers and not stop.is_set():
                    await asyncio.wait([*self._trackers, *chores, stopped],
                                       return_when=asyncio.FIRST_COMPLETED)
                    for task in chores:
                        if task.done() and task.exception() is not None:
                            raise task.exception()
                log.info("ingest done", scored=_total(self.metrics, "scored"),
                         failed=_total(self.metrics, "failed"))
        finally:
            stopped.cancel()
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    async def _close(self) -> None:
        with contextlib.suppress(Exception):
            await self.listener.stop()
        for sink in self.sinks:
            await sink.close()
        if self.pages is not None:
            await self.pages.close()
        if self.http is not None:
            await self.http.aclose()
        await self.redis.aclose()

    def _source(self, source: Source) -> SourceBase:
        if source.kind == "feed":
            return FeedSource(source, self.state, self.metrics, self.http)
        if source.kind == "jsonl":
            return JsonlSource(source, self.state, self.metrics)
        return StreamSource(source, self.state, self.metrics, self.config.stream_start)

    async def _chores(self) -> None:
        """Keep the lease; forget old identities now and then; publish the pending gauge."""
        last_trim = last_note = 0.0
        while True:
            if not await self.state.renew():
                await self.state.acquire()       # expired while Redis was away: take it again
            if time.monotonic() - last_trim > TRIM_EVERY_S:
                last_trim = time.monotonic()
                await self.state.trim(self.config.remember_days, [s.id for s in self.sinks])
            self.metrics.pending.set(len(self._inflight))
            oldest = min((since for _, since in self._inflight.values()), default=None)
            if oldest is not None and now_ms() - oldest > WAIT_S * 1000 \
                    and time.monotonic() - last_note > WAIT_S:
                last_note = time.monotonic()
                log.info("items waiting for results (are workers running?)",
                         pending=len(self._inflight),
                         oldest_s=round((now_ms() - oldest) / 1000))
            await asyncio.sleep(LEASE_RENEW_S)

    # ---- reading sources -----------------------------------------------------------------

    async def _follow(self, source: SourceBase, stop: asyncio.Event) -> None:
        delay = 0.0
        while not stop.is_set():
            try:
                items = await source.poll(block=not self.once)
                for item in items:
                    await self._admit(item, source.source)
                await source.commit()
                delay = 0.0
            except Exception as err:     # Redis away, an unreadable file: later, again
                delay = min(RETRY_MAX_S, max(0.5, delay * 2))
                log.warning("reading a source failed", feed=source.name,
                            error=f"{type(err).__name__}: {err}", retry_in_s=delay,
                            exc_info=not isinstance(err, (RedisError, OSError)))
                await asyncio.sleep(delay)
                continue
            if self.once and not source.more:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), await source.delay_s())

    async def _admit(self, item: Item, source: Source) -> None:
        self.metrics.seen.labels(item.feed).inc()
        await self.gate.acquire()
        record = {"item": item.to_record(), "scoring": source.scoring, "seen_ms": now_ms()}
        try:
            new = await self.state.claim(item.key, item.identities(), record)
        except BaseException:
            self.gate.release()
            raise
        if not new:
            self.gate.release()
            return
        self.metrics.new.labels(item.feed).inc()
        self._spawn(item.key, record)

    def _spawn(self, key: str, record: dict) -> None:
        self._inflight[key] = (record["item"]["feed"], record.get("seen_ms") or now_ms())
        task = asyncio.create_task(self._track(key, record))
        self._trackers.add(task)
        task.add_done_callback(self._trackers.discard)

    # ---- one item ------------------------------------------------------------------------

    async def _track(self, key: str, record: dict) -> None:
        delay = 0.0
        try:
            while True:
                try:
                    result = await self._score(key, record)
                    break
                except Exception as err:     # the item stays pending: try it again later
                    delay = min(RETRY_MAX_S, max(0.5, delay * 2))
                    log.warning("submitting or waiting failed; retrying the item", key=key,
                                error=f"{type(err).__name__}: {err}", retry_in_s=delay,
                                exc_info=not isinstance(err, RedisError))
                    await asyncio.sleep(delay)
            item = Item.from_record(record["item"])
            ok = result.succeeded
            line = {**item.meta(), "job_id": record["job"],
                    "status": "succeeded" if ok else "failed",
                    "response": result.body if ok else None, "error": result.openai_error}
            written = asyncio.get_running_loop().create_future()
            await self.outbox.put((Result(key, line), written))
            await written
        finally:
            self._inflight.pop(key, None)
            self.gate.release()

    async def _score(self, key: str, record: dict) -> JobResult:
        """Submit the item unless its job is known and alive, and wait for the result."""
        while True:
            job = record.get("job")
            if job is None or await self.producer.get_job(job) is None:
                if job is not None:          # the job record expired or was lost: again
                    log.warning("job gone; submitting the item again", key=key, job=job)
                    record["attempt"] = record.get("attempt", 0) + 1
                await self._submit(key, record)
            result = await self.listener.wait(record["job"], WAIT_S)
            if result is not None:
                return result

    async def _submit(self, key: str, record: dict) -> None:
        item = Item.from_record(record["item"])
        if self.pages is not None and item.summary_only and item.link:
            page = await self.pages.text(item.link)
            if page:
                item.text, item.summary_only = page, False
                record["item"] = item.to_record()
        request = {"text": item.content(), **record["scoring"]}
        try:
            job, _ = await self.producer.submit(Submission(
                request=request, priority="bulk", custom_id=item.item_id,
                idempotency_key=f"ingest:{self.config.name}:{key}:{record.get('attempt', 0)}",
                reply_to=self.listener.instance_id))
        except IdempotencyKeyReused as reused:
            # A repeat after a crash may read the item's page anew, and the page may have
            # changed since: the job the key names is still this item's.
            job = reused.job_id
        record["job"] = job
        await self.state.update(key, record)

    # ---- writing sinks -------------------------------------------------------------------

    async def _sink_loop(self) -> None:
        while True:
            batch = [await self.outbox.get()]
            while not self.outbox.empty() and len(batch) < SINK_BATCH:
                batch.append(self.outbox.get_nowait())
            results = [result for result, _ in batch]
            await self._write(results)
            for result in results:
                name = "failed" if result.line["error"] else "scored"
                getattr(self.metrics, name).labels(result.line["feed"]).inc()
            for _, written in batch:
                if not written.done():
                    written.set_result(None)

    async def _write(self, results: list[Result]) -> None:
        delay = 0.0
        for sink in self.sinks:
            while True:
                try:
                    await sink.write(results)
                    break
                except (SinkError, RedisError, OSError) as err:
                    self.metrics.sink_errors.labels(sink.spec).inc()
                    delay = min(RETRY_MAX_S, max(0.5, delay * 2))
                    log.warning("sink write failed; retrying", sink=sink.spec, error=str(err),
                                items=len(results), retry_in_s=delay)
                    await asyncio.sleep(delay)
        while True:
            try:
                await self.state.done([r.key for r in results])
                return
            except RedisError as err:
                log.warning("redis error; retrying", error=str(err))
                await asyncio.sleep(1.0)


def _feed_client():
    import httpx

    from .. import __version__

    return httpx.AsyncClient(timeout=FEED_TIMEOUT_S, follow_redirects=True,
                             headers={"user-agent": f"spinf-serve-ingest/{__version__}"})


def _total(metrics: IngestMetrics, name: str) -> float:
    return sum(sample.value for metric in getattr(metrics, name).collect()
               for sample in metric.samples if sample.name.endswith("_total"))

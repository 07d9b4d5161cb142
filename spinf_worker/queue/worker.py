"""The queue worker: reads work entries from Redis Streams, scores them in packed passes,
stores results and tells whoever waits (docs/QUEUE.md).

One worker drives one engine, two passes deep: pass N+1 is laid out and queued on the device
before pass N is read back (Engine.start_batch), so the device is not idle while the host
reads results back, stores them and lays out what comes next. The engine thread never sits
waiting for the device: a thread of its own waits for each pass to run, and only then is its
read-back queued on the engine thread, so a pass laid out meanwhile is never held behind a
read-back waiting for the device. A pass's replies are written on a thread of their own (the
responder), not on the engine thread: on a small model they cost the host about a third of
what the device spends on the pass. Meanwhile the event loop reads and parses the entries of
the pass after, heartbeats, keeps the entries it holds from looking idle, and reclaims
entries of dead workers with XAUTOCLAIM.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from .. import jsonio
from ..completions import CompletionRequest, CompletionResponse
from ..errors import SpinfError
from ..protocol import ScoreRequest, ScoreResponse
from ..tiles import ROW_TILE, PassRows, RowPart
from . import batches, outcomes
from .collector_clock import CollectorClock
from .engine_thread import ENGINE_THREAD, LATER, LAUNCH, RESPONDER, URGENT
from .keys import GROUP, Keys
from .results import JobResult
from .settings import ServiceSettings
from .switch_interval import switch_interval

log = structlog.get_logger()

IDLE_BLOCK_MS = 250          # an idle worker notices `stop` and reclaimed entries this often
REPLY_MAXLEN = 1000          # reply streams hold hints only; the results are durable
REPLY_TTL_S = 3600           # the reply stream of an API instance that went away expires
MAX_RETRY_DELAY_S = 5.0      # Redis unreachable: wait up to this long between attempts
PRUNE_CONSUMER_IDLE_MS = 3_600_000   # consumers this quiet with nothing pending are gone
MAX_FINISHING = 2            # passes read back but not yet stored: past it, no pass starts
REQUESTS_RECENT_S = 1.0      # requests "keep coming" while one was read this recently


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Entry:
    """One work entry as read from a stream, parsed."""

    stream: str
    id: str
    fields: dict[str, str]
    arrived: float = field(default_factory=time.monotonic)
    deliveries: int = 1
    request: ScoreRequest | CompletionRequest | None = None
    error: SpinfError | None = None   # the request's own fault: a final answer, not retried
    failure: str | None = None        # could not even be read: retried, then dead-lettered
    parts: list[RowPart] = field(default_factory=list)   # its documents' rows (Engine.row_parts)

    @property
    def rows(self) -> int:
        """Rows in a pass read alone."""
        return sum(part.length for part in self.parts)

    @property
    def job(self) -> str:
        return self.fields.get("job", "")

    def expired(self, at_ms: int) -> bool:
        deadline = self.fields.get("deadline_ms")
        return deadline is not None and int(float(deadline)) <= at_ms


def read_request(payload: str | bytes) -> ScoreRequest | CompletionRequest:
    """A work entry's request from its JSON text (raises the request's own SpinfError)."""
    body, exact = jsonio.read(payload)
    if isinstance(body, dict) and "completion" in body:
        # POST /v1/completions: the request the API validated (completions.py)
        return CompletionRequest.model_validate(body["completion"])
    scoring = body.get("scoring") if isinstance(body, dict) else None
    # read by orjson, the block written back by orjson is its exact JSON text: the key of
    # the block ScoreRequest.parse has validated already (bulk jobs repeat it)
    key = jsonio.dumps(scoring) if exact and isinstance(scoring, dict) else None
    return ScoreRequest.parse(body, scoring_json=key)


def score_counts(response: ScoreResponse) -> tuple[int, int, int, int]:
    """What the queue's statistics count of a reply: documents, questions, real rows, rows,
    as the engine counted them (reading ``results`` would validate every option of its
    reply, ScoreResponse.of_engine, only to count them)."""
    return (response.usage.inputs, response._questions, response._rows,
            response._padded_rows)


def pass_counts(outcomes: list, busy_s: float, engine_s: float, gc_s: float,
                kept: tuple[int, int] = (0, 0)) -> dict[str, int | float]:
    """What a pass adds to the stats hash (docs/QUEUE.md). ``kept``: its documents laid out
    on kept roots, and those roots' rows."""
    counts = [score_counts(o) for o in outcomes if isinstance(o, ScoreResponse)]
    tokens = sum(c[2] for c in counts)
    # a document takes its rows padded to the tile: real_rows/rows is the fill
    return {"passes": 1, "docs": sum(c[0] for c in counts), "tokens": tokens,
            "questions": sum(c[1] for c in counts),
            "real_rows": tokens, "rows": sum(c[3] for c in counts),
            "seconds_busy": busy_s, "seconds_engine": engine_s, "seconds_gc": gc_s,
            "kept_roots": kept[0], "kept_root_rows": kept[1]}


@dataclass
class Launched:
    """A pass queued on the device (``flight``: Engine.start_batch's batch), or one whose
    ``outcomes`` are known already (it could not be launched as a whole)."""

    entries: list[Entry]
    marking: asyncio.Task           # the job records' "running", written meanwhile
    started_ms: int
    engine_s: float                 # engine-thread seconds spent on it so far
    device_s: float | None = None   # the device's seconds on it, where it tells (CUDA)
    flight: object | None = None
    outcomes: list | None = None
    ran: asyncio.Task | None = None   # done once the pass has run on the device
    urgent: bool = False            # read back ahead of launches (Worker._answer_first)
    # when it reached each step (time.monotonic), in order: formed (its entries chosen),
    # launching (queued on the engine thread), begun (the engine thread took it up),
    # launched, ran (on the device), read (back), answered (its replies written), stored
    times: dict[str, float] = field(default_factory=dict)
    engine_idle_s: float = 0.0      # how long the engine thread sat idle before its launch

    def mark(self, step: str) -> None:
        self.times[step] = time.monotonic()

    def steps_ms(self) -> dict[str, float]:
        """How long each step took, as the pass's log line tells it: ``launching_ms`` is
        the wait for the device (two passes deep) and for the requests that then join."""
        marks = list(self.times.items())
        steps = {f"{step}_ms": round((at - before) * 1000, 1)
                 for (_, before), (step, at) in itertools.pairwise(marks)}
        if "begun" in self.times:
            steps["engine_idle_ms"] = round(self.engine_idle_s * 1000, 1)
        return steps


def timed(fn, *args):
    """``fn(*args)`` and the seconds it took (run on the engine thread: its busy time)."""
    started = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - started


def timed_launch(fn, *args):
    """``timed(fn, *args)`` on the engine thread, and when it began there and how long the
    thread had sat idle before it (time.monotonic): a launch that finds the thread idle
    waited for the event loop to hand it over, not for other work."""
    begun = time.monotonic()
    idle_s = max(0.0, begun - ENGINE_THREAD.idle_since)
    return (*timed(fn, *args), begun, idle_s)


def queue_wait_ms(entry_id: str, started_ms: int) -> int:
    """How long an entry waited in its stream: its id begins with the ms it was added."""
    try:
        return max(0, started_ms - int(entry_id.split("-", 1)[0]))
    except ValueError:
        return 0


class Worker:
    def __init__(self, engine, redis: Redis, keys: Keys, settings: ServiceSettings,
                 name: str | None = None, started_ms: int | None = None):
        self.engine = engine
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # registered with every heartbeat: when loading the model began (started_ms, from
        # whoever loaded it) and ended (the engine is loaded once a Worker exists)
        self.loaded_ms = now_ms()
        self.started_ms = started_ms if started_ms is not None else self.loaded_ms
        self.passes = 0                       # passes started (Engine.start_batch calls)
        self.log = log.bind(worker=self.name)
        # entry ids this worker holds (read, not yet acked or given up on): kept looking busy
        self._held: dict[str, set[str]] = {s: set() for s in keys.streams}
        self._ready: list[Entry] = []         # parsed, waiting for a pass
        self._claimed: list[tuple[str, str, dict]] = []   # from XAUTOCLAIM, not parsed yet
        self._starting: asyncio.Task | None = None     # a pass being laid out and launched
        self._admitting: asyncio.Task | None = None    # entries read, being parsed
        self._admitting_requests = False      # whether those hold interactive entries
        self._entry_rows = ROW_TILE           # rows an entry took in the last pass started
        self._drained = False                 # the last read left no entry in the streams
        self._launched: Launched | None = None         # on the device, read-back not queued
        self._last_ran: asyncio.Task | None = None     # the last pass launched has run
        self._ran_before: asyncio.Task | None = None   # ... and the one before it
        self._reading: set[asyncio.Task] = set()       # being read back from the device
        self._finishing: set[asyncio.Task] = set()     # results being stored
        # own pending entries still to re-read on start: the last id read, None when done
        self._history: dict[str, str | None] = {s: "0-0" for s in keys.streams}
        self._claim_cursor: dict[str, str] = {s: "0-0" for s in keys.streams}
        self._need_groups = True
        self._interactive_seen = -math.inf    # when an interactive entry was last admitted
        self._collector = CollectorClock()    # the cyclic collector's seconds, told per pass
        self._kept_told = (0, 0)              # the engine's kept-root hits and rows, told so far

    def _kept_roots_since(self) -> tuple[int, int]:
        """Documents laid out on kept roots, and those roots' rows, since the last call (the
        engine counts them as passes are laid out; an engine in a process of its own, none)."""
        roots = getattr(self.engine, "roots", None)
        if roots is None:
            return 0, 0
        now = (roots.hits, roots.rows_saved)
        since = (now[0] - self._kept_told[0], now[1] - self._kept_told[1])
        self._kept_told = now
        return since

    @property
    def budget(self) -> int:
        """Rows of documents handed to the engine at once: a full pass of its own."""
        return self.settings.max_pass_tokens or self.engine.settings.max_pass_tokens

    # ---- lifecycle ---------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Work until ``stop`` is set; then finish the pass in flight, hand back entries not
        started, and leave."""
        self.log.info("worker started", model=self.engine.model_name, budget=self.budget)
        chores = [asyncio.create_task(self._heartbeat_loop(stop)),
                  asyncio.create_task(self._claim_loop(stop))]
        stopped = asyncio.create_task(stop.wait())
        with self._process_tuned():
            try:
                await self._work(stop, stopped)
            finally:
                stopped.cancel()
                await self._drain()
                for chore in chores:
                    chore.cancel()
                await asyncio.gather(*chores, return_exceptions=True)
                await self._leave()
                self.log.info("worker stopped", passes=self.passes)

    @contextlib.contextmanager
    def _process_tuned(self):
        """While the worker runs: the collector's seconds counted, and the process's switch
        interval the settings' (``switch_interval_ms``); both as they were afterwards."""
        with switch_interval(self.settings.switch_interval_ms):
            self._collector.start()
            try:
                yield
            finally:
                self._collector.stop()

    async def _drain(self) -> None:
        """Finish every pass started: the one being launched, then every read-back. Entries
        being parsed join the ready ones (handed back on leaving)."""
        if self._admitting is not None:
            with contextlib.suppress(Exception):   # what did not reach _ready is released
                await self._admitting
            self._admitting = None
        if self._starting is not None:
            await self._starting
            self._starting = None
        self._read_back()
        while self._reading or self._finishing:
            await asyncio.gather(*self._reading, *self._finishing)

    def _busy(self) -> set[asyncio.Task]:
        """What a worker with nothing to do next waits on."""
        if self._starting is not None:
            return {self._starting}
        return self._reading | self._finishing

    def _may_start(self) -> bool:
        """A pass may start when the previous one has launched and the stores keep up. Its
        launch then waits for the pass before the last to have run (``_start_pass``): when
        it runs, one other pass at most is on the device (a third would only wait there, and
        so would a request put in it), and the engine thread has the next pass to lay out
        while the device runs (a small model's pass costs the host more than the device).
        With
        ``interactive_window_ms`` set, while interactive requests come a pass of bulk
        entries alone waits for the device to be free: a request arriving then waits for
        one pass, not two."""
        if self._starting is not None or len(self._finishing) >= MAX_FINISHING:
            return False
        if self._single_file():
            return self._launched is None and not self._reading
        return True

    def _nothing_to_wait_for(self) -> bool:
        """Whether a pass that is not full starts now: no other entry is known to be coming
        (the last read emptied the streams and none is being parsed) and no pass is being
        read back (the device holds one pass at most, with none queued behind it). Holding
        the pass then only delays it: entries that arrive meanwhile join the next one, laid
        out while this one runs, as in continuous batching. Otherwise a pass waits to be
        full, for ``max_wait_ms`` at most."""
        return (self._drained and self._admitting is None and self._starting is None
                and not self._reading)

    def _single_file(self) -> bool:
        """Whether bulk passes go on the device one at a time now: interactive requests came
        within ``interactive_window_ms`` and none is waiting (a pass holding one may queue)."""
        recent = (time.monotonic() - self._interactive_seen) * 1000 \
            < self.settings.interactive_window_ms
        interactive = self.keys.interactive
        return recent and not any(e.stream == interactive for e in self._ready)

    async def _create_groups(self) -> None:
        for stream in self.keys.streams:
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as err:
                if "BUSYGROUP" not in str(err):
                    raise

    async def _leave(self) -> None:
        unstarted = [(e.stream, e.id, e.fields) for e in self._ready] + self._claimed
        self._ready, self._claimed = [], []
        try:
            await self._release(unstarted)
            await self.redis.hdel(self.keys.workers, self.name)
            for stream in self.keys.streams:
                consumers = await self.redis.xinfo_consumers(stream, GROUP)
                if any(c["name"] == self.name and c["pending"] == 0 for c in consumers):
                    await self.redis.xgroup_delconsumer(stream, GROUP, self.name)
        except RedisError as err:
            self.log.warning("could not tidy up on exit", error=str(err))

    async def _release(self, entries: list[tuple[str, str, dict]]) -> None:
        """Give entries this worker read but never started back to the group: add a copy for
        any worker to read and drop the original, in one transaction."""
        if not entries:
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            for stream, entry_id, fields in entries:
                pipe.xadd(stream, fields)
                pipe.xack(stream, GROUP, entry_id)
                pipe.xdel(stream, entry_id)
            await pipe.execute()
        for stream, entry_id, _ in entries:
            self._held[stream].discard(entry_id)
        self.log.info("handed back unstarted entries", count=len(entries))

    # ---- the main loop -----------------------------------------------------------------

    async def _work(self, stop: asyncio.Event, stopped: asyncio.Task) -> None:
        delay = 0.0
        while not stop.is_set():
            try:
                await self._step(stopped)
                delay = 0.0
            except RedisError as err:
                if isinstance(err, ResponseError) and "NOGROUP" in str(err):
                    self.log.warning("consumer group missing; creating it again")
                    self._need_groups = True
                    continue
                delay = min(MAX_RETRY_DELAY_S, max(0.1, delay * 2))
                self.log.warning("redis unavailable", error=str(err), retry_in_s=delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)

    async def _step(self, stopped: asyncio.Task) -> None:
        """One turn: start a pass when one is due, else read more entries."""
        if self._need_groups:
            await self._create_groups()
            self._need_groups = False
        if self._starting is not None and self._starting.done():
            self._starting = None
        if self._admitting is not None and self._admitting.done():
            admitting, self._admitting = self._admitting, None
            admitting.result()      # a Redis error is this turn's, retried as any other
        if self._claimed:
            claimed, self._claimed = self._claimed, []
            await self._admit(claimed, redelivered=True)
        rows = self._fill(self._ready).rows   # as the packer will count them: roots once
        full = rows >= self.bulk_budget()
        waited_ms = (time.monotonic() - min(e.arrived for e in self._ready)) * 1000 \
            if self._ready else 0.0
        # a pass that is not full waits for entries being parsed (read to fill it) even past
        # max_wait_ms: started without them it would be a short pass of the leftovers
        timed_out = waited_ms >= self.settings.max_wait_ms and self._admitting is None
        due = bool(self._ready) and (full or timed_out or self._nothing_to_wait_for())
        if due and self._may_start():
            await self._take_interactive()
            self._dispatch()
            return
        if self._starting is None and (not due or self._single_file()):
            self._read_back()       # no pass follows now (or only once the device is free)
        busy = self._busy()
        if full and busy:   # the next pass is complete: wait until it may start
            await asyncio.wait({*busy, stopped}, return_when=asyncio.FIRST_COMPLETED)
            return
        if self._ready and not due:
            block_ms = max(1, int(self.settings.max_wait_ms - waited_ms))
        else:
            block_ms = IDLE_BLOCK_MS
        if self._admitting is not None:   # the next entries are being parsed meanwhile
            await asyncio.wait({*busy, self._admitting, stopped},
                               return_when=asyncio.FIRST_COMPLETED, timeout=block_ms / 1000)
            return
        count = self._room(rows)   # parsed while the passes before it run
        if not busy and not self._ready:
            raw, from_history = await self._read(count, block_ms)
        else:  # read what is there for the next pass, but don't sit on a finished one, nor
            # on ready entries when the streams are empty (they are due then: _drained)
            raw, from_history = await self._read(count, None)
            if not raw and busy:
                await asyncio.wait({*busy, stopped}, return_when=asyncio.FIRST_COMPLETED,
                                   timeout=min(block_ms, self.settings.max_wait_ms) / 1000)
        if raw:
            self._admitting = asyncio.create_task(self._admit(raw, redelivered=from_history))
            self._admitting_requests = any(r[0] == self.keys.interactive for r in raw)

    async def _read(self, count: int, block_ms: int | None
                    ) -> tuple[list[tuple[str, str, dict]], bool]:
        """Up to ``count`` entries: own pending ones first (after a restart), then new ones,
        interactive before bulk. Returns (entries, whether they are re-deliveries)."""
        self._drained = False
        for stream, last in self._history.items():
            if last is None:
                continue
            reply = await self.redis.xreadgroup(GROUP, self.name, {stream: last}, count=count)
            entries = reply[0][1] if reply else []
            self._history[stream] = entries[-1][0] if len(entries) == count else None
            if entries:
                return self._hold(stream, entries), True
        for stream in self.keys.streams:
            reply = await self.redis.xreadgroup(GROUP, self.name, {stream: ">"}, count=count)
            if reply:
                # read short: no more waiting there (requests don't wait for bulk entries)
                self._drained = len(reply[0][1]) < count
                return self._hold(stream, reply[0][1]), False
        self._drained = True
        if block_ms is None:
            return [], False
        reply = await self.redis.xreadgroup(GROUP, self.name, dict.fromkeys(self.keys.streams, ">"),
                                            count=count, block=block_ms)
        entries = [e for stream, entries in reply or () for e in self._hold(stream, entries)]
        self._drained = len(entries) < count
        return entries, False

    async def _take_interactive(self) -> None:
        """Interactive entries that arrived while the last pass was laid out (the worker does
        not read while its next pass is already full) join the pass about to start, ahead of
        bulk ones: a request waits at most for the passes in flight when it came."""
        if self._history[self.keys.interactive] is not None:
            return          # own pending entries are read again first (_read)
        waiting = self._fill([e for e in self._ready if e.stream == self.keys.interactive])
        if waiting.rows >= self.budget:
            return          # requests enough for this pass: the rest are read meanwhile
        reply = await self.redis.xreadgroup(GROUP, self.name, {self.keys.interactive: ">"},
                                            count=self._room(waiting.rows))
        if reply:
            await self._admit(self._hold(self.keys.interactive, reply[0][1]), redelivered=False)

    def _room(self, rows: int) -> int:
        """Entries to read for a pass that holds ``rows`` already: its room over the rows an
        entry took in the last pass, so a read is parsed in about a pass's time, never
        much more."""
        return min(self.settings.read_count,
                   max(1, math.ceil((self.budget - rows) / self._entry_rows)))

    def _hold(self, stream: str, entries: list) -> list[tuple[str, str, dict]]:
        self._held[stream].update(entry_id for entry_id, _ in entries)
        return [(stream, entry_id, fields or {}) for entry_id, fields in entries]

    # ---- admitting entries -------------------------------------------------------------

    def _parse(self, stream: str, entry_id: str, fields: dict) -> Entry:
        return self._parse_many([(stream, entry_id, fields)])[0]

    def _parse_many(self, raw: list[tuple[str, str, dict]]) -> list[Entry]:
        """Each entry read and laid out (Engine.row_parts_many): the contents of a read
        tokenised together, in parallel, not one entry after another."""
        entries = [self._read_entry(*r) for r in raw]
        laid = [e for e in entries if e.request is not None]
        try:
            parts = self.engine.row_parts_many([e.request for e in laid])
        except Exception:   # each one alone: a damaged entry then fails by itself
            self.log.exception("laying out entries together failed")
            parts = [self._row_parts(e.request) for e in laid]
        for entry, rows in zip(laid, parts, strict=True):
            if isinstance(rows, SpinfError):
                entry.error = rows
            elif isinstance(rows, Exception):   # a damaged entry; retried, then dead
                entry.failure = f"{type(rows).__name__}: {rows}"
            else:
                # the engine's own layout (prefix tree included); it keeps the request's
                # preparation for the pass that scores the entry
                entry.parts = rows
        return entries

    def _row_parts(self, request) -> list[RowPart] | Exception:
        try:
            return self.engine.row_parts(request)
        except Exception as err:   # noqa: BLE001 - the entry's own, sorted by the caller
            return err

    @staticmethod
    def _read_entry(stream: str, entry_id: str, fields: dict) -> Entry:
        entry = Entry(stream, entry_id, fields)
        try:
            if not entry.job:
                raise ValueError("entry has no job id")
            try:
                entry.request = read_request(fields["payload"])
            except SpinfError as err:
                entry.error = err
        except Exception as err:   # a damaged entry; retried like any failure, then dead
            entry.failure = f"{type(err).__name__}: {err}"
        return entry

    async def _admit(self, raw: list[tuple[str, str, dict]], redelivered: bool) -> None:
        """Parse entries (on a thread) and sort them: ready for a pass, answered at once
        (request errors, expired, already done), dead-lettered, or failed."""
        try:
            await self._sort_in(raw, redelivered)
        except BaseException:
            # whatever did not reach the ready list is left to be reclaimed
            ready = {e.id for e in self._ready}
            for stream, entry_id, _ in raw:
                if entry_id not in ready:
                    self._held[stream].discard(entry_id)
            raise

    async def _sort_in(self, raw: list[tuple[str, str, dict]], redelivered: bool) -> None:
        started = time.monotonic()
        entries = await asyncio.to_thread(self._parse_many, raw)
        self.log.debug("entries read", entries=len(entries),
                       parse_ms=round((time.monotonic() - started) * 1000, 1))
        done_before: dict[str, str] = {}
        if redelivered:
            await self._load_deliveries(entries)
            async with self.redis.pipeline(transaction=False) as pipe:
                for entry in entries:
                    pipe.get(self.keys.result(entry.job))
                stored = await pipe.execute()
            done_before = {e.id: r for e, r in zip(entries, stored, strict=True) if r is not None}
        at = now_ms()
        answered: list[tuple[Entry, JobResult, str | None]] = []
        dead: list[Entry] = []
        gone: list[Entry] = []
        for entry in entries:
            if not entry.fields:          # deleted from the stream while pending
                gone.append(entry)
            elif entry.id in done_before:   # finished before a crash, not acked: tell again
                answered.append((entry, JobResult.from_json(done_before[entry.id]), None))
            elif entry.deliveries > self.settings.max_deliveries:
                dead.append(entry)
            elif entry.failure is not None:
                await self._fail(entry, entry.failure)
            elif entry.error is not None:
                answered.append((entry, JobResult.failed(entry.error), "failed"))
            elif entry.expired(at):
                answered.append((entry, JobResult.expired(), "expired"))
            else:
                self._ready.append(entry)
                if entry.stream == self.keys.interactive:
                    self._interactive_seen = time.monotonic()
        await self._ack(gone)
        if dead:
            await self._bury(dead)
        if answered:
            await self._finish(answered)

    async def _load_deliveries(self, entries: list[Entry]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry in entries:
                pipe.xpending_range(entry.stream, GROUP, entry.id, entry.id, 1)
            replies = await pipe.execute()
        for entry, pending in zip(entries, replies, strict=True):
            if pending:
                entry.deliveries = int(pending[0]["times_delivered"])

    # ---- passes ------------------------------------------------------------------------

    @property
    def interactive_budget(self) -> int:
        """Rows up to which bulk entries fill a pass that holds interactive ones."""
        return min(self.budget, self.settings.interactive_pass_tokens or self.budget // 4)

    def bulk_budget(self) -> int:
        """Rows a pass of bulk entries alone holds now: the budget, or while requests keep
        coming (one read within REQUESTS_RECENT_S) ``interactive_bulk_pass_tokens`` (half
        the budget by default), so that a request arriving meanwhile waits for shorter
        passes on the device."""
        if time.monotonic() - self._interactive_seen >= REQUESTS_RECENT_S:
            return self.budget
        rows = self.settings.interactive_bulk_pass_tokens or self.budget // 2
        return min(self.budget, rows)

    @staticmethod
    def _fill(entries: list[Entry]) -> PassRows:
        """The rows of ``entries`` in one pass, documents of the same content sharing a root
        (a client sending one question per request about a text fills a pass as it would
        with all of them in one request)."""
        fill = PassRows()
        for entry in entries:
            fill.add_parts(entry.parts)
        return fill

    def _dispatch(self) -> None:
        """Start a pass over the ready entries that fit the budget (``_select``); the misfits
        wait for the next pass."""
        batch, self._ready, fill = self._select(self._ready)
        self._entry_rows = max(1, math.ceil(fill.rows / len(batch)))
        self._starting = asyncio.create_task(self._start_pass(batch))

    def _select(self, entries: list[Entry]) -> tuple[list[Entry], list[Entry], PassRows]:
        """The entries of a pass, those left out and the pass's rows: interactive first, in
        order. Interactive entries fill the whole budget; bulk ones join them only up to
        ``interactive_budget``, so the pass a request waits for is short (a pass without
        interactive entries is filled to ``bulk_budget``)."""
        interactive = self.keys.interactive
        ordered = sorted(entries, key=lambda e: e.stream != interactive)
        bulk_rows = self.interactive_budget if ordered[0].stream == interactive \
            else self.bulk_budget()
        batch, rest, fill = [], [], PassRows()
        for entry in ordered:
            limit = self.budget if entry.stream == interactive else bulk_rows
            trial = fill.with_parts(entry.parts)
            if not batch or trial.rows <= limit:
                batch.append(entry)
                fill = trial
            else:
                rest.append(entry)
        return batch, rest, fill

    async def _with_requests(self, batch: list[Entry]) -> list[Entry]:
        """``batch`` with the interactive entries that came while it waited to launch, ahead
        of its bulk ones (``_select``; bulk ones left out go back first in line): a request
        then waits for the passes on the device when it came, not for one more."""
        try:
            await self._take_interactive()
        except RedisError as err:   # the pass goes as it is; they join the next one
            self.log.warning("could not read requests for a pass", error=str(err))
        interactive = self.keys.interactive
        waiting = [e for e in self._ready if e.stream == interactive]
        if not waiting:
            return batch
        self._ready = [e for e in self._ready if e.stream != interactive]
        batch, rest, _ = self._select(batch + waiting)
        self._ready[:0] = rest
        return batch

    async def _start_pass(self, batch: list[Entry]) -> None:
        """Lay out and launch a pass once one other pass at most is on the device; the pass
        before it is read back once it has run, while the device runs this one."""
        live, formed = batch, time.monotonic()
        try:
            if self._ran_before is not None and not self._ran_before.done():
                # one other pass at most on the device when this one reaches it: a third
                # would only wait there, and so would a request put in it
                await asyncio.wait({self._ran_before})
                batch = await self._with_requests(batch)
            at = now_ms()
            live = [e for e in batch if not e.expired(at)]
            if expired := [e for e in batch if e.expired(at)]:
                await self._finish([(e, JobResult.expired(), "expired") for e in expired])
                self._release_held(expired)
            if not live:
                self._read_back()
                return
            # the records say "running" while the pass runs; written before the results
            marking = asyncio.create_task(self._mark_running(live))
            pass_ = Launched(live, marking, now_ms(), 0.0, times={"formed": formed})
            pass_.mark("launching")
            self.passes += 1
            flight = ENGINE_THREAD.run(timed_launch, self.engine.start_batch,
                                       [e.request for e in live], priority=LAUNCH)
            self._read_back()          # read back once it has run, while this one runs
            try:
                pass_.flight, pass_.engine_s, begun, pass_.engine_idle_s = await flight
                pass_.times["begun"] = begun
                pass_.mark("launched")
                pass_.ran = asyncio.create_task(self._device_ran(pass_.flight,
                                                                 self._last_ran))
                self._ran_before, self._last_ran = self._last_ran, pass_.ran
            except Exception as err:
                pass_.outcomes = await self._score_alone(live, err)
            self._launched = pass_
            if pass_.outcomes is None and await self._answer_first(live):
                pass_.urgent = True
                self._read_back()
        except Exception:   # entries not answered stay pending and are reclaimed later
            self.log.exception("pass failed", jobs=[e.job for e in live])
            self._release_held(live)

    async def _answer_first(self, live: list[Entry]) -> bool:
        """Whether a pass holding requests is read back as soon as it has run, ahead of any
        launch on the engine thread: when no other request is waiting, the next pass is bulk
        work, and a caller need not wait for its layout (during a bulk job, a layout of a
        small model's pass takes longer than the device's pass). With requests waiting (ready,
        being parsed, or still in the stream: reads are sized to a pass, so many callers
        leave most of theirs there), passes stay pipelined: many callers are served fastest
        at full throughput."""
        interactive = self.keys.interactive
        if not any(e.stream == interactive for e in live):
            return False
        if any(e.stream == interactive for e in self._ready) or (
                self._admitting is not None and self._admitting_requests):
            return False
        # entries not acked yet, less the ones this worker holds: not read by it yet. Held
        # ones counted first: a pass finishing meanwhile drops its entries from the stream
        # before it drops them from ``_held``
        held = len(self._held[interactive])
        try:
            unread = await self.redis.xlen(interactive) - held
        except RedisError:
            return True
        return unread <= 0

    @staticmethod
    async def _device_ran(flight, before: asyncio.Task | None) -> None:
        """Done once ``flight``'s passes have run on the device (after the pass launched
        before it: passes run in launch order), waited for on a thread of its own."""
        if before is not None:
            await asyncio.wait({before})
        if getattr(flight, "on_device", False):   # on the CPU a launched pass has run
            with contextlib.suppress(Exception):   # its read-back raises it, if it lasts
                await asyncio.to_thread(flight.wait_device)

    def _read_back(self) -> None:
        """Read back the pass on the device, if any, once it has run: its read-back is then
        queued on the engine thread (a caller's ahead of launches, bulk behind them), and the
        storing of its results after it."""
        pass_, self._launched = self._launched, None
        if pass_ is not None:
            task = asyncio.create_task(self._read_pass(pass_))
            self._reading.add(task)
            task.add_done_callback(self._reading.discard)

    async def _read_pass(self, pass_: Launched) -> None:
        try:
            if pass_.outcomes is None:
                if pass_.ran is not None:
                    await asyncio.wait({pass_.ran})
                    pass_.mark("ran")
                try:
                    pass_.outcomes, seconds = await self._answers(
                        pass_.flight, URGENT if pass_.urgent else LATER, pass_)
                    pass_.engine_s += seconds
                    pass_.device_s = getattr(pass_.flight, "device_seconds", None)
                except Exception as err:
                    pass_.outcomes = await self._score_alone(pass_.entries, err)
        except BaseException:
            self._release_held(pass_.entries)
            raise
        task = asyncio.create_task(self._finish_pass(pass_))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _finish_pass(self, pass_: Launched) -> None:
        live, outcomes = pass_.entries, pass_.outcomes
        try:
            await pass_.marking
            answered = []
            for entry, outcome in zip(live, outcomes, strict=True):
                if isinstance(outcome, CompletionResponse):
                    answered.append((entry, JobResult.ok(outcome.plain()), "succeeded"))
                elif isinstance(outcome, ScoreResponse):
                    queued_ms = queue_wait_ms(entry.id, pass_.started_ms)
                    timing = outcome.timing
                    timing.queue_ms = queued_ms
                    timing.wall_ms = queued_ms + timing.score_ms
                    answered.append((entry, JobResult.ok(outcome), "succeeded"))
                elif isinstance(outcome, SpinfError):
                    answered.append((entry, JobResult.failed(outcome), "failed"))
                else:
                    await self._fail(entry, outcome)
            # the device's time on the pass where it tells, else the engine thread's (the CPU,
            # where launching a pass runs it)
            busy_s = pass_.engine_s if pass_.device_s is None else pass_.device_s
            await self._finish(answered, pass_counts(outcomes, busy_s, pass_.engine_s,
                                                     self._collector.take(),
                                                     self._kept_roots_since()))
            pass_.mark("stored")
            requests = sum(e.stream == self.keys.interactive for e in live)
            self.log.info("pass done", docs=len(live), requests=requests,
                          seconds=round(busy_s, 3), **pass_.steps_ms())
        except Exception:   # entries not answered stay pending and are reclaimed later
            self.log.exception("pass failed", jobs=[e.job for e in live])
        finally:
            self._release_held(live)

    async def _answers(self, flight, priority: int, pass_: Launched | None = None
                       ) -> tuple[list, float]:
        """A launched pass's answers: its read-back on the engine thread, then its replies
        on the responder, while the engine thread lays out the next pass; on both at
        ``priority`` (a caller's pass ahead of bulk ones). Returns (answers, the engine
        thread's seconds); ``pass_`` is marked read, then answered."""
        _, seconds = await ENGINE_THREAD.run(timed, flight.read_back, priority=priority)
        if pass_ is not None:
            pass_.mark("read")
        answers = await RESPONDER.run(flight.respond, priority=priority)
        if pass_ is not None:
            pass_.mark("answered")
        return answers, seconds

    def _release_held(self, entries: list[Entry]) -> None:
        for entry in entries:
            self._held[entry.stream].discard(entry.id)

    async def _score_alone(self, live: list[Entry], err: Exception
                           ) -> list[ScoreResponse | SpinfError | Exception]:
        """A pass raised: one bad entry must not sink its neighbours, so each is scored
        alone to find it."""
        if len(live) == 1:
            return [err]
        self.log.warning("pass raised; scoring its entries one by one", error=repr(err))
        outcomes: list[ScoreResponse | SpinfError | Exception] = []
        for entry in live:
            try:
                flight = await ENGINE_THREAD.run(self.engine.start_batch, [entry.request])
                outcomes.extend((await self._answers(flight, LATER))[0])
            except Exception as one:
                outcomes.append(one)
        return outcomes

    async def _mark_running(self, entries: list[Entry]) -> None:
        await outcomes.mark_running(self.redis, self.keys, [e.job for e in entries],
                                    int(time.time()), self.name)

    # ---- outcomes ----------------------------------------------------------------------

    async def _finish(self, answered: list[tuple[Entry, JobResult, str | None]],
                      counts: dict[str, int | float] | None = None) -> None:
        """Store results, notify, record batch lines and ack, in one transaction (with the
        pass's ``counts``). ``status`` None: the result is stored already (a re-delivery
        after a crash), only the later steps are repeated. An entry whose batch line could
        not be recorded stays pending (``_fail``)."""
        ttl = self.settings.result_ttl_s
        finished_at = int(time.time())
        # each body written once: to its result key, and to its batch line where it has one
        bodies = [result.body_json() if status is not None else None
                  for _, result, status in answered]
        jobs = [batches.Finished(e.fields["batch"], e.job, e.fields.get("custom_id"), result,
                                 ack=(e.stream, e.id), body_json=body)
                for (e, result, _), body in zip(answered, bodies, strict=True)
                if e.job and e.fields.get("batch")]
        record, recorded, trouble = batches.RecordCall([], []), [], None
        if jobs:
            try:
                record, recorded, _ = await batches.record_call(self.redis, self.keys, jobs,
                                                                GROUP)
            except Exception as err:   # no line can be recorded: those entries stay pending
                trouble = err
        lined = {job.ack for job in recorded}        # acked by the script, with their line
        held_back = {job.ack for job in jobs} if trouble is not None else set()
        acks = [e for e, _, _ in answered if (e.stream, e.id) not in lined | held_back]
        # One MULTI/EXEC, in this order: the results and job records first, then the reply
        # notifications and callback entries (one script call: outcomes.py), then the batch
        # lines, each followed by its entry's ack (_RECORD_MANY_LUA), then the other acks.
        # Redis runs it as one step:
        # nobody sees a notification, a callback, a line or an ack without its result, and
        # a crash before EXEC leaves it all undone (the entries are delivered again).
        stats = dict(counts or {})
        for name in ("failed", "expired"):
            if n := sum(status == name for _, _, status in answered):
                stats[name] = n
        store = outcomes.StoreCall.of(self.keys, [
            outcomes.Answer(entry.job, result, status, self._result_ttl(entry),
                            reply=entry.fields.get("reply"),
                            callback=bool(entry.fields.get("callback")), body_json=body)
            for (entry, result, status), body in zip(answered, bodies, strict=True)
            if entry.job],
            stats, finished_at=finished_at, job_ttl=ttl, reply_maxlen=REPLY_MAXLEN,
            reply_ttl=REPLY_TTL_S)
        async with self.redis.pipeline(transaction=True) as pipe:
            if len(store.keys) > 2 or stats:
                store.queue(pipe)
            at = len(pipe)   # the script's reply
            if recorded:
                record.queue(pipe)
            self._queue_ack(pipe, acks)
            if not len(pipe):
                return
            replies = await pipe.execute(raise_on_error=False)
        if recorded and isinstance(replies[at], Exception):
            # the lines up to the failing one went in with their acks; the rest stay pending
            trouble, held_back, lined = replies[at], lined, set()
        for entry in acks:
            self._held[entry.stream].discard(entry.id)
        for stream, entry_id in lined:
            self._held[stream].discard(entry_id)
        for entry, _, _ in answered:
            if (entry.stream, entry.id) in held_back:
                await self._fail(entry, trouble)
        errors = [r for i, r in enumerate(replies)
                  if isinstance(r, Exception) and not (recorded and i == at)]
        if errors:
            raise errors[0]

    def _result_ttl(self, entry: Entry) -> int:
        """A batch line's answer is kept in the batch's output file: its result key only
        bridges a re-delivery, unless a callback still has to read it."""
        if entry.fields.get("batch") and not entry.fields.get("callback"):
            return min(self.settings.result_ttl_s, self.settings.batch_result_ttl_s)
        return self.settings.result_ttl_s

    def _queue_ack(self, pipe, entries: list[Entry]) -> None:
        by_stream: dict[str, list[str]] = {}
        for entry in entries:
            by_stream.setdefault(entry.stream, []).append(entry.id)
        for stream, ids in by_stream.items():
            pipe.xack(stream, GROUP, *ids)
            pipe.xdel(stream, *ids)

    async def _ack(self, entries: list[Entry]) -> None:
        if not entries:
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            self._queue_ack(pipe, entries)
            await pipe.execute()
        for entry in entries:
            self._held[entry.stream].discard(entry.id)

    async def _fail(self, entry: Entry, error: Exception | str) -> None:
        """Unexpected trouble: note it and leave the entry pending, to be reclaimed."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.log.error("job failed; it stays pending", job=entry.job, entry=entry.id,
                       deliveries=entry.deliveries, error=text,
                       exc_info=error if isinstance(error, Exception) else None)
        self._held[entry.stream].discard(entry.id)
        if entry.job:
            await self.redis.hset(self.keys.job(entry.job), "last_error", text)

    async def _bury(self, entries: list[Entry]) -> None:
        """Move entries delivered too often to the dead-letter stream and answer them."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry in entries:
                pipe.hget(self.keys.job(entry.job), "last_error")
            last_errors = await pipe.execute()
        async with self.redis.pipeline(transaction=True) as pipe:
            for entry, last_error in zip(entries, last_errors, strict=True):
                pipe.xadd(self.keys.dead, {
                    "job": entry.job, "stream": entry.stream, "entry": entry.id,
                    "deliveries": entry.deliveries,
                    "error": last_error or entry.failure or "unknown",
                    "payload": entry.fields.get("payload", "")})
            pipe.hincrby(self.keys.stats, "dead", len(entries))
            await pipe.execute()
        for entry in entries:
            self.log.error("job dead-lettered", job=entry.job, entry=entry.id,
                           deliveries=entry.deliveries)
        await self._finish([(e, JobResult.dead_letter(e.deliveries), "failed")
                            for e in entries])

    # ---- chores ------------------------------------------------------------------------

    async def _heartbeat_loop(self, stop: asyncio.Event) -> None:
        # often enough that the entries held stay well under the reclaim idle time
        interval = min(self.settings.heartbeat_s, self.settings.claim_idle_ms / 3000)
        while not stop.is_set():
            try:
                await self._beat()
                await self._touch_held()
            except RedisError as err:
                self.log.warning("heartbeat failed", error=str(err))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    async def _beat(self) -> None:
        # status "available": the API tells a loaded model from one still loading (serve.py
        # registers "loading" under the same name until this worker exists)
        config = getattr(getattr(self.engine, "checkpoint", None), "config", None)
        manifest = getattr(self.engine, "manifest", None)   # what GET /v1/models lists
        await self.redis.hset(self.keys.workers, self.name, json.dumps({
            "model": self.engine.model_name, "fingerprint": self.engine.fingerprint,
            "device": str(self.engine.device), "pid": os.getpid(),
            "host": socket.gethostname(), "heartbeat_ms": now_ms(), "passes": self.passes,
            "status": "available", "started_ms": self.started_ms, "loaded_ms": self.loaded_ms,
            "family": config.get("model_type") if isinstance(config, dict) else None,
            "media": list(getattr(self.engine, "media_kinds", ())),
            "manifest": manifest.model_dump(mode="json") if manifest is not None else None}))

    async def _touch_held(self) -> None:
        """Reset the idle time of entries held (queued here or in a pass), so a pass longer
        than claim_idle_ms is not taken over. JUSTID leaves the delivery count alone."""
        for stream, held in self._held.items():
            if held:
                await self.redis.xclaim(stream, GROUP, self.name, 0, list(held), justid=True)

    async def _claim_loop(self, stop: asyncio.Event) -> None:
        interval = self.settings.claim_idle_ms / 2000
        last_prune = time.monotonic()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if stop.is_set():
                return
            try:
                await self._claim()
                if time.monotonic() - last_prune > PRUNE_CONSUMER_IDLE_MS / 1000:
                    last_prune = time.monotonic()
                    await self._prune_consumers()
            except RedisError as err:
                self.log.warning("reclaim failed", error=str(err))

    async def _claim(self) -> None:
        """Take over entries idle longer than claim_idle_ms (their worker died, or they
        failed); the main loop parses them, checking the delivery count. A pass's worth at
        a time, so that other live workers share a dead one's backlog."""
        count = min(self.settings.read_count, max(1, self.budget // ROW_TILE))
        for stream in self.keys.streams:
            cursor, claimed, *_ = await self.redis.xautoclaim(
                stream, GROUP, self.name, self.settings.claim_idle_ms,
                start_id=self._claim_cursor[stream], count=count)
            self._claim_cursor[stream] = cursor
            fresh = [(i, f) for i, f in claimed if i not in self._held[stream]]
            if fresh:
                self.log.info("reclaimed entries", stream=stream, count=len(fresh))
                self._claimed.extend(self._hold(stream, fresh))

    async def _prune_consumers(self) -> None:
        for stream in self.keys.streams:
            for consumer in await self.redis.xinfo_consumers(stream, GROUP):
                if consumer["pending"] == 0 and consumer["idle"] > PRUNE_CONSUMER_IDLE_MS:
                    await self.redis.xgroup_delconsumer(stream, GROUP, consumer["name"])

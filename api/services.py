"""What the routes are given: settings, the Redis client, the producer and the reply listener
(opened once by the app's lifespan), and a few reads shared by several routes: the workers
registered in Redis (and whether their model has loaded), the draining flag."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args

import orjson
import structlog
from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from redis.asyncio import Redis
from redis.exceptions import RedisError

from spinf_worker.errors import InvalidRequestError
from spinf_worker.manifest import Manifest
from spinf_worker.queue.keys import Keys
from spinf_worker.queue.producer import Producer
from spinf_worker.queue.replies import ReplyListener
from spinf_worker.queue.settings import ServiceSettings
from spinf_worker.request_limits import ServedTokens

from .errors import UNAVAILABLE_RETRY_S, ServiceUnavailableError, WarmingUpError
from .metrics import ApiMetrics
from .tokens import TokenizerCache

PRELOAD_POLL_S = 1.0   # how often a starting API looks for the served model's workers

log = structlog.get_logger("spinf.api")


WorkerStatus = Literal["loading", "available", "error"]   # as the worker registers it


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    model: str
    fingerprint: str | None
    device: str | None
    heartbeat_ms: int
    # a registration without a status comes from a worker that registers once loaded
    status: WorkerStatus = "available"
    error: str | None = None
    started_ms: int | None = None    # when it began to load its model
    loaded_ms: int | None = None     # when the model was loaded
    family: str | None = None
    host: str | None = None
    pid: int | None = None
    passes: int = 0
    media: list[str] | None = None   # the media kinds its model reads (None: not said)
    # its model's manifest (spinf_worker/manifest.py; None: a worker still loading, or older)
    manifest: Manifest | None = None

    @property
    def available(self) -> bool:
        return self.status == "available"

    def boot(self) -> dict:
        load_s = (round((self.loaded_ms - self.started_ms) / 1000, 1)
                  if self.loaded_ms is not None and self.started_ms is not None else None)
        return {"worker": self.name, "model": self.model, "status": self.status,
                "started_ms": self.started_ms, "loaded_ms": self.loaded_ms, "load_s": load_s}

    def engine(self) -> dict:
        return {"worker": self.name, "model": self.model, "family": self.family,
                "fingerprint": self.fingerprint, "device": self.device, "host": self.host,
                "pid": self.pid, "status": self.status, "passes": self.passes}

    @classmethod
    def from_registration(cls, name: str, raw: str) -> WorkerInfo:
        info = json.loads(raw)
        status = info.get("status") or "available"
        if status not in get_args(WorkerStatus):
            raise ValueError(f"unknown worker status {status!r}")
        return cls(name=name, model=str(info["model"]), fingerprint=info.get("fingerprint"),
                   device=info.get("device"), heartbeat_ms=int(info.get("heartbeat_ms", 0)),
                   status=status, error=info.get("error"),
                   started_ms=_int_or_none(info.get("started_ms")),
                   loaded_ms=_int_or_none(info.get("loaded_ms")), family=info.get("family"),
                   host=info.get("host"), pid=_int_or_none(info.get("pid")),
                   passes=int(info.get("passes") or 0),
                   media=[str(k) for k in info["media"]] if isinstance(info.get("media"), list)
                   else None,
                   manifest=(Manifest.model_validate(info["manifest"])
                             if isinstance(info.get("manifest"), dict) else None))


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


# (live, all registered) workers, as Services.workers() read them
Workers = tuple[list[WorkerInfo], list[WorkerInfo]]


def draining_key(keys: Keys) -> str:
    """The flag POST /v0/drain sets: this deployment's instances answer /readyz 503."""
    return f"{keys.base}:draining"


@dataclass
class Services:
    settings: ServiceSettings
    redis: Redis
    keys: Keys
    producer: Producer
    listener: ReplyListener
    metrics: ApiMetrics
    started_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    background: set[asyncio.Task] = field(default_factory=set)
    tokenizers: TokenizerCache = field(default_factory=TokenizerCache)
    pack_queries: dict = field(default_factory=dict)   # request_limits.pack_queries' cache
    # each worker's registration as last read, and what it was read as
    _registrations: dict[str, tuple[str, WorkerInfo]] = field(default_factory=dict)

    def spawn(self, work: Coroutine, *, name: str) -> None:
        """Run ``work`` after the response; kept referenced so it is not collected, and
        cancelled when the app stops."""
        task = asyncio.create_task(work, name=name)
        self.background.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", task=task.get_name(),
                      error=repr(task.exception()))

    async def workers(self) -> Workers:
        """(live, all registered) workers; live = heartbeat within worker_ttl_s."""
        return self._workers_of(await self.redis.hgetall(self.keys.workers))

    async def admission(self) -> tuple[Workers, int]:
        """The workers and the backlog (Producer.backlog) in one round trip: what a request
        is checked against before it is queued."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.workers)
            self.producer.ask_backlog(pipe)
            replies = await pipe.execute(raise_on_error=False)
        if isinstance(replies[0], Exception):
            raise replies[0]
        return self._workers_of(replies[0]), await self.producer.backlog_of(replies[1:])

    def _workers_of(self, registrations: dict) -> Workers:
        registered = []
        read = {}
        for name, raw in registrations.items():
            # a registration read as before is the same worker (they are frozen): parsed
            # once per heartbeat, not on every request
            known = self._registrations.get(name)
            if known is not None and known[0] == raw:
                read[name] = known
                registered.append(known[1])
                continue
            try:
                info = WorkerInfo.from_registration(name, raw)
            except (ValueError, KeyError, TypeError):
                continue  # a half-written or foreign entry is no worker
            read[name] = (raw, info)
            registered.append(info)
        self._registrations = read
        oldest_ms = (time.time() - self.settings.worker_ttl_s) * 1000
        return sorted((w for w in registered if w.heartbeat_ms >= oldest_ms),
                      key=lambda w: w.name), registered

    async def served_models(self, workers: Workers | None = None) -> set[str]:
        """The models of the live workers (those loaded first), or of the registered ones
        when none is live (a restarting fleet); empty with no worker at all. ``workers``:
        what ``workers()`` read for this request already."""
        live, registered = workers or await self.workers()
        loaded = [w for w in live if w.available]
        return {w.model for w in (loaded or live or registered)}

    async def served_tokens(self, workers: Workers | None = None) -> ServedTokens | None:
        """The served model's tokenizer (api/tokens.py), when one model is served and its
        tokenizer is on this machine; None otherwise (the workers then check the tokens)."""
        models = await self.served_models(workers)
        if len(models) != 1:
            return None
        model = next(iter(models))
        # loaded already: no thread (a hop per request costs more than the lookup)
        return self.tokenizers.loaded(model) or await asyncio.to_thread(self.tokenizers.get,
                                                                        model)

    async def preload_tokens(self, every_s: float = PRELOAD_POLL_S) -> None:
        """Load the served model's tokenizer before any request needs it: the first request
        to an API process would otherwise wait for it (a second or more for a 262k-token
        vocabulary), once per process. Polls the worker registrations until one model is
        served and its tokenizer is loaded (or found missing here); runs until then."""
        while True:
            try:
                models = await self.served_models()
            except RedisError:
                models = set()
            if len(models) == 1:
                model = next(iter(models))
                await asyncio.to_thread(self.tokenizers.get, model)
                return
            await asyncio.sleep(every_s)

    async def check_serving(self, workers: Workers | None = None) -> None:
        """503 when the live workers cannot score yet: ``warming_up`` (Retry-After) while
        they are all still loading their model, ``model_unavailable`` when none could load
        it. With no live worker at all a job is queued and waits for one, as before."""
        live, _registered = workers or await self.workers()
        if not live or any(w.available for w in live):
            return
        if any(w.status == "loading" for w in live):
            raise WarmingUpError()
        failed = next(w for w in live if w.status == "error")
        raise ServiceUnavailableError(f"the model failed to load: {failed.error or 'unknown'}",
                                      headers={"Retry-After": str(UNAVAILABLE_RETRY_S)})

    async def draining(self) -> bool:
        return bool(await self.redis.exists(draining_key(self.keys)))

    async def set_draining(self, on: bool) -> None:
        if on:
            await self.redis.set(draining_key(self.keys), str(int(time.time() * 1000)))
        else:
            await self.redis.delete(draining_key(self.keys))


async def get_services(request: Request) -> Services:
    # async: FastAPI runs a plain function dependency on a worker thread, a hop per request
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]


class ResultResponse(JSONResponse):
    """A job's result as the reply's body, written by orjson: a scoring reply is thousands of
    floats, and the json module takes several times as long to write them (a sync caller
    waits for it). The worker stored the result through orjson already (spinf_worker/jsonio.py), so
    it holds nothing orjson would write otherwise."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


async def read_json(request: Request) -> Any:
    """The request body as JSON; the size limit is enforced while it is read (middleware)."""
    raw = await request.body()
    if not raw.strip():
        raise InvalidRequestError("the request body is empty; send a JSON object",
                                  code="invalid_json")
    try:
        # orjson refuses what scoring cannot take: lone surrogates, NaN and Infinity,
        # numbers past a float, nesting deeper than 1,024 (json.loads would recurse into a 500)
        return orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise InvalidRequestError(f"the request body is not valid JSON: {err.msg} (line "
                                  f"{err.lineno}, column {err.colno})",
                                  code="invalid_json") from None

"""What the routes are given: settings, the Redis client, the producer and the reply listener
(opened once by the app's lifespan), and a few reads shared by several routes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Annotated, Any

import structlog
from fastapi import Depends, Request
from redis.asyncio import Redis

from spinf_worker.errors import InvalidRequestError
from spinf_worker.queue.keys import Keys
from spinf_worker.queue.producer import Producer
from spinf_worker.queue.replies import ReplyListener
from spinf_worker.queue.settings import ServiceSettings

from .metrics import ApiMetrics

log = structlog.get_logger("spinf.api")


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    model: str
    fingerprint: str | None
    device: str | None
    heartbeat_ms: int


@dataclass
class Services:
    settings: ServiceSettings
    redis: Redis
    keys: Keys
    producer: Producer
    listener: ReplyListener
    metrics: ApiMetrics
    background: set[asyncio.Task] = field(default_factory=set)

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

    async def workers(self) -> tuple[list[WorkerInfo], list[WorkerInfo]]:
        """(live, all registered) workers; live = heartbeat within worker_ttl_s."""
        registered = []
        for name, raw in (await self.redis.hgetall(self.keys.workers)).items():
            try:
                info = json.loads(raw)
                registered.append(WorkerInfo(name=name, model=str(info["model"]),
                                             fingerprint=info.get("fingerprint"),
                                             device=info.get("device"),
                                             heartbeat_ms=int(info.get("heartbeat_ms", 0))))
            except (ValueError, KeyError, TypeError):
                continue  # a half-written or foreign entry is no worker
        oldest_ms = (time.time() - self.settings.worker_ttl_s) * 1000
        return [w for w in registered if w.heartbeat_ms >= oldest_ms], registered


def get_services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]


async def read_json(request: Request) -> Any:
    """The request body as JSON; the size limit is enforced while it is read (middleware)."""
    raw = await request.body()
    if not raw.strip():
        raise InvalidRequestError("the request body is empty; send a JSON object",
                                  code="invalid_json")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        detail = (f"{err.msg} (line {err.lineno}, column {err.colno})"
                  if isinstance(err, json.JSONDecodeError) else "not UTF-8")
        raise InvalidRequestError(f"the request body is not valid JSON: {detail}",
                                  code="invalid_json") from None

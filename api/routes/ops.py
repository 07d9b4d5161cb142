"""Operations, open without a key: /health (the process is up), /ready (Redis answers and a
worker is alive: route traffic here), /metrics (Prometheus text format)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from ..errors import ServiceUnavailableError
from ..metrics import queue_families, render
from ..models import Health, Ready, error_responses
from ..services import ServicesDep

router = APIRouter(tags=["operations"])

REDIS_PING_TIMEOUT_S = 2.0


@router.get("/health", response_model=Health)
async def health() -> Health:
    return Health()


@router.get("/ready", response_model=Ready, responses=error_responses(503))
async def ready(services: ServicesDep) -> Ready:
    try:
        await asyncio.wait_for(services.redis.ping(), REDIS_PING_TIMEOUT_S)
    except (RedisError, OSError, TimeoutError) as err:
        raise ServiceUnavailableError(f"Redis does not answer: {err or 'timeout'}",
                                      code="redis_unavailable") from None
    live, registered = await services.workers()
    if not live:
        reason = (f"no live worker: {len(registered)} registered, none with a heartbeat in "
                  f"the last {services.settings.worker_ttl_s:g} s" if registered
                  else "no worker has registered")
        raise ServiceUnavailableError(reason, code="no_live_worker")
    return Ready(workers=len(live), models=sorted({w.model for w in live}))


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(services: ServicesDep) -> Response:
    live, _registered = await services.workers()
    families = await queue_families(services.redis, services.keys, live)
    return Response(render(services.metrics, families), media_type=CONTENT_TYPE_LATEST)

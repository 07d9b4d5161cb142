"""Operations, open without a key: /healthz and /health (the process is up), /readyz and
/ready (Redis answers and a live worker's model has loaded: route traffic here), /livez
(the same, draining or not), /metrics (Prometheus text format). /v0 needs the trusted token
(auth.require_trusted): GET /v0/info (what produces the scores), POST and DELETE /v0/drain
(start and stop draining: /readyz answers 503 so load balancers move calls away, while
/v1/score keeps scoring what still comes)."""

from __future__ import annotations

import asyncio
import os
import socket

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from spinf_worker import __version__

from ..auth import V0_AUTH
from ..errors import (
    UNAVAILABLE_RETRY_S,
    RedisUnavailableError,
    ServiceUnavailableError,
    WarmingUpError,
)
from ..metrics import queue_families, render
from ..models import (
    ApiProcess,
    Boot,
    Drain,
    Health,
    Healthz,
    Info,
    Livez,
    Ready,
    Readyz,
    error_responses,
)
from ..services import Services, ServicesDep, WorkerInfo

router = APIRouter(tags=["operations"])

REDIS_PING_TIMEOUT_S = 2.0


class NotServing(Exception):
    """Why this instance should get no traffic (the 503 bodies of /readyz and /livez)."""

    def __init__(self, reason: str | None = None):
        super().__init__(reason)
        self.reason = reason


async def _ping(services: Services) -> None:
    try:
        await asyncio.wait_for(services.redis.ping(), REDIS_PING_TIMEOUT_S)
    except (RedisError, OSError, TimeoutError) as err:
        raise NotServing(f"Redis does not answer: {err or 'timeout'}") from None


def _boot(services: Services, live: list[WorkerInfo]) -> Boot:
    loaded = [w.loaded_ms for w in live if w.available and w.loaded_ms is not None]
    return Boot(api_started_ms=services.started_ms, loaded_ms=min(loaded, default=None),
                workers=[w.boot() for w in live])


async def _serving(services: Services) -> list[WorkerInfo]:
    """The live workers, when Redis answers and one of them has loaded its model."""
    await _ping(services)
    live, registered = await services.workers()
    if any(w.available for w in live):
        return live
    if any(w.status == "loading" for w in live):
        raise NotServing()      # loading: nothing wrong, nothing to say
    failed = [w for w in live if w.status == "error"]
    if failed:
        raise NotServing(f"the model failed to load: {failed[0].error or 'unknown'}")
    raise NotServing(f"no live worker: {len(registered)} registered, none with a heartbeat in "
                     f"the last {services.settings.worker_ttl_s:g} s" if registered
                     else "no worker has registered")


def _not(key: str, error: NotServing) -> JSONResponse:
    body: dict = {key: False}
    if error.reason:
        body["error"] = error.reason
    return JSONResponse(body, status_code=503)


@router.get("/healthz", response_model=Healthz)
async def healthz() -> Healthz:
    return Healthz()


@router.get("/readyz", response_model=Readyz, response_model_exclude_none=True,
            responses={503: {"model": Readyz}})
async def readyz(services: ServicesDep) -> Response:
    try:
        live = await _serving(services)
        if await services.draining():
            return JSONResponse({"ready": False, "draining": True}, status_code=503)
    except NotServing as error:
        return _not("ready", error)
    except RedisError as err:          # Redis went away between the ping and the reads
        return _not("ready", NotServing(f"Redis does not answer: {err}"))
    return JSONResponse(Readyz(ready=True, boot=_boot(services, live))
                        .model_dump(mode="json", exclude_none=True))


@router.get("/livez", response_model=Livez, responses={503: {"model": Livez}})
async def livez(services: ServicesDep) -> Response:
    try:
        await _serving(services)
    except (NotServing, RedisError):
        return JSONResponse({"live": False}, status_code=503)
    return JSONResponse({"live": True})


@router.get("/health", response_model=Health)
async def health() -> Health:
    return Health()


@router.get("/ready", response_model=Ready, responses=error_responses(503))
async def ready(services: ServicesDep) -> Ready:
    try:
        await asyncio.wait_for(services.redis.ping(), REDIS_PING_TIMEOUT_S)
    except (RedisError, OSError, TimeoutError) as err:
        raise RedisUnavailableError(f"Redis does not answer: {err or 'timeout'}") from None
    live, registered = await services.workers()
    if not live:
        reason = (f"no live worker: {len(registered)} registered, none with a heartbeat in "
                  f"the last {services.settings.worker_ttl_s:g} s" if registered
                  else "no worker has registered")
        raise ServiceUnavailableError(reason, code="no_live_worker")
    if not any(w.available for w in live):
        raise WarmingUpError()
    return Ready(workers=len(live), models=sorted({w.model for w in live}))


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(services: ServicesDep) -> Response:
    live, _registered = await services.workers()
    families = await queue_families(services.redis, services.keys, live)
    return Response(render(services.metrics, families), media_type=CONTENT_TYPE_LATEST)


# ---- /v0: trusted callers -------------------------------------------------------------------


@router.get("/v0/info", response_model=Info, dependencies=V0_AUTH,
            responses=error_responses(401, 503))
async def info(services: ServicesDep) -> Info:
    """The engines behind this API: each live worker's model, fingerprint and device, and
    when they started and loaded; and this API process. 503 ``warming_up`` until one has
    loaded."""
    await services.check_serving()
    live, _registered = await services.workers()
    if not live:
        raise ServiceUnavailableError("no live worker: nothing produces scores yet",
                                      headers={"Retry-After": str(UNAVAILABLE_RETRY_S)})
    available = [w for w in live if w.available]
    return Info(engine={"version": __version__,
                        "models": sorted({w.model for w in available}),
                        "fingerprints": sorted({w.fingerprint for w in available
                                                if w.fingerprint}),
                        "workers": [w.engine() for w in live]},
                boot=_boot(services, live),
                api=ApiProcess(host=socket.gethostname(), pid=os.getpid(),
                               instance=services.listener.instance_id))


@router.post("/v0/drain", response_model=Drain, dependencies=V0_AUTH,
             responses=error_responses(401))
async def drain(services: ServicesDep) -> Drain:
    await services.set_draining(True)
    return Drain(draining=True)


@router.delete("/v0/drain", response_model=Drain, dependencies=V0_AUTH,
               responses=error_responses(401))
async def undrain(services: ServicesDep) -> Drain:
    await services.set_draining(False)
    return Drain(draining=False)

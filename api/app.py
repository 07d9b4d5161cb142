"""The API tier: a FastAPI app in front of the Redis work streams. It imports no torch.

``create_app(settings)`` builds the app; its lifespan opens the Redis client, the producer and
this instance's reply listener, and closes them (cancelling background enqueues) on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import structlog
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from spinf_worker import __version__
from spinf_worker.queue.batches import QueueKeeper
from spinf_worker.queue.keys import Keys
from spinf_worker.queue.producer import Producer
from spinf_worker.queue.redis_client import connect
from spinf_worker.queue.replies import ReplyListener
from spinf_worker.queue.settings import ServiceSettings
from spinf_worker.queue.switch_interval import switch_interval

from .auth import load_api_keys
from .errors import install_error_handlers
from .metrics import ApiMetrics
from .middleware import BodyLimitMiddleware, RequestContextMiddleware
from .models import DOCUMENTED_BODIES
from .routes import ROUTERS
from .routes.scoring import limits_check
from .services import Services

log = structlog.get_logger("spinf.api")

MULTIPART_OVERHEAD_BYTES = 1 << 20  # form fields and part headers around an uploaded file
SHUTDOWN_GRACE_S = 5.0              # background enqueues get this long to finish on exit


def create_app(settings: ServiceSettings | None = None) -> FastAPI:
    settings = settings or ServiceSettings()
    if not settings.redis_url:
        raise ValueError("the API needs a Redis URL (SPINF_REDIS_URL); `spinf-serve serve` "
                         "starts a private Redis when none is given")
    metrics = ApiMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        with switch_interval(settings.api_switch_interval_ms):
            async with serving(app):
                yield

    @contextlib.asynccontextmanager
    async def serving(app: FastAPI) -> AsyncIterator[None]:
        redis = connect(settings.redis_url, client_name="spinf-api")
        # Jobs are queued on a client that never sends a command twice: redis-py repeats a
        # whole MULTI/EXEC after a dropped connection, and one whose reply was lost after
        # Redis had run it would put the job on the stream twice (scored twice). A pooled
        # connection that a Redis restart closed is still replaced before use; a failure in
        # the middle of a command is a 503 for the caller to repeat.
        queue_redis = connect(settings.redis_url, client_name="spinf-api-producer", retries=0)
        keys = Keys(settings.prefix)
        listener = ReplyListener(redis, keys)
        await listener.start()
        services = Services(settings=settings, redis=redis, keys=keys,
                            producer=Producer(queue_redis, keys, settings), listener=listener,
                            metrics=metrics)
        app.state.services = services
        # resumes batches left half-queued, with the checks a batch's lines get when it starts
        keeper = QueueKeeper(redis, keys, services.producer,
                             checks=lambda: limits_check(services))
        keeper.start()
        preload = asyncio.create_task(services.preload_tokens(), name="preload-tokens")
        log.info("api started", prefix=settings.prefix, instance=listener.instance_id)
        try:
            yield
        finally:
            preload.cancel()
            await keeper.stop()
            if services.background:
                _done, still_running = await asyncio.wait(services.background,
                                                          timeout=SHUTDOWN_GRACE_S)
                for task in still_running:
                    log.warning("stopping unfinished background task", task=task.get_name())
                    task.cancel()
            await listener.stop()
            await queue_redis.aclose()
            await redis.aclose()

    app = FastAPI(
        title="spinf-serve",
        version=__version__,
        description="Reads a document once and answers many multiple-choice questions about "
                    "it in the same forward pass. OpenAI-compatible where OpenAI has a shape.",
        lifespan=lifespan,
    )
    app.state.api_keys = load_api_keys(settings)
    app.state.trusted_token = settings.token
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)

    def body_limit(path: str) -> int:
        if path.rstrip("/") == "/v1/files":
            return settings.max_file_bytes + MULTIPART_OVERHEAD_BYTES
        return settings.max_body_bytes

    # The last added runs first: the request id and timing cover the 413s too.
    app.add_middleware(BodyLimitMiddleware, limit_for_path=body_limit)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema plus the request bodies the routes parse themselves."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version,
                             description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in DOCUMENTED_BODIES:
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, definition in body.pop("$defs", {}).items():
                components.setdefault(name, definition)
            components[model.__name__] = body
        app.openapi_schema = schema
    return app.openapi_schema

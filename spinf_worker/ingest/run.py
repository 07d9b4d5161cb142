"""``spinf-serve ingest``: the consumer on the service's event loop (serve.run_tiers), joined to
a deployment's Redis (``--redis``) or, without one, with the embedded stack ``serve`` uses: a
private redis-server on a state dir and one worker in this process."""

from __future__ import annotations

import contextlib
from pathlib import Path

import structlog

from ..queue.settings import ServiceSettings
from ..serve import (
    EmbeddedRedis,
    Tiers,
    WorkerSpec,
    default_state_dir,
    load_or_create_secret,
    run_loop,
    run_tiers,
    state_lock,
)
from .config import Settings
from .consumer import Consumer
from .metrics import IngestMetrics

log = structlog.get_logger("spinf.ingest")


def ingest(service: ServiceSettings, config: Settings, *, once: bool = False,
           model: str | None = None, device: str | None = None, state_dir: Path | None = None,
           metrics_port: int | None = None, metrics_host: str = "127.0.0.1") -> None:
    metrics = IngestMetrics()
    with contextlib.ExitStack() as stack:
        worker = None
        updates: dict = {}
        if not service.redis_url:
            # its own state dir by default, so it runs beside a `serve` on the same machine
            state_dir = Path(state_dir) if state_dir else default_state_dir() / "ingest"
            state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            stack.enter_context(state_lock(state_dir))
            embedded = stack.enter_context(EmbeddedRedis(state_dir / "redis"))
            updates["redis_url"] = embedded.url
            if not service.webhook_secret and any(s.startswith("webhook:") for s in config.sinks):
                secret, path, created = load_or_create_secret(state_dir)
                log.info("webhook secret created" if created else "webhook secret loaded",
                         path=str(path))
                updates["webhook_secret"] = secret
            # the only worker of this Redis: a stable name re-reads its own pending entries
            worker = WorkerSpec(model=model, device=device, name="ingest")
        service = service.model_copy(update=updates)
        if metrics_port is not None:
            server = metrics.serve(metrics_port, metrics_host)
            stack.callback(server.shutdown)
            log.info("metrics served", url=f"http://{metrics_host}:{metrics_port}/metrics")
        consumer = Consumer(config, service, once=once, metrics=metrics)
        run_loop(run_tiers(service, Tiers(worker=worker, jobs={"ingest": consumer.run})))

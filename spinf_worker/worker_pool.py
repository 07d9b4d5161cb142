"""``spinf-serve worker --devices``: one worker process per device, all consumers of the same
queue, supervised.

Each child is an ordinary ``spinf-serve worker`` (its own interpreter, CUDA context, engine
and consumer name) started with the pool's resolved settings in its environment. A GPU child
sees only its GPU (``CUDA_VISIBLE_DEVICES``) and scores on ``cuda``: every kernel runs on
device 0 of its process, and the fingerprint names the GPU's model, not its index, so the same
document gives the same bits on any GPU of one kind. Names are stable per device
(``<base>-gpu<K>``): a child started again first finishes its own pending entries, as a
restarted worker of the same name does; a child gone for good has its entries reclaimed by
the others (queue/worker.py).

A child that exits while the pool runs is started again after a pause that doubles (1 s up
to a minute; back to 1 s once a child has run a minute). One that exits with the CLI's usage
code (2: a bad model, flag or pack, the same for every restart) stops the pool. SIGINT /
SIGTERM: every child is asked to stop gracefully (its pass finished, unstarted entries handed
back), and the pool returns when all have.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from .child_processes import dies_with_parent
from .errors import SpinfError
from .queue.settings import ServiceSettings

log = structlog.get_logger("spinf.workers")

USAGE_EXIT = 2              # the CLI's code for what a restart cannot mend
FIRST_PAUSE_S = 1.0
MAX_PAUSE_S = 60.0
STEADY_S = 60.0             # a child that ran this long starts the next pause from scratch


class DevicesError(ValueError):
    """A ``--devices`` value that names no usable device."""


class PoolError(SpinfError):
    """A worker of the pool cannot run: the CLI says it in one line and exits 2."""


def visible_gpus() -> int:
    """CUDA devices this process could use (0 without CUDA); creates no CUDA context."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_devices(spec: str, gpus: int | None = None) -> list[str]:
    """``all`` (every visible GPU), GPU indexes (``0,1``) or device names (``cuda:1``,
    ``cpu``) -> one device per worker. A device may repeat: several worker processes on it
    (``0,0``), each with an interpreter of its own, where one process's host work per pass
    outlasts a small model's pass on a fast GPU."""
    gpus = visible_gpus() if gpus is None else gpus
    if spec.strip() == "all":
        if not gpus:
            raise DevicesError("--devices all: no GPU is visible to this process")
        return [f"cuda:{k}" for k in range(gpus)]
    devices = []
    for part in (p.strip() for p in spec.split(",")):
        if part.isdigit():
            part = f"cuda:{part}"
        elif part == "cuda":
            part = "cuda:0"
        if part != "cpu" and not (part.startswith("cuda:") and part[5:].isdigit()):
            raise DevicesError(f"--devices: {part!r} is not a GPU index, cuda:K or cpu")
        if part != "cpu" and gpus and int(part[5:]) >= gpus:
            raise DevicesError(f"--devices: {part}, but {gpus} GPU(s) are visible")
        devices.append(part)
    if not devices:
        raise DevicesError("--devices: name at least one device")
    return devices


def shared_without_mps(devices: list[str]) -> list[str]:
    """The GPUs named more than once while no MPS control daemon answers (its pipe,
    ``$CUDA_MPS_PIPE_DIRECTORY/control``, default ``/tmp/nvidia-mps``). Without MPS the
    processes of one GPU take turns on it, context by context; under MPS their kernels run
    side by side (two 270M engines on one H100: 80,485 questions/s together, against 70,664
    taking turns and ~75,000 for one alone; benchmarks/RESULTS.md)."""
    shared = sorted({d for d in devices if d.startswith("cuda:") and devices.count(d) > 1})
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")
    return [] if (pipe / "control").exists() else shared


@dataclass
class Child:
    device: str
    name: str
    process: asyncio.subprocess.Process | None = None
    started: float = 0.0
    pause_s: float = FIRST_PAUSE_S
    restarts: int = 0


@dataclass
class WorkerPool:
    """Worker processes for ``devices`` on the queue of ``settings``."""

    settings: ServiceSettings
    devices: list[str]
    model: str | None = None
    base_name: str | None = None
    log_args: list[str] = field(default_factory=list)   # --log-level / --log-format, passed on
    stop_grace_s: float = 120.0     # after a stop request, children still running are killed

    def __post_init__(self):
        base = self.base_name or socket.gethostname()
        self.children = [Child(d, f"{base}-{self._label(i, d)}")
                         for i, d in enumerate(self.devices)]

    def _label(self, i: int, device: str) -> str:
        """``gpu<K>`` for a GPU's first worker, ``gpu<K>-<n>`` for its n-th; ``cpu<i>``:
        stable across restarts, each its own consumer."""
        if not device.startswith("cuda:"):
            return f"cpu{i}"
        nth = self.devices[:i + 1].count(device)
        return f"gpu{device[5:]}" + (f"-{nth}" if nth > 1 else "")

    def _command(self, child: Child) -> tuple[list[str], dict[str, str]]:
        settings = self.settings
        env = {**os.environ, "SPINF_REDIS_URL": settings.redis_url or "",
               "SPINF_PREFIX": settings.prefix, "SPINF_PACKS": json.dumps(settings.packs),
               "SPINF_QUANT": settings.quant, "SPINF_LOAD_FORMAT": settings.load_format}
        if settings.fp8_scales:
            env["SPINF_FP8_SCALES"] = settings.fp8_scales
        device = child.device
        if device.startswith("cuda:"):
            env["CUDA_VISIBLE_DEVICES"] = device[5:]
            device = "cuda"
        command = [sys.executable, "-m", "spinf_worker.cli", "worker", "--device", device,
                   "--name", child.name, *self.log_args]
        if self.model:
            command += ["--model", self.model]
        return command, env

    async def _start(self, child: Child) -> None:
        command, env = self._command(child)
        # its own session: a Ctrl-C in the terminal reaches the pool alone, which asks each
        # child once (a second signal would stop a child at once); and a pool killed outright
        # takes its children with it
        child.process = await asyncio.create_subprocess_exec(
            *command, env=env, start_new_session=True,
            preexec_fn=dies_with_parent())
        child.started = time.monotonic()
        log.info("worker process started", name=child.name, device=child.device,
                 pid=child.process.pid, restarts=child.restarts)

    async def run(self, stop: asyncio.Event) -> None:
        """Run and supervise every child until ``stop`` is set; then stop them all. A child
        that cannot run (exit 2) stops the pool with its error."""
        if shared := shared_without_mps(self.devices):
            log.warning("several worker processes share a GPU without MPS: they will take "
                        "turns on it; start `nvidia-cuda-mps-control -d` first", gpus=shared)
        keepers = [asyncio.create_task(self._keep(child, stop)) for child in self.children]
        try:
            await asyncio.gather(*keepers)
        finally:
            for keeper in keepers:
                keeper.cancel()
            await asyncio.gather(*keepers, return_exceptions=True)
            await self._stop_all()

    async def _keep(self, child: Child, stop: asyncio.Event) -> None:
        """One child, started again after each exit until ``stop`` (each child on its own, so
        one's pause before a restart holds up no other)."""
        await self._start(child)
        while True:
            stopping = asyncio.ensure_future(stop.wait())
            exited = asyncio.ensure_future(child.process.wait())
            await asyncio.wait([stopping, exited], return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if stop.is_set():
                exited.cancel()
                return
            code = exited.result()
            if code == USAGE_EXIT:
                raise PoolError(f"worker {child.name} ({child.device}) exited {code}: a "
                                "restart would fail the same way")
            if time.monotonic() - child.started >= STEADY_S:
                child.pause_s = FIRST_PAUSE_S
            log.error("worker process exited; starting it again", name=child.name,
                      device=child.device, code=code, in_s=child.pause_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), child.pause_s)
            if stop.is_set():
                return
            child.pause_s = min(MAX_PAUSE_S, child.pause_s * 2)
            child.restarts += 1
            await self._start(child)

    async def _stop_all(self) -> None:
        """SIGTERM to every running child (each stops gracefully), SIGKILL past the grace."""
        running = [c.process for c in self.children
                   if c.process is not None and c.process.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        if not running:
            return
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in running)),
                                   self.stop_grace_s)
        except (TimeoutError, asyncio.CancelledError):
            for process in running:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            await asyncio.gather(*(p.wait() for p in running))
            raise
        log.info("worker processes stopped", count=len(running))

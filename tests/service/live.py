"""A real API server and real workers for end-to-end tests (no mocks).

- ``LiveServer(settings)``: uvicorn serving ``create_app(settings)`` on 127.0.0.1 at a free
  port, in a thread; ``.url`` / ``.v1``.
- ``InProcessWorker(engine, settings)``: a queue Worker on an already loaded engine, in a
  thread with its own event loop (no model load: fast).
- ``subprocess_worker(settings, model)``: ``spinf-serve worker`` as a real process, the way
  it is deployed.
- ``api_process(settings, log_path)``: ``spinf-serve api`` as a real process, to kill.
- ``PrivateRedis(directory, aof=...)``: a redis-server of its own, to kill and start again.

Fixtures: ``api_server`` (a LiveServer on the ``settings`` fixture) and ``tiny_worker`` (an
InProcessWorker on ``tiny_engine``). To use one, name it in the test module:
``api_server = live.api_server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync
import uvicorn

from api.app import create_app
from api.http_protocol import EnvelopeHttpToolsProtocol
from spinf_worker.queue.keys import Keys
from spinf_worker.queue.settings import ServiceSettings

from ..conftest import WAIT_S

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = WAIT_S


def wait_for(condition: Callable[[], object], timeout: float = WAIT_S, interval: float = 0.05,
             what: str = "condition"):
    """Poll until ``condition()`` is truthy; returns its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class LiveServer:
    def __init__(self, settings: ServiceSettings):
        self.settings = settings
        self.app = create_app(settings)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        # log_config=None: leave the test process's logging alone
        # http: the protocol serve.py runs, so a request the parser refuses gets the envelope here too
        config = uvicorn.Config(self.app, log_config=None, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=5,
                                http=EnvelopeHttpToolsProtocol)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]},
                                        name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def start(self) -> LiveServer:
        self._thread.start()
        wait_for(lambda: self._server.started or not self._thread.is_alive(),
                 START_TIMEOUT_S, what="uvicorn to start")
        if not self._server.started:
            raise RuntimeError("uvicorn did not start (see the log above)")
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(WAIT_S)
        self._socket.close()

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _registered(settings: ServiceSettings, name: str | None = None) -> bool:
    client = redis_sync.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        workers = client.hgetall(Keys(settings.prefix).workers)
    finally:
        client.close()
    return name in workers if name else bool(workers)


class InProcessWorker:
    def __init__(self, engine, settings: ServiceSettings, name: str | None = None):
        self.engine = engine
        self.settings = settings
        self.name = name or f"test-worker-{os.getpid()}-{id(self):x}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as err:  # surfaced by stop()
            self._error = err

    async def _main(self) -> None:
        from spinf_worker.queue.redis_client import connect
        from spinf_worker.queue.worker import Worker

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        redis = connect(self.settings.redis_url, client_name=self.name, socket_timeout=WAIT_S)
        try:
            worker = Worker(self.engine, redis, Keys(self.settings.prefix), self.settings,
                            name=self.name)
            await worker.run(self._stop)
        finally:
            await redis.aclose()

    def start(self) -> InProcessWorker:
        self._thread.start()
        wait_for(lambda: _registered(self.settings, self.name) or not self._thread.is_alive(),
                 START_TIMEOUT_S, what=f"worker {self.name} to register")
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(WAIT_S)
        if self._error is not None:
            raise self._error

    def __enter__(self) -> InProcessWorker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def subprocess_worker(settings: ServiceSettings, model: str, *, device: str = "cpu",
                      name: str = "subprocess-worker") -> Iterator[subprocess.Popen]:
    """A worker process; waits until it registers, stops it with SIGTERM (graceful)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "spinf_worker.cli", "worker", "--redis", settings.redis_url,
         "--prefix", settings.prefix, "--model", model, "--device", device, "--name", name],
        cwd=ROOT, env=env)
    try:
        wait_for(lambda: _registered(settings, name) or process.poll() is not None,
                 WAIT_S, interval=0.2, what="the worker process to register")
        assert process.poll() is None, f"worker exited with {process.returncode}"
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def raw_http(port: int, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    """Send ``request`` over a plain socket exactly as given (httpx refuses control
    characters) and read to the close; (status, headers by lowercased name, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as conn:
        conn.sendall(request)
        return read_reply(conn)


def read_reply(conn: socket.socket) -> tuple[int, dict[bytes, bytes], bytes]:
    """Read a reply to the close: (status, headers by lowercased name, body)."""
    reply = b""
    while chunk := conn.recv(65536):
        reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    status_line, *lines = head.split(b"\r\n")
    headers = dict(line.split(b": ", 1) for line in lines)
    return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def api_process(settings: ServiceSettings, log_path: Path, *args: str, **env
                ) -> Iterator[tuple[subprocess.Popen, str]]:
    """``spinf-serve api [args]`` as its own process; yields it and its /v1 URL. Killed
    (SIGKILL) at the end with whatever is left of its process group (``--workers``'
    children)."""
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPINF_")}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "spinf_worker.cli", "api", "--redis", settings.redis_url,
             "--prefix", settings.prefix, "--port", str(port), "--log-format", "json", *args],
            cwd=ROOT, env={**environ, "PYTHONPATH": str(ROOT), **env}, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.poll() is None, log_path.read_text()
        with contextlib.suppress(httpx.TransportError):
            return httpx.get(f"{url}/healthz", timeout=WAIT_S).status_code == 200
        return False

    try:
        wait_for(healthy, WAIT_S, 0.2, "the API process to start")
        yield process, f"{url}/v1"
    finally:
        with contextlib.suppress(ProcessLookupError):   # the group is gone already
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(WAIT_S)


class PrivateRedis:
    """redis-server on a fixed free port of 127.0.0.1, killed (SIGKILL, as in a crash) and
    started again on the same port and directory."""

    def __init__(self, directory: Path, *, aof: bool):
        self.port = free_port()
        self.directory = directory
        self.aof = aof
        # appendfsync always: what was acknowledged before the kill is there after it
        self.persistence = (["--appendonly", "yes", "--appendfsync", "always"] if aof
                            else ["--appendonly", "no"])
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             *self.persistence, "--dir", str(self.directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._answers, WAIT_S, what="redis-server to answer")
        return self

    def _answers(self) -> bool:
        assert self.process is not None and self.process.poll() is None, "redis-server exited"
        client = redis_sync.Redis(port=self.port, socket_timeout=WAIT_S)
        try:
            return client.ping()
        except redis_sync.ConnectionError:   # refused, or LOADING its AOF
            return False
        finally:
            client.close()

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(WAIT_S)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.kill()


def stream_length(settings: ServiceSettings) -> int:
    """Entries in both work streams."""
    keys = Keys(settings.prefix)
    client = redis_sync.Redis.from_url(settings.redis_url)
    try:
        return sum(client.xlen(stream) for stream in keys.streams)
    finally:
        client.close()


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


@pytest.fixture
def api_server(settings) -> Iterator[LiveServer]:
    with LiveServer(settings) as server:
        yield server


@pytest.fixture
def tiny_worker(tiny_engine, settings) -> Iterator[InProcessWorker]:
    with InProcessWorker(tiny_engine, settings) as worker:
        yield worker

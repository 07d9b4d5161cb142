"""``spinf-serve api --workers 2`` as deployed, with a real ``spinf-serve worker`` on the tiny
model: concurrent synchronous requests each get their own result, the one a single-process
API gives; both API processes answer, each on its own reply stream; a killed one is
replaced; SIGTERM stops the whole group with status 0."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import redis as redis_sync

from spinf_worker.queue.keys import Keys

from ..conftest import WAIT_S
from .live import LiveServer, api_process, subprocess_worker, wait_for

REQUESTS = 40
SCORING = {"queries": [
    {"id": "refund", "template": "\n\nRefund?{?}", "options": [" yes", " no"]},
    {"id": "count", "template": "\n\nHow many times?{?}", "options": [" one", " two", " many"]}]}
# generous where only a slow machine would trip: the worker stays live between heartbeats,
# /v1/score waits for its result
API_ENV = {"SPINF_WORKER_TTL_S": str(WAIT_S), "SPINF_SYNC_TIMEOUT_S": str(WAIT_S / 2)}


def bodies() -> list[dict]:
    """Each request its own text, so a result handed to the wrong caller shows."""
    return [{"text": f"Order {i}: I was charged {i} times for September, refund please.",
             "scoring": SCORING} for i in range(REQUESTS)]


async def _post_all(v1: str, requests: list[dict]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(timeout=WAIT_S, limits=limits) as client:
        return await asyncio.gather(*(client.post(f"{v1}/score", json=body)
                                      for body in requests))


def score_all(v1: str, requests: list[dict]) -> list[dict]:
    """All at once, each on a connection of its own; every reply must be a 200."""
    replies = asyncio.run(_post_all(v1, requests))
    for reply in replies:
        assert reply.status_code == 200, reply.text
    return [reply.json() for reply in replies]


def answered(response: dict) -> tuple:
    """What the engine produced, without the ids and timings of the call."""
    return response["model"], response["system_fingerprint"], response["results"]


async def _infos(url: str, count: int) -> list[dict]:
    async with httpx.AsyncClient(timeout=WAIT_S, limits=httpx.Limits(max_connections=count)
                                 ) as client:
        replies = await asyncio.gather(*(client.get(f"{url}/v0/info") for _ in range(count)))
    for reply in replies:
        assert reply.status_code == 200, reply.text
    return [reply.json()["api"] for reply in replies]


def api_processes(url: str) -> dict[int, str]:
    """pid -> reply-stream instance of the API processes /v0/info reports, over 20 fresh
    connections (the kernel picks which process accepts each)."""
    return {info["pid"]: info["instance"] for info in asyncio.run(_infos(url, 20))}


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name: state, parent pid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def parent_of(pid: int) -> int:
    return int(_stat(pid)[1])


def running(pid: int) -> bool:
    """Not exited (a zombie nobody has reaped yet counts as exited)."""
    try:
        return _stat(pid)[0] != "Z"
    except FileNotFoundError:
        return False


def replied_instances(settings, exclude: str) -> set[str]:
    """Instances whose reply stream a worker wrote to (the reference server's left out)."""
    client = redis_sync.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        streams = client.scan_iter(match=Keys(settings.prefix).reply("*"), count=1000)
        found = {stream.rsplit(":", 1)[1] for stream in streams if client.xlen(stream)}
    finally:
        client.close()
    return found - {exclude}


def test_two_api_processes_answer_concurrent_requests_each_with_its_own_result(
        tiny_dir, settings, tmp_path):
    requests = bodies()
    with subprocess_worker(settings, str(tiny_dir)), \
            api_process(settings, tmp_path / "api.log", "--workers", "2",
                        **API_ENV) as (supervisor, v1):
        url = v1.removesuffix("/v1")
        wait_for(lambda: httpx.get(f"{url}/readyz", timeout=WAIT_S).status_code == 200,
                 WAIT_S, 0.2, "the API to see the worker's model loaded")
        with LiveServer(settings) as single:
            reference = [answered(r) for r in score_all(single.v1, requests)]
            single_instance = single.app.state.services.listener.instance_id

        # rounds until both processes have had replies: which one accepts a connection is
        # the kernel's choice, and one may take a whole round
        def both_replied() -> bool:
            got = score_all(v1, requests)
            assert [answered(r) for r in got] == reference
            return len(replied_instances(settings, single_instance)) == 2

        wait_for(both_replied, WAIT_S, 0, "replies on two API processes' streams")
        seen: dict[int, str] = {}

        def both_seen() -> bool:
            seen.update(api_processes(url))
            return len(seen) == 2

        wait_for(both_seen, WAIT_S, 0, "/v0/info from both API processes")
        assert set(seen.values()) == replied_instances(settings, single_instance)
        assert all(parent_of(pid) == supervisor.pid for pid in seen)

        # a child that dies is replaced by uvicorn's supervisor; the group keeps serving
        killed = next(iter(seen))
        os.kill(killed, signal.SIGKILL)
        replaced: dict[int, str] = {}

        def a_new_process() -> bool:
            assert supervisor.poll() is None
            replaced.update(api_processes(url))
            return bool(replaced.keys() - seen.keys())

        wait_for(a_new_process, WAIT_S, 0.2, "the supervisor to replace a killed process")
        assert killed not in replaced
        new_pid = next(iter(replaced.keys() - seen.keys()))
        assert parent_of(new_pid) == supervisor.pid
        assert [answered(r) for r in score_all(v1, requests[:8])] == reference[:8]

        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(WAIT_S) == 0, (tmp_path / "api.log").read_text()
        children = (seen.keys() | replaced.keys()) - {killed}
        wait_for(lambda: not any(map(running, children)),
                 WAIT_S, 0.2, "every API process to exit")


def spawned_children(pid: int) -> list[int]:
    """The API processes of a supervisor: its children started by multiprocessing's spawn
    (its resource tracker left out)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]


def test_a_killed_supervisor_leaves_no_api_process_serving(settings, tmp_path):
    with api_process(settings, tmp_path / "api.log", "--workers", "2") as (supervisor, _v1):
        children = wait_for(lambda: len(spawned_children(supervisor.pid)) == 2
                            and spawned_children(supervisor.pid), WAIT_S, 0.2,
                            "two API processes")
        supervisor.kill()
        supervisor.wait(WAIT_S)
        # the group is not killed here: each child stops of itself (PR_SET_PDEATHSIG)
        wait_for(lambda: not any(map(running, children)),
                 WAIT_S, 0.2, "the orphaned API processes to stop")

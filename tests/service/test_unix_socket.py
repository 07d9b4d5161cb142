"""A unix:// Redis URL, as docs/SERVICE.md allows: a private redis-server on a socket file."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import pytest

from spinf_worker.queue.redis_client import connect

from ..conftest import WAIT_S
from .live import wait_for


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server binary")
def test_a_unix_socket_url_connects(tmp_path):
    socket = tmp_path / "redis.sock"
    server = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", str(socket),
                               "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(socket.exists, WAIT_S, what="the redis socket")

        async def round_trip() -> str | None:
            client = connect(f"unix://{socket}")
            try:
                await client.set("k", "v")
                return await client.get("k")
            finally:
                await client.aclose()

        assert asyncio.run(round_trip()) == "v"
    finally:
        server.terminate()
        server.wait(WAIT_S)

"""Helpers of the ingest tests: a feed server on 127.0.0.1 in a thread, a consumer running on
the test's loop, waiting for a condition, reading a JSONL sink."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import threading
from pathlib import Path

from spinf_worker.ingest import config as ingest_config
from spinf_worker.ingest.consumer import Consumer

from ..conftest import WAIT_S

QUERIES = [{"id": "markets", "template": "\n\nIs this about markets?\nAnswer:{?}",
            "options": [" yes", " no"]}]


def rss(items: list[dict]) -> bytes:
    entries = "".join(
        f"<item><title>{i['title']}</title><link>{i['link']}</link><guid>{i['guid']}</guid>"
        f"<pubDate>Mon, 30 Nov 2026 10:0{n % 10}:00 GMT</pubDate>"
        f"<description>{i.get('summary', 'Shares rose on the news.')}</description></item>"
        for n, i in enumerate(items))
    return (f'<?xml version="1.0"?><rss version="2.0"><channel><title>Test</title>'
            f"<link>http://example.com/</link>{entries}</channel></rss>").encode()


def article(n: int) -> dict:
    return {"guid": f"urn:test:{n}", "title": f"Story {n}", "link": f"http://example.com/{n}",
            "summary": f"Markets moved on story number {n}."}


class FeedServer(http.server.ThreadingHTTPServer):
    """Serves ``routes``: path -> (status, body, content type). A 200 carries an ETag; a
    request whose If-None-Match matches it gets 304. ``requests`` logs (path, headers)."""

    def __init__(self):
        self.routes: dict[str, tuple[int, bytes, str]] = {}
        self.requests: list[tuple[str, dict]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(handler):
                self.requests.append((handler.path, dict(handler.headers)))
                status, body, kind = self.routes.get(handler.path, (404, b"", "text/plain"))
                etag = f'"{hash(body) & 0xffffffff:x}"'
                if status == 200 and handler.headers.get("If-None-Match") == etag:
                    handler.send_response(304)
                    handler.end_headers()
                    return
                handler.send_response(status)
                handler.send_header("content-type", kind)
                handler.send_header("content-length", str(len(body)))
                if status == 200:
                    handler.send_header("etag", etag)
                handler.end_headers()
                handler.wfile.write(body)

            def log_message(handler, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"

    def feed(self, path: str, items: list[dict]) -> str:
        self.routes[path] = (200, rss(items), "application/rss+xml")
        return self.url(path)


def make_config(queries_file: Path, **flags) -> ingest_config.Settings:
    flags.setdefault("interval_s", 0.2)
    return ingest_config.load(None, queries=str(queries_file), **flags)


@contextlib.asynccontextmanager
async def consuming(config, service, *, once: bool = False):
    """A consumer on this loop; yields (consumer, task), stops it on exit."""
    consumer = Consumer(config, service, once=once)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        yield consumer, task
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)


async def wait_until(condition, timeout: float = WAIT_S, what: str = "condition"):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

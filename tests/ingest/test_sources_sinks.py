"""A JSONL file followed as it grows, a Redis stream in and out, a signed webhook sink, and
the page fetcher."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading

import pytest
import standardwebhooks

from spinf_worker.ingest.config import ConfigError
from spinf_worker.ingest.pages import PageFetcher
from spinf_worker.webhooks import new_secret
from tests.service.live import InProcessWorker

from .helpers import article, consuming, make_config, read_lines, wait_until


def _line(n: int) -> str:
    return json.dumps({"id": f"w{n}", "title": f"Wire {n}", "text": f"Copper rose {n}%."}) + "\n"


@pytest.mark.asyncio
async def test_jsonl_file_is_followed_as_it_grows(tmp_path, settings, queries_file, tiny_engine):
    wire, out = tmp_path / "wire.jsonl", tmp_path / "out.jsonl"
    wire.write_text(_line(1) + _line(2))
    config = make_config(queries_file, feeds=[{"jsonl": str(wire), "name": "wire"}],
                         sinks=[f"jsonl:{out}"], interval_s=0.1)
    with InProcessWorker(tiny_engine, settings):
        async with consuming(config, settings) as (consumer, _task):
            await wait_until(lambda: len(read_lines(out)) == 2, what="the first lines")
            with open(wire, "a") as f:
                f.write(_line(3)[:20])                      # a line still being written
                f.flush()
                await asyncio.sleep(0.5)
                assert len(read_lines(out)) == 2
                f.write(_line(3)[20:] + "not json\n" + _line(4))
            await wait_until(lambda: len(read_lines(out)) == 4, what="the appended lines")
            await wait_until(lambda: consumer.metrics.value(
                "spinf_ingest_items_failed_total", feed="wire") == 1, what="the bad line")
            # replaced by a file holding the same items and one more: only that one is new
            replacement = tmp_path / "wire.new"
            replacement.write_text(_line(1) + _line(5))
            replacement.replace(wire)
            await wait_until(lambda: len(read_lines(out)) == 5, what="the new file's item")
            await asyncio.sleep(0.3)
    # in the order results come back, each once
    assert sorted(line["item_id"] for line in read_lines(out)) == ["w1", "w2", "w3", "w4", "w5"]
    assert consumer.metrics.value("spinf_ingest_items_new_total", feed="wire") == 5


@pytest.mark.asyncio
async def test_redis_stream_in_and_out(settings, queries_file, tiny_engine, redis):
    source = f"{settings.prefix}:{{q}}:articles"
    sink = f"{settings.prefix}:{{q}}:scored"
    await redis.xadd(source, {"data": json.dumps({"id": "s1", "title": "Oil", "text": "Up."})})
    await redis.xadd(source, {"id": "s2", "title": "Gold", "text": "Down."})   # flat fields
    await redis.xadd(source, {"data": "{not json"})
    config = make_config(queries_file, feeds=[{"stream": source, "name": "bus"}],
                         sinks=[f"redis:{sink}"])
    with InProcessWorker(tiny_engine, settings):
        async with consuming(config, settings) as (consumer, _task):
            await wait_until(lambda: _equals(redis.xlen(sink), 2), what="two results")
            await redis.xadd(source, {"data": json.dumps({"id": "s1", "text": "Up."})})  # repeat
            await redis.xadd(source, {"data": json.dumps({"id": "s3", "text": "Flat."})})
            await wait_until(lambda: _equals(redis.xlen(sink), 3), what="the third")
            await asyncio.sleep(0.3)
    entries = await redis.xrange(sink)
    assert sorted(fields["item_id"] for _, fields in entries) == ["s1", "s2", "s3"]
    data = next(json.loads(f["data"]) for _, f in entries if f["item_id"] == "s2")
    assert data["feed"] == "bus" and data["title"] == "Gold" and data["status"] == "succeeded"
    assert data["response"]["results"][0]["queries"][0]["id"] == "markets"
    assert consumer.metrics.value("spinf_ingest_items_failed_total", feed="bus") == 1
    groups = await redis.xinfo_groups(source)
    assert groups[0]["pending"] == 0                        # every entry acknowledged


async def _equals(awaitable, expected) -> bool:
    return await awaitable == expected


class Receiver(http.server.ThreadingHTTPServer):
    """Answers 500 to the first POST, then 204; keeps (headers, body) of each."""

    def __init__(self):
        self.got: list[tuple[dict, bytes]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(handler):
                body = handler.rfile.read(int(handler.headers["content-length"]))
                self.got.append((dict(handler.headers), body))
                handler.send_response(500 if len(self.got) == 1 else 204)
                handler.end_headers()

            def log_message(handler, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.mark.asyncio
async def test_webhook_sink_is_signed_like_callbacks(settings, queries_file, tiny_engine,
                                                     feed_server):
    receiver = Receiver()
    secret = new_secret()
    hook = f"http://127.0.0.1:{receiver.server_address[1]}/hook"
    url = feed_server.feed("/f.xml", [article(1)])
    config = make_config(queries_file, feeds=[{"url": url, "name": "news"}],
                         sinks=[f"webhook:{hook}"])
    refused = settings.model_copy(update={"webhook_secret": secret})
    with pytest.raises(ConfigError, match="loopback"):      # the callbacks' SSRF rules
        async with consuming(config, refused, once=True) as (_c, task):
            await task
    allowed = refused.model_copy(update={"callback_allow": ["127.0.0.1"]})
    try:
        with InProcessWorker(tiny_engine, settings):
            async with consuming(config, allowed, once=True) as (_c, task):
                await task
    finally:
        receiver.shutdown()
    assert len(receiver.got) == 2                           # a 500, then delivered
    (first_headers, _), (headers, body) = receiver.got
    assert first_headers["webhook-id"] == headers["webhook-id"]     # the same on a retry
    event = standardwebhooks.Webhook(secret).verify(body, {k.lower(): v for k, v in headers.items()})
    assert event["type"] == "ingest.scored"
    assert event["data"]["item_id"] == "urn:test:1" and event["data"]["feed"] == "news"
    assert event["data"]["response"]["results"][0]["queries"][0]["id"] == "markets"


@pytest.mark.asyncio
async def test_page_fetch_extracts_main_text_and_keeps_to_allowed_hosts(
        tmp_path, feed_server, settings, queries_file, tiny_engine):
    paragraphs = "".join(f"<p>The central bank raised rates by a quarter point, paragraph {n}, "
                         "citing persistent inflation in services.</p>" for n in range(6))
    page = (f"<html><head><title>Rates</title></head><body><nav>Home | World</nav><article>"
            f"<h1>Rates rise</h1>{paragraphs}</article><footer>(c) Paper</footer></body></html>")
    feed_server.routes["/story"] = (200, page.encode(), "text/html; charset=utf-8")
    allowed = PageFetcher(("127.0.0.1",))
    refused = PageFetcher()
    try:
        text = await allowed.text(feed_server.url("/story"))
        assert "raised rates by a quarter point" in text and "Home | World" not in text
        assert await refused.text(feed_server.url("/story")) is None
    finally:
        await allowed.close()
        await refused.close()
    # an item with only a summary is scored on its page's text
    url = feed_server.feed("/f.xml", [{**article(1), "link": feed_server.url("/story"),
                                       "summary": "Rates."}])
    out = tmp_path / "out.jsonl"
    config = make_config(queries_file, feeds=[{"url": url}], sinks=[f"jsonl:{out}"],
                         fetch_pages=True, fetch_allow=["127.0.0.1"])
    with InProcessWorker(tiny_engine, settings):
        async with consuming(config, settings, once=True) as (_c, task):
            await task
    (line,) = read_lines(out)
    assert line["response"]["usage"]["prompt_tokens"] > 100     # "Story 1\n\nRates." is ~10

"""RSS feeds through the real queue and a real (tiny) worker: items scored once, conditional
GET, and a feed that fails in every way while the others go on."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from spinf_worker.ingest.sources import FeedSource
from tests.service.live import InProcessWorker

from ..conftest import WAIT_S
from .helpers import article, consuming, make_config, read_lines, wait_until


@pytest.mark.asyncio
async def test_feed_that_gains_items_is_scored_once_per_item(tmp_path, feed_server, settings,
                                                             queries_file, tiny_engine, redis):
    items = [article(1), article(2)]
    url = feed_server.feed("/news.xml", items)
    out = tmp_path / "out.jsonl"
    config = make_config(queries_file, feeds=[{"url": url, "name": "news"}],
                         sinks=[f"jsonl:{out}"])
    with InProcessWorker(tiny_engine, settings):
        async with consuming(config, settings) as (consumer, _task):
            await wait_until(lambda: len(read_lines(out)) == 2, what="the first two items")
            # unchanged feed: answered 304 to the stored ETag
            await wait_until(lambda: consumer.metrics.value(
                "spinf_ingest_polls_total", feed="news", outcome="not_modified") >= 1,
                what="a 304")
            # the feed gains items (and repeats one under a new GUID with the same link)
            items += [article(3), article(4), {**article(1), "guid": "urn:test:1-bis"}]
            feed_server.feed("/news.xml", items)
            await wait_until(lambda: len(read_lines(out)) == 4, what="the new items")
            await wait_until(lambda: consumer.metrics.value(
                "spinf_ingest_items_seen_total", feed="news") >= 7, what="another poll")
            metrics = consumer.metrics
            await wait_until(lambda: metrics.value("spinf_ingest_items_scored_total",
                                                   feed="news") == 4, what="the count")
            assert metrics.value("spinf_ingest_items_new_total", feed="news") == 4
    lines = read_lines(out)
    assert sorted(line["item_id"] for line in lines) == [f"urn:test:{n}" for n in (1, 2, 3, 4)]
    first = next(line for line in lines if line["item_id"] == "urn:test:1")
    assert first["feed"] == "news" and first["title"] == "Story 1"
    assert first["published"] == "2026-11-30T10:00:00+00:00"
    assert first["status"] == "succeeded" and first["error"] is None
    options = first["response"]["results"][0]["queries"][0]["combinations"][0]["options"]
    assert [o["text"] for o in options] == [" yes", " no"]
    conditional = [h for path, h in feed_server.requests if "If-None-Match" in h]
    assert conditional, "the stored ETag was never sent"
    assert not await redis.hlen(f"{settings.prefix}:{{q}}:ingest:default:pending")


@pytest.mark.asyncio
async def test_failing_feeds_are_reported_and_the_others_go_on(tmp_path, feed_server, settings,
                                                               queries_file, tiny_engine):
    feed_server.routes["/down.xml"] = (500, b"oops", "text/plain")
    feed_server.routes["/bad.xml"] = (200, b"<html><body>not a feed", "text/html")
    good = feed_server.feed("/good.xml", [article(7)])
    out = tmp_path / "out.jsonl"
    config = make_config(queries_file, sinks=[f"jsonl:{out}"], feeds=[
        {"url": feed_server.url("/down.xml"), "name": "down"},
        {"url": feed_server.url("/bad.xml"), "name": "bad"},
        {"url": feed_server.url("/gone.xml"), "name": "gone"},         # 404
        {"url": "http://127.0.0.1:1/feed.xml", "name": "refused"},     # nothing listens
        {"url": good, "name": "good"}])
    with InProcessWorker(tiny_engine, settings), capture_logs() as logs:
        async with consuming(config, settings, once=True) as (consumer, task):
            await task
        async with consuming(config, settings, once=True) as (again, task):
            await task
    assert [line["item_id"] for line in read_lines(out)] == ["urn:test:7"]
    for metrics, good_outcome in ((consumer.metrics, "ok"), (again.metrics, "not_modified")):
        polls = {(feed, outcome): metrics.value("spinf_ingest_polls_total", feed=feed,
                                                outcome=outcome)
                 for feed, outcome in (("down", "http_error"), ("gone", "http_error"),
                                       ("bad", "malformed"), ("refused", "network_error"),
                                       ("good", good_outcome))}
        assert set(polls.values()) == {1.0}, polls
    failed = {(e["feed"], e["outcome"]) for e in logs if e["event"] == "feed poll failed"}
    assert failed == {("down", "http_error"), ("gone", "http_error"), ("bad", "malformed"),
                      ("refused", "network_error")}
    assert any("HTTP 500" in e["error"] for e in logs if e["event"] == "feed poll failed")


@pytest.mark.asyncio
async def test_a_failing_feed_backs_off_exponentially(redis, settings, queries_file,
                                                      feed_server):
    import httpx

    from spinf_worker.ingest.metrics import IngestMetrics
    from spinf_worker.ingest.state import IngestKeys, State
    from spinf_worker.queue.keys import Keys

    feed_server.routes["/down.xml"] = (503, b"", "text/plain")
    config = make_config(queries_file, sinks=["jsonl:x"], interval_s=10,
                         feeds=[{"url": feed_server.url("/down.xml")}])
    state = State(redis, IngestKeys(Keys(settings.prefix), "t"))
    async with httpx.AsyncClient(timeout=WAIT_S) as client:
        source = FeedSource(config.sources[0], state, IngestMetrics(), client)
        delays = []
        for _ in range(3):
            await source.poll()
            delays.append(await source.delay_s())
        assert delays == [20, 40, 80]
        stored = await state.source(source.name)
        assert stored["errors"] == "3" and stored["last_error"] == "HTTP 503"
        feed_server.feed("/down.xml", [article(1)])
        assert len(await source.poll()) == 1 and await source.delay_s() == 10

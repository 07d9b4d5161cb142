"""The ingest process's Prometheus metrics, in a registry of its own, served on
``--metrics-port`` when given.

Why in the process rather than in Redis for the API's /metrics: the counters describe this
consumer (its feeds, its sinks), Prometheus copes with a counter that restarts at zero, and
the durable state that matters for correctness (seen, pending, cursors) is in Redis already.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric


class _Lag:
    """Per feed, the age of the oldest item claimed and not yet written to every sink."""

    def __init__(self, oldest: Callable[[], dict[str, int]]):
        self._oldest = oldest

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            "spinf_ingest_feed_lag_seconds",
            "Age of the feed's oldest item seen and not yet in every sink (0: none).",
            labels=["feed"])
        now_ms = time.time() * 1000
        for feed, since_ms in sorted(self._oldest().items()):
            family.add_metric([feed], max(0.0, (now_ms - since_ms) / 1000) if since_ms else 0.0)
        yield family


class IngestMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.seen = Counter("spinf_ingest_items_seen", "Items read from a source, repeats "
                            "included.", ["feed"], registry=r)
        self.new = Counter("spinf_ingest_items_new", "Items not seen before, submitted for "
                           "scoring.", ["feed"], registry=r)
        self.scored = Counter("spinf_ingest_items_scored", "Items scored and written to every "
                              "sink.", ["feed"], registry=r)
        self.failed = Counter("spinf_ingest_items_failed", "Items that could not be read, or "
                              "whose job ended with an error (written to the sinks as such).",
                              ["feed"], registry=r)
        self.polls = Counter("spinf_ingest_polls", "Source polls by outcome: ok, not_modified, "
                             "http_error, malformed, network_error.", ["feed", "outcome"],
                             registry=r)
        self.last_success = Gauge("spinf_ingest_feed_last_success_timestamp_seconds",
                                  "When the feed last answered (200 or 304).", ["feed"],
                                  registry=r)
        self.sink_errors = Counter("spinf_ingest_sink_errors", "Failed writes to a sink "
                                   "(retried).", ["sink"], registry=r)
        self.pending = Gauge("spinf_ingest_pending", "Items claimed and not yet in every sink.",
                             registry=r)

    def watch_lag(self, oldest: Callable[[], dict[str, int]]) -> None:
        self.registry.register(_Lag(oldest))

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (tests, logs); 0 when absent."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def serve(self, port: int, host: str = "127.0.0.1"):
        """Serve /metrics on a thread; returns the server (``shutdown()`` stops it)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server

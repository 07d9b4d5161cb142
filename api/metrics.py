"""Prometheus metrics: this API process's request durations, and the queue and worker
counters read from Redis at scrape time (so every API replica reports the same cluster view;
tokens/s and questions/s are ``rate()`` of the counters in Prometheus)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from redis.exceptions import ResponseError

from spinf_worker.queue.keys import GROUP, Keys

if TYPE_CHECKING:
    from .services import WorkerInfo

# Scoring latency runs from milliseconds (a warm worker) to the sync timeout.
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# counter name (without _total) -> (field of the stats hash, help)
_STATS_COUNTERS = {
    "spinf_passes": ("passes", "Forward passes run by workers."),
    "spinf_documents": ("docs", "Documents scored by workers."),
    "spinf_tokens": ("tokens", "Tokens read by workers (content, templates, options)."),
    "spinf_questions": ("questions", "Questions (query combinations) answered by workers."),
    "spinf_pass_rows": ("rows", "Rows of all passes, padding included."),
    "spinf_pass_real_rows": ("real_rows", "Rows of all passes holding real tokens."),
    "spinf_dead_letters": ("dead", "Work entries moved to the dead-letter stream."),
    "spinf_kept_roots": ("kept_roots", "Documents laid out on a root kept from an earlier pass "
                         "(`root_cache_mib`): their root rows not read again."),
    "spinf_kept_root_rows": ("kept_root_rows", "Root rows those documents did not read again."),
    "spinf_worker_busy_seconds": ("seconds_busy", "Seconds the workers' devices spent running "
                                  "passes (CUDA: from a pass's first kernel to its last; CPU: "
                                  "the engine thread's)."),
    "spinf_worker_engine_seconds": ("seconds_engine", "Seconds the workers' engine threads spent "
                                    "laying out, launching and answering passes."),
    "spinf_worker_gc_seconds": ("seconds_gc", "Seconds the workers' cyclic garbage collector "
                                "ran (holding the interpreter lock: passes and Redis work "
                                "wait meanwhile)."),
}
_DELIVERY_OUTCOMES = {"succeeded": "docs", "failed": "failed", "expired": "expired",
                      "dead": "dead"}


@dataclass(frozen=True)
class MetricSpec:
    """One metric ``/metrics`` exports: its type, labels and help (the reference page,
    docs/reference/metrics.md, is written from these)."""

    kind: str                   # "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, ...] = ()


# Every metric, by name (a counter is exported with ``_total`` after it).
METRICS: dict[str, MetricSpec] = {
    "spinf_request_duration_seconds": MetricSpec(
        "histogram", "HTTP request duration by route template and status class.",
        ("method", "route", "status_class")),
    "spinf_queue_depth": MetricSpec("gauge", "Work entries waiting to be read by a worker.",
                                    ("stream",)),
    "spinf_queue_pending": MetricSpec(
        "gauge", "Work entries read by a worker and not yet acknowledged.", ("stream",)),
    "spinf_queue_lag_seconds": MetricSpec("gauge", "Age of the oldest waiting work entry.",
                                          ("stream",)),
    "spinf_workers_live": MetricSpec("gauge", "Workers with a recent heartbeat."),
    **{name: MetricSpec("counter", help_text)
       for name, (_, help_text) in _STATS_COUNTERS.items()},
    "spinf_pass_fill_ratio": MetricSpec(
        "gauge", "Share of pass rows holding real tokens, since the start."),
    "spinf_deliveries": MetricSpec("counter", "Work entries finished, by outcome.",
                                   ("outcome",)),
    "spinf_callbacks": MetricSpec("counter", "Callbacks finished, by outcome.", ("outcome",)),
    "spinf_callback_attempts": MetricSpec(
        "counter", "Callback HTTP attempts, by response status.", ("status",)),
}


def _family(name: str, value: float | None = None) -> Metric:
    """The family of ``METRICS[name]`` for this scrape (its labels, or its one ``value``)."""
    spec = METRICS[name]
    family = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}[spec.kind]
    if spec.labels:
        return family(name, spec.help, labels=list(spec.labels))
    return family(name, spec.help, value=value)
_CALLBACK_OUTCOMES = ("delivered", "failed", "refused")
_CALLBACK_ATTEMPT_PREFIX = "callback_attempts_"


class ApiMetrics:
    """This process's own metrics, in a registry of its own (several apps in one process,
    as in tests, must not collide in the global one)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        spec = METRICS["spinf_request_duration_seconds"]
        self.request_duration = Histogram(
            "spinf_request_duration_seconds", spec.help, list(spec.labels),
            buckets=REQUEST_BUCKETS, registry=self.registry)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.request_duration.labels(method, route, f"{status // 100}xx").observe(seconds)


def _number(value: str | None) -> float:
    try:
        return float(value) if value is not None else 0.0
    except ValueError:
        return 0.0


async def _stream_state(redis, stream: str, now_ms: int) -> tuple[int, int, float]:
    """(waiting, pending, age in seconds of the oldest waiting entry) of one work stream."""
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError:  # no stream yet
        return 0, 0, 0.0
    group = next((g for g in groups if g["name"] == GROUP), None)
    if group is None:
        waiting, pending, after = await redis.xlen(stream), 0, "-"
    else:
        pending = int(group["pending"])
        # lag is unknown to Redis after some deletions; acked entries are deleted, so what
        # remains beyond the pending ones is waiting
        lag = group.get("lag")
        waiting = int(lag) if lag is not None else max(0, await redis.xlen(stream) - pending)
        after = f"({group['last-delivered-id']}"
    age = 0.0
    if waiting:
        oldest = await redis.xrange(stream, min=after, max="+", count=1)
        if oldest:
            entry_ms = int(oldest[0][0].split("-")[0])
            age = max(0.0, (now_ms - entry_ms) / 1000)
    return waiting, pending, age


async def queue_families(redis, keys: Keys, live: list[WorkerInfo]) -> list[Metric]:
    seconds, micros = await redis.time()
    now_ms = seconds * 1000 + micros // 1000  # the clock that stamped the stream ids
    depth, pending, lag = (_family(name) for name in (
        "spinf_queue_depth", "spinf_queue_pending", "spinf_queue_lag_seconds"))
    for name, stream in (("interactive", keys.interactive), ("bulk", keys.bulk)):
        waiting, in_flight, age = await _stream_state(redis, stream, now_ms)
        depth.add_metric([name], waiting)
        pending.add_metric([name], in_flight)
        lag.add_metric([name], age)

    stats = await redis.hgetall(keys.stats)
    families: list[Metric] = [depth, pending, lag, _family("spinf_workers_live", len(live))]
    for name, (field, _) in _STATS_COUNTERS.items():
        families.append(_family(name, _number(stats.get(field))))
    rows = _number(stats.get("rows"))
    families.append(_family("spinf_pass_fill_ratio",
                            _number(stats.get("real_rows")) / rows if rows else 0.0))

    deliveries = _family("spinf_deliveries")
    for outcome, field in _DELIVERY_OUTCOMES.items():
        deliveries.add_metric([outcome], _number(stats.get(field)))
    callbacks = _family("spinf_callbacks")
    for outcome in _CALLBACK_OUTCOMES:
        callbacks.add_metric([outcome], _number(stats.get(f"callbacks_{outcome}")))
    attempts = _family("spinf_callback_attempts")
    for field, value in sorted(stats.items()):
        if field.startswith(_CALLBACK_ATTEMPT_PREFIX):
            attempts.add_metric([field.removeprefix(_CALLBACK_ATTEMPT_PREFIX)], _number(value))
    families += [deliveries, callbacks, attempts]
    return families


class _Families:
    """A one-shot collector over metric families already read."""

    def __init__(self, families: Iterable[Metric]):
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def render(metrics: ApiMetrics, families: Iterable[Metric]) -> bytes:
    snapshot = CollectorRegistry(auto_describe=False)
    snapshot.register(_Families(families))
    return generate_latest(metrics.registry) + generate_latest(snapshot)

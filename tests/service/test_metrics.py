"""What /metrics exports is what the metrics reference lists (api/metrics.py METRICS,
docs/reference/metrics.md), with the type it says."""

from __future__ import annotations

import re

import pytest

from api.metrics import METRICS, ApiMetrics, queue_families, render


@pytest.mark.asyncio
async def test_every_exported_metric_is_listed_with_its_type(redis, keys):
    await redis.hset(keys.stats, mapping={"passes": 3, "seconds_gc": 0.25,
                                          "callback_attempts_200": 2})
    metrics = ApiMetrics()
    metrics.observe("POST", "/v1/score", 200, 0.01)
    text = render(metrics, await queue_families(redis, keys, [])).decode()
    # a counter's HELP and TYPE name it with or without "_total", by the client's version
    exported = {name.removesuffix("_total") if kind == "counter" else name: kind
                for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M)
                if not name.endswith("_created")}   # the client's own, beside the histogram
    assert exported == {name: spec.kind for name, spec in METRICS.items()}
    for name, spec in METRICS.items():
        assert re.search(rf"^# HELP {name}(_total)? {re.escape(spec.help)}$", text, re.M), name
    assert "spinf_passes_total 3.0" in text and "spinf_worker_gc_seconds_total 0.25" in text
    assert 'spinf_callback_attempts_total{status="200"} 2.0' in text

"""The worker's count of the cyclic collector's seconds (queue/collector_clock.py)."""

from __future__ import annotations

import gc

from spinf_worker.queue.collector_clock import CollectorClock


def _cycles(n: int) -> None:
    for _ in range(n):
        a: list = []
        a.append(a)


def test_the_clock_counts_collections_only_while_started():
    clock = CollectorClock()
    _cycles(10_000)
    gc.collect()
    assert clock.take() == 0.0            # not started: nothing counted
    clock.start()
    try:
        _cycles(10_000)
        gc.collect()
        first = clock.take()
        assert first > 0.0
        assert clock.take() == 0.0        # taken: counted afresh
        clock.start()                     # started twice: one callback
        assert gc.callbacks.count(clock._note) == 1
    finally:
        clock.stop()
    assert clock._note not in gc.callbacks
    gc.collect()
    assert clock.take() == 0.0

"""Seconds the cyclic garbage collector runs in this process.

A collection holds the interpreter lock: while it walks the heap, the engine thread and the
event loop both wait, so a worker's passes and its Redis work stall for its duration. The
worker reports these seconds with each pass (``seconds_gc`` in the stats hash,
``spinf_worker_gc_seconds_total``), which tells a heap the collector keeps walking (one not
frozen after start-up: Engine.warm_up, freeze_heap) from a slow pass."""

from __future__ import annotations

import gc
import time


class CollectorClock:
    """Counts collections' seconds between ``start`` and ``stop`` (a gc callback)."""

    def __init__(self) -> None:
        self._began = 0.0
        self._seconds = 0.0

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began:
            self._seconds += time.perf_counter() - self._began
            self._began = 0.0

    def start(self) -> None:
        if self._note not in gc.callbacks:
            gc.callbacks.append(self._note)

    def stop(self) -> None:
        if self._note in gc.callbacks:
            gc.callbacks.remove(self._note)

    def take(self) -> float:
        """Seconds collected since the last ``take``."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds

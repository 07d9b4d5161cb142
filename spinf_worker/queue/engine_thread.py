"""One thread for every torch call of a process.

Each thread that runs torch ops gets an OpenMP pool of its own, and idle pools still compete
for the cores: passes hopping between executor threads ran 1.7x slower on 2 cores, and the
slowdown stayed after the hopping stopped. So the model is loaded and every pass runs on this
one thread, in order of priority (``URGENT``, ``LAUNCH``, ``LATER``), then of arrival. It is a
daemon thread: a process asked to stop does not wait for a model load that can take minutes
the first time. A second one, ``RESPONDER``, writes the replies of passes read back (no torch
there): a request's ahead of a bulk pass's, while the engine thread lays out the next pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from itertools import count

# What runs first when several calls wait: a read-back a caller waits on, then the launch of a
# pass (the device may be running dry), then everything else.
URGENT, LAUNCH, LATER = 0, 1, 2


class EngineThread:
    """Started by its first ``run``, not when created: importing this module (``spinf-serve
    api`` does, through serve.py) must not start a thread that will never score."""

    def __init__(self, name: str = "spinf-engine"):
        self.name = name
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = count()     # arrival order among calls of one priority
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()
        # when the thread last finished a call (time.monotonic): a call that begins finds
        # it idle since then if nothing else was queued before it
        self.idle_since = time.monotonic()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def run(self, fn: Callable, *args, priority: int = LATER) -> asyncio.Future:
        """``fn(*args)`` on the engine thread, after the calls queued before it with the same
        or a higher priority (a lower number)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._start()
        self._jobs.put((priority, next(self._order), (fn, args, loop, future)))
        return future

    def _start(self) -> None:
        if self._thread is not None:
            return
        with self._starting:     # event loops on two threads may call run() at once
            if self._thread is None:
                thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                thread.start()
                self._thread = thread

    def _serve(self) -> None:
        while True:
            fn, args, loop, future = self._jobs.get()[2]
            try:
                value, error = fn(*args), None
            except BaseException as err:   # noqa: BLE001 - handed to the awaiting coroutine
                value, error = None, err
            self.idle_since = time.monotonic()
            with contextlib.suppress(RuntimeError):     # the loop is gone: nobody waits
                loop.call_soon_threadsafe(_settle, future, value, error)


def _settle(future: asyncio.Future, value, error) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)


# The process's one engine thread: every Worker and the model load go through it.
ENGINE_THREAD = EngineThread()
# The process's thread for replies (engine/batch.py: ScoringBatch.respond).
RESPONDER = EngineThread("spinf-respond")

"""The engine thread: none at import, one per process once something runs on it."""

from __future__ import annotations

import asyncio
import threading

from spinf_worker.queue.engine_thread import LATER, LAUNCH, URGENT, EngineThread


def test_engine_thread_starts_on_first_run_and_only_once():
    engine_thread = EngineThread("spinf-engine-test")
    assert not engine_thread.started
    assert not any(t.name == "spinf-engine-test" for t in threading.enumerate())

    async def where() -> list[threading.Thread]:
        return await asyncio.gather(*[engine_thread.run(threading.current_thread)
                                      for _ in range(4)])

    ran_on: list[threading.Thread] = []
    # two event loops on two threads, as a worker and ``serve``'s loader may be
    loops = [threading.Thread(target=lambda: ran_on.extend(asyncio.run(where())))
             for _ in range(2)]
    for loop in loops:
        loop.start()
    for loop in loops:
        loop.join(30)
    assert len(ran_on) == 8 and len(set(ran_on)) == 1
    assert ran_on[0].name == "spinf-engine-test" and ran_on[0] is not threading.current_thread()
    assert sum(t.name == "spinf-engine-test" for t in threading.enumerate()) == 1


def test_engine_thread_runs_waiting_calls_by_priority_then_arrival():
    engine_thread = EngineThread("spinf-engine-order")
    gate = threading.Event()
    ran: list[str] = []

    async def main() -> None:
        blocked = engine_thread.run(gate.wait, 30)   # holds the thread while the rest queue
        calls = [engine_thread.run(ran.append, name, priority=priority) for name, priority in (
            ("later-1", LATER), ("launch-1", LAUNCH), ("urgent", URGENT), ("later-2", LATER),
            ("launch-2", LAUNCH))]
        gate.set()
        await asyncio.gather(blocked, *calls)

    asyncio.run(main())
    assert ran == ["urgent", "launch-1", "launch-2", "later-1", "later-2"]

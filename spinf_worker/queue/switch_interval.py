"""The process's interpreter switch interval for as long as a tier runs.

A thread running Python keeps the interpreter lock from another that asks for it for up to
the switch interval (Python's default: 5 ms). Where one thread does long stretches of Python
(an API validating a batch's lines, a worker's event loop) beside one whose every step needs
the lock back quickly (the API's event loop answering requests, the engine thread launching a
pass), a shorter interval bounds each such wait.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def switch_interval(ms: float | None) -> Iterator[None]:
    """``ms`` (None: leave it as it is) while the block runs; as it was afterwards."""
    before = sys.getswitchinterval()
    if ms is not None:
        sys.setswitchinterval(ms / 1000)
    try:
        yield
    finally:
        sys.setswitchinterval(before)

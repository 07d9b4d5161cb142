"""Child processes that must not outlive this one: on Linux a child asks, between fork and
exec, for SIGTERM when its parent dies (PR_SET_PDEATHSIG), even by SIGKILL, so a killed
``serve`` or worker pool leaves no redis-server or worker behind."""

from __future__ import annotations

import signal
import sys

_prctl = None


def _die_with_parent() -> None:
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)    # PR_SET_PDEATHSIG


def dies_with_parent():
    """``preexec_fn`` for such a child (None off Linux). prctl is looked up here, before the
    fork: the child only calls it."""
    global _prctl
    if sys.platform.startswith("linux") and _prctl is None:
        import ctypes

        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    return _die_with_parent if _prctl is not None else None

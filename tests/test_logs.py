"""Logging: JSON lines on stderr, written to the stderr of the moment."""

from __future__ import annotations

import io
import json
import logging
import sys

import structlog

from spinf_worker.logs import configure_logging


def test_lines_go_to_the_current_stderr_even_after_the_old_one_closed(monkeypatch):
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging(json=True)
    try:
        structlog.get_logger("t").info("one", n=1)
        monkeypatch.setattr(sys, "stderr", second)
        first.close()                     # as a test's captured stream is, after the test
        structlog.get_logger("t").info("two", n=2)
        logging.getLogger("uvicorn.error").warning("three")
    finally:
        monkeypatch.undo()
        configure_logging(json=True)
    lines = [json.loads(line) for line in second.getvalue().splitlines()]
    assert [(x["event"], x.get("n")) for x in lines] == [("two", 2), ("three", None)]
    assert lines[0]["level"] == "info" and lines[1]["logger"] == "uvicorn.error"

"""Logging for the service: structlog everywhere, stdlib loggers (uvicorn, redis) routed through
the same processors, so every line is one JSON object (or a readable line on a terminal)."""

from __future__ import annotations

import logging
import sys

import structlog

# Loggers that install handlers of their own; theirs are dropped so records reach the root once.
_THIRD_PARTY = ("uvicorn", "uvicorn.error", "uvicorn.access", "httpx", "asyncio")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted: a process that swaps
    stderr (a test run capturing it, a daemon redirecting it) never writes to a closed one."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:   # StreamHandler sets it; the current stderr is used
        pass


def configure_logging(json: bool | None = None, level: str | int = "INFO") -> None:
    """JSON lines on stderr, or colourful console lines when ``json`` is None and stderr is a
    terminal. Context bound with ``structlog.contextvars.bind_contextvars`` (job, request ids)
    is merged into every line. Safe to call again (tests, a changed level)."""
    if json is None:
        json = not sys.stderr.isatty()
    shared: list = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if json:
        renderer = structlog.processors.JSONRenderer()
        # no local variables in tracebacks: they may hold secrets (webhook key, API keys)
        shared.append(structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)))
    else:
        renderer = structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *shared,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        # records from stdlib loggers go through the same chain as structlog's own
        foreign_pre_chain=[structlog.stdlib.ExtraAdder(allow=()), *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = _StderrHandler()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level if isinstance(level, int) else level.upper())
    for name in _THIRD_PARTY:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    # one line per request is httpx's INFO; the dispatcher logs its own outcome
    logging.getLogger("httpx").setLevel(logging.WARNING)

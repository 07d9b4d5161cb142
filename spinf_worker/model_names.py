"""The names a model answers to, in one place for the engine, the loader and the API (no torch).

A model served as ``owner/name`` also answers to the bare ``name``, and to the hosted API's
aliases (``spinf-12b``, the official client's default, and ``spinf-31b``): a client written
for the hosted service is served by whatever model this server runs. ``DEFAULT_MODEL`` (the
packaged Gemma 3 270M) is what no name, or any of its names, loads.
"""

from __future__ import annotations

import re

DEFAULT_MODEL = "google/gemma-3-270m"
HOSTED_ALIASES = ("spinf-12b", "spinf-31b")
# An instruct model, by its name: shown its content in its chat template (presentation "auto")
INSTRUCT_NAME = re.compile(r"(-it\b|instruct|chat)", re.IGNORECASE)


def served_names(model: str) -> set[str]:
    """The names a served model answers to: its own, the bare name after the last "/", and
    the hosted aliases."""
    return {model, model.rsplit("/", 1)[-1], *HOSTED_ALIASES}


def aliases(model: str) -> list[str]:
    """The other names of ``model``, sorted (GET /v1/models)."""
    return sorted(served_names(model) - {model})


def is_default(name: str | None) -> bool:
    return name is None or name in served_names(DEFAULT_MODEL)


def auto_presentation(model: str, has_chat_template: bool) -> str:
    """Presentation "auto": ``chat`` for an instruct model with a chat template, else ``raw``."""
    return "chat" if has_chat_template and INSTRUCT_NAME.search(model) else "raw"

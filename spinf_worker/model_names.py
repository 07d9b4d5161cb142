"""The names a model answers to, in one place for the engine, the loader and the API (no torch).

A model served as ``owner/name`` also answers to the bare ``name``; ``DEFAULT_MODEL`` (the
packaged Gemma 3 270M) is what no name, or either of its names, loads.
"""

from __future__ import annotations

DEFAULT_MODEL = "google/gemma-3-270m"


def served_names(model: str) -> set[str]:
    """The names a served model answers to: its own and the bare name after the last "/"."""
    return {model, model.rsplit("/", 1)[-1]}


def is_default(name: str | None) -> bool:
    return name is None or name in served_names(DEFAULT_MODEL)

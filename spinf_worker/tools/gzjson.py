"""Gzip JSON files: the parity fixtures and references."""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any

from . import ToolError


def read(path: Path, what: str) -> Any:
    """The JSON value of a gzip (or plain) JSON file; a ToolError names ``what`` was bad."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ToolError(f"cannot read {what} {path}: {err.strerror or err}") from None
    try:
        text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
        return json.loads(text)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError) as err:
        raise ToolError(f"{what} {path} is not gzip JSON: {str(err).splitlines()[0]}") from None


def write(path: Path, value: Any) -> None:
    """Gzip JSON with a fixed header time, so recording the same values gives the same bytes;
    one entry a line, so ``zcat`` shows a readable file."""
    text = json.dumps(value, indent=1, ensure_ascii=False) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
    except OSError as err:
        raise ToolError(f"cannot write {path}: {err.strerror or err}") from None

"""JSON of what the queue stores and reads back (work entries, results, batch lines): orjson,
several times faster than the json module, and compact.

``loads`` returns exactly what ``json.loads`` returns; orjson reads every valid text the same
except integers past 64 bits (as floats) and what it refuses (NaN, Infinity, lone surrogates,
overflowing numbers), so those go through the json module. ``dumps`` writes the same values as
``json.dumps`` in other spelling (compact, UTF-8, shortest float digits), except non-finite
floats, which orjson writes as null: they are not JSON, and no reader could take them (the
API's replies refuse them).
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

# a run of 19 digits: an integer that may not fit 64 bits (orjson would read it as a float)
_LONG_NUMBER = re.compile("[0-9]{19}")
_LONG_NUMBER_BYTES = re.compile(b"[0-9]{19}")


def loads(raw: str | bytes) -> Any:
    """``json.loads(raw)``, through orjson where that reads the same."""
    return read(raw)[0]


def read(raw: str | bytes) -> tuple[Any, bool]:
    """``loads(raw)``, and whether orjson read it: then no part of it holds what orjson cannot
    write back as the same value (NaN, infinities, integers past 64 bits)."""
    long = (_LONG_NUMBER if isinstance(raw, str) else _LONG_NUMBER_BYTES).search(raw)
    if long is None:
        try:
            return orjson.loads(raw), True
        except orjson.JSONDecodeError:
            pass   # what json reads and orjson refuses, or a text neither reads
    return json.loads(raw), False


def dumps(value: Any) -> bytes:
    """Compact JSON (UTF-8); the json module where orjson refuses (lone surrogates, integers
    past 64 bits, keys that are not strings)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, separators=(",", ":")).encode()

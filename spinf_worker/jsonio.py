"""JSON of what the queue stores and reads back (work entries, results, batch lines), and of the
results the engine writes as text already (``RawJSON``): orjson,
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
from typing import Any

import orjson

# Every digit to "0", every other byte to " ": a run of 19 zeros then marks 19 digits in a
# row, maybe an integer past 64 bits (orjson would read it as a float), maybe not (a
# fraction's digits, a string's): either way json reads it. (translate and a substring
# search run at memory speed; a regular expression takes ten times as long.)
_DIGITS = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_LONG_RUN = b"0" * 19


def _long_digit_run(raw: bytes) -> bool:
    return _LONG_RUN in raw.translate(_DIGITS)


def loads(raw: str | bytes, *, long_integers: bool = True) -> Any:
    """``json.loads(raw)``, through orjson where that reads the same. ``long_integers``
    False: the caller knows the text holds no integer past 64 bits (a result's integers are
    counts and times), so it is not looked for (in a text of many floats that costs more
    than the parse)."""
    return read(raw, long_integers=long_integers)[0]


def read(raw: str | bytes, *, long_integers: bool = True) -> tuple[Any, bool]:
    """``loads(raw)``, and whether orjson read it: then no part of it holds what orjson cannot
    write back as the same value (NaN, infinities, integers past 64 bits)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if not long_integers or not _long_digit_run(data):
        try:
            return orjson.loads(data), True
        except orjson.JSONDecodeError:
            pass   # what json reads and orjson refuses, or a text neither reads
    return json.loads(raw), False


class RawJSON(bytes):
    """JSON text written already (by ``dumps``), placed by ``dumps`` as it is where a value
    goes: a result's body is written once for its key and its batch line alike."""


def _as_written(value: Any) -> Any:
    if isinstance(value, RawJSON):
        return orjson.Fragment(bytes(value))
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def as_read(value: Any) -> Any:
    """``json.dumps``' default for a value holding ``RawJSON``: the value it holds."""
    if isinstance(value, RawJSON):
        return json.loads(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def dumps(value: Any) -> bytes:
    """Compact JSON (UTF-8); the json module where orjson refuses (lone surrogates, integers
    past 64 bits, keys that are not strings). A ``RawJSON`` in ``value`` is written as it is."""
    try:
        return orjson.dumps(value, default=_as_written)
    except orjson.JSONEncodeError:
        return json.dumps(value, separators=(",", ":"), default=as_read).encode()

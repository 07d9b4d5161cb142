"""ULIDs: 48 bits of milliseconds then 80 random bits, in Crockford base32, so ids sort by
time (response ids ``scr_...``, request ids)."""

from __future__ import annotations

import os
import time

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
# every two digits by their 10 bits: a ULID in 13 look-ups (one is made per reply)
_PAIRS = [a + b for a in _CROCKFORD for b in _CROCKFORD]


def new_ulid() -> str:
    n = (time.time_ns() // 1_000_000) << 80 | int.from_bytes(os.urandom(10), "big")
    # 26 digits: 130 bits, the first two zero
    return "".join([_PAIRS[(n >> shift) & 1023] for shift in range(120, -1, -10)])

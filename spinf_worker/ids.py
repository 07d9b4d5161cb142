"""ULIDs: 48 bits of milliseconds then 80 random bits, in Crockford base32, so ids sort by
time (response ids ``scr_...``, request ids)."""

from __future__ import annotations

import os
import time

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_ulid() -> str:
    n = (time.time_ns() // 1_000_000) << 80 | int.from_bytes(os.urandom(10), "big")
    return "".join(_CROCKFORD[(n >> shift) & 31] for shift in range(125, -1, -5))

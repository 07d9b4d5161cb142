"""ULIDs: 48 bits of milliseconds then 80 random bits, in Crockford base32, so ids sort by
time (response ids ``scr_...``, request ids)."""

from __future__ import annotations

import random
import time

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
# every two digits by their 10 bits: a ULID in 13 look-ups (one is made per reply)
_PAIRS = [a + b for a in _CROCKFORD for b in _CROCKFORD]


def new_ulid() -> str:
    # ids, not secrets: the process's own generator (seeded from the OS, again in a forked
    # child), not a system call, which would hand the interpreter lock to another thread
    # mid-reply (the worker's engine thread makes one per reply)
    n = (time.time_ns() // 1_000_000) << 80 | random.getrandbits(80)
    # 26 digits: 130 bits, the first two zero
    return "".join([_PAIRS[(n >> shift) & 1023] for shift in range(120, -1, -10)])

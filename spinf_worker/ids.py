"""ULIDs: 48 bits of milliseconds then 80 random bits, in Crockford base32, so ids sort by
time (response ids ``scr_...``, request ids)."""

from __future__ import annotations

import base64
import os
import time

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
# RFC 4648's base32 alphabet, letter for letter, to Crockford's
_TO_CROCKFORD = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", _CROCKFORD.encode())


def new_ulid() -> str:
    n = (time.time_ns() // 1_000_000) << 80 | int.from_bytes(os.urandom(10), "big")
    # the 128 bits as 20 bytes (32 digits of 5 bits, by C's base32): the last 26 digits
    return base64.b32encode(n.to_bytes(20, "big")).translate(_TO_CROCKFORD)[6:].decode()

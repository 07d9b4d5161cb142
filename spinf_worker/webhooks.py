"""Webhooks the Standard Webhooks way (https://www.standardwebhooks.com/), for job callbacks
(queue/callbacks.py) and the ingest webhook sink: signing secrets, signatures and their
verification, the SSRF guard that decides where a POST may go (also used for fetched pages),
and how one POST's answer is read (retry, give up) and backed off. Torch- and Redis-free.

The signer is a few lines of hmac rather than the ``standardwebhooks`` package, which is no
runtime dependency of the service; the tests check these signatures against that package.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import email.utils
import hashlib
import hmac
import ipaddress
import random
import secrets
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timezone

import httpx

from . import __version__

SECRET_PREFIX = "whsec_"
SIGNATURE_VERSION = "v1"
USER_AGENT = f"spinf-serve-webhooks/{__version__}"

MAX_DELAY_S = 3600.0          # cap on a backoff step and on a receiver's Retry-After
RETRY_STATUS = frozenset({408, 429})


# ---------------------------------------------------------------------------------------------
# Signatures (Standard Webhooks v1: HMAC-SHA256 over "{id}.{timestamp}.{body}")


def new_secret() -> str:
    """A fresh signing secret: ``whsec_`` + base64 of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def secret_bytes(secret: str) -> bytes:
    """The HMAC key of a ``whsec_<base64>`` secret. Raises ValueError when malformed."""
    raw = secret.removeprefix(SECRET_PREFIX)
    try:
        key = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("webhook secret must be 'whsec_' followed by base64") from None
    if len(key) < 16:
        raise ValueError("webhook secret is shorter than 16 bytes")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value: ``v1,<base64 HMAC-SHA256>``."""
    return sign_with_key(secret_bytes(secret), msg_id, int(timestamp), body)


def sign_with_key(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """``sign`` with the key ``secret_bytes`` gave: a sender decodes its secret once."""
    digest = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


def verify(secret: str, headers: Mapping[str, str], body: bytes, tolerance_s: float = 300,
           *, now: float | None = None) -> bool:
    """True when ``headers`` carry a valid v1 signature of ``body`` made with ``secret`` and a
    timestamp within ``tolerance_s`` of now (either way, against replays). Header names are
    matched case-insensitively; the signature header may list several space-separated
    signatures (key rotation). Never raises on malformed input."""
    lowered = {k.lower(): v for k, v in headers.items()}
    msg_id = lowered.get("webhook-id")
    stamp = lowered.get("webhook-timestamp")
    offered = lowered.get("webhook-signature")
    if not (msg_id and stamp and offered):
        return False
    try:
        timestamp = int(stamp)
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    expected = sign(secret, msg_id, timestamp, body).encode()
    return any(hmac.compare_digest(expected, candidate.encode())
               for candidate in offered.split() if candidate.startswith(f"{SIGNATURE_VERSION},"))


# ---------------------------------------------------------------------------------------------
# SSRF guard


class CallbackRefused(Exception):
    """The callback URL may not be called: a private address, a bad scheme, no such host."""


@dataclass(frozen=True)
class Target:
    url: httpx.URL          # as the job gave it
    address: str            # the checked IP that the request connects to

    def request_url(self) -> httpx.URL:
        return self.url.copy_with(host=self.address)


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# IPv6 ranges that carry an IPv4 address which a relay or translator then reaches
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")             # RFC 6052: the IPv4 in the low 32 bits
LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")     # RFC 8215: a site's own translator
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")          # ::a.b.c.d, deprecated (RFC 4291)


def _embedded_ipv4(address: ipaddress.IPv6Address) -> list[tuple[str, ipaddress.IPv4Address]]:
    """The IPv4 addresses inside an IPv6 one, with the form that carries them."""
    found = []
    if address.sixtofour is not None:
        found.append(("6to4", address.sixtofour))
    if address.teredo is not None:     # the client's address is stored inverted; teredo undoes it
        server, client = address.teredo
        found += [("Teredo server", server), ("Teredo client", client)]
    if address in NAT64:
        found.append(("NAT64", ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)))
    if address in IPV4_COMPATIBLE and int(address) > 1:    # not :: or ::1
        found.append(("IPv4-compatible", ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)))
    return found


def _forbidden(address: IPAddress) -> str | None:
    """Why ``address`` is no place to send a webhook, or None when it is a public one. An IPv6
    address that carries an IPv4 one (IPv4-mapped, IPv4-compatible, 6to4, Teredo, NAT64) is
    refused when that IPv4 address would be: a relay or translator would deliver to it."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:     # the socket connects to that IPv4 address itself
            reason = _forbidden(address.ipv4_mapped)
            return reason and f"{reason}: the IPv4-mapped address {address.ipv4_mapped}"
        for form, inner in _embedded_ipv4(address):
            reason = _forbidden(inner)
            if reason is not None:
                return f"{reason}: the {form} address {inner}"
        if address in NAT64:
            # a public IPv4 host behind DNS64 (an IPv6-only network); the range itself counts
            # as reserved (it lies in ::/8), so the embedded address alone decides
            return None
        if address in LOCAL_NAT64:
            return "not global: local-use NAT64"    # its IPv4 position depends on the site
    for what in ("loopback", "link_local", "private", "multicast", "reserved", "unspecified"):
        if getattr(address, f"is_{what}"):
            return what.replace("_", "-")
    if not address.is_global:     # shared (100.64/10), documentation, benchmarking ranges
        return "not global"
    return None


class TargetGuard:
    """Resolves a callback URL's host and refuses internal addresses unless allowed.

    ``allow`` holds host names (matched exactly, case-insensitively) and IPs / CIDRs; a host on
    the list may resolve anywhere, an address inside a listed network is allowed. The caller
    connects to ``Target.address`` — the address checked here — so a second DNS answer
    (rebinding) cannot move the request elsewhere."""

    def __init__(self, allow: Iterable[str] = ()):
        self.hosts: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for item in allow:
            item = item.strip()
            try:
                self.networks.append(ipaddress.ip_network(item.strip("[]"), strict=False))
            except ValueError:
                self.hosts.add(item.lower().rstrip("."))

    def _allowed(self, address: IPAddress) -> bool:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped    # the same host: an allowed IPv4 address allows it
        return any(address in net for net in self.networks if net.version == address.version)

    async def resolve(self, url: str) -> Target:
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError) as err:
            raise CallbackRefused(f"invalid callback URL: {err}") from None
        if parsed.scheme not in ("http", "https"):
            raise CallbackRefused(f"callback URL scheme must be http or https, not {parsed.scheme!r}")
        host = parsed.host.lower().rstrip(".")
        if not host:
            raise CallbackRefused("callback URL has no host")
        if parsed.userinfo:
            raise CallbackRefused("callback URL must not carry credentials")
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        except (socket.gaierror, UnicodeError) as err:
            raise CallbackRefused(f"cannot resolve {host}: {err}") from None
        addresses = list(dict.fromkeys(
            ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos))
        if not addresses:
            raise CallbackRefused(f"{host} has no address")
        if host not in self.hosts:
            for address in addresses:
                reason = _forbidden(address)
                if reason is not None and not self._allowed(address):
                    # every address is checked: a host with one internal address is refused
                    raise CallbackRefused(f"{host} resolves to {address} ({reason}); "
                                          "add it to callback_allow to permit it")
        return Target(parsed, str(addresses[0]))


# ---------------------------------------------------------------------------------------------
# One POST's outcome, and the wait before the next attempt


@dataclass
class Attempt:
    """What one POST gave."""
    outcome: str                     # delivered | retry | failed
    bucket: str                      # 2xx | 3xx | 4xx | 5xx | error: the stats counter
    status_code: int | None = None
    error: str | None = None
    retry_after_s: float | None = None


def classify(response: httpx.Response) -> Attempt:
    code = response.status_code
    bucket = f"{code // 100}xx" if 200 <= code < 600 else "error"
    if 200 <= code < 300:
        return Attempt("delivered", bucket, code)
    if code == 410:
        return Attempt("failed", bucket, code, "410 Gone: the endpoint is gone")
    if 300 <= code < 400:
        return Attempt("failed", bucket, code, f"{code}: redirects are not followed")
    if code in RETRY_STATUS or code >= 500:
        return Attempt("retry", bucket, code, f"HTTP {code}",
                       retry_after_s=parse_retry_after(response.headers.get("retry-after")))
    return Attempt("failed", bucket, code, f"HTTP {code}")


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        seconds = when.timestamp() - (time.time() if now is None else now)
    return min(max(seconds, 0.0), MAX_DELAY_S)


def backoff_s(attempt: int, base_s: float) -> float:
    """Full jitter: uniform in [0, base * 2^(attempt-1)], the step capped at MAX_DELAY_S."""
    return random.uniform(0.0, min(base_s * 2 ** (attempt - 1), MAX_DELAY_S))

"""Bearer tokens. /v1: with no API key and no token configured the API is open (the embedded
default); with any, every /v1 route needs ``Authorization: Bearer <key>`` (else 401
``invalid_token``). /v0 (operators: drain, engine info) needs the trusted token
(``settings.token``, ``serve --token``); with none configured only loopback callers are
trusted, so a bare ``spinf-serve serve`` is operated from its own machine. Behind a proxy on
the same host every caller looks local: configure a token there.

Tenants: every key belongs to one. A key entry (an item of settings.api_keys or a line of
settings.api_keys_file) is ``<key>`` or ``<key> <tenant>``; a bare key is a tenant of its own,
named ``key-`` and a short digest of the key (not the key). Jobs, files and batches record
the tenant that created them and are only visible to it; the server's token (the operator)
reads every tenant's. The open mode is one tenant, ``default``."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from spinf_worker.queue.settings import ServiceSettings

from .errors import AuthenticationError

# auto_error=False: a missing header must get our 401 in the envelope, not FastAPI's 403
_bearer = HTTPBearer(auto_error=False, description="an API key from SPINF_API_KEYS or the "
                                                   "server's token (SPINF_TOKEN)")
_CHALLENGE = {"WWW-Authenticate": "Bearer"}

OPEN_TENANT = "default"
# No ':' in a name: Redis keys put the tenant between colons (keys.py)
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class ApiKeysError(ValueError):
    """A key entry, or the keys file, that cannot be used; the message names the entry
    (``SPINF_API_KEYS[n]``, or the file and its line)."""


@dataclass(frozen=True)
class ApiKey:
    secret: bytes
    tenant: str


@dataclass(frozen=True)
class Caller:
    """Who sent a /v1 request: the tenant its records are created for, and whether it may
    read every tenant's (the server's token, or anyone in the open mode)."""

    tenant: str
    reads_all: bool = False

    def owns(self, tenant: str | None) -> bool:
        """Whether a record created by ``tenant`` is visible to this caller (None: a record
        of no tenant, such as one made before tenants or by ingestion: operators only)."""
        return self.reads_all or tenant == self.tenant


OPEN_CALLER = Caller(OPEN_TENANT, reads_all=True)


def key_tenant(secret: str) -> str:
    """The tenant of a key listed without one: a digest names it, so logs and Redis never
    hold the key itself."""
    return "key-" + hashlib.sha256(b"spinf-tenant\0" + secret.encode()).hexdigest()[:12]


def parse_key_entry(entry: str, where: str) -> ApiKey | None:
    """``<key>`` or ``<key> <tenant>`` (None for a blank entry). Bearer tokens hold no
    whitespace, so the old one-key-per-line format reads the same."""
    parts = entry.split()
    if not parts:
        return None
    if len(parts) > 2:
        raise ApiKeysError(f"{where}: expected '<key>' or '<key> <tenant>', got {len(parts)} "
                         "fields")
    secret = parts[0]
    tenant = parts[1] if len(parts) == 2 else key_tenant(secret)
    if not TENANT_NAME.fullmatch(tenant):
        raise ApiKeysError(f"{where}: tenant {tenant!r} must be 1-64 letters, digits, '.', '_' "
                         "or '-', starting with a letter or digit")
    return ApiKey(secret.encode(), tenant)


def load_api_keys(settings: ServiceSettings) -> tuple[ApiKey, ...]:
    """Keys from settings.api_keys plus settings.api_keys_file (one entry per line; blank
    lines and lines starting with # are skipped), and the server's token. A missing file, a
    malformed entry or a key listed for two tenants is an ApiKeysError at start-up."""
    entries = [(entry, f"SPINF_API_KEYS[{n}]") for n, entry in enumerate(settings.api_keys)]
    if settings.api_keys_file:
        lines = _read_keys_file(settings.api_keys_file)
        entries += [(line, f"{settings.api_keys_file}:{n}") for n, line in enumerate(lines, 1)
                    if not line.strip().startswith("#")]
    keys: dict[bytes, ApiKey] = {}
    for entry, where in entries:
        key = parse_key_entry(entry, where)
        if key is not None and keys.setdefault(key.secret, key).tenant != key.tenant:
            raise ApiKeysError(f"{where}: this key is already listed for another tenant")
    token = (settings.token or "").strip()
    if token:   # its own tenant, unless listed with one above
        keys.setdefault(token.encode(), ApiKey(token.encode(), key_tenant(token)))
    return tuple(keys.values())


def _read_keys_file(path: str) -> list[str]:
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise ApiKeysError(f"{path}: the API keys file cannot be read: "
                           f"{err.strerror or err}") from None
    except UnicodeDecodeError as err:
        line = Path(path).read_bytes()[:err.start].count(b"\n") + 1
        raise ApiKeysError(f"{path}:{line}: the API keys file must be UTF-8 text") from None


def _match(token: bytes, keys: tuple[ApiKey, ...]) -> ApiKey | None:
    # Compare with every key, without stopping at the first match, so the time taken tells
    # nothing about which key (or how much of one) was right.
    found = None
    for key in keys:
        if hmac.compare_digest(token, key.secret) and found is None:
            found = key
    return found


async def require_api_key(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Caller:
    keys: tuple[ApiKey, ...] = request.app.state.api_keys
    if not keys:
        return OPEN_CALLER
    if credentials is None:
        raise AuthenticationError(
            "missing API key: send it as 'Authorization: Bearer <key>'", headers=_CHALLENGE)
    presented = credentials.credentials.encode()
    key = _match(presented, keys)
    if key is None:
        raise AuthenticationError("invalid API key", headers=_CHALLENGE)
    token: str | None = request.app.state.trusted_token
    operator = bool(token) and hmac.compare_digest(presented, token.strip().encode())
    return Caller(key.tenant, reads_all=operator)


def _loopback(request: Request) -> bool:
    host = request.client.host if request.client else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def require_trusted(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    token: str | None = request.app.state.trusted_token
    if not token:
        if not _loopback(request):
            raise AuthenticationError("this endpoint is for the server's operators: with no "
                                      "token configured, only local callers may use it",
                                      headers=_CHALLENGE)
        return
    if credentials is None or not hmac.compare_digest(credentials.credentials.encode(),
                                                      token.encode()):
        raise AuthenticationError("this endpoint needs the server's trusted token "
                                  "(Authorization: Bearer <token>)", headers=_CHALLENGE)


V1_AUTH = [Depends(require_api_key)]    # dependencies of every /v1 router
# a route's caller: the same dependency, run once per request (FastAPI caches it)
CallerDep = Annotated[Caller, Depends(require_api_key)]
V0_AUTH = [Depends(require_trusted)]    # dependencies of the /v0 router

"""Bearer tokens. /v1: with no API key and no token configured the API is open (the embedded
default); with any, every /v1 route needs ``Authorization: Bearer <key>`` (else 401
``invalid_token``). /v0 (operators: drain, engine info) needs the trusted token
(``settings.token``, ``serve --token``); with none configured only loopback callers are
trusted, so a bare ``spinf-serve serve`` is operated from its own machine. Behind a proxy on
the same host every caller looks local: configure a token there."""

from __future__ import annotations

import hmac
import ipaddress
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


def load_api_keys(settings: ServiceSettings) -> tuple[bytes, ...]:
    """Keys from settings.api_keys plus settings.api_keys_file (one per line; blank lines and
    lines starting with # are skipped), and the server's token. A missing file is an error at
    start-up."""
    keys = [key.strip() for key in settings.api_keys]
    if settings.api_keys_file:
        for line in Path(settings.api_keys_file).read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    if settings.token:
        keys.append(settings.token.strip())
    return tuple(key.encode() for key in keys if key)


def _matches(token: bytes, keys: tuple[bytes, ...]) -> bool:
    # Compare with every key, without stopping at the first match, so the time taken tells
    # nothing about which key (or how much of one) was right.
    found = False
    for key in keys:
        found |= hmac.compare_digest(token, key)
    return found


async def require_api_key(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    keys: tuple[bytes, ...] = request.app.state.api_keys
    if not keys:
        return
    if credentials is None:
        raise AuthenticationError(
            "missing API key: send it as 'Authorization: Bearer <key>'", headers=_CHALLENGE)
    if not _matches(credentials.credentials.encode(), keys):
        raise AuthenticationError("invalid API key", headers=_CHALLENGE)


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
V0_AUTH = [Depends(require_trusted)]    # dependencies of the /v0 router

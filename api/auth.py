"""Bearer API keys. With no key configured the API is open (the embedded default); with any
key, every /v1 route needs ``Authorization: Bearer <key>``."""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from spinf_worker.queue.settings import ServiceSettings

from .errors import AuthenticationError

# auto_error=False: a missing header must get our 401 in the OpenAI shape, not FastAPI's 403
_bearer = HTTPBearer(auto_error=False, description="an API key from SPINF_API_KEYS")


def load_api_keys(settings: ServiceSettings) -> tuple[bytes, ...]:
    """Keys from settings.api_keys plus settings.api_keys_file (one per line; blank lines and
    lines starting with # are skipped). A missing file is an error at start-up."""
    keys = [key.strip() for key in settings.api_keys]
    if settings.api_keys_file:
        for line in Path(settings.api_keys_file).read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
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
    challenge = {"WWW-Authenticate": "Bearer"}
    if credentials is None:
        raise AuthenticationError(
            "missing API key: send it as 'Authorization: Bearer <key>'", headers=challenge)
    if not _matches(credentials.credentials.encode(), keys):
        raise AuthenticationError("invalid API key", headers=challenge)


V1_AUTH = [Depends(require_api_key)]  # dependencies of every /v1 router

"""GET /v1/packs: the prompt packs this deployment loads (packs/ of the distribution)."""

from __future__ import annotations

from functools import cache

from fastapi import APIRouter

from spinf_worker.packs import Pack, official_packs

from ..auth import V1_AUTH
from ..models import error_responses

router = APIRouter(prefix="/v1/packs", tags=["packs"], dependencies=V1_AUTH)


@cache
def _packs() -> dict[str, Pack]:
    return official_packs()


@router.get("", responses=error_responses(401))
async def list_packs() -> dict:
    return {"object": "list", "data": [p.summary() for p in _packs().values()]}

"""GET /v1/packs: the prompt packs this deployment loads (the official packs/ plus the
SPINF_PACKS sources, as the workers load them)."""

from __future__ import annotations

from functools import cache

from fastapi import APIRouter

from spinf_worker.pack_sources import load_sources
from spinf_worker.packs import Pack

from ..auth import V1_AUTH
from ..models import error_responses
from ..services import ServicesDep

router = APIRouter(prefix="/v1/packs", tags=["packs"], dependencies=V1_AUTH)


@cache
def _packs(sources: tuple[str, ...]) -> dict[str, Pack]:
    return load_sources(sources)


@router.get("", responses=error_responses(401))
def list_packs(services: ServicesDep) -> dict:
    # a plain def: FastAPI runs it on a thread, so a first git fetch does not block the loop
    return {"object": "list",
            "data": [p.summary() for p in _packs(tuple(services.settings.packs)).values()]}

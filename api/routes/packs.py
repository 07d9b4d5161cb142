"""GET /v1/packs and GET /v1/packs/{id}: the prompt packs this deployment loads (the official
packs/ plus the SPINF_PACKS sources, as the workers load them)."""

from __future__ import annotations

from functools import cache

from fastapi import APIRouter

from spinf_worker.errors import InvalidRequestError
from spinf_worker.pack_sources import load_sources
from spinf_worker.packs import Pack, find_pack

from ..auth import V1_AUTH
from ..errors import NotFoundError
from ..models import error_responses
from ..services import ServicesDep

router = APIRouter(prefix="/v1/packs", tags=["packs"], dependencies=V1_AUTH)


@cache
def loaded_packs(sources: tuple[str, ...]) -> dict[str, dict[str, Pack]]:
    """The packs of these sources, loaded once per process (as the workers load them)."""
    return load_sources(sources)


def _sources(sources: tuple[str, ...]) -> list[str]:
    return ["official", *sources]


# plain defs: FastAPI runs them on a thread, so a first git fetch does not block the loop
@router.get("", responses=error_responses(401))
def list_packs(services: ServicesDep) -> dict:
    sources = tuple(services.settings.packs)
    packs = loaded_packs(sources)
    return {"packs": [next(iter(versions.values())).summary(list(versions))
                      for versions in packs.values()],
            "sources": _sources(sources)}


@router.get("/{pack_id:path}", responses=error_responses(401, 404))
def get_pack(pack_id: str, services: ServicesDep, version: str | None = None) -> dict:
    """The pack file as loaded (default: the newest version)."""
    try:
        pack = find_pack(loaded_packs(tuple(services.settings.packs)), pack_id, version,
                         param="id", version_param="version")
    except InvalidRequestError as err:
        raise NotFoundError(err.message, param=err.param, code=err.code) from None
    return pack.raw

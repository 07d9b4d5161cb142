"""HTTP routes, one small module per resource. Everything under /v1 needs the API key when
keys are configured; the operations routes stay open."""

from fastapi import APIRouter, Depends

from ..auth import require_api_key
from . import batches, catalog, files, jobs, ops, scoring

v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
for module in (scoring, jobs, catalog, files, batches):
    v1.include_router(module.router)

__all__ = ["ops", "v1"]

"""GET /v1/models and GET /v1/models/{id}: the models live workers serve, in the OpenAI shape.
Ids may contain "/" (google/gemma-3-270m); the bare name after the last "/" also finds one."""

from __future__ import annotations

from fastapi import APIRouter

from spinf_worker.model_names import served_names

from ..auth import V1_AUTH
from ..errors import NotFoundError
from ..models import ModelList, ModelObject, error_responses
from ..services import ServicesDep, WorkerInfo

router = APIRouter(prefix="/v1/models", tags=["models"], dependencies=V1_AUTH)


def _catalog(live: list[WorkerInfo]) -> list[ModelObject]:
    by_model: dict[str, list[WorkerInfo]] = {}
    for worker in live:
        by_model.setdefault(worker.model, []).append(worker)
    return [ModelObject(id=model,
                        # the oldest heartbeat of a live worker is as close to "since" as the
                        # registry knows
                        created=min(w.heartbeat_ms for w in workers) // 1000,
                        fingerprints=sorted({w.fingerprint for w in workers if w.fingerprint}),
                        workers=len(workers))
            for model, workers in sorted(by_model.items())]


@router.get("", response_model=ModelList, responses=error_responses(401))
async def list_models(services: ServicesDep) -> ModelList:
    live, _registered = await services.workers()
    return ModelList(data=_catalog(live))


@router.get("/{model_id:path}", response_model=ModelObject, responses=error_responses(401, 404))
async def get_model(model_id: str, services: ServicesDep) -> ModelObject:
    live, _registered = await services.workers()
    for model in _catalog(live):
        if model_id in served_names(model.id):
            return model
    raise NotFoundError(f"model {model_id!r} is not served by any live worker",
                        param="model", code="model_not_found")

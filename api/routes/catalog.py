"""GET /v1/models and GET /v1/models/{id}: the models live workers serve, in the hosted shape
(``models``) and the OpenAI list (``object``, ``data``) in one reply. Ids may contain "/"
(google/gemma-3-270m); any alias (the bare name after the last "/", the hosted spinf-12b and
spinf-31b) also finds one."""

from __future__ import annotations

from fastapi import APIRouter

from spinf_worker.model_names import aliases, served_names
from spinf_worker.protocol import DEFAULT_LIMITS

from ..auth import V1_AUTH
from ..errors import NotFoundError
from ..models import ModelFeatures, ModelList, ModelObject, ModelStatus, error_responses
from ..services import ServicesDep, WorkerInfo

router = APIRouter(prefix="/v1/models", tags=["models"], dependencies=V1_AUTH)

# What every model served here can do: options and extraction slots; media (content kinds
# besides text) are the workers' to say (their registrations, api/media.py).
CAPABILITIES = ["score", "extract"]


def _status(workers: list[WorkerInfo]) -> ModelStatus:
    statuses = {w.status for w in workers}
    return next(s for s in ("available", "loading", "error") if s in statuses)


def _media(workers: list[WorkerInfo]) -> list[str]:
    """The media kinds every worker of the model reads."""
    kinds = [set(w.media or ()) for w in workers]
    return sorted(set.intersection(*kinds)) if kinds else []


def _catalog(live: list[WorkerInfo]) -> list[ModelObject]:
    by_model: dict[str, list[WorkerInfo]] = {}
    for worker in live:
        by_model.setdefault(worker.model, []).append(worker)
    limits = DEFAULT_LIMITS.model_dump()    # what the engine applies to every request
    return [ModelObject(id=model, name=model.rsplit("/", 1)[-1], status=_status(workers),
                        base_model=model, aliases=aliases(model),
                        family=next((w.family for w in workers if w.family), None),
                        capabilities=CAPABILITIES, media=_media(workers), limits=limits,
                        features=ModelFeatures(media=_media(workers),
                                               extraction="extract" in CAPABILITIES,
                                               generation="generate" in CAPABILITIES),
                        # since the first live worker began to load it (or its heartbeat,
                        # for a worker that does not say)
                        created=min(w.started_ms or w.heartbeat_ms for w in workers) // 1000,
                        fingerprints=sorted({w.fingerprint for w in workers if w.fingerprint}),
                        workers=len(workers))
            for model, workers in sorted(by_model.items())]


@router.get("", response_model=ModelList, responses=error_responses(401))
async def list_models(services: ServicesDep) -> ModelList:
    live, _registered = await services.workers()
    models = _catalog(live)
    return ModelList(models=models, data=models)


@router.get("/{model_id:path}", response_model=ModelObject, responses=error_responses(401, 404))
async def get_model(model_id: str, services: ServicesDep) -> ModelObject:
    live, _registered = await services.workers()
    models = _catalog(live)
    # its own id first: an alias shared by several models finds the first of them
    for model in sorted(models, key=lambda m: m.id != model_id):
        if model_id in served_names(model.id):
            return model
    raise NotFoundError(f"model {model_id!r} is not served by any live worker",
                        param="model", code="model_not_found")

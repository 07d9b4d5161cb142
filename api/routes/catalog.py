"""GET /v1/models and GET /v1/models/{id}: the models live workers serve, in the hosted shape
(``models``) and the OpenAI list (``object``, ``data``) in one reply. Ids may contain "/"
(google/gemma-3-270m); any alias (the bare name after the last "/", the hosted spinf-12b and
spinf-31b, a manifest's own) also finds one. What each model is comes from the manifest its
workers register (spinf_worker/manifest.py)."""

from __future__ import annotations

from fastapi import APIRouter

from spinf_worker.manifest import Manifest, infer

from ..auth import V1_AUTH
from ..errors import NotFoundError
from ..models import ModelFeatures, ModelList, ModelObject, ModelStatus, error_responses
from ..services import ServicesDep, WorkerInfo

router = APIRouter(prefix="/v1/models", tags=["models"], dependencies=V1_AUTH)


def _status(workers: list[WorkerInfo]) -> ModelStatus:
    statuses = {w.status for w in workers}
    return next(s for s in ("available", "loading", "error") if s in statuses)


def _media(workers: list[WorkerInfo]) -> list[str]:
    """The media kinds every worker of the model reads."""
    kinds = [set(w.media or ()) for w in workers]
    return sorted(set.intersection(*kinds)) if kinds else []


def _manifest(model: str, workers: list[WorkerInfo]) -> Manifest:
    """The model's manifest, as its workers registered it; a worker still loading (or one
    from before manifests) says none: then what its registration says (the inferred one)."""
    found = next((w.manifest for w in workers if w.manifest is not None), None)
    if found is not None:
        return found
    return Manifest.model_validate(
        infer(model, {"model_type": next((w.family for w in workers if w.family), None)},
              _media(workers)))


def _catalog(live: list[WorkerInfo]) -> list[ModelObject]:
    by_model: dict[str, list[WorkerInfo]] = {}
    for worker in live:
        by_model.setdefault(worker.model, []).append(worker)
    out = []
    for model, workers in sorted(by_model.items()):
        entry = _manifest(model, workers).catalog_entry()
        caps = entry["capabilities"]
        out.append(ModelObject(
            **entry, status=_status(workers),
            features=ModelFeatures(media=entry["media"], extraction="extract" in caps,
                                   generation="generate" in caps),
            # since the first live worker began to load it (or its heartbeat, for a worker
            # that does not say)
            created=min(w.started_ms or w.heartbeat_ms for w in workers) // 1000,
            fingerprints=sorted({w.fingerprint for w in workers if w.fingerprint}),
            workers=len(workers)))
    return out


def names_of(model: str, workers: list[WorkerInfo]) -> set[str]:
    """Every name the model answers to: its manifest's (model_names.served_names by default)."""
    return _manifest(model, [w for w in workers if w.model == model]).names


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
        if model_id == model.id or model_id in model.aliases:
            return model
    raise NotFoundError(f"model {model_id!r} is not served by any live worker",
                        param="model", code="model_not_found")

"""Files of the Batch API: upload a JSONL input (purpose "batch"), read file objects and
content (inputs, and the output/error files batches produce)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.datastructures import UploadFile

from spinf_worker.errors import InvalidRequestError
from spinf_worker.queue import batches, files

from ..auth import V1_AUTH, Caller, CallerDep
from ..errors import BodyTooLarge, NotFoundError
from ..models import FileObject, error_responses
from ..services import Services, ServicesDep

router = APIRouter(prefix="/v1/files", tags=["files"], dependencies=V1_AUTH)


def _not_found(file_id: str) -> NotFoundError:
    return NotFoundError(f"no file {file_id!r} (unknown, or expired)", param="file_id",
                         code="file_not_found")


async def check_owner(services: Services, caller: Caller, file_id: str,
                      param: str = "file_id") -> None:
    """Another tenant's file is as unknown as a missing one: its existence is not told. A
    batch's output and error files are its batch's tenant's."""
    tenant = await files.tenant_of(services.redis, services.keys, file_id)
    batch_id = batches.producer_of(file_id)
    if tenant is None and batch_id is not None:
        tenant = await batches.tenant_of(services.redis, services.keys, batch_id)
    if not caller.owns(tenant):
        raise NotFoundError(f"no file {file_id!r} (unknown, or expired)", param=param,
                            code="file_not_found")


# The form is read in the route, not declared as File()/Form() parameters: FastAPI parses a
# declared form before any dependency runs, so a caller without a key had its upload read (up
# to max_file_bytes) and a malformed one answered 400 instead of 401.
UPLOAD_BODY = {"required": True, "content": {"multipart/form-data": {"schema": {
    "title": "Upload", "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"title": "File", "type": "string",
                            "contentMediaType": "application/octet-stream"},
                   "purpose": {"title": "Purpose", "type": "string", "const": "batch"}}}}}}


@router.post("", response_model=FileObject, responses=error_responses(400, 401, 413),
             openapi_extra={"requestBody": UPLOAD_BODY})
async def upload_file(request: Request, services: ServicesDep, caller: CallerDep) -> dict:
    async with request.form() as form:
        purpose = form.get("purpose")
        if purpose != "batch":
            raise InvalidRequestError("purpose: a form field that must be 'batch'",
                                      param="purpose")
        file = form.get("file")
        if not isinstance(file, UploadFile):
            raise InvalidRequestError("file: a file part is required", param="file")
        return await _store_upload(services, caller, file, purpose)


async def _store_upload(services: Services, caller: Caller, file: UploadFile,
                        purpose: str) -> dict:
    limit = services.settings.max_file_bytes
    content = await file.read(limit + 1)
    if len(content) > limit:
        raise BodyTooLarge(limit)
    try:
        content.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequestError("the file must be UTF-8 JSONL text", param="file",
                                  code="invalid_file") from None
    if not content.strip():
        raise InvalidRequestError("the file is empty", param="file", code="invalid_file")
    return await files.create_file(services.redis, services.keys, content,
                                   filename=file.filename or "input.jsonl", purpose=purpose,
                                   ttl_s=services.settings.result_ttl_s,
                                   tenant=caller.tenant)


@router.get("/{file_id}", response_model=FileObject, responses=error_responses(401, 404))
async def get_file(file_id: str, services: ServicesDep, caller: CallerDep) -> dict:
    await check_owner(services, caller, file_id)
    meta = await files.get_file(services.redis, services.keys, file_id)
    if meta is None:
        raise _not_found(file_id)
    return meta


@router.get("/{file_id}/content", response_class=StreamingResponse,
            responses={200: {"content": {"application/jsonl": {}}},
                       **error_responses(401, 404)})
async def get_file_content(file_id: str, services: ServicesDep,
                           caller: CallerDep) -> StreamingResponse:
    await check_owner(services, caller, file_id)
    chunks = await files.iter_content(services.redis, services.keys, file_id)
    if chunks is None:
        raise _not_found(file_id)
    return StreamingResponse(chunks, media_type="application/jsonl")

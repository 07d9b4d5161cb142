"""Files of the Batch API, kept in Redis (no FastAPI here).

A file is the hash ``<base>:file:<id>`` with ``meta`` (the OpenAI file object as JSON) and
either ``content`` (an uploaded file) or ``lines`` (the key of a list holding the lines of a
file produced by a batch). Produced files point at their batch's line list instead of copying
it, so finishing a batch of a million lines costs O(1) and reading one streams it in chunks.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from .keys import Keys

FILE_ID_PREFIX = "file-"
LINES_PER_CHUNK = 1000  # list entries fetched per LRANGE when streaming a produced file


def new_file_id() -> str:
    return FILE_ID_PREFIX + uuid.uuid4().hex


def _text(value: Any) -> str | None:
    """Redis replies are str with decode_responses=True and bytes without; accept both."""
    if value is None or isinstance(value, str):
        return value
    return value.decode()


def file_object(file_id: str, *, size: int, filename: str, purpose: str, created_at: int,
                expires_at: int | None) -> dict:
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at,
            "filename": filename, "purpose": purpose, "expires_at": expires_at,
            "status": "processed"}


async def create_file(redis, keys: Keys, content: bytes, *, filename: str, purpose: str,
                      ttl_s: int, tenant: str | None = None) -> dict:
    """Store an uploaded file; returns its file object. ``content`` must be UTF-8 text."""
    now = int(time.time())
    file_id = new_file_id()
    meta = file_object(file_id, size=len(content), filename=filename, purpose=purpose,
                       created_at=now, expires_at=now + ttl_s)
    key = keys.file(file_id)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping={"meta": json.dumps(meta), "content": content,
                                **({"tenant": tenant} if tenant is not None else {})})
        pipe.expire(key, ttl_s)
        await pipe.execute()
    return meta


async def get_file(redis, keys: Keys, file_id: str) -> dict | None:
    meta = _text(await redis.hget(keys.file(file_id), "meta"))
    return json.loads(meta) if meta is not None else None


async def tenant_of(redis, keys: Keys, file_id: str) -> str | None:
    """The API tenant that uploaded the file (None: none recorded, as on a batch's output
    file, whose owner is its batch's)."""
    return _text(await redis.hget(keys.file(file_id), "tenant"))


async def read_content(redis, keys: Keys, file_id: str) -> str | None:
    """The whole content of an uploaded file (None when missing or a produced file)."""
    return _text(await redis.hget(keys.file(file_id), "content"))


async def iter_content(redis, keys: Keys, file_id: str) -> AsyncIterator[str] | None:
    """The file's content in chunks, or None when there is no such file."""
    fields = await redis.hmget(keys.file(file_id), ["meta", "content", "lines"])
    meta, content, lines_key = (_text(v) for v in fields)
    if meta is None:
        return None
    if content is not None:
        return _once(content)
    return _list_lines(redis, lines_key)


async def _once(text: str) -> AsyncIterator[str]:
    yield text


async def _list_lines(redis, lines_key: str | None) -> AsyncIterator[str]:
    if lines_key is None:
        return
    start = 0
    while True:
        chunk = await redis.lrange(lines_key, start, start + LINES_PER_CHUNK - 1)
        if not chunk:
            return
        yield "".join(_text(line) + "\n" for line in chunk)
        if len(chunk) < LINES_PER_CHUNK:
            return
        start += LINES_PER_CHUNK

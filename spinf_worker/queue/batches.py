"""Bulk batches in the shape of the OpenAI Batch API, kept in Redis (no FastAPI here).

Life of a batch (``<base>:batch:<id>`` hash, see docs/QUEUE.md):

- ``create_batch``: status ``validating``; the API then runs ``enqueue_batch`` in the
  background, so a huge input file never holds the request.
- ``enqueue_batch``: ``in_progress``; reads the input JSONL line by line. A valid line becomes a
  bulk job (``batch_id``, ``custom_id``) after its custom_id joins the batch's *pending* set; an
  invalid line (bad JSON, bad body, duplicate custom_id, url other than the endpoint) goes
  straight to the error list. At the end the batch is *sealed* with its ``total``.
- ``record_result`` (called by workers): removes the custom_id from the pending set, appends the
  output or error line, and counts it. The removal is the guard: a job delivered twice
  (at-least-once) or finishing after a cancel is not counted again.
- The call that brings ``completed + failed`` to ``total`` on a sealed batch finalizes it
  inside the same Lua script, so exactly one caller does it however many workers race:
  status ``completed`` (or ``cancelled``), output/error files pointing at the line lists.
- ``cancel_batch``: ``cancelling``; then every custom_id still pending gets a
  ``batch_cancelled`` error line, which finalizes the batch as ``cancelled``. Entries already
  in the bulk stream are still scored by workers; their results are kept on the job records
  (GET /v1/jobs/<id>) but are not added to the batch.

Not done: reading the input is not resumed when the API process stops (or Redis fails) in the
middle of it; the batch then stays ``in_progress`` with ``errors`` naming the line where
queueing stopped. ``completion_window`` is recorded (``expires_at``) but not enforced.

Error lines: ``error`` is always ``{"code", "message"}`` (plus ``line``, the 1-based input line,
for lines rejected while reading the file). ``response`` is ``null`` for lines that never
became a request (bad JSON, bad line shape, duplicate custom_id, cancelled) and
``{"status_code", "request_id", "body": {"error": ...}}`` for requests that were answered with
an error (invalid body: 400 with ``request_id`` null; a job the worker failed or that expired:
its status with the job id), as OpenAI does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any

import orjson

from ..errors import SpinfError
from ..openai_compat import score_request_from_chat, score_to_chat_completion
from ..protocol import ScoreRequest
from . import files
from .keys import Keys
from .results import JobResult

BATCH_ID_PREFIX = "batch_"
LINE_ID_PREFIX = "batch_req_"
COMPLETION_WINDOWS = {"24h": 24 * 3600}
TIMESTAMP_FIELDS = ("created_at", "in_progress_at", "expires_at", "finalizing_at",
                    "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")

LINES_PER_CHUNK = 64  # lines validated together while enqueueing, between status checks
SUBMITS_AT_ONCE = 16  # concurrent submissions: each holds a pooled Redis connection


def output_file_id(batch_id: str) -> str:
    return f"{files.FILE_ID_PREFIX}{batch_id.removeprefix(BATCH_ID_PREFIX)}-output"


def error_file_id(batch_id: str) -> str:
    return f"{files.FILE_ID_PREFIX}{batch_id.removeprefix(BATCH_ID_PREFIX)}-errors"


def producer_of(file_id: str) -> str | None:
    """The batch whose output or error file ``file_id`` would be (None: not such an id)."""
    for suffix in ("-output", "-errors"):
        if file_id.startswith(files.FILE_ID_PREFIX) and file_id.endswith(suffix):
            return BATCH_ID_PREFIX + file_id[len(files.FILE_ID_PREFIX):-len(suffix)]
    return None


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return value.decode()


def _script_keys(keys: Keys, batch_id: str) -> list[str]:
    """The KEYS of every batch script, in the order the Lua code reads them."""
    return [keys.batch(batch_id), keys.batch_pending(batch_id),
            keys.batch_lines(batch_id, "out"), keys.batch_lines(batch_id, "err"),
            keys.file(output_file_id(batch_id)), keys.file(error_file_id(batch_id))]


# ---- Lua ---------------------------------------------------------------------------------

# Shared by the scripts below: turn a sealed, fully answered batch into its terminal state and
# create the files, in the same atomic step as the write that completed it.
_FINALIZE_LUA = """
local function file_meta(id, bytes, filename, now, ttl)
  return cjson.encode({id = id, object = 'file', bytes = bytes, created_at = now,
                       filename = filename, purpose = 'batch_output',
                       expires_at = now + ttl, status = 'processed'})
end

local function try_finalize(now)
  local f = redis.call('HMGET', KEYS[1], 'status', 'sealed', 'total', 'completed', 'failed',
                       'ttl_s', 'id', 'completed_bytes', 'failed_bytes')
  local status = f[1]
  if f[2] ~= '1' or (status ~= 'in_progress' and status ~= 'cancelling') then return 1 end
  local completed, failed = tonumber(f[4] or '0'), tonumber(f[5] or '0')
  if completed + failed < tonumber(f[3]) then return 1 end
  local ttl, id = tonumber(f[6]), f[7]
  local final = (status == 'in_progress') and 'completed' or 'cancelled'
  local fields = {'status', final, final .. '_at', now}
  if final == 'completed' then
    table.insert(fields, 'finalizing_at'); table.insert(fields, now)
  end
  if completed > 0 then
    redis.call('HSET', KEYS[5], 'meta', file_meta(ARGV[1], tonumber(f[8] or '0'),
               id .. '_output.jsonl', now, ttl), 'lines', KEYS[3])
    redis.call('EXPIRE', KEYS[5], ttl)
    table.insert(fields, 'output_file_id'); table.insert(fields, ARGV[1])
  end
  if failed > 0 then
    redis.call('HSET', KEYS[6], 'meta', file_meta(ARGV[2], tonumber(f[9] or '0'),
               id .. '_errors.jsonl', now, ttl), 'lines', KEYS[4])
    redis.call('EXPIRE', KEYS[6], ttl)
    table.insert(fields, 'error_file_id'); table.insert(fields, ARGV[2])
  end
  redis.call('HSET', KEYS[1], unpack(fields))
  redis.call('DEL', KEYS[2])
  for _, key in ipairs({KEYS[1], KEYS[3], KEYS[4]}) do redis.call('EXPIRE', key, ttl) end
  return 2
end
"""

# ARGV: out file id, err file id, now, custom_id, line, counter ('completed' | 'failed'),
#       check_pending ('1': only if custom_id is still pending)
# Returns -1 no such batch, 0 not pending (duplicate or cancelled), 1 recorded, 2 finalized.
_RECORD_LUA = _FINALIZE_LUA + """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if ARGV[7] == '1' and redis.call('SREM', KEYS[2], ARGV[4]) == 0 then return 0 end
local list = (ARGV[6] == 'completed') and KEYS[3] or KEYS[4]
redis.call('RPUSH', list, ARGV[5])
redis.call('EXPIRE', list, tonumber(redis.call('HGET', KEYS[1], 'ttl_s')))
redis.call('HINCRBY', KEYS[1], ARGV[6], 1)
redis.call('HINCRBY', KEYS[1], ARGV[6] .. '_bytes', string.len(ARGV[5]) + 1)
return try_finalize(tonumber(ARGV[3]))
"""

# ARGV: out file id, err file id, now, total.
# Returns -1 no such batch, 1 sealed, 2 sealed and finalized, 3 sealed while cancelling (the
# caller drains the pending set).
_SEAL_LUA = _FINALIZE_LUA + """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
redis.call('HSET', KEYS[1], 'total', ARGV[4], 'sealed', '1')
local status = redis.call('HGET', KEYS[1], 'status')
if try_finalize(tonumber(ARGV[3])) == 2 then return 2 end
if status == 'cancelling' then return 3 end
return 1
"""

# ARGV: out file id, err file id, now. Returns the try_finalize code (-1 without the batch).
_FINALIZE_ONLY_LUA = _FINALIZE_LUA + """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
return try_finalize(tonumber(ARGV[3]))
"""

# ARGV: now. Returns -1 no such batch, 0 not cancellable, 1 cancelling (the enqueuer drains
# when it seals), 2 cancelling and sealed (the caller drains).
_CANCEL_LUA = """
local f = redis.call('HMGET', KEYS[1], 'status', 'sealed')
if not f[1] then return -1 end
if f[1] == 'validating' or f[1] == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
elseif f[1] ~= 'cancelling' then
  return 0
end
if f[2] == '1' then return 2 end
return 1
"""

# ARGV: from-status, then field/value pairs. Returns 1 when the status matched and was changed.
_TRANSITION_LUA = """
if redis.call('HGET', KEYS[1], 'status') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return 1
"""


async def _eval(redis, script: str, keys: list[str], *args) -> int:
    # EVAL ships the script each time; scripts are a few hundred bytes and calls are one per
    # job, so this stays simple and survives SCRIPT FLUSH and Redis restarts.
    return int(await redis.eval(script, len(keys), *keys, *args))


# ---- batch objects -------------------------------------------------------------------------


async def create_batch(redis, keys: Keys, *, input_file_id: str, endpoint: str,
                       completion_window: str, metadata: dict | None, ttl_s: int,
                       tenant: str | None = None) -> dict:
    now = int(time.time())
    batch_id = BATCH_ID_PREFIX + uuid.uuid4().hex
    fields = {
        "id": batch_id, "endpoint": endpoint, "input_file_id": input_file_id,
        "completion_window": completion_window, "status": "validating",
        "metadata": json.dumps(metadata), "created_at": now,
        "expires_at": now + COMPLETION_WINDOWS[completion_window],
        "total": 0, "completed": 0, "failed": 0, "sealed": 0, "ttl_s": ttl_s,
    }
    if tenant is not None:   # the API tenant it belongs to, with its jobs and files
        fields["tenant"] = tenant
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.batch(batch_id), mapping=fields)
        pipe.expire(keys.batch(batch_id), ttl_s)
        pipe.zadd(keys.batch_index, {batch_id: time.time() * 1000})
        if tenant is not None:
            pipe.zadd(keys.tenant_batch_index(tenant), {batch_id: time.time() * 1000})
        await pipe.execute()
    return _batch_object({k: str(v) for k, v in fields.items()})


def _batch_object(fields: dict) -> dict:
    """The OpenAI batch object from the stored hash."""
    def integer(name: str) -> int | None:
        value = fields.get(name)
        return int(value) if value not in (None, "") else None

    errors = fields.get("errors")
    return {
        "id": fields["id"], "object": "batch", "endpoint": fields["endpoint"],
        "errors": json.loads(errors) if errors else None,
        "input_file_id": fields["input_file_id"],
        "completion_window": fields["completion_window"], "status": fields["status"],
        "output_file_id": fields.get("output_file_id"),
        "error_file_id": fields.get("error_file_id"),
        **{name: integer(name) for name in TIMESTAMP_FIELDS},
        "request_counts": {"total": integer("total") or 0,
                           "completed": integer("completed") or 0,
                           "failed": integer("failed") or 0},
        "metadata": json.loads(fields.get("metadata") or "null"),
    }


async def get_batch(redis, keys: Keys, batch_id: str) -> dict | None:
    fields = await redis.hgetall(keys.batch(batch_id))
    if not fields:
        return None
    return _batch_object({_text(k): _text(v) for k, v in fields.items()})


async def tenant_of(redis, keys: Keys, batch_id: str) -> str | None:
    """The API tenant that created the batch (None: none recorded)."""
    return _text(await redis.hget(keys.batch(batch_id), "tenant"))


async def list_batches(redis, keys: Keys, *, limit: int = 20, after: str | None = None,
                       tenant: str | None = None) -> tuple[list[dict], bool]:
    """Newest first; ``after`` is the id of the last batch of the previous page; ``tenant``:
    only that tenant's (None: all). Returns (batches, has_more). Ids of expired batches are
    dropped from the index here."""
    index = keys.batch_index if tenant is None else keys.tenant_batch_index(tenant)
    start = 0
    if after is not None:
        rank = await redis.zrevrank(index, after)
        if rank is None:
            return [], False
        start = rank + 1
    found: list[dict] = []
    while len(found) <= limit:
        ids = [_text(i) for i in await redis.zrevrange(index, start, start + limit)]
        if not ids:
            break
        start += len(ids)
        for batch_id in ids:
            batch = await get_batch(redis, keys, batch_id)
            if batch is None:
                await redis.zrem(index, batch_id)
                start -= 1
            else:
                found.append(batch)
    return found[:limit], len(found) > limit


async def cancel_batch(redis, keys: Keys, batch_id: str) -> tuple[str, bool]:
    """Move a batch to ``cancelling``. Returns (outcome, drain): outcome "missing",
    "not_cancellable" or "cancelling"; ``drain`` is True when all its lines are enqueued and
    the caller must run ``drain_cancelled`` (otherwise the enqueuer drains when it stops)."""
    code = await _eval(redis, _CANCEL_LUA, [keys.batch(batch_id)], int(time.time()))
    if code == -1:
        return "missing", False
    if code == 0:
        return "not_cancellable", False
    return "cancelling", code == 2


async def drain_cancelled(redis, keys: Keys, batch_id: str) -> None:
    """Give every still-pending custom_id of a cancelling batch its error line; the last one
    finalizes the batch as ``cancelled``."""
    pending = keys.batch_pending(batch_id)
    while True:
        custom_ids = [_text(c) async for c in redis.sscan_iter(pending, count=1000)]
        for custom_id in custom_ids:
            line = {"id": _line_id(), "custom_id": custom_id, "response": None,
                    "error": {"code": "batch_cancelled",
                              "message": "the batch was cancelled before this request ran"}}
            await _record_line(redis, keys, batch_id, custom_id, line, "failed", pending=True)
        if not custom_ids or not await redis.exists(pending):
            break
    # Every job may have answered before the cancel came: nothing left to record, so finalize.
    await _eval(redis, _FINALIZE_ONLY_LUA, _script_keys(keys, batch_id),
                output_file_id(batch_id), error_file_id(batch_id), int(time.time()))


# ---- results -------------------------------------------------------------------------------


def _line_id() -> str:
    return LINE_ID_PREFIX + uuid.uuid4().hex


async def _record_line(redis, keys: Keys, batch_id: str, custom_id: str | None, line: dict,
                       counter: str, *, pending: bool) -> int:
    return await _eval(redis, _RECORD_LUA, _script_keys(keys, batch_id),
                       output_file_id(batch_id), error_file_id(batch_id), int(time.time()),
                       custom_id or "", json.dumps(line, separators=(",", ":")), counter,
                       "1" if pending else "0")


_endpoint_cache: dict[tuple[str, str], str] = {}  # (key prefix, batch id) -> endpoint
_ENDPOINT_CACHE_SIZE = 4096


async def _endpoint(redis, keys: Keys, batch_id: str) -> str | None:
    # A batch's endpoint never changes; workers ask once per batch, not once per job.
    cache_key = (keys.base, batch_id)
    endpoint = _endpoint_cache.get(cache_key)
    if endpoint is None:
        endpoint = _text(await redis.hget(keys.batch(batch_id), "endpoint"))
        if endpoint is not None:
            if len(_endpoint_cache) >= _ENDPOINT_CACHE_SIZE:
                _endpoint_cache.pop(next(iter(_endpoint_cache)))
            _endpoint_cache[cache_key] = endpoint
    return endpoint


def result_line(endpoint: str, job_id: str, custom_id: str | None, result: JobResult
                ) -> tuple[dict, str]:
    """The output or error line of a finished job, and the counter it adds to."""
    if result.succeeded:
        body = result.body
        if endpoint == "/v1/chat/completions":
            body = score_to_chat_completion(body)
        response = {"status_code": 200, "request_id": job_id, "body": body}
        return {"id": _line_id(), "custom_id": custom_id, "response": response,
                "error": None}, "completed"
    error = result.openai_error
    response = {"status_code": result.status_code, "request_id": job_id,
                "body": {"error": error}}
    return {"id": _line_id(), "custom_id": custom_id, "response": response,
            "error": {"code": result.error_code, "message": error["message"]}}, "failed"


async def record_result(redis, keys: Keys, batch_id: str, job_id: str,
                        custom_id: str | None, result: JobResult) -> bool:
    """Add a finished job's line to its batch. Safe to call more than once for the same job
    (only the first call counts) and from many workers at once. Returns True when this call
    recorded the line."""
    endpoint = await _endpoint(redis, keys, batch_id)
    if endpoint is None:
        return False  # the batch expired or never existed
    line, counter = result_line(endpoint, job_id, custom_id, result)
    code = await _record_line(redis, keys, batch_id, custom_id, line, counter, pending=True)
    return code > 0


# ---- enqueueing --------------------------------------------------------------------------


class LineError(Exception):
    """An input line that cannot become a request."""

    def __init__(self, code: str, message: str, *, response: dict | None = None,
                 custom_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.response = response
        self.custom_id = custom_id  # when the line got as far as naming one


def parse_line(text: str, endpoint: str) -> tuple[str, dict]:
    """One input line -> (custom_id, the scoring request to queue). Raises LineError."""
    try:
        line = orjson.loads(text)   # as the API reads a body (api/services.read_json)
    except orjson.JSONDecodeError as err:
        raise LineError("invalid_json", f"the line is not valid JSON: {err.msg}") from None
    if not isinstance(line, dict):
        raise LineError("invalid_line", "the line must be a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_custom_id", "the line needs a non-empty string 'custom_id'")
    try:
        return custom_id, _line_body(line, endpoint)
    except LineError as err:
        err.custom_id = custom_id
        raise


def _line_body(line: dict, endpoint: str) -> dict:
    if line.get("method", "POST") != "POST":
        raise LineError("invalid_method", "'method' must be \"POST\"")
    if line.get("url") != endpoint:
        raise LineError("invalid_url",
                        f"'url' must be the batch's endpoint {endpoint!r}, got {line.get('url')!r}")
    body = line.get("body")
    try:
        if endpoint == "/v1/chat/completions":
            request = score_request_from_chat(body)
        else:
            request = ScoreRequest.parse(body)
    except SpinfError as err:
        response = {"status_code": err.status, "request_id": None, "body": err.to_openai()}
        raise LineError(err.code or "invalid_request", err.message, response=response) from None
    # the worker gets the validated request, without fields only the endpoint knew
    return request.model_dump(mode="json", exclude_none=True)


def _error_line(custom_id: str | None, err: LineError, line_number: int) -> dict:
    return {"id": _line_id(), "custom_id": custom_id, "response": err.response,
            "error": {"code": err.code, "message": err.message, "line": line_number}}


async def _transition(redis, keys: Keys, batch_id: str, from_status: str, **fields) -> bool:
    args = [v for pair in fields.items() for v in pair]
    return await _eval(redis, _TRANSITION_LUA, [keys.batch(batch_id)], from_status, *args) == 1


async def _fail(redis, keys: Keys, batch_id: str, code: str, message: str) -> None:
    errors = {"object": "list",
              "data": [{"code": code, "message": message, "param": "input_file_id",
                        "line": None}]}
    await _transition(redis, keys, batch_id, "validating", status="failed",
                      failed_at=int(time.time()), errors=json.dumps(errors))


async def _enqueue_chunk(redis, keys: Keys, producer, batch_id: str, endpoint: str,
                         chunk: list[tuple[int, str]], seen: set[str]) -> None:
    """Validate lines; invalid ones get their error line, valid ones become bulk jobs after
    their custom_ids join the pending set (so no result can arrive before its id is there)."""
    from .producer import Submission  # the producer's module pulls in more than batches need

    valid: list[tuple[int, str, dict]] = []
    for number, text in chunk:
        try:
            custom_id, body = parse_line(text, endpoint)
            if custom_id in seen:  # the first line with this id is the request
                raise LineError("duplicate_custom_id",
                                "this custom_id already appeared earlier in the file",
                                custom_id=custom_id)
            seen.add(custom_id)
            valid.append((number, custom_id, body))
        except LineError as err:
            await _record_line(redis, keys, batch_id, err.custom_id,
                               _error_line(err.custom_id, err, number), "failed", pending=False)
    if not valid:
        return
    await redis.sadd(keys.batch_pending(batch_id), *[c for _, c, _ in valid])
    submitted = []
    for at in range(0, len(valid), SUBMITS_AT_ONCE):
        submitted += await asyncio.gather(
            *[producer.submit(Submission(request=body, priority="bulk", batch_id=batch_id,
                                         custom_id=custom_id))
              for _, custom_id, body in valid[at:at + SUBMITS_AT_ONCE]],
            return_exceptions=True)
    for (number, custom_id, _), outcome in zip(valid, submitted, strict=True):
        if isinstance(outcome, BaseException):
            err = LineError("enqueue_failed", f"could not queue the request: {outcome}")
            await _record_line(redis, keys, batch_id, custom_id,
                               _error_line(custom_id, err, number), "failed", pending=True)


async def enqueue_batch(redis, keys: Keys, producer, batch_id: str) -> None:
    """Read the batch's input file and submit its lines as bulk jobs (see the module doc).

    ``producer``: a ``spinf_worker.queue.producer.Producer``."""
    batch = await get_batch(redis, keys, batch_id)
    if batch is None:
        return
    content = await files.read_content(redis, keys, batch["input_file_id"])
    if content is None:
        await _fail(redis, keys, batch_id, "file_not_found",
                    f"input file {batch['input_file_id']!r} no longer exists")
        return
    lines = [(number, text) for number, text in enumerate(content.split("\n"), 1)
             if text.strip()]
    del content
    if not lines:
        await _fail(redis, keys, batch_id, "empty_file", "the input file has no lines")
        return
    if not await _transition(redis, keys, batch_id, "validating", status="in_progress",
                             in_progress_at=int(time.time())):
        lines = []  # cancelled before it started: seal empty, then finalize as cancelled

    endpoint = batch["endpoint"]
    seen: set[str] = set()
    processed = 0
    try:
        for start in range(0, len(lines), LINES_PER_CHUNK):
            if _text(await redis.hget(keys.batch(batch_id), "status")) != "in_progress":
                break  # cancelled: stop submitting, drain below
            chunk = lines[start:start + LINES_PER_CHUNK]
            await _enqueue_chunk(redis, keys, producer, batch_id, endpoint, chunk, seen)
            processed += len(chunk)
            await redis.hset(keys.batch(batch_id), "total", processed)
    except Exception as err:
        # Not resumed (module doc): say on the batch where and why queueing stopped.
        line = lines[processed][0] if processed < len(lines) else None
        errors = {"object": "list", "data": [{
            "code": "enqueue_interrupted", "param": "input_file_id", "line": line,
            "message": f"queueing stopped near line {line}: {type(err).__name__}: {err}"}]}
        with contextlib.suppress(Exception):
            await redis.hset(keys.batch(batch_id), "errors", json.dumps(errors))
        raise

    code = await _eval(redis, _SEAL_LUA, _script_keys(keys, batch_id), output_file_id(batch_id),
                       error_file_id(batch_id), int(time.time()), processed)
    if code == 3:
        await drain_cancelled(redis, keys, batch_id)

"""Bulk batches in the shape of the OpenAI Batch API, kept in Redis (no FastAPI here).

Life of a batch (``<base>:batch:<id>`` hash, see docs/QUEUE.md):

- ``create_batch``: status ``validating``, and the batch joins the *queueing* set; the API then
  runs ``enqueue_batch`` in the background, so a huge input file never holds the request.
- ``enqueue_batch``: ``in_progress``; reads the input JSONL in chunks of lines, holding the
  batch's *queuer lease* (a key with a TTL it renews). A valid line becomes a bulk job
  (``batch_id``, ``custom_id``) and its custom_id joins the batch's *pending* set; an invalid
  line (bad JSON, bad body, a request the API's checks refuse (``RequestChecks``: the limits
  the synchronous routes check), a custom_id an earlier line already had, valid or not, url
  other than the endpoint) goes straight to the error list. A chunk is committed by one Lua script:
  job records, stream entries, pending ids, error lines, ``total`` and the progress
  ``queued_line`` (the last input line handled) together, and only while the caller holds the
  lease and ``queued_line`` is still what it started from, so no line is queued twice.
- Backpressure: the script counts the entries in both work streams and takes no more valid
  lines than ``max_backlog`` leaves room for (the stream never holds more than the limit);
  with no room the queuer pauses (``queue_paused_ms`` on the batch) until workers drain some.
- Resuming: every API instance runs a ``QueueKeeper``, which sweeps the queueing set on start
  and every half lease; a batch whose queuer lease has expired (the process died) is taken over
  and queued on from ``queued_line`` (the custom_ids of the lines before it are read again to
  refuse duplicates). The chunk with the last line *seals* the batch and it leaves the set.
- ``record_result`` (``record_results``: many lines of any batches in one script call, as
  workers record a pass's): removes the custom_id from the pending set, appends the
  output or error line, and counts it. The removal is the guard: a job delivered twice
  (at-least-once) or finishing after a cancel is not counted again. Every script keeps
  ``total = completed + failed + |pending|``.
- The call that brings ``completed + failed`` to ``total`` on a sealed batch finalizes it
  inside the same Lua script, so exactly one caller does it however many workers race:
  status ``completed`` (or ``cancelled``), output/error files pointing at the line lists.
- ``cancel_batch``: ``cancelling``; the queuer (or, when it died, whoever takes over) stops,
  seals what was queued, and every custom_id still pending gets a ``batch_cancelled`` error
  line, which finalizes the batch as ``cancelled``. Entries already in the bulk stream are
  still scored by workers; their results are kept on the job records (GET /v1/jobs/<id>) but
  are not added to the batch.

Not done: ``completion_window`` is recorded (``expires_at``) but not enforced.

Error lines: ``error`` is always ``{"code", "message"}`` (plus ``line``, the 1-based input line,
for lines rejected while reading the file). ``response`` is ``null`` for lines that never
became a request (bad JSON, bad line shape, duplicate custom_id, cancelled) and
``{"status_code", "request_id", "body": {"error": ...}}`` for requests that were answered with
an error (invalid body or over a limit: its status, 400 or 413, with ``request_id`` null; a job the worker failed or that expired:
its status with the job id), as OpenAI does.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import structlog
from redis.exceptions import RedisError

from .. import jsonio
from ..completions import CompletionRequest
from ..errors import SpinfError
from ..openai_compat import score_request_from_chat, score_to_chat_completion
from ..protocol import ScoreRequest
from . import files
from .keys import Keys
from .results import JobResult

log = structlog.get_logger("spinf.batches")

BATCH_ID_PREFIX = "batch_"
LINE_ID_PREFIX = "batch_req_"
COMPLETION_WINDOWS = {"24h": 24 * 3600}
TIMESTAMP_FIELDS = ("created_at", "in_progress_at", "expires_at", "finalizing_at",
                    "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")

LINES_PER_CHUNK = 64          # input lines committed together (one script call)
CHUNK_BYTES = 4 << 20         # ... or fewer, so one call stays a few MiB (a longer line: alone)
BACKLOG_POLL_S = 0.2          # a queuer paused by a full backlog looks again this often
ACTIVE = ("validating", "in_progress", "cancelling")

# What the API checks of a request before queueing it (the limits a worker enforces), raising
# the SpinfError its synchronous route answers; asked for once per chunk of lines, since
# what it knows (the served model's tokenizer) may change while a large file is queued.
RequestCheck = Callable[[ScoreRequest | CompletionRequest], None]
RequestChecks = Callable[[], Awaitable[RequestCheck]]


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
            keys.file(output_file_id(batch_id)), keys.file(error_file_id(batch_id)),
            keys.batch_queueing]


# ---- Lua ---------------------------------------------------------------------------------

# Shared by the scripts below: turn a sealed, fully answered batch into its terminal state and
# create the files, in the same atomic step as the write that completed it.
_FINALIZE_LUA = """
local function file_meta(id, bytes, filename, now, ttl)
  return cjson.encode({id = id, object = 'file', bytes = bytes, created_at = now,
                       filename = filename, purpose = 'batch_output',
                       expires_at = now + ttl, status = 'processed'})
end

-- k: the batch's 7 script keys (_script_keys); out_id, err_id: its file ids
local function finalize(k, out_id, err_id, now)
  local f = redis.call('HMGET', k[1], 'status', 'sealed', 'total', 'completed', 'failed',
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
    redis.call('HSET', k[5], 'meta', file_meta(out_id, tonumber(f[8] or '0'),
               id .. '_output.jsonl', now, ttl), 'lines', k[3])
    redis.call('EXPIRE', k[5], ttl)
    table.insert(fields, 'output_file_id'); table.insert(fields, out_id)
  end
  if failed > 0 then
    redis.call('HSET', k[6], 'meta', file_meta(err_id, tonumber(f[9] or '0'),
               id .. '_errors.jsonl', now, ttl), 'lines', k[4])
    redis.call('EXPIRE', k[6], ttl)
    table.insert(fields, 'error_file_id'); table.insert(fields, err_id)
  end
  redis.call('HSET', k[1], unpack(fields))
  redis.call('DEL', k[2])
  redis.call('SREM', k[7], id)
  for _, key in ipairs({k[1], k[3], k[4]}) do redis.call('EXPIRE', key, ttl) end
  return 2
end

local function try_finalize(now) return finalize(KEYS, ARGV[1], ARGV[2], now) end

-- One line of a batch (k, out_id, err_id: as finalize's). counter: 'completed' | 'failed';
-- check_pending '1': only if custom_id is still pending. Returns -1 no such batch, 0 not
-- pending (duplicate or cancelled), 1 recorded, 2 finalized.
local function record(k, out_id, err_id, now, custom_id, line, counter, check_pending)
  if redis.call('EXISTS', k[1]) == 0 then return -1 end
  if check_pending == '1' and redis.call('SREM', k[2], custom_id) == 0 then return 0 end
  local list = (counter == 'completed') and k[3] or k[4]
  redis.call('RPUSH', list, line)
  redis.call('EXPIRE', list, tonumber(redis.call('HGET', k[1], 'ttl_s')))
  redis.call('HINCRBY', k[1], counter, 1)
  redis.call('HINCRBY', k[1], counter .. '_bytes', string.len(line) + 1)
  return finalize(k, out_id, err_id, now)
end
"""

# ARGV: out file id, err file id, now, custom_id, line, counter ('completed' | 'failed'),
#       check_pending ('1': only if custom_id is still pending)
# Returns -1 no such batch, 0 not pending (duplicate or cancelled), 1 recorded, 2 finalized.
_RECORD_LUA = _FINALIZE_LUA + """
return record(KEYS, ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6], ARGV[7])
"""

# Many lines, of any batches, in one call (a worker's pass): each as _RECORD_LUA with its
# custom_id still pending, then, when it names one, its work entry acked and deleted, so an
# entry is acked only once its line is in (a failing call leaves the rest pending).
# KEYS: per line the batch's 7 script keys and the entry's stream (the batch key: none).
# ARGV: now, the consumer group, then per line out file id, err file id, custom_id, line,
#       counter, entry id ('': none). Returns each line's _RECORD_LUA code.
_RECORD_MANY_LUA = _FINALIZE_LUA + """
local now, codes = tonumber(ARGV[1]), {}
for i = 0, #KEYS / 8 - 1 do
  local k, a = {unpack(KEYS, 8 * i + 1, 8 * i + 8)}, 3 + 6 * i
  codes[i + 1] = record(k, ARGV[a], ARGV[a + 1], now, ARGV[a + 2], ARGV[a + 3], ARGV[a + 4],
                        '1')
  if ARGV[a + 5] ~= '' then
    redis.call('XACK', k[8], ARGV[2], ARGV[a + 5])
    redis.call('XDEL', k[8], ARGV[a + 5])
  end
end
return codes
"""

# Commits one chunk of input lines (see the module doc). KEYS: the 7 script keys, then the
# lease, the two work streams, then one job hash per valid line.
# ARGV: out file id, err file id, now (s), now (ms), lease token, lease ms, queued_line read,
#       queued_line after the chunk, seal ('1' | '0'), max backlog, job ttl, n valid lines,
#       then n x (job id, custom_id, payload, model or ''), then the error lines.
# Returns {code, room}: 1 committed, 2 committed and finalized, 3 sealed while cancelling (the
# caller drains), -1 no such batch, -2 lease or progress taken by another queuer (or sealed),
# -4 not in progress (cancelled: seal what was queued), -5 no room for the valid lines (room;
# none at all: queue_paused_ms is set, until a commit goes through).
_COMMIT_LUA = _FINALIZE_LUA + """
local owner = redis.call('GET', KEYS[8])
if owner and owner ~= ARGV[5] then return {-2, 0} end
local f = redis.call('HMGET', KEYS[1], 'status', 'sealed', 'queued_line', 'id', 'ttl_s',
                     'tenant')
if not f[1] then return {-1, 0} end
-- a lapsed lease nobody took yet is taken back; the progress check keeps the order
redis.call('SET', KEYS[8], ARGV[5], 'PX', ARGV[6])
if f[2] == '1' then return {-2, 0} end
local progress = tonumber(f[3] or '0')
if progress ~= tonumber(ARGV[7]) then
  -- this same commit, run already: the client repeated it after losing the reply
  if owner == ARGV[5] and progress == tonumber(ARGV[8]) then return {1, 0} end
  return {-2, 0}
end
local n = tonumber(ARGV[12])
local first_err = 13 + 4 * n
local adding = #ARGV >= 13
if f[1] ~= 'in_progress' and (adding or f[1] ~= 'cancelling') then return {-4, 0} end
if n > 0 then
  local room = tonumber(ARGV[10]) - redis.call('XLEN', KEYS[9]) - redis.call('XLEN', KEYS[10])
  if room < n then
    if room <= 0 then redis.call('HSET', KEYS[1], 'queue_paused_ms', ARGV[4]) end
    return {-5, room}
  end
end
local batch_id, ttl = f[4], tonumber(f[5])
local ids = {}
for i = 0, n - 1 do
  local a = 13 + 4 * i
  local job = {'status', 'queued', 'created_at', ARGV[3], 'priority', 'bulk',
               'batch_id', batch_id, 'custom_id', ARGV[a + 1]}
  if ARGV[a + 3] ~= '' then table.insert(job, 'model'); table.insert(job, ARGV[a + 3]) end
  if f[6] then table.insert(job, 'tenant'); table.insert(job, f[6]) end  -- the batch's
  -- as Producer.submit writes a job: the hash first, then its entry
  redis.call('HSET', KEYS[11 + i], unpack(job))
  redis.call('EXPIRE', KEYS[11 + i], ARGV[11])
  redis.call('XADD', KEYS[10], '*', 'job', ARGV[a], 'payload', ARGV[a + 2],
             'enqueued_ms', ARGV[4], 'batch', batch_id, 'custom_id', ARGV[a + 1])
  ids[#ids + 1] = ARGV[a + 1]
end
if n > 0 then redis.call('SADD', KEYS[2], unpack(ids)) end
local errors, bytes = 0, 0
for i = first_err, #ARGV do
  redis.call('RPUSH', KEYS[4], ARGV[i])
  errors = errors + 1
  bytes = bytes + string.len(ARGV[i]) + 1
end
if errors > 0 then
  redis.call('EXPIRE', KEYS[4], ttl)
  redis.call('HINCRBY', KEYS[1], 'failed', errors)
  redis.call('HINCRBY', KEYS[1], 'failed_bytes', bytes)
end
redis.call('HINCRBY', KEYS[1], 'total', n + errors)
redis.call('HSET', KEYS[1], 'queued_line', ARGV[8])
redis.call('HDEL', KEYS[1], 'queue_paused_ms')
if ARGV[9] ~= '1' then return {1, 0} end
redis.call('HSET', KEYS[1], 'sealed', '1')
if try_finalize(tonumber(ARGV[3])) == 2 then return {2, 0} end
if f[1] == 'cancelling' then return {3, 0} end
redis.call('SREM', KEYS[7], batch_id)
return {1, 0}
"""

# ARGV: token, lease ms. Renews the lease (taking it back when it lapsed and nobody took it);
# 0 when another queuer holds it.
_RENEW_LUA = """
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# ARGV: token.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""

# ARGV: out file id, err file id, now. Returns the try_finalize code (-1 without the batch).
_FINALIZE_ONLY_LUA = _FINALIZE_LUA + """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
return try_finalize(tonumber(ARGV[3]))
"""

# KEYS: batch, queueing set. ARGV: now, batch id. Returns -1 no such batch, 0 not
# cancellable, 1 cancelling (the queuer drains when it seals), 2 cancelling and sealed (the
# caller drains; the batch is back in the queueing set, so a keeper drains should it stop).
_CANCEL_LUA = """
local f = redis.call('HMGET', KEYS[1], 'status', 'sealed')
if not f[1] then return -1 end
if f[1] == 'validating' or f[1] == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
elseif f[1] ~= 'cancelling' then
  return 0
end
if f[2] == '1' then
  redis.call('SADD', KEYS[2], ARGV[2])
  return 2
end
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
        pipe.sadd(keys.batch_queueing, batch_id)   # until sealed: a keeper resumes it
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
    the caller must run ``drain_cancelled`` (otherwise its queuer drains when it stops, or the
    keeper that takes over from a queuer that died)."""
    code = await _eval(redis, _CANCEL_LUA, [keys.batch(batch_id), keys.batch_queueing],
                       int(time.time()), batch_id)
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
                       custom_id or "", jsonio.dumps(line), counter, "1" if pending else "0")


_endpoint_cache: dict[tuple[str, str], str] = {}  # (key prefix, batch id) -> endpoint
_ENDPOINT_CACHE_SIZE = 4096


async def _endpoints(redis, keys: Keys, batch_ids: set[str]) -> dict[str, str | None]:
    """Each batch's endpoint (None: no such batch). A batch's endpoint never changes, so
    workers ask once per batch, not once per job; those not known yet in one round trip."""
    found = {b: _endpoint_cache.get((keys.base, b)) for b in batch_ids}
    missing = [b for b, endpoint in found.items() if endpoint is None]
    if missing:
        async with redis.pipeline(transaction=False) as pipe:
            for batch_id in missing:
                pipe.hget(keys.batch(batch_id), "endpoint")
            for batch_id, endpoint in zip(missing, await pipe.execute(), strict=True):
                found[batch_id] = endpoint = _text(endpoint)
                if endpoint is not None:
                    if len(_endpoint_cache) >= _ENDPOINT_CACHE_SIZE:
                        _endpoint_cache.pop(next(iter(_endpoint_cache)))
                    _endpoint_cache[(keys.base, batch_id)] = endpoint
    return found


def result_line(endpoint: str, job_id: str, custom_id: str | None, result: JobResult,
                body_json: bytes | None = None) -> tuple[dict, str]:
    """The output or error line of a finished job, and the counter it adds to;
    ``body_json``: the result's body written already (JobResult.body_json)."""
    if result.succeeded:
        body = result.body
        if endpoint == "/v1/chat/completions":
            body = score_to_chat_completion(body)
        elif body_json is not None:
            body = jsonio.RawJSON(body_json)
        response = {"status_code": 200, "request_id": job_id, "body": body}
        return {"id": _line_id(), "custom_id": custom_id, "response": response,
                "error": None}, "completed"
    error = result.openai_error
    response = {"status_code": result.status_code, "request_id": job_id,
                "body": {"error": error}}
    return {"id": _line_id(), "custom_id": custom_id, "response": response,
            "error": {"code": result.error_code, "message": error["message"]}}, "failed"


@dataclass(frozen=True)
class Finished:
    """A finished job of a batch, to record; ``ack``: its work entry (stream, entry id), acked
    and deleted once the line is in."""

    batch_id: str
    job_id: str
    custom_id: str | None
    result: JobResult
    ack: tuple[str, str] | None = None
    body_json: bytes | None = None   # the result's body written already (JobResult.body_json)


@dataclass
class RecordCall:
    """One script call recording many lines (``_RECORD_MANY_LUA``): run it with ``run``, or
    queue it on a pipeline of one's own with ``queue``."""

    keys: list[str]
    args: list[Any]

    def queue(self, pipe) -> None:
        pipe.eval(_RECORD_MANY_LUA, len(self.keys), *self.keys, *self.args)

    async def run(self, redis) -> list[int]:
        return [int(c) for c in await redis.eval(_RECORD_MANY_LUA, len(self.keys), *self.keys,
                                                 *self.args)]


async def record_call(redis, keys: Keys, jobs: list[Finished], group: str = ""
                      ) -> tuple[RecordCall, list[Finished], list[Finished]]:
    """The call recording the lines of ``jobs`` (record_result's, each), those it records and
    those of batches that no longer exist (nothing to record; their entries, if any, are for
    the caller to ack). ``group``: the consumer group of the entries to ack. The only round
    trip is for the endpoints of batches not seen before."""
    endpoints = await _endpoints(redis, keys, {job.batch_id for job in jobs})
    call, recorded, gone = RecordCall([], [int(time.time()), group]), [], []
    for job in jobs:
        endpoint = endpoints[job.batch_id]
        if endpoint is None:
            gone.append(job)   # the batch expired or never existed
            continue
        line, counter = result_line(endpoint, job.job_id, job.custom_id, job.result,
                                    job.body_json)
        stream, entry_id = job.ack or (keys.batch(job.batch_id), "")
        call.keys += [*_script_keys(keys, job.batch_id), stream]
        call.args += [output_file_id(job.batch_id), error_file_id(job.batch_id),
                      job.custom_id or "", jsonio.dumps(line), counter, entry_id]
        recorded.append(job)
    return call, recorded, gone


async def record_results(redis, keys: Keys, jobs: list[Finished], group: str = ""
                         ) -> list[bool]:
    """``record_result`` of many jobs, of any batches, in one script call: per job whether
    this call recorded its line."""
    call, recorded, gone = await record_call(redis, keys, jobs, group)
    codes = iter(await call.run(redis) if recorded else [])
    missing = {job.batch_id for job in gone}   # the lines in the call are the others, in order
    return [job.batch_id not in missing and next(codes) > 0 for job in jobs]


async def record_result(redis, keys: Keys, batch_id: str, job_id: str,
                        custom_id: str | None, result: JobResult) -> bool:
    """Add a finished job's line to its batch. Safe to call more than once for the same job
    (only the first call counts) and from many workers at once. Returns True when this call
    recorded the line."""
    endpoint = (await _endpoints(redis, keys, {batch_id}))[batch_id]
    if endpoint is None:
        return False  # the batch expired or never existed
    line, counter = result_line(endpoint, job_id, custom_id, result)
    code = await _record_line(redis, keys, batch_id, custom_id, line, counter, pending=True)
    return code > 0


# ---- queueing ----------------------------------------------------------------------------


class LineError(Exception):
    """An input line that cannot become a request."""

    def __init__(self, code: str, message: str, *, response: dict | None = None,
                 custom_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.response = response
        self.custom_id = custom_id  # when the line got as far as naming one


def parse_line(text: str, endpoint: str, check: RequestCheck | None = None
               ) -> tuple[str, dict]:
    """One input line -> (custom_id, the request to queue: a scoring request, or a completion
    as POST /v1/completions queues it), the request passing ``check``. Raises LineError."""
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
        return custom_id, _line_body(line, endpoint, check)
    except LineError as err:
        err.custom_id = custom_id
        raise


def _custom_id_of(text: str) -> str | None:
    """The custom_id ``parse_line`` finds on a line, valid or not (None: the line has none)."""
    try:
        line = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    custom_id = line.get("custom_id") if isinstance(line, dict) else None
    return custom_id if isinstance(custom_id, str) and custom_id else None


def _line_body(line: dict, endpoint: str, check: RequestCheck | None) -> dict:
    if line.get("method", "POST") != "POST":
        raise LineError("invalid_method", "'method' must be \"POST\"")
    if line.get("url") != endpoint:
        raise LineError("invalid_url",
                        f"'url' must be the batch's endpoint {endpoint!r}, got {line.get('url')!r}")
    body = line.get("body")
    try:
        # the line was read by orjson (parse_line)
        if endpoint == "/v1/chat/completions":
            request = score_request_from_chat(body, read_by_orjson=True)
        elif endpoint == "/v1/completions":
            request = CompletionRequest.parse(body)
        else:
            request = ScoreRequest.parse(body, read_by_orjson=True)
        if check is not None:
            check(request)
    except SpinfError as err:
        response = {"status_code": err.status, "request_id": None, "body": err.to_openai()}
        raise LineError(err.code or "invalid_request", err.message, response=response) from None
    if isinstance(request, CompletionRequest):   # queued as POST /v1/completions queues it
        return {"model": request.model, "completion": request.model_dump(mode="json")}
    # the worker gets the validated request, without fields only the endpoint knew
    return request.model_dump(mode="json", exclude_none=True)


def _error_line(custom_id: str | None, err: LineError, line_number: int) -> dict:
    return {"id": _line_id(), "custom_id": custom_id, "response": err.response,
            "error": {"code": err.code, "message": err.message, "line": line_number}}


@dataclass
class _Line:
    """An input line, validated: a request to queue (``payload``) or an error line."""

    number: int
    custom_id: str | None
    payload: bytes | None = None    # the request as JSON
    model: str | None = None
    error: bytes | None = None      # the error line as JSON

    @property
    def size(self) -> int:
        return len(self.payload or self.error or b"")


def _validate(number: int, text: str, endpoint: str, seen: set[str],
              check: RequestCheck | None = None) -> _Line:
    """Parse one line; ``seen`` (the custom_ids of the lines before it) gains its custom_id."""
    error: LineError | None = None
    try:
        custom_id, body = parse_line(text, endpoint, check)
    except LineError as err:
        error, custom_id = err, err.custom_id
    if custom_id is not None:
        # an id an earlier line had, valid or not, is refused: the first line is its request
        if custom_id in seen:
            error = LineError("duplicate_custom_id",
                              "this custom_id already appeared earlier in the file")
        seen.add(custom_id)
    if error is not None:
        return _Line(number, custom_id, error=jsonio.dumps(_error_line(custom_id, error, number)))
    return _Line(number, custom_id, payload=jsonio.dumps(body), model=body.get("model"))


def _fill(chunk: list[_Line], lines: list[tuple[int, str]], at: int, endpoint: str,
          seen: set[str], check: RequestCheck | None) -> int:
    """Validate lines from ``at`` into ``chunk`` up to a chunk's lines or bytes; the next
    line's index."""
    size = sum(line.size for line in chunk)
    while at < len(lines) and len(chunk) < LINES_PER_CHUNK and size < CHUNK_BYTES:
        chunk.append(_validate(*lines[at], endpoint, seen, check))
        size += chunk[-1].size
        at += 1
    return at


def _fitting(chunk: list[_Line], room: int) -> int:
    """How many lines of ``chunk`` go in with at most ``room`` valid ones among them."""
    valid = 0
    for at, line in enumerate(chunk):
        if line.payload is not None:
            if valid == room:
                return at
            valid += 1
    return len(chunk)


async def _transition(redis, keys: Keys, batch_id: str, from_status: str, **fields) -> bool:
    args = [v for pair in fields.items() for v in pair]
    return await _eval(redis, _TRANSITION_LUA, [keys.batch(batch_id)], from_status, *args) == 1


async def _fail(redis, keys: Keys, batch_id: str, code: str, message: str) -> bool:
    """A batch still ``validating`` -> ``failed``; False when it was no longer validating."""
    errors = {"object": "list",
              "data": [{"code": code, "message": message, "param": "input_file_id",
                        "line": None}]}
    failed = await _transition(redis, keys, batch_id, "validating", status="failed",
                               failed_at=int(time.time()), errors=json.dumps(errors))
    if failed:
        await redis.srem(keys.batch_queueing, batch_id)
    return failed


# _COMMIT_LUA's codes
COMMITTED, FINALIZED, DRAIN, MISSING, TAKEN, STOPPED, FULL = 1, 2, 3, -1, -2, -4, -5


class _Queuer:
    """Queues one batch's input under its lease (``enqueue_batch``)."""

    def __init__(self, redis, keys: Keys, settings, batch_id: str, token: str,
                 checks: RequestChecks | None = None):
        self.redis, self.keys, self.batch_id, self.token = redis, keys, batch_id, token
        self.checks = checks
        self.lease_ms = max(1, int(settings.batch_lease_s * 1000))
        self.job_ttl_s = settings.result_ttl_s
        self.limit = max(1, settings.max_backlog)   # an empty queue always takes a line
        self.queued_line = 0

    async def run(self) -> None:
        keys, batch_id = self.keys, self.batch_id
        fields = {_text(k): _text(v)
                  for k, v in (await self.redis.hgetall(keys.batch(batch_id))).items()}
        status = fields.get("status")
        if status not in ACTIVE:           # expired, or finished meanwhile
            await self.redis.srem(keys.batch_queueing, batch_id)
            return
        if fields.get("sealed") == "1":    # all queued; a cancel whose drain did not finish
            if status == "cancelling":
                await drain_cancelled(self.redis, keys, batch_id)
            else:
                await self.redis.srem(keys.batch_queueing, batch_id)
            return
        self.queued_line = int(fields.get("queued_line") or 0)
        content = await files.read_content(self.redis, keys, fields["input_file_id"])
        if content is None:
            if await _fail(self.redis, keys, batch_id, "file_not_found",
                           f"input file {fields['input_file_id']!r} no longer exists"):
                return
            lines = []   # it expired while queueing: seal what was queued
        else:
            lines = [(number, text) for number, text in enumerate(content.split("\n"), 1)
                     if text.strip()]
        del content
        if status == "validating":
            if not lines and await _fail(self.redis, keys, batch_id, "empty_file",
                                         "the input file has no lines"):
                return
            # not moved when cancelled meanwhile: the first commit then stops and seals
            await _transition(self.redis, keys, batch_id, "validating", status="in_progress",
                              in_progress_at=int(time.time()))
        # resuming: the lines up to queued_line are queued; their custom_ids are taken
        at = bisect.bisect_right(lines, self.queued_line, key=lambda line: line[0])
        seen = {c for _, text in lines[:at] if (c := _custom_id_of(text)) is not None}
        await self._queue(lines, at, fields["endpoint"], seen)

    async def _queue(self, lines: list[tuple[int, str]], at: int, endpoint: str,
                     seen: set[str]) -> None:
        chunk: list[_Line] = []   # validated, not committed yet
        room: int | None = None   # the room the last refusal reported
        stopping = False          # cancelled: seal what was queued
        while True:
            if not stopping and at < len(lines) and len(chunk) < LINES_PER_CHUNK:
                check = await self.checks() if self.checks is not None else None
                # on a thread: parsing and counting tokens would hold up the API's loop
                at = await asyncio.to_thread(_fill, chunk, lines, at, endpoint, seen, check)
            take = 0 if stopping else _fitting(chunk, room) if room is not None else len(chunk)
            part = chunk[:take]
            code, room = await self._commit(
                part, seal=stopping or (at == len(lines) and take == len(chunk)))
            if code == FULL:
                if room <= 0:
                    await self._wait_for_room()
                    room = None
                continue
            room = None
            if code == COMMITTED and (stopping or at < len(lines) or take < len(chunk)):
                del chunk[:take]
                continue
            if code == STOPPED and not stopping:
                stopping = True
                continue
            if code == DRAIN:
                await drain_cancelled(self.redis, self.keys, self.batch_id)
            return   # sealed (and maybe finalized), stopped, taken over or gone

    async def _commit(self, part: list[_Line], *, seal: bool) -> tuple[int, int]:
        from .producer import new_job_id  # the producer's module pulls in more than we need

        keys, batch_id = self.keys, self.batch_id
        valid = [line for line in part if line.payload is not None]
        job_ids = [new_job_id() for _ in valid]
        after = part[-1].number if part else self.queued_line
        now = time.time()
        args: list[Any] = [output_file_id(batch_id), error_file_id(batch_id), int(now),
                           int(now * 1000), self.token, self.lease_ms, self.queued_line, after,
                           "1" if seal else "0", self.limit, self.job_ttl_s, len(valid)]
        for job_id, line in zip(job_ids, valid, strict=True):
            args += [job_id, line.custom_id, line.payload, line.model or ""]
        args += [line.error for line in part if line.payload is None]
        script_keys = [*_script_keys(keys, batch_id), keys.batch_queuer(batch_id),
                       keys.interactive, keys.bulk, *[keys.job(j) for j in job_ids]]
        code, room = await self.redis.eval(_COMMIT_LUA, len(script_keys), *script_keys, *args)
        if int(code) in (COMMITTED, FINALIZED, DRAIN):
            self.queued_line = after
        return int(code), int(room)

    async def _wait_for_room(self) -> None:
        """Paused: until the backlog is under the limit, the batch is no longer in progress,
        or the lease is lost (then the next commit says so)."""
        key = self.keys.batch(self.batch_id)
        while True:
            await asyncio.sleep(BACKLOG_POLL_S)
            if not await self._renew():
                return
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xlen(self.keys.interactive)
                pipe.xlen(self.keys.bulk)
                pipe.hget(key, "status")
                interactive, bulk, status = await pipe.execute()
            if interactive + bulk < self.limit or _text(status) != "in_progress":
                return

    async def _renew(self) -> bool:
        return await _eval(self.redis, _RENEW_LUA, [self.keys.batch_queuer(self.batch_id)],
                           self.token, self.lease_ms) == 1


async def enqueue_batch(redis, keys: Keys, producer, batch_id: str,
                        checks: RequestChecks | None = None) -> None:
    """Queue the batch's input file as bulk jobs (see the module doc), from where queueing
    stopped when it was begun before. Returns at once when another process holds the lease.

    ``producer``: a ``spinf_worker.queue.producer.Producer`` (its settings: the lease, the
    backlog limit, the job records' TTL). ``checks``: the API's checks of each line's
    request; a line refused by them is an error line, never queued."""
    settings = producer.settings
    token = uuid.uuid4().hex
    lease = keys.batch_queuer(batch_id)
    if not await redis.set(lease, token, nx=True, px=max(1, int(settings.batch_lease_s * 1000))):
        return
    try:
        await _Queuer(redis, keys, settings, batch_id, token, checks).run()
    finally:
        # stopped for whatever reason: another instance may take over at once
        with contextlib.suppress(RedisError):
            await _eval(redis, _RELEASE_LUA, [lease], token)


class QueueKeeper:
    """Finishes what a dead queuer left: every ``batch_lease_s / 2`` (and on start) it looks
    at the batches in the queueing set and runs ``enqueue_batch`` for those whose lease has
    lapsed (queueing on from ``queued_line``, or the drain of a cancel). One per API process;
    several keepers race harmlessly (the lease decides)."""

    def __init__(self, redis, keys: Keys, producer, checks: RequestChecks | None = None):
        self.redis, self.keys, self.producer, self.checks = redis, keys, producer, checks
        self.interval_s = max(0.05, producer.settings.batch_lease_s / 2)
        self._task: asyncio.Task | None = None
        self._resuming: dict[str, asyncio.Task] = {}

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="batch-keeper")

    async def stop(self) -> None:
        """Stop sweeping and stop the queueing it resumed (its leases are released, so the
        next keeper takes over at once)."""
        tasks = [t for t in (self._task, *self._resuming.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self.sweep()
            except RedisError as err:
                log.warning("batch keeper sweep failed", error=str(err))
            except Exception:   # a bug must not end the sweeps of this process for good
                log.exception("batch keeper sweep failed")
            await asyncio.sleep(self.interval_s)

    async def sweep(self) -> int:
        """Start resuming the batches no live queuer holds; returns how many it started."""
        started = 0
        for batch_id in [_text(b) for b in await self.redis.smembers(self.keys.batch_queueing)]:
            if batch_id in self._resuming or await self.redis.exists(
                    self.keys.batch_queuer(batch_id)):
                continue
            task = asyncio.create_task(
                enqueue_batch(self.redis, self.keys, self.producer, batch_id, self.checks),
                name=f"resume-{batch_id}")
            self._resuming[batch_id] = task
            task.add_done_callback(lambda t, b=batch_id: self._done(b, t))
            started += 1
        return started

    def _done(self, batch_id: str, task: asyncio.Task) -> None:
        self._resuming.pop(batch_id, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("resuming a batch failed", batch=batch_id, error=repr(task.exception()))
        elif not task.cancelled():
            log.info("batch queueing resumed", batch=batch_id)

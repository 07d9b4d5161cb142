"""A pass's job records and results written by one script call each (docs/QUEUE.md).

A pass of a small model answers tens of entries many times a second, and every Redis command
queued on a pipeline costs the worker's event loop its packing and its reply's parsing, time
taken from the engine thread beside it (one interpreter lock). So the per-entry commands of
a pass (its results, job records, statistics, reply notifications and callback entries) go
as the arguments of one script call: the same writes, in the same order, as one step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .keys import Keys
from .results import JobResult

# KEYS: the job records. ARGV: started_at, worker.
_RUNNING_LUA = """
for i = 1, #KEYS do
  redis.call('HSET', KEYS[i], 'status', 'running', 'started_at', ARGV[1], 'worker', ARGV[2])
end
return #KEYS
"""

# KEYS: the stats hash, the callbacks stream, then 3 per answer: its result, its job record,
#       its reply stream (the job record again when it has none).
# ARGV: finished_at, job ttl, reply maxlen, reply ttl, n stats, n x (name, value, 'f' | 'i'),
#       then 6 per answer: job id, result ('' when stored already: a re-delivery, only told
#       again), result ttl, status, error ('' none), reply and callback flags ('r', 'c', 'rc').
_STORE_LUA = """
local finished_at, job_ttl, maxlen, reply_ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local n = tonumber(ARGV[5])
local first = 6 + 3 * n
local answers = (#KEYS - 2) / 3
for i = 0, answers - 1 do
  local k, a = 3 + 3 * i, first + 6 * i
  if ARGV[a + 1] ~= '' then
    redis.call('SET', KEYS[k], ARGV[a + 1], 'EX', ARGV[a + 2])
    if ARGV[a + 4] ~= '' then
      redis.call('HSET', KEYS[k + 1], 'status', ARGV[a + 3], 'finished_at', finished_at,
                 'error', ARGV[a + 4])
    else
      redis.call('HSET', KEYS[k + 1], 'status', ARGV[a + 3], 'finished_at', finished_at)
    end
    redis.call('EXPIRE', KEYS[k + 1], job_ttl)
  end
end
for i = 0, n - 1 do
  local a = 6 + 3 * i
  if ARGV[a + 2] == 'f' then
    redis.call('HINCRBYFLOAT', KEYS[1], ARGV[a], ARGV[a + 1])
  else
    redis.call('HINCRBY', KEYS[1], ARGV[a], ARGV[a + 1])
  end
end
for i = 0, answers - 1 do
  local k, a = 3 + 3 * i, first + 6 * i
  local tell = ARGV[a + 5]
  if string.find(tell, 'r', 1, true) then
    redis.call('XADD', KEYS[k + 2], 'MAXLEN', '~', maxlen, '*', 'job', ARGV[a])
    redis.call('EXPIRE', KEYS[k + 2], reply_ttl)
  end
  if string.find(tell, 'c', 1, true) then
    redis.call('XADD', KEYS[2], '*', 'job', ARGV[a])
  end
end
return answers
"""


async def mark_running(redis, keys: Keys, jobs: list[str], started_at: int, worker: str
                       ) -> None:
    """The job records of ``jobs`` say "running" (written while the pass runs, before its
    results)."""
    await redis.eval(_RUNNING_LUA, len(jobs), *(keys.job(job) for job in jobs), started_at,
                     worker)


@dataclass(frozen=True)
class Answer:
    """One job's outcome to write: ``status`` None when its result is stored already (a
    re-delivery after a crash), then it is only told again."""

    job: str
    result: JobResult
    status: str | None
    result_ttl: int
    reply: str | None = None       # the reply stream of the API instance waiting for it
    callback: bool = False
    body_json: bytes | None = None   # the result's body written already (JobResult.body_json)


@dataclass
class StoreCall:
    """The script call writing a pass's answers and statistics (``_STORE_LUA``)."""

    keys: list[str]
    args: list

    @classmethod
    def of(cls, keys: Keys, answers: list[Answer], stats: dict[str, int | float], *,
           finished_at: int, job_ttl: int, reply_maxlen: int, reply_ttl: int) -> StoreCall:
        call = cls([keys.stats, keys.callbacks],
                   [finished_at, job_ttl, reply_maxlen, reply_ttl, len(stats)])
        for name, value in stats.items():
            call.args += [name, value, "f" if isinstance(value, float) else "i"]
        for answer in answers:
            job_key = keys.job(answer.job)
            call.keys += [keys.result(answer.job), job_key, answer.reply or job_key]
            stored = answer.status is not None
            error = answer.result.error
            call.args += [answer.job, answer.result.to_bytes(answer.body_json) if stored else "",
                          answer.result_ttl, answer.status or "",
                          json.dumps(error) if stored and error is not None else "",
                          ("r" if answer.reply else "") + ("c" if answer.callback else "")]
        return call

    def queue(self, pipe) -> None:
        pipe.eval(_STORE_LUA, len(self.keys), *self.keys, *self.args)

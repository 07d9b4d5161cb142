"""Redis key names (docs/QUEUE.md). One hash tag, so Redis Cluster keeps them in one slot."""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "workers"
DISPATCHERS = "dispatchers"


@dataclass(frozen=True)
class Keys:
    prefix: str = "spinf"

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{q}}"

    @property
    def interactive(self) -> str:
        return f"{self.base}:jobs:interactive"

    @property
    def bulk(self) -> str:
        return f"{self.base}:jobs:bulk"

    @property
    def streams(self) -> tuple[str, str]:
        """Work streams, in the order workers read them."""
        return (self.interactive, self.bulk)

    @property
    def dead(self) -> str:
        return f"{self.base}:dead"

    @property
    def workers(self) -> str:
        return f"{self.base}:workers"

    @property
    def stats(self) -> str:
        return f"{self.base}:stats"

    @property
    def callbacks(self) -> str:
        return f"{self.base}:callbacks"

    @property
    def callback_retry(self) -> str:
        """Sorted set: job id -> due time (ms) of its next callback attempt."""
        return f"{self.base}:callbacks:retry"

    @property
    def batch_index(self) -> str:
        """Sorted set of batch ids by creation time (ms), for listing newest first."""
        return f"{self.base}:batches"

    def batch_pending(self, batch_id: str) -> str:
        """Set of a batch's custom_ids submitted and not yet answered."""
        return f"{self.batch(batch_id)}:pending"

    @property
    def batch_queueing(self) -> str:
        """Set of batch ids whose input is not all queued yet (or whose cancel is not drained)."""
        return f"{self.base}:batches:queueing"

    def batch_queuer(self, batch_id: str) -> str:
        """String (PX): the lease token of the process queueing the batch's input."""
        return f"{self.batch(batch_id)}:queuer"

    def job(self, job_id: str) -> str:
        return f"{self.base}:job:{job_id}"

    def result(self, job_id: str) -> str:
        return f"{self.base}:result:{job_id}"

    def reply(self, instance: str) -> str:
        return f"{self.base}:reply:{instance}"

    def idempotency(self, key: str) -> str:
        return f"{self.base}:idem:{key}"

    def tenant_idempotency(self, tenant: str, key: str) -> str:
        """A tenant's Idempotency-Key -> "<job id> <body digest>" (a tenant name has no ':',
        so no tenant's keys meet another's, or those of jobs of no tenant)."""
        return f"{self.base}:tenant:{tenant}:idem:{key}"

    def tenant_batch_index(self, tenant: str) -> str:
        """Sorted set of one tenant's batch ids by creation time (ms), as batch_index."""
        return f"{self.base}:tenant:{tenant}:batches"

    def batch(self, batch_id: str) -> str:
        return f"{self.base}:batch:{batch_id}"

    def batch_lines(self, batch_id: str, kind: str) -> str:
        """kind: "out" or "err"."""
        return f"{self.base}:batch:{batch_id}:{kind}"

    def file(self, file_id: str) -> str:
        return f"{self.base}:file:{file_id}"

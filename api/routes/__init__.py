"""HTTP routes, one small module per resource. Every /v1 router carries the API key check
(auth.V1_AUTH); the operations routes stay open.

Each router has its full path as its own prefix (no nested prefixes), so a request's matched
route knows its whole template, which the request metrics use as their label."""

from . import batches, catalog, completions, files, jobs, ops, packs, scoring

ROUTERS = (ops.router, scoring.router, completions.router, jobs.router, catalog.router,
           files.router, batches.router, packs.router)

__all__ = ["ROUTERS"]

"""``spinf-serve ingest``: a long-running consumer that follows news sources (RSS/Atom feeds,
JSONL files, a Redis stream), de-duplicates their items, submits each to the bulk work stream
with a prompt pack and/or queries, and writes every result once to its sinks (docs/INGEST.md).

- ``config.py``  the YAML file and flags, validated (precise errors)
- ``sources.py`` feeds over HTTP (conditional GET, backoff), JSONL files, a Redis stream
- ``pages.py``   optional fetch of an item's page and main-text extraction
- ``state.py``   Redis keys and records: seen items, pending items, sink intents, lease
- ``sinks.py``   JSONL file, Redis stream, signed webhook
- ``consumer.py`` the loop: poll, claim, submit, wait, sink; restart-safe
- ``metrics.py`` prometheus-client counters and gauges of the ingest process
- ``run.py``     the command: embedded Redis + worker, or join a deployment

Nothing here imports torch: the scoring runs in the service's workers.
"""

"""Typed settings of the service, from SPINF_* environment variables.

Every field carries its description: docs/reference/configuration.md is generated from them
(scripts/docs_reference.py), and a test fails when a field is undocumented."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPINF_", extra="ignore")

    redis_url: str | None = Field(
        None, description="Redis URL of the deployment. None: `serve` and `ingest` start a "
                          "private redis-server; `api`, `worker` and `dispatcher` need one.")
    prefix: str = Field("spinf", description="key prefix: every key is `<prefix>:{q}:...` "
                                             "(one Redis Cluster slot)")
    # results and job records
    result_ttl_s: int = Field(7 * 24 * 3600, description="seconds results, job records, "
                                                         "files and idempotency keys are kept")
    batch_result_ttl_s: int = Field(
        3600, ge=1, description="seconds a batch line's own result key is kept (at most "
                                "`result_ttl_s`): its answer lives on in the batch's output "
                                "file, so Redis holds it once; a line with a callback keeps "
                                "`result_ttl_s` for the dispatcher")
    packs: list[str] = Field(
        default_factory=list,
        description="prompt pack sources besides the official packs: directories, "
                    "`git+URL[@rev][#subdir]`, `github:owner/repo[@ref][#subdir]` (a JSON "
                    "list); the API and the workers load the same list")
    # workers
    max_pass_tokens: int | None = Field(
        None, description="rows of one pass. None: the engine's default for the device "
                          "(16384 on CUDA, 8192 on the CPU)")
    max_content_tokens: int = Field(
        4096, description="content tokens per input (the hosted limit); a server may raise "
                          "it up to the model's context, a request's `limits` only lower it")
    root_cache_mib: int = Field(
        0, ge=0, description="MiB of roots' keys and values a worker keeps across passes "
                             "(device memory on CUDA): a document sent again reads only its "
                             "questions' rows, its scores unchanged. 0: off")
    quant: str = Field("auto", description="the engine's scheme (`--quant`): `auto`, `fp32`, "
                                           "`bf16`, `fp8`, `fp8-static`, `int8`, `int4`")
    fp8_scales: str | None = Field(
        None, description="`fp8-static`'s activation scales file (`--fp8-scales`). None: an "
                          "fp8 checkpoint's own stored scales, else "
                          "`fp8-static-scales.safetensors` beside the checkpoint")
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="`dummy` (`--load-format`): the model's config and tokenizer with "
                            "random weights of its shapes, for capacity and speed runs")
    max_wait_ms: int = Field(50, description="a pass that is not full waits at most this long "
                                             "for the entries still to be read; with none "
                                             "left and no pass queued on the device, it "
                                             "starts at once")
    interactive_pass_tokens: int | None = Field(
        None, ge=1, description="bulk entries fill a pass that holds interactive requests "
                                "only up to this many rows, so a request waits for a short "
                                "pass of its own, not a full one. None: a quarter of the "
                                "pass budget")
    interactive_bulk_pass_tokens: int | None = Field(
        None, ge=1, description="while requests keep coming (one read within the last "
                                "second), a pass of bulk entries alone holds at most this "
                                "many rows, so a request arriving meanwhile waits behind "
                                "shorter passes (still two deep). None: half the pass "
                                "budget; the budget or more: whole passes")
    interactive_window_ms: int = Field(
        0, ge=0, description="for this long after an interactive request, a pass of bulk "
                             "entries alone is queued on the device only when none other is "
                             "there, so the next request waits for the pass running, not a "
                             "second one queued behind it (bulk passes then are not laid out "
                             "while the device runs). 0: always two deep")
    switch_interval_ms: float | None = Field(
        None, gt=0, description="the worker process's interpreter switch interval "
                                "(sys.setswitchinterval): how long a thread running Python "
                                "keeps the lock from another that waits, such as the engine "
                                "thread with a pass to launch behind the event loop. None: "
                                "Python's own (5 ms)")
    api_switch_interval_ms: float | None = Field(
        0.5, gt=0, description="an API process's interpreter switch interval while it serves: "
                               "how long the thread validating a batch's lines keeps the lock "
                               "from the event loop answering requests (each of a request's "
                               "steps waits up to this long for it). 5 is Python's own; None "
                               "leaves the process's as it is")
    read_count: int = Field(256, description="stream entries a worker reads per XREADGROUP")
    claim_idle_ms: int = Field(
        120_000, description="an entry a worker has held this long is reclaimed by another "
                             "(keep it longer than the slowest pass)")
    max_deliveries: int = Field(3, description="deliveries of an entry before it goes to the "
                                               "dead-letter stream")
    heartbeat_s: float = Field(2.0, description="worker heartbeat period, seconds")
    worker_ttl_s: float = Field(10.0, description="a worker silent this long is not alive "
                                                  "(`/ready`, `/v1/models`)")
    # API
    api_workers: int = Field(
        default=1, ge=1,
        description="`spinf-serve api` processes on one host and port (`--workers`), under "
                    "uvicorn's supervisor, each with its own reply stream")
    sync_timeout_s: float = Field(
        120.0, description="`/v1/score` waits this long for its result, then answers 503 "
                           "`model_unavailable` with the job's id (the job goes on)")
    max_backlog: int = Field(
        1_000_000, description="entries waiting in the work streams: past it, 429 "
                               "`concurrency_limit` with Retry-After; batch queueing pauses "
                               "at it")
    batch_lease_s: float = Field(
        30.0, description="a batch's queuer that has not renewed its lease this long is taken "
                          "over by another API instance")
    max_body_bytes: int = Field(10 * 1024 * 1024, description="request body limit, bytes "
                                                              "(else 413 `body_too_large`)")
    max_file_bytes: int = Field(200 * 1024 * 1024, description="uploaded file limit "
                                                               "(`/v1/files`), bytes")
    api_keys: list[str] = Field(
        default_factory=list,
        description="bearer keys, each `<key>` or `<key> <tenant>` (a bare key is a tenant of "
                    "its own; api/auth.py); empty, with no token: no authentication")
    api_keys_file: str | None = Field(None, description="more keys, one per line in the same "
                                                        "format (`#` comments)")
    token: str | None = Field(
        None, description="`serve --token`: a bearer token for /v1 like an API key (the "
                          "operator: it sees every tenant), and the trusted token /v0 needs "
                          "(with none, /v0 answers loopback callers only)")
    # callbacks
    webhook_secret: str | None = Field(
        None, description="`whsec_<base64>`: the key callbacks are signed with; `serve` "
                          "generates one into its state dir when unset")
    callback_max_attempts: int = Field(6, description="delivery attempts per callback")
    callback_backoff_s: float = Field(1.0, description="first retry delay, seconds; doubles, "
                                                       "with full jitter")
    callback_timeout_s: float = Field(10.0, description="timeout of one callback request, "
                                                        "seconds")
    callback_allow: list[str] = Field(
        default_factory=list, description="hosts and CIDRs callbacks may reach although they "
                                          "are private (the SSRF guard refuses them otherwise)")
    fetch_media: bool = Field(
        False, description="the API fetches `https://` image URLs (else only `data:` URLs are "
                           "read), under the callbacks' SSRF rule and `callback_allow` "
                           "(api/media.py)")
    media_fetch_timeout_s: float = Field(10.0, description="timeout of one media fetch, "
                                                           "seconds")
    media_fetch_max_bytes: int = Field(20 * 1024 * 1024, ge=1,
                                       description="largest media file fetched, bytes")

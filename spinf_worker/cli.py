"""``spinf-serve`` command line: offline scoring, the service (serve, api, worker, dispatcher)
and the tools (parity, bench, models, quantize)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from .errors import InvalidRequestError, SpinfError

CHUNK_DOCS = 64   # documents handed to the engine at once: enough to fill passes
QUANT_SCHEMES = ("auto", "fp32", "bf16", "fp8", "fp8-static", "int8", "int4")
QUANT_HELP = ("weights at load: fp32, bf16 (CUDA), fp8 (per-token activation scales; CUDA, "
              "or the CPU's reference path), fp8-static (calibrated activation scales: "
              "--fp8-scales; CUDA, or the CPU's reference path), int8 weight-only, int4 (a GPTQ "
              "checkpoint kept packed, CUDA) (default auto: fp32 on the CPU, fp8 or bf16 on a "
              "GPU, int4 for GPTQ, an fp8 checkpoint's own fp8 / fp8-static; $SPINF_QUANT for "
              "the service)")
FP8_SCALES_HELP = ("fp8-static: the activation scales file from `spinf-serve quantize "
                   "fp8-static` (default: an fp8 checkpoint's stored scales, else "
                   "fp8-static-scales.safetensors beside the checkpoint; $SPINF_FP8_SCALES for "
                   "the service)")


def _load_scoring(path: str | None) -> dict | None:
    if path is None:
        return None
    block = json.loads(Path(path).read_text())
    return {"queries": block} if isinstance(block, list) else block


def _to_request(line: str, scoring: dict | None) -> tuple[object, dict]:
    """One input line -> (custom_id, request body): a hosted request body (``messages`` or
    ``inputs``, ``scoring``), or ``{"text": ...}``; the --queries block is its ``scoring``
    when it has none. Raises InvalidRequestError."""
    import orjson

    try:
        obj = orjson.loads(line)   # as the API reads a body (api/services.read_json)
    except orjson.JSONDecodeError as err:
        raise InvalidRequestError(f"line is not valid JSON: {err.msg} at column {err.colno}",
                                  code="invalid_json") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError("line must be a JSON object", code="invalid_field")
    custom_id = obj.get("custom_id", obj.get("id"))
    if not any(k in obj for k in ("messages", "inputs", "text")):
        raise InvalidRequestError("line needs 'text', 'messages' or 'inputs'", param="text",
                                  code="invalid_field")
    body = {k: v for k, v in obj.items() if k not in ("id", "custom_id")}
    if "scoring" not in body:
        if scoring is None:
            raise InvalidRequestError("line has no 'scoring' block and no --queries file was "
                                      "given", param="scoring", code="invalid_field")
        body["scoring"] = scoring
    return custom_id, body


def _read_lines(path: str) -> Iterator[str]:
    with sys.stdin if path == "-" else open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield line


# ---- extras: each command's third-party imports are lazy; a missing one names its extra -------

EXTRA_MODULES = {   # the extra that installs each module a command imports (pyproject.toml)
    "api": ("fastapi", "orjson", "uvicorn", "httptools", "redis", "httpx", "pydantic_settings",
            "prometheus_client", "structlog", "platformdirs", "av"),
    "server": ("torch", "numpy", "tokenizers", "safetensors", "gguf", "huggingface_hub",
               "jinja2", "tqdm", "yaml", "feedparser", "trafilatura", "soxr"),
    "calibrate": ("sklearn", "matplotlib"),
}
COMMAND_EXTRAS = {"serve": ("server",), "worker": ("server",), "ingest": ("server",),
                  "score": ("server",), "calibrate": ("server", "calibrate"),
                  "parity": ("server",), "bench": ("server",), "quantize": ("server",),
                  "api": ("api",), "dispatcher": ("api",)}


def _extra_of(module: str) -> str | None:
    return next((extra for extra, modules in EXTRA_MODULES.items() if module in modules), None)


def missing_extra(command: str) -> tuple[str, str] | None:
    """(extra, module) for the first module ``command`` needs that is not installed."""
    import importlib.util

    for extra in COMMAND_EXTRAS.get(command, ()):
        for module in EXTRA_MODULES[extra]:
            try:
                found = importlib.util.find_spec(module) is not None
            except ImportError:
                found = False
            if not found:
                return extra, module
    return None


def _needs_extra_line(command: str, extra: str, module: str) -> str:
    return (f"spinf-serve {command}: needs the [{extra}] extra: pip install "
            f"'spinf-serve[{extra}]' (no module named {module!r})")


def _error_line(custom_id, err: SpinfError) -> dict:
    return {"custom_id": custom_id, **err.to_openai()}


def cmd_score(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .engine.engine import Engine, EngineSettings, freeze_heap
    from .pack_sources import load_sources
    from .packs import PackError

    scoring = _load_scoring(args.queries)
    try:
        packs = load_sources(args.packs)   # before the model: a bad pack fails fast
    except PackError as err:
        print(f"spinf-serve: {err}", file=sys.stderr)
        return 2
    settings = EngineSettings(scheme=args.quant or "auto", fp8_scales=args.fp8_scales,
                              root_cache_mib=args.root_cache_mib)
    if args.max_pass_tokens:
        settings.max_pass_tokens = args.max_pass_tokens
    try:
        engine = Engine.load(args.model, device=args.device, settings=settings, packs=packs)
    except ValueError as err:    # a scheme off its device, a bad scales file
        print(f"spinf-serve: cannot load the model: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    freeze_heap()
    total = None if args.input == "-" else sum(1 for _ in _read_lines(args.input))
    sink = (contextlib.nullcontext(sys.stdout) if args.output == "-"
            else open(args.output, "w", encoding="utf-8"))  # noqa: SIM115 (closed by with)
    failed = 0
    with sink as out, tqdm(total=total, unit="doc", file=sys.stderr, disable=args.quiet) as bar:
        chunk: list[str] = []
        for line in _read_lines(args.input):
            chunk.append(line)
            if len(chunk) == CHUNK_DOCS:
                failed += _score_chunk(engine, chunk, scoring, out)
                bar.update(len(chunk))
                chunk = []
        if chunk:
            failed += _score_chunk(engine, chunk, scoring, out)
            bar.update(len(chunk))
    if failed:
        print(f"{failed} line(s) failed; see their error lines in the output", file=sys.stderr)
    return 0


def _score_chunk(engine, lines: list[str], scoring: dict | None, out) -> int:
    ids, bodies, slots = [], [], []
    for line in lines:
        try:
            custom_id, body = _to_request(line, scoring)
            slots.append(len(bodies))
            ids.append(custom_id)
            bodies.append(body)
        except SpinfError as err:
            slots.append(err)
            ids.append(None)
    results = engine.score_batch(bodies)
    failed = 0
    for custom_id, slot in zip(ids, slots, strict=True):
        result = slot if isinstance(slot, SpinfError) else results[slot]
        if isinstance(result, SpinfError):
            failed += 1
            row = _error_line(custom_id, result)
        else:
            row = {"custom_id": custom_id, **result.model_dump(mode="json")}
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
    out.flush()
    return failed


# ---- the service: serve | api | worker | dispatcher (docs/SERVICE.md) -------------------------


def _service_settings(args: argparse.Namespace):
    """ServiceSettings from SPINF_* variables, with the flags given overriding them."""
    from .queue.settings import ServiceSettings

    flags = {"redis_url": args.redis, "prefix": args.prefix, "packs": args.packs or None,
             "quant": getattr(args, "quant", None),
             "fp8_scales": getattr(args, "fp8_scales", None),
             "load_format": getattr(args, "load_format", None),
             "api_workers": getattr(args, "workers", None)}
    settings = ServiceSettings(**{k: v for k, v in flags.items() if v is not None})
    if settings.packs and args.command != "dispatcher":
        from .pack_sources import pin_sources
        from .packs import PackError
        from .serve import ServiceError

        try:   # every pack checked before anything starts; git revisions pinned to commits
            settings = settings.model_copy(update={"packs": pin_sources(settings.packs)})
        except PackError as err:
            raise ServiceError(str(err)) from None
    return settings


def _log_json(args: argparse.Namespace) -> bool | None:
    return {"auto": None, "json": True, "console": False}[args.log_format]


def _start_logging(args: argparse.Namespace) -> None:
    from .logs import configure_logging

    configure_logging(json=_log_json(args), level=args.log_level)


def _needs(settings, *, redis: bool = True, secret: bool = False) -> None:
    from .serve import ServiceError

    if redis and not settings.redis_url:
        raise ServiceError("no Redis URL: pass --redis redis://host:6379 or set SPINF_REDIS_URL")
    if secret and not settings.webhook_secret:
        raise ServiceError("callbacks need the signing secret shared by all dispatchers: set "
                           "SPINF_WEBHOOK_SECRET (whsec_...; `spinf-serve serve` writes one "
                           "into its state dir)")


def cmd_packs(args: argparse.Namespace) -> int:
    from .pack_sources import load_sources
    from .packs import PackError

    try:
        packs = load_sources(args.packs)
    except PackError as err:
        print(f"spinf-serve: {err}", file=sys.stderr)
        return 2
    for versions in packs.values():
        for pack in versions.values():
            summary = pack.summary(list(versions))
            if args.json:
                print(json.dumps(summary))
                continue
            layer = pack.file.decision.micro_layer
            lock = "-" if layer is None else "ok" if pack.lock_ok else "MISMATCH"
            print(f"{pack.group}  {summary['queries']} queries ({summary['prompts']} prompts)  "
                  f"categories: {', '.join(c['id'] for c in summary['categories'])}  "
                  f"mode {summary['decision']['mode']}  lock {lock}  from {pack.source}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Scores normal traffic (and labelled texts), fits the pack's constants, reports."""
    from . import calibrate as cal
    from .pack_sources import load_sources
    from .packs import PackError, find_pack, load_pack

    try:
        pack = (load_pack(Path(args.pack), draft=True) if args.pack.endswith(".json")
                else find_pack(load_sources(args.packs), args.pack))
        normal = cal.read_texts(Path(args.normal), text_field=args.text_field,
                                limit=args.max_docs)
        labelled = None
        if args.data:
            extra = args.label_map
            if extra is not None:
                extra = json.loads(Path(extra).read_text() if Path(extra).is_file() else extra)
            labelled = cal.read_texts(Path(args.data), cal.label_map(pack, extra),
                                      text_field=args.text_field, label_field=args.label_field,
                                      limit=args.max_docs)
    except (PackError, SpinfError, ValueError, OSError) as err:
        print(f"spinf-serve: {getattr(err, 'message', err)}", file=sys.stderr)
        return 2
    if labelled is not None and labelled.unmapped:
        print(f"labels that match no category (negatives for every category): "
              f"{labelled.unmapped}", file=sys.stderr)
    scorer = None
    if args.scores is None or labelled is not None:
        from .engine import Engine, EngineSettings

        scorer = cal.engine_scorer(Engine.load(
            args.model, device=args.device,
            settings=EngineSettings(scheme=getattr(args, "quant", None) or "auto",
                                    fp8_scales=getattr(args, "fp8_scales", None)),
            load_format=getattr(args, "load_format", None) or "auto"))
    context = args.context or next(iter(pack.contexts))
    normal_results = (cal.read_scores(Path(args.scores)) if args.scores else
                      cal.score_texts(scorer, pack, normal.texts, context=context))
    fit_idx, test_idx = [], []
    labelled_results: list = []
    if labelled is not None:
        labelled_results = cal.score_texts(scorer, pack, labelled.texts, context=context)
        fit_idx, test_idx = cal.split(len(labelled.texts), args.fit_fraction, args.seed)
    target = ({"precision": args.target_precision} if args.target_precision is not None
              else {"recall": args.target_recall} if args.target_recall is not None else None)
    record = cal.fitted_record(normal, labelled, pack.model or "", context)
    calibrated, fitted = cal.calibrate(
        pack, normal_results, labelled=[labelled_results[i] for i in fit_idx],
        labels=[labelled.labels[i] for i in fit_idx] if labelled else [], target=target,
        rate=args.rate, record=record)
    Path(args.output).write_text(json.dumps(calibrated.raw, indent=1, ensure_ascii=False) + "\n")
    print(f"{calibrated.group}: fitted on {len(normal_results)} normal texts"
          + (f" and {len(fit_idx)} labelled ({len(test_idx)} held out)" if labelled else ""))
    if labelled is not None and test_idx:
        rep = cal.report(calibrated, [labelled_results[i] for i in test_idx],
                         [labelled.labels[i] for i in test_idx])
        print(cal.format_report(rep, fitted))
        args.report_dir.mkdir(parents=True, exist_ok=True)
        (args.report_dir / "report.json").write_text(json.dumps(rep, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


def _with_token(settings, args: argparse.Namespace):
    """``--token`` over $SPINF_TOKEN: the bearer token of /v1 and the trusted one of /v0."""
    return settings.model_copy(update={"token": args.token}) if args.token else settings


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve import serve

    if args.model and args.model_arg and args.model != args.model_arg:
        print(f"spinf-serve serve: two models given ({args.model_arg!r} and --model "
              f"{args.model!r}); name one", file=sys.stderr)
        return 2
    _start_logging(args)
    settings = _with_token(_service_settings(args), args)
    if settings.api_workers != 1:
        # one process holds the API and the engine; more API processes need their own worker
        print("spinf-serve serve: runs the API in one process with its worker; for several "
              "API processes run `spinf-serve api --workers N` and `spinf-serve worker` on one "
              "Redis (--workers / SPINF_API_WORKERS)", file=sys.stderr)
        return 2
    if args.devices is not None and args.device is not None:
        print("spinf-serve serve: --device and --devices both given; name one", file=sys.stderr)
        return 2
    serve(settings, host=args.host, port=args.port, model=args.model_arg or args.model,
          device=args.device, state_dir=args.state_dir, devices=args.devices,
          log_args=["--log-level", args.log_level, "--log-format", args.log_format])
    return 0


def cmd_api(args: argparse.Namespace) -> int:
    from .serve import Tiers, run_api_processes, run_loop, run_tiers

    _start_logging(args)
    settings = _with_token(_service_settings(args), args)
    _needs(settings)
    if settings.api_workers > 1:
        run_api_processes(settings, args.host, args.port, log_json=_log_json(args),
                          log_level=args.log_level)
    else:   # the API in this process, as `serve` runs it
        run_loop(run_tiers(settings, Tiers(api=(args.host, args.port))))
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from .serve import Tiers, WorkerSpec, run_loop, run_tiers

    _start_logging(args)
    settings = _service_settings(args)
    _needs(settings, secret=args.callbacks)
    if args.devices is not None:
        if args.device is not None:
            print("spinf-serve worker: --device and --devices both given; name one",
                  file=sys.stderr)
            return 2
        pool = _worker_pool(args, settings, args.devices, base_name=args.name)
        run_loop(run_tiers(settings, Tiers(dispatcher=args.callbacks,
                                           jobs={"workers": pool.run})))
        return 0
    worker = WorkerSpec(model=args.model, device=args.device, name=args.name)
    run_loop(run_tiers(settings, Tiers(worker=worker, dispatcher=args.callbacks)))
    return 0


def _worker_pool(args: argparse.Namespace, settings, devices: str, base_name: str | None):
    """One worker process per device of ``devices`` (worker_pool.py)."""
    from .serve import ServiceError
    from .worker_pool import DevicesError, WorkerPool, parse_devices

    try:
        resolved = parse_devices(devices)
    except DevicesError as err:
        raise ServiceError(str(err)) from None
    return WorkerPool(settings, resolved, model=args.model, base_name=base_name,
                      log_args=["--log-level", args.log_level, "--log-format", args.log_format])


def cmd_dispatcher(args: argparse.Namespace) -> int:
    from .serve import Tiers, run_loop, run_tiers

    _start_logging(args)
    settings = _service_settings(args)
    _needs(settings, secret=True)
    run_loop(run_tiers(settings, Tiers(dispatcher=True)))
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    """A news-feed ingestion consumer (docs/INGEST.md)."""
    from .ingest import config as ingest_config
    from .ingest.run import ingest
    from .pack_sources import load_sources

    _start_logging(args)
    settings = _service_settings(args)

    def here(path: str) -> str:     # flags are relative to the working directory
        return str(Path(path).resolve())

    feeds = ([{"url": url} for url in args.feed] + [{"jsonl": here(p)} for p in args.jsonl]
             + [{"stream": key} for key in args.stream])
    sinks = [f"jsonl:{here(s[6:])}" if s.startswith("jsonl:") else s for s in args.sink]
    config = ingest_config.load(
        args.config, packs=load_sources(settings.packs), feeds=feeds, sinks=sinks,
        pack=args.pack or None, queries=here(args.queries) if args.queries else None,
        interval_s=args.interval, fetch_pages=args.fetch_pages, fetch_allow=args.fetch_allow,
        name=args.name)
    ingest(settings, config, once=args.once, model=args.model, device=args.device,
           state_dir=args.state_dir, metrics_port=args.metrics_port,
           metrics_host=args.metrics_host)
    return 0


# ---- tools: parity | bench | models (spinf_worker/tools/) --------------------------------------


def cmd_parity(args: argparse.Namespace) -> int:
    from .tools import parity

    return parity.run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .tools import bench

    return bench.run(args)


def cmd_models(args: argparse.Namespace) -> int:
    from .tools import model_cache

    return model_cache.run(args)


def cmd_quantize(args: argparse.Namespace) -> int:
    from .tools import fp8_calibrate

    return fp8_calibrate.run(args)


def _tool_parsers(sub) -> None:
    parity = sub.add_parser("parity", help="score the public parity fixture; compare with a "
                                           "recorded reference (bits, else tolerances)")
    parity.add_argument("--fixture", default=None, metavar="F",
                        help="fixture .json.gz (default: fixtures/parity/mixed-12.json.gz)")
    parity.add_argument("--reference", default=None, metavar="R",
                        help="recorded reference .json.gz (fixtures/parity/<model>.<device>-"
                             "<scheme>.json.gz)")
    parity.add_argument("--record", default=None, metavar="OUT",
                        help="write this run's scores as a reference")
    parity.add_argument("--passes", type=_positive_int, default=1, metavar="N",
                        help="score the fixture N times (each in another document order); "
                             "every repeat must give the same bits (default 1)")
    parity.add_argument("--max-abs-delta", type=float, default=0.5, metavar="X",
                        help="another fingerprint: the largest |Δ logprob| allowed (default 0.5)")
    parity.add_argument("--min-top1", type=float, default=0.9, metavar="A",
                        help="another fingerprint: the least share of questions whose top "
                             "option agrees (default 0.9)")
    parity.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                        help="torch's CPU threads, part of the fingerprint (default: torch's "
                             "own choice; a CPU reference records its count)")
    parity.add_argument("--json", action="store_true", help="one JSON object")
    _model_options(parity)
    parity.set_defaults(func=cmd_parity)

    bench = sub.add_parser("bench", help="the news job (articles x 56 questions) on a model "
                                         "and device: questions/s, tokens/s, memory")
    bench.add_argument("--docs", type=_positive_int, default=24, metavar="N",
                       help="articles to score (default 24)")
    bench.add_argument("--doc-tokens", type=_positive_int, default=470, metavar="T",
                       help="each article cut to its first T tokens (default 470)")
    bench.add_argument("--data", default=None, metavar="DIR",
                       help="directory with news_articles.jsonl (default: $SPINF_SHARED_DATA "
                            "or ../shared/data)")
    bench.add_argument("--questions", default=None, type=Path, metavar="FILE",
                       help="scoring block (default: benchmarks/news_questions.json)")
    bench.add_argument("--case-insensitive", action="store_true",
                       help="options over their case spellings (the hosted default); "
                            "default: exactly as given, as the benchmarks measure")
    bench.add_argument("--no-floors", action="store_true",
                       help="ask no floors (empty_floor false): the timed call is the same "
                            "work, the warm-up skips scoring the 56 questions on empty content")
    bench.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                       help="torch's CPU threads (default: torch's own choice)")
    bench.add_argument("--json", action="store_true", help="one JSON object")
    _model_options(bench)
    bench.set_defaults(func=cmd_bench)

    models = sub.add_parser("models", help="the models in the cache (size, whether each "
                                           "loads), the default and the known families")
    models.add_argument("paths", nargs="*", type=Path, metavar="DIR",
                        help="checkpoint directories: show each one's manifest (its "
                             "spinf-manifest.json over what config.json says) instead")
    models.add_argument("--json", action="store_true", help="one JSON object")
    models.set_defaults(func=cmd_models)

    quantize = sub.add_parser("quantize", help="calibrate a quantisation scheme offline: "
                                               "fp8-static's activation scales")
    quantize.add_argument("scheme", choices=("fp8-static",),
                          help="fp8-static: one fp8 scale per linear layer's input, "
                               "max |x| / 448 over the calibration rows")
    quantize.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                          help="model id, HF directory or .gguf path (default: the packaged "
                               "Gemma 3 270M)")
    quantize.add_argument("--data", required=True, metavar="FILE",
                          help="JSONL calibration texts (text, else title + description)")
    quantize.add_argument("--out", required=True, metavar="DIR",
                          help="writes fp8-static-scales.safetensors and "
                               "recipe-fp8-static.json there")
    quantize.add_argument("--queries", default=None, metavar="FILE",
                          help="scoring block: each text is asked these questions, so the "
                               "question rows are calibrated too (default: each text alone "
                               "as a prompt)")
    quantize.add_argument("--text-field", default=None,
                          help="the text's field (default: text, else title + description)")
    quantize.add_argument("--skip", type=int, default=0, metavar="N",
                          help="leave out the first N texts (e.g. those an agreement is "
                               "measured on)")
    quantize.add_argument("--max-docs", type=_positive_int, default=None, metavar="N",
                          help="calibrate on at most N texts")
    quantize.add_argument("--doc-tokens", type=_positive_int, default=None, metavar="T",
                          help="cut each text to its first T tokens (the news job: 470)")
    quantize.add_argument("--device", default=None,
                          help="cpu, cuda, cuda:1 (default: cuda if present); the reference "
                               "runs fp32 on the CPU, bf16 on CUDA")
    quantize.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                          help="torch's CPU threads (default: torch's own choice)")
    quantize.set_defaults(func=cmd_quantize)


def _service_options(redis_help: str) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--redis", default=None, metavar="URL", help=redis_help)
    common.add_argument("--prefix", default=None, help="key prefix (default: $SPINF_PREFIX or spinf)")
    common.add_argument("--packs", action="append", default=None, metavar="SOURCE",
                        help="also load the packs of a directory or git+URL[@rev] (repeatable; "
                             "default: $SPINF_PACKS, a JSON list)")
    common.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    common.add_argument("--log-format", choices=("auto", "json", "console"), default="auto",
                        help="auto: console lines on a terminal, JSON lines otherwise")
    return common


def _http_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--token", default=None, metavar="T",
                        help="require 'Authorization: Bearer T' on /v1 (besides any API key) "
                             "and on the operators' /v0 (default: $SPINF_TOKEN; none: /v1 "
                             "open unless API keys are set, /v0 for local callers only)")


def _model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model id, HF directory or .gguf path "
                                                      "(default: the packaged Gemma 3 270M)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if present)")
    parser.add_argument("--quant", default=None, choices=QUANT_SCHEMES, help=QUANT_HELP)
    parser.add_argument("--fp8-scales", default=None, metavar="FILE", help=FP8_SCALES_HELP)
    parser.add_argument("--load-format", default=None, choices=("auto", "dummy"),
                        help="dummy: random weights of the model's shapes, for capacity and "
                             "speed runs (default: $SPINF_LOAD_FORMAT or auto)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spinf-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    external = "Redis URL (default: $SPINF_REDIS_URL; required)"

    serve = sub.add_parser(
        "serve", parents=[_service_options(
            "Redis URL (default: $SPINF_REDIS_URL; none: start a private redis-server)")],
        help="the whole service on this machine: API, one worker, callbacks")
    serve.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                       help="model id, HF directory or .gguf path (same as --model)")
    _http_options(serve)
    _model_options(serve)
    # refused with a pointer to `api --workers` (cmd_serve) rather than argparse's usage text
    serve.add_argument("--workers", type=_positive_int, default=None, help=argparse.SUPPRESS)
    serve.add_argument("--devices", default=None, metavar="all|0,1,...",
                       help="one worker process per device (as `worker --devices`); default: "
                            "every GPU when more than one is visible, else the worker runs in "
                            "this process")
    serve.add_argument("--state-dir", default=None, type=Path,
                       help="private Redis data and the webhook secret (default: the user data "
                            "dir, e.g. ~/.local/share/spinf-serve)")
    serve.set_defaults(func=cmd_serve)

    api = sub.add_parser("api", parents=[_service_options(external)],
                         help="only the HTTP API (no torch); workers run elsewhere")
    _http_options(api)
    api.add_argument("--workers", type=_positive_int, default=None, metavar="N",
                     help="API processes on this host and port, each with its own reply "
                          "stream (uvicorn's supervisor; a child that dies is restarted); "
                          "default: $SPINF_API_WORKERS or 1, this process alone")
    api.set_defaults(func=cmd_api)

    worker = sub.add_parser("worker", parents=[_service_options(external)],
                            help="a scoring worker on a shared Redis")
    _model_options(worker)
    worker.add_argument("--name", default=None,
                        help="consumer name; a restarted worker with the same name first "
                             "finishes its own pending entries (default: host-pid-random)")
    worker.add_argument("--callbacks", action="store_true",
                        help="also run a callback dispatcher in this process")
    worker.add_argument("--devices", default=None, metavar="all|0,1,...",
                        help="one worker process per device, supervised (a crashed one is "
                             "started again): all (every visible GPU), GPU indexes, or names "
                             "(cuda:1, cpu); a device named twice gets two (0,0: two processes "
                             "on GPU 0, for a small model on a fast GPU); --name is their "
                             "names' base")
    worker.set_defaults(func=cmd_worker)

    dispatcher = sub.add_parser("dispatcher", parents=[_service_options(external)],
                                help="only the webhook callback dispatcher")
    dispatcher.set_defaults(func=cmd_dispatcher)

    ingest = sub.add_parser(
        "ingest", parents=[_service_options(
            "Redis URL of a deployment (default: $SPINF_REDIS_URL; none: a private "
            "redis-server and a worker in this process)")],
        help="follow RSS/Atom feeds, JSONL files or a Redis stream; score each new item once")
    ingest.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="YAML: feeds (each with its pack/queries/interval), sinks, defaults")
    ingest.add_argument("--feed", action="append", default=[], metavar="URL",
                        help="an RSS/Atom feed (repeatable)")
    ingest.add_argument("--jsonl", action="append", default=[], metavar="PATH",
                        help="a JSONL file followed as it grows (repeatable)")
    ingest.add_argument("--stream", action="append", default=[], metavar="KEY",
                        help="a Redis stream of articles (repeatable)")
    ingest.add_argument("--sink", action="append", default=[], metavar="SPEC",
                        help="jsonl:PATH, redis:STREAM or webhook:URL (repeatable)")
    ingest.add_argument("--pack", action="append", default=[], metavar="ID",
                        help="score with this prompt pack (repeatable)")
    ingest.add_argument("--queries", default=None, metavar="FILE",
                        help="scoring block or list of queries, as for `score --queries`")
    ingest.add_argument("--interval", type=float, default=None, metavar="S",
                        help="seconds between polls (default: 300 for feeds, 1 for files and "
                             "streams)")
    ingest.add_argument("--fetch-pages", action="store_true",
                        help="fetch the linked page of items that carry only a summary")
    ingest.add_argument("--fetch-allow", action="append", default=[], metavar="HOST|CIDR",
                        help="private hosts/networks pages may be fetched from (repeatable)")
    ingest.add_argument("--name", default=None,
                        help="consumer name: its state in Redis (default: default)")
    ingest.add_argument("--once", action="store_true",
                        help="poll every source once, wait until every new item is in the "
                             "sinks, exit")
    ingest.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on this port")
    ingest.add_argument("--metrics-host", default="127.0.0.1",
                        help="address of the metrics server (default 127.0.0.1)")
    ingest.add_argument("--state-dir", type=Path, default=None,
                        help="without --redis: the private Redis data (default: the user data "
                             "dir's ingest/)")
    _model_options(ingest)
    ingest.set_defaults(func=cmd_ingest)

    score = sub.add_parser("score", help="score a JSONL file offline (no server)")
    score.add_argument("input", help="JSONL: /v1/score bodies or {\"id\", \"text\"} lines; - for stdin")
    score.add_argument("-o", "--output", default="-", help="output JSONL (default stdout)")
    score.add_argument("--model", default=None, help="model id, HF directory or .gguf path")
    score.add_argument("--queries", default=None,
                       help="JSON file with the scoring block for lines that have none")
    score.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if present)")
    score.add_argument("--max-pass-tokens", type=int, default=None)
    score.add_argument("--root-cache-mib", type=int, default=0, metavar="MIB",
                       help="keep the roots read (this many MiB): a line about a text read "
                            "before reads only its questions (default 0: off)")
    score.add_argument("--quant", default=None, choices=QUANT_SCHEMES, help=QUANT_HELP)
    score.add_argument("--fp8-scales", default=None, metavar="FILE", help=FP8_SCALES_HELP)
    score.add_argument("--packs", action="append", default=[], metavar="SOURCE",
                       help="also load the packs of a directory or git+URL[@rev][#subdir] "
                            "(repeatable)")
    score.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    score.set_defaults(func=cmd_score)

    packs = sub.add_parser("packs", help="list the prompt packs that load (and check them)")
    packs.add_argument("--packs", action="append", default=[], metavar="SOURCE",
                       help="also load the packs of a directory or git+URL[@rev][#subdir] "
                            "(repeatable)")
    packs.add_argument("--json", action="store_true", help="one JSON object per pack")
    packs.set_defaults(func=cmd_packs)

    cal = sub.add_parser("calibrate", help="fit a pack's constants on normal traffic and "
                                           "labelled data; held-out report")
    cal.add_argument("--pack", required=True, help="pack id, or a pack .json file")
    cal.add_argument("--packs", action="append", default=[], metavar="SOURCE",
                     help="also load the packs of a directory or git+URL[@rev] (repeatable)")
    cal.add_argument("--normal", required=True,
                     help="JSONL texts of normal traffic: the reads, percentiles and default "
                          "thresholds are fitted on them")
    cal.add_argument("--scores", default=None, metavar="JSONL",
                     help="the --normal texts' stored results ({\"queries\": [...]} a line): "
                          "no model is run for them")
    cal.add_argument("--data", default=None,
                     help="labelled JSONL: a text and a label per line (Platt maps, thresholds, "
                          "the micro-layer)")
    cal.add_argument("--context", default=None, help="the pack context (default: its first)")
    cal.add_argument("--rate", type=float, default=0.005,
                     help="share of normal traffic a default threshold flags (default 0.005)")
    cal.add_argument("--text-field", default=None,
                     help="the text's field (default: text, else title + description)")
    cal.add_argument("--label-field", default="label", help="the label's field (default label)")
    cal.add_argument("--label-map", default=None, metavar="JSON",
                     help="label -> category id, a JSON object or file (besides the categories' "
                          "ids and labels)")
    aim = cal.add_mutually_exclusive_group()
    aim.add_argument("--target-precision", type=float, default=None, metavar="P",
                     help="thresholds: the most recall with at least this precision")
    aim.add_argument("--target-recall", type=float, default=None, metavar="R",
                     help="thresholds: the most precision with at least this recall")
    cal.add_argument("--fit-fraction", type=float, default=0.5,
                     help="share of the labelled texts to fit on; the rest is held out")
    cal.add_argument("--seed", type=int, default=0, help="seed of the fit / held-out split")
    cal.add_argument("--max-docs", type=int, default=None, help="only the first N lines")
    cal.add_argument("-o", "--output", required=True, help="the calibrated pack (.json)")
    cal.add_argument("--report-dir", default="calibration-report", type=Path,
                     help="report.json of the held-out texts (default ./calibration-report)")
    _model_options(cal)
    cal.set_defaults(func=cmd_calibrate)
    _tool_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before torch starts CUDA: segments that grow in place instead of a new block per odd
    # size, so the allocator's reserve stays near what a pass uses (the 12B fp8 model: 19.1
    # -> 16.9 GiB in nvidia-smi for the news job). A value the user set wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args = build_parser().parse_args(argv)
    missing = missing_extra(args.command)
    if missing:
        print(_needs_extra_line(args.command, *missing), file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except SpinfError as err:
        print(f"spinf-serve: {err.message}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:   # a lazy import of an extra's package, not installed
        extra = _extra_of(err.name or "")
        if extra is None:
            raise
        print(_needs_extra_line(args.command, extra, err.name), file=sys.stderr)
        return 2
    except KeyboardInterrupt:       # before the service installed its own signal handling
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""``spinf-serve`` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from .errors import InvalidRequestError, SpinfError

CHUNK_DOCS = 64   # documents handed to the engine at once: enough to fill passes


def _load_scoring(path: str | None) -> dict | None:
    if path is None:
        return None
    block = json.loads(Path(path).read_text())
    return {"queries": block} if isinstance(block, list) else block


def _to_request(line: str, scoring: dict | None) -> tuple[object, dict]:
    """One input line -> (custom_id, request body). Raises InvalidRequestError."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise InvalidRequestError(f"line is not valid JSON: {err.msg} at column {err.colno}") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError("line must be a JSON object")
    custom_id = obj.get("custom_id", obj.get("id"))
    if "messages" in obj or "scoring" in obj:
        body = {k: v for k, v in obj.items() if k not in ("id", "custom_id")}
    elif "text" in obj:
        body = {"messages": [{"role": "user", "content": obj["text"]}]}
    else:
        raise InvalidRequestError("line needs 'text', or 'messages' and 'scoring'", param="text")
    if "scoring" not in body:
        if scoring is None:
            raise InvalidRequestError("line has no 'scoring' block and no --queries file was given",
                                      param="scoring")
        body["scoring"] = scoring
    return custom_id, body


def _read_lines(path: str) -> Iterator[str]:
    with sys.stdin if path == "-" else open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield line


def _error_line(custom_id, err: SpinfError) -> dict:
    return {"custom_id": custom_id, **err.to_openai()}


def cmd_score(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .engine import Engine, EngineSettings

    scoring = _load_scoring(args.queries)
    settings = EngineSettings()
    if args.max_pass_tokens:
        settings.max_pass_tokens = args.max_pass_tokens
    engine = Engine.load(args.model, device=args.device, settings=settings)
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
    for custom_id, slot in zip(ids, slots):
        result = slot if isinstance(slot, SpinfError) else results[slot]
        if isinstance(result, SpinfError):
            failed += 1
            row = _error_line(custom_id, result)
        else:
            row = {"custom_id": custom_id, **result.model_dump()}
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
    out.flush()
    return failed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spinf-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    score = sub.add_parser("score", help="score a JSONL file offline (no server)")
    score.add_argument("input", help="JSONL: /v1/score bodies or {\"id\", \"text\"} lines; - for stdin")
    score.add_argument("-o", "--output", default="-", help="output JSONL (default stdout)")
    score.add_argument("--model", default=None, help="model id, HF directory or .gguf path")
    score.add_argument("--queries", default=None,
                       help="JSON file with the scoring block for lines that have none")
    score.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if present)")
    score.add_argument("--max-pass-tokens", type=int, default=None)
    score.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    score.set_defaults(func=cmd_score)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpinfError as err:
        print(f"spinf-serve: {err.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

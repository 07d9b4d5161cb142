"""The ingest configuration: sources, what each is scored with, and sinks; from a YAML file
(``--config``) and flags, validated with pydantic. Errors name the file, the field and why."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import InvalidRequestError, SpinfError
from ..packs import find_pack
from ..protocol import PackRef, ScoreRequest

FEED_INTERVAL_S = 300.0      # RSS/Atom feeds: polite by default
FOLLOW_INTERVAL_S = 1.0      # JSONL files and Redis streams: cheap to look at
SINK_KINDS = ("jsonl", "redis", "webhook")


class ConfigError(SpinfError):
    """The configuration cannot be used: which file or flag, which field, why."""


def _pack_list(value):
    """``pack: spinf/news`` and ``pack: [spinf/news, {id: x, version: 1.0.0}]`` both work."""
    if isinstance(value, (str, dict)):
        value = [value]
    if isinstance(value, list):
        return [{"id": v} if isinstance(v, str) else v for v in value]
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")    # a misspelt key must fail, not be ignored


class SourceConfig(_Strict):
    """One source: exactly one of ``url`` (RSS/Atom), ``jsonl`` (a file followed as it grows)
    or ``stream`` (a Redis stream key). Each field's description is its entry in
    docs/reference/configuration.md."""

    name: str | None = Field(default=None, min_length=1, max_length=200,
                             description="the source's name, the `feed` of its results "
                                         "(default: host + path, the file's stem, the key)")
    url: str | None = Field(default=None, description="an RSS or Atom feed (http or https)")
    jsonl: str | None = Field(default=None, description="a JSONL file followed as it grows "
                                                        "(relative to the config file)")
    stream: str | None = Field(default=None, description="a Redis stream key another "
                                                         "system writes articles into")
    interval_s: float | None = Field(default=None, gt=0,
                                     description="seconds between polls (default: the "
                                                 "file's, else 300 for feeds, 1 for files "
                                                 "and streams)")
    pack: list[PackRef] | None = Field(default=None,
                                       description="prompt packs to score with: an id, or a "
                                                   "list of ids and `{id, version, ...}`")
    queries: str | None = Field(default=None, description="a JSON file: a scoring block or a "
                                                          "list of queries")

    _pack_shorthand = field_validator("pack", mode="before")(_pack_list)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and urlsplit(value).scheme not in ("http", "https"):
            raise ValueError(f"url must be http(s)://, not {value!r}")
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> SourceConfig:
        given = [k for k in ("url", "jsonl", "stream") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("give exactly one of url, jsonl or stream"
                             + (f" (got {', '.join(given)})" if given else ""))
        return self

    @property
    def kind(self) -> str:
        return "feed" if self.url else "jsonl" if self.jsonl else "stream"

    @property
    def target(self) -> str:
        return self.url or self.jsonl or self.stream or ""


class IngestConfig(_Strict):
    """The top level of ``--config FILE``. Each field's description is its entry in
    docs/reference/configuration.md."""

    name: str = Field(default="default", pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                      description="the consumer's name: its state in Redis")
    feeds: list[SourceConfig] = Field(default_factory=list, description="the sources")
    sinks: list[str] = Field(default_factory=list,
                             description="`jsonl:PATH`, `redis:STREAM` or `webhook:URL`")
    # defaults for feeds that do not set their own
    pack: list[PackRef] | None = Field(default=None, description="packs for feeds that set "
                                                                 "none")
    queries: str | None = Field(default=None, description="the queries file for feeds that "
                                                          "set none")
    interval_s: float | None = Field(default=None, gt=0,
                                     description="the poll interval for feeds that set none")
    fetch_pages: bool = Field(default=False, description="fetch the linked page of items "
                                                         "that carry only a summary")
    fetch_allow: list[str] = Field(default_factory=list,
                                   description="hosts and CIDRs pages may come from although "
                                               "they are private")
    max_in_flight: int = Field(default=256, ge=1, description="items submitted and not yet "
                                                              "written to the sinks "
                                                              "(backpressure)")
    remember_days: float = Field(default=30.0, gt=0, description="how long seen item ids are "
                                                                 "kept for de-duplication")
    stream_start: Literal["0", "$"] = Field(default="0",
                                            description="where a new stream consumer group "
                                                        "starts: `0` the whole stream, `$` "
                                                        "only new entries")

    _pack_shorthand = field_validator("pack", mode="before")(_pack_list)

    @field_validator("sinks")
    @classmethod
    def _sink_specs(cls, specs: list[str]) -> list[str]:
        for spec in specs:
            kind, _, target = spec.partition(":")
            if kind not in SINK_KINDS or not target:
                raise ValueError(f"sink {spec!r} must be jsonl:PATH, redis:STREAM or "
                                 "webhook:URL")
        return specs


@dataclass(frozen=True)
class Source:
    """A validated source with its scoring block resolved."""

    name: str
    kind: str            # feed | jsonl | stream
    target: str          # the URL, file path or stream key
    interval_s: float
    scoring: dict        # {"scoring": {queries, packs}}: merged into each request


@dataclass(frozen=True)
class Settings:
    name: str
    sources: tuple[Source, ...]
    sinks: tuple[str, ...]
    fetch_pages: bool
    fetch_allow: tuple[str, ...]
    max_in_flight: int
    remember_days: float
    stream_start: str


def _load_yaml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}:{where}: not valid YAML: "
                          f"{getattr(err, 'problem', None) or err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping (feeds:, sinks:, ...)")
    return data


def _describe(err: ValidationError, data: dict, origin: str) -> str:
    lines = []
    for problem in err.errors(include_url=False):
        loc = [str(p) for p in problem["loc"]]
        where = ".".join(loc) or "(top level)"
        if len(loc) >= 2 and loc[0] == "feeds" and loc[1].isdigit():
            feed = (data.get("feeds") or [])[int(loc[1])]
            if isinstance(feed, dict):
                label = feed.get("name") or feed.get("url") or feed.get("jsonl") or feed.get("stream")
                where += f" ({label})" if label else ""
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            message = "unknown field"
        lines.append(f"{where}: {message}")
    return f"{origin}: " + "; ".join(lines)


def load_queries(path: Path, where: str) -> dict:
    """A queries file as ``spinf-serve score --queries`` reads it: a list of queries or a
    scoring block."""
    try:
        block = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"{where}: cannot read the queries file {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where}: {path} line {err.lineno} column {err.colno}: {err.msg}") from None
    return {"queries": block} if isinstance(block, list) else block


def _default_name(source: SourceConfig) -> str:
    if source.url:
        parts = urlsplit(source.url)
        return (parts.netloc + parts.path).rstrip("/")
    return Path(source.jsonl).stem if source.jsonl else source.stream


def _scoring(source: SourceConfig, config: IngestConfig, base: Path, where: str,
             known: dict) -> dict:
    packs = source.pack if source.pack is not None else config.pack or []
    queries = source.queries or config.queries
    if not packs and not queries:
        raise ConfigError(f"{where}: nothing to score with: give a pack or queries "
                          "(for this feed, in the file's defaults, or --pack / --queries)")
    for index, ref in enumerate(packs):
        try:
            pack = find_pack(known, ref.id, ref.version, param=f"pack.{index}")
            pack.check_decision(ref.decision, f"pack.{index}.decision")
        except InvalidRequestError as err:
            raise ConfigError(f"{where}: {err.message} (--packs SOURCE loads more)") from None
    block: dict = {"scoring": load_queries(base / queries, where) if queries else {}}
    if packs:
        block["scoring"]["packs"] = [ref.model_dump(exclude_none=True) for ref in packs]
    try:
        ScoreRequest.parse({"text": "probe", **block})
    except SpinfError as err:
        raise ConfigError(f"{where}: {queries or 'packs'}: {err.message}") from None
    return block


def build(data: dict, *, origin: str = "flags", base: Path | None = None,
          packs: dict | None = None) -> Settings:
    """Validate ``data`` (the YAML file's mapping with the flags merged in) into Settings.
    ``packs``: the packs a pack name may refer to (default: the official ones)."""
    base = base or Path.cwd()
    if packs is None:
        from ..packs import official_packs

        packs = official_packs()
    try:
        config = IngestConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err, data, origin)) from None
    if not config.feeds:
        raise ConfigError(f"{origin}: no sources: give --feed/--jsonl/--stream or feeds: in "
                          "the config file")
    if not config.sinks:
        raise ConfigError(f"{origin}: no sinks: give --sink jsonl:PATH (or redis:, webhook:) "
                          "or sinks: in the config file")
    sources, names = [], {}
    for index, feed in enumerate(config.feeds):
        name = feed.name or _default_name(feed)
        where = f"{origin}: feeds.{index} ({name})"
        if name in names:
            raise ConfigError(f"{where}: the name {name!r} is taken by feeds.{names[name]}; "
                              "give each feed its own name")
        names[name] = index
        interval = feed.interval_s or config.interval_s or (
            FEED_INTERVAL_S if feed.kind == "feed" else FOLLOW_INTERVAL_S)
        target = str(base / feed.jsonl) if feed.jsonl else feed.target
        sources.append(Source(name, feed.kind, target, interval,
                              _scoring(feed, config, base, where, packs)))
    sinks = tuple(f"jsonl:{base / spec[6:]}" if spec.startswith("jsonl:") else spec
                  for spec in config.sinks)
    return Settings(config.name, tuple(sources), sinks, config.fetch_pages,
                    tuple(config.fetch_allow), config.max_in_flight, config.remember_days,
                    config.stream_start)


def load(path: Path | None = None, *, packs: dict | None = None, **flags) -> Settings:
    """The YAML file (if any) with flags on top: ``feeds`` and ``sinks`` given as flags are
    added to the file's, the other flags replace the file's values. Relative paths in the file
    are relative to the file."""
    data = _load_yaml(path) if path else {}
    origin = str(path) if path else "flags"
    for key in ("feeds", "sinks", "fetch_allow"):
        data[key] = list(data.get(key) or []) + list(flags.pop(key, None) or [])
    data.update({k: v for k, v in flags.items() if v not in (None, False, [])})
    return build(data, origin=origin, base=path.parent if path else None, packs=packs)

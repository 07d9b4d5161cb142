"""A served checkpoint's manifest: what GET /v1/models says of it (name, aliases, family, the
pinned revision, capabilities, media, limits) and, for a decision model, its code readout and
prompt format (no torch; the loader, the worker's registration, the API and the CLI read it).

A checkpoint directory may carry ``spinf-manifest.json``; its fields override what is
inferred from config.json (``infer``), so a directory without one is served as before. A bad
file is a ``ManifestError`` of one line naming the file and the field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import ModelNotFoundError
from .model_names import served_names
from .protocol import DEFAULT_LIMITS, Limits

MANIFEST_FILE = "spinf-manifest.json"
# score: options read out; extract: {*} {n} {$} slots; generate: sampled slots;
# complete: /v1/completions (this server's; the hosted API lists the first three)
Capability = Literal["score", "extract", "generate", "complete"]
FULL_CAPABILITIES: list[Capability] = ["score", "extract", "generate", "complete"]
MediaKind = Literal["image", "audio", "video"]
_SHA = re.compile(r"^[0-9a-f]{40}$")


class ManifestError(ModelNotFoundError):
    """A manifest file that does not validate: the model is not served."""

    code = "invalid_manifest"


class DecisionPrompt(BaseModel):
    """The decision model's own prompt format: the content and each question are shown to it
    only through these (a request's template gives the question's text before ``{?}``)."""

    model_config = ConfigDict(extra="forbid")

    content: str = Field("{content}", description="the presented content's frame")
    question: str = Field("{question}", description="a question's frame; the readout follows")

    @model_validator(mode="after")
    def _slots(self) -> DecisionPrompt:
        for name in ("content", "question"):
            if getattr(self, name).count("{" + name + "}") != 1:
                raise ValueError(f"prompt.{name} must hold {{{name}}} exactly once")
        return self

    def frame_content(self, text: str) -> str:
        return self.content.replace("{content}", text)

    def frame_question(self, text: str) -> str:
        return self.question.replace("{question}", text)


class Decision(BaseModel):
    """A decision model: it answers with one of a fixed set of code tokens, read out as the
    log-softmax over those codes only (at ``temperature``) in place of the whole vocabulary."""

    model_config = ConfigDict(extra="forbid")

    codes: list[str] = Field(min_length=2, description="the answer codes; each one token")
    temperature: float = Field(1.0, gt=0)
    prompt: DecisionPrompt = Field(default_factory=DecisionPrompt)

    @model_validator(mode="after")
    def _distinct(self) -> Decision:
        if len(set(self.codes)) != len(self.codes):
            raise ValueError("decision.codes has duplicates")
        return self


class ManifestLimits(BaseModel):
    """What the checkpoint allows, below the server's own limits."""

    model_config = ConfigDict(extra="forbid")

    context: int | None = Field(None, gt=0, description="positions a document may take "
                                                         "(default: the config's)")
    max_content_tokens: int | None = Field(None, gt=0)
    max_inputs: int | None = Field(None, gt=0, description="inputs per call")


class Manifest(BaseModel):
    """One served checkpoint, as GET /v1/models lists it."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, description="the served name (default: the name it loads by)")
    name: str | None = None
    aliases: list[str] = Field(default_factory=list)
    family: str | None = None
    base_model: str | None = None
    revision: str | None = Field(None, description="the pinned commit of the weights (40 hex)")
    capabilities: list[Capability] = Field(default_factory=lambda: list(FULL_CAPABILITIES))
    media: list[MediaKind] = Field(default_factory=list)
    limits: ManifestLimits = Field(default_factory=ManifestLimits)
    decision: Decision | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.revision is not None and not _SHA.match(self.revision):
            raise ValueError("revision must be a 40-hex commit hash")
        if "score" not in self.capabilities:
            raise ValueError("capabilities must include score")
        if self.decision is not None and self.capabilities != ["score"]:
            # its head reads the codes only: nothing to extract, generate or complete with
            raise ValueError("a decision model's capabilities are [\"score\"]")
        return self

    @property
    def names(self) -> set[str]:
        """Every name requests may use: the id's (model_names.served_names) and the aliases."""
        return served_names(self.id) | set(self.aliases)

    def listed_limits(self) -> dict[str, int]:
        """The hosted ``limits`` object: the call limits, the checkpoint's where it is lower."""
        limits = DEFAULT_LIMITS.model_dump()
        if self.limits.max_content_tokens is not None:
            limits["max_content_tokens"] = min(limits["max_content_tokens"],
                                               self.limits.max_content_tokens)
        return Limits(**limits).model_dump()

    def catalog_entry(self) -> dict:
        """The /v1/models fields the manifest decides (the API adds status and the rest)."""
        return {"id": self.id, "name": self.name or self.id.rsplit("/", 1)[-1],
                "base_model": self.base_model or self.id,
                "aliases": sorted(self.names - {self.id}), "family": self.family,
                "capabilities": list(self.capabilities), "media": sorted(self.media),
                "limits": self.listed_limits()}


def infer(name: str, config: dict, media: list[str] | None = None) -> dict:
    """What a checkpoint without a manifest file is: read from its config.json (as before);
    a stack with recurrent layers (models/registry.Family.slots) has no extract, generate
    or complete: its decoder keeps no state per slot, and completion prompts are laid out as
    shared blocks (engine/prompt_blocks.py) that its recurrence does not walk."""
    inferred = {"id": name, "family": config.get("model_type"), "media": list(media or [])}
    if not decodes_slots(config):
        inferred["capabilities"] = ["score"]
    return inferred


def decodes_slots(config: dict) -> bool:
    """Whether the stack of this config.json decodes extraction and generated slots (an
    unknown architecture: as far as the manifest knows, yes; it fails to load anyway)."""
    from .models.registry import family_for

    try:
        return family_for(config).slots
    except ModelNotFoundError:
        return True


def read_file(path: Path) -> dict | None:
    """The directory's manifest file as a dict (None: it has none); bad JSON is one line."""
    file = Path(path) / MANIFEST_FILE
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ManifestError(f"{file}: not JSON: {err}", param="model") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{file}: not a JSON object", param="model")
    return data


def load(path: Path | None, name: str, config: dict, media: list[str] | None = None
         ) -> Manifest:
    """The checkpoint's manifest: its file's fields over what is inferred from the config."""
    inferred = infer(name, config, media)
    own = read_file(path) if path is not None else None
    try:
        return Manifest.model_validate({**inferred, **(own or {})})
    except ValidationError as err:
        raise ManifestError(f"{Path(path) / MANIFEST_FILE}: {one_line(err)}",
                            param="model") from None


def one_line(err: ValidationError) -> str:
    """A pydantic error as one line: each problem's field path and message."""
    parts = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "manifest"
        parts.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)

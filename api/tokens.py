"""The served model's tokenizer at the API, so that the token limits are checked before a job
is queued (spinf_worker/request_limits.py). No torch: the ``tokenizers`` library reads the
model's tokenizer.json, when it is installed.

The API knows the model by the name its workers register, and reads the tokenizer.json a
worker loads for that name (models/loader.py): the model directory a path names, the
packaged default converted in the cache, a GGUF converted in the cache (by the name in its
marker), or a Hub snapshot in the Hub cache. With no ``tokenizers``, or no such file on this
machine, there is no tokenizer: the API then checks only what needs none, and the worker
refuses the rest after the job is queued. The counts are exact (the same file, read the same
way), so the API never refuses what a worker would score.
"""

from __future__ import annotations

import json
import os
import threading
import time
from functools import lru_cache
from pathlib import Path

import structlog

from spinf_worker.media import ImageText
from spinf_worker.model_names import INSTRUCT_NAME, auto_presentation, is_default  # noqa: F401 - the rule, here too
from spinf_worker.models.cache import CONVERSION_MARKER, DEFAULT_DIR, cache_root
from spinf_worker.request_limits import ServedTokens

log = structlog.get_logger("spinf.api")

MISS_RETRY_S = 30.0        # a model whose tokenizer was not found is looked for again after this
SHORT_TEXT = 1024          # texts up to this many characters (templates, options) are memoised
MARKER = CONVERSION_MARKER


def hub_cache() -> Path:
    if env := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env)
    home = os.environ.get("HF_HOME")
    return Path(home) / "hub" if home else Path.home() / ".cache" / "huggingface" / "hub"


def model_dir(model: str) -> Path | None:
    """The directory a worker loads ``model`` from, when it is on this machine."""
    if is_default(model):
        target = cache_root() / "models" / DEFAULT_DIR
        return target if (target / MARKER).is_file() else None
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    models = cache_root() / "models"
    if models.is_dir():
        for marker in sorted(models.glob(f"*/{MARKER}")):
            try:
                if json.loads(marker.read_text()).get("name") == model:
                    return marker.parent
            except (OSError, ValueError):
                continue
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        repo = hub_cache() / f"models--{model.replace('/', '--')}"
        try:
            revision = (repo / "refs" / "main").read_text().strip()
        except OSError:
            return None
        snapshot = repo / "snapshots" / revision
        return snapshot if snapshot.is_dir() else None
    return None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def load(model: str) -> ServedTokens | None:
    """The tokenizer, presentation and context of ``model``; None when they cannot be had."""
    directory = model_dir(model)
    if directory is None or not (directory / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception as err:   # a damaged file: the worker will say what it is
        log.warning("cannot read the model's tokenizer", model=model, error=repr(err))
        return None
    tokenizer.post_processor = None   # as the worker: BOS is added as an id, never by it

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False).ids)

    short = lru_cache(maxsize=65536)(ids)

    def encode(text: str) -> tuple[int, ...]:
        return short(text) if len(text) <= SHORT_TEXT else ids(text)

    raw_config = _read_json(directory / "config.json")
    config = raw_config.get("text_config") or raw_config
    context = config.get("max_position_embeddings")
    tokenizer_config = _read_json(directory / "tokenizer_config.json")
    chat = ((directory / "chat_template.jinja").is_file()
            or bool(tokenizer_config.get("chat_template"))
            or bool(_read_json(directory / "chat_template.json").get("chat_template")))
    mode = auto_presentation(model, chat)
    log.info("model tokenizer loaded", model=model, path=str(directory), mode=mode,
             context=context)
    # a Gemma 4's processor settings (its image token counts follow each image's size)
    processor = _read_json(directory / "processor_config.json")
    processor["image_processor"] = (processor.get("image_processor")
                                    or _read_json(directory / "preprocessor_config.json"))
    processor["video_processor"] = (processor.get("video_processor")
                                    or _read_json(directory / "video_preprocessor_config.json"))
    return ServedTokens(encode, mode, context if isinstance(context, int) else None,
                        ImageText.from_config(raw_config, tokenizer.id_to_token, processor))


class TokenizerCache:
    """Each model's ServedTokens, loaded once (a blocking call: run it on a thread); a model
    not found is looked for again after MISS_RETRY_S (its conversion may finish)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._found: dict[str, ServedTokens] = {}
        self._missed: dict[str, float] = {}

    def loaded(self, model: str) -> ServedTokens | None:
        """The model's ServedTokens when loaded already (never blocks)."""
        return self._found.get(model)

    def get(self, model: str) -> ServedTokens | None:
        found = self._found.get(model)
        if found is not None:
            return found
        with self._lock:
            if (found := self._found.get(model)) is not None:
                return found
            missed = self._missed.get(model)
            if missed is not None and time.monotonic() - missed < MISS_RETRY_S:
                return None
            found = load(model)
            if found is None:
                self._missed[model] = time.monotonic()
                log.info("no tokenizer for the served model here; token limits are left "
                         "to the workers", model=model)
                return None
            self._found[model] = found
            self._missed.pop(model, None)
            return found

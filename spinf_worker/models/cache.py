"""Where converted models live, without torch: the loader writes conversions there and the
API reads a served model's tokenizer from there (api/tokens.py)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

CONVERSION_MARKER = "spinf-source.json"  # written last: its presence means the directory is complete
DEFAULT_DIR = "google--gemma-3-270m"     # the packaged default's conversion, under models/


def cache_root() -> Path:
    env = os.environ.get("SPINF_CACHE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir("spinf-serve"))

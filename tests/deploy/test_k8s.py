"""deploy/k8s: both overlays render with `kubectl kustomize`, and every rendered object
validates against a schema: the built-in kinds against the Kubernetes OpenAPI schemas in strict
mode (kubernetes-validate: unknown fields fail too), KEDA's ScaledObject and the Prometheus
Operator's ServiceMonitor against the narrower schemas of crd_schemas.py. Then the cross-object
facts no schema sees: references resolve, KEDA watches the streams and group the workers really
use (spinf_worker/queue/keys.py), the probes, the device of each overlay.

`kubectl apply --dry-run=client` is not used: it needs an API server for discovery even then
(deploy/README.md quotes the error)."""

from __future__ import annotations

import copy
import os
from functools import cache
from urllib.parse import urlsplit

import pytest
import yaml

from .crd_schemas import CUSTOM
from .tools import K8S, executable, run

OVERLAYS = ("cpu", "gpu")
K8S_VERSION = "1.30"          # the oldest Kubernetes the manifests are checked against
EXTERNAL_SECRETS = {"spinf-secrets"}   # created by the operator (deploy/README.md)


def _kubectl() -> str:
    binary = executable("kubectl")
    if binary is None:
        pytest.skip("kubectl is not installed")
    return binary


@cache
def _render(path: str) -> tuple[dict, ...]:
    done = run([_kubectl(), "kustomize", path])
    assert done.returncode == 0, done.stderr
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def rendered(overlay: str) -> list[dict]:
    return copy.deepcopy(list(_render(str(K8S / "overlays" / overlay))))


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_specs(docs: list[dict]):
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield d, d["spec"]["template"]["spec"]


def config(docs: list[dict]) -> dict[str, str]:
    [cm] = [d for d in docs if d["kind"] == "ConfigMap" and
            d["metadata"]["name"].startswith("spinf-config")]
    return cm["data"]


@pytest.fixture(scope="module")
def kubernetes_validate():
    return pytest.importorskip("kubernetes_validate",
                               reason="kubernetes-validate (the dev extra) is not installed")


@pytest.fixture(scope="module")
def jsonschema():
    return pytest.importorskip("jsonschema", reason="jsonschema is not installed")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders(overlay):
    kinds = sorted(d["kind"] for d in rendered(overlay))
    assert kinds == sorted(["Namespace", "ConfigMap", "Service", "Service", "Deployment",
                            "Deployment", "Deployment", "Deployment", "StatefulSet",
                            "HorizontalPodAutoscaler", "PodDisruptionBudget", "ScaledObject",
                            "ServiceMonitor"])
    for d in rendered(overlay):
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "spinf", d["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates(overlay, kubernetes_validate, jsonschema):
    for d in rendered(overlay):
        where = f"{d['kind']}/{d['metadata']['name']}"
        custom = CUSTOM.get((d["apiVersion"], d["kind"]))
        if custom is not None:
            jsonschema.Draft202012Validator(custom).validate(d)
            continue
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{where}: no schema for {d['apiVersion']} {d['kind']}")
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{where}: {err.message}")


def test_the_validators_refuse_bad_objects(kubernetes_validate, jsonschema):
    """The schemas bite: a misspelt field, a wrong type, a KEDA trigger missing what it needs."""
    docs = rendered("cpu")
    api = copy.deepcopy(by_kind(docs, "Deployment")["spinf-api"])
    api["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(api, K8S_VERSION, strict=True)
    api = copy.deepcopy(by_kind(docs, "Deployment")["spinf-api"])
    api["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(api, K8S_VERSION, strict=True)

    scaled = by_kind(docs, "ScaledObject")["spinf-worker-bulk"]
    schema = jsonschema.Draft202012Validator(CUSTOM[("keda.sh/v1alpha1", "ScaledObject")])
    broken = copy.deepcopy(scaled)
    del broken["spec"]["triggers"][0]["metadata"]["activationLagCount"]
    assert not schema.is_valid(broken)
    broken = copy.deepcopy(scaled)
    broken["spec"]["minReplicas"] = 0
    assert not schema.is_valid(broken)
    broken = copy.deepcopy(scaled)
    broken["spec"]["triggers"][0]["metadata"]["lagCount"] = 64
    assert not schema.is_valid(broken)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_resolve(overlay):
    docs = rendered(overlay)
    configmaps = set(by_kind(docs, "ConfigMap"))
    for owner, pod in pod_specs(docs):
        for container in pod["containers"]:
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in configmaps, owner["metadata"]["name"]
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] in EXTERNAL_SECRETS
    # each Service selects pods of some workload, and names a port they have
    for service in by_kind(docs, "Service").values():
        selector = service["spec"]["selector"]
        pods = [pod for owner, pod in pod_specs(docs)
                if selector.items() <= owner["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, service["metadata"]["name"]
        ports = {p["name"] for pod in pods for c in pod["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    # HPA, PDB, ScaledObject and ServiceMonitor point at what is there
    deployments = by_kind(docs, "Deployment")
    for hpa in by_kind(docs, "HorizontalPodAutoscaler").values():
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
    for pdb in by_kind(docs, "PodDisruptionBudget").values():
        labels = deployments["spinf-api"]["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    [monitor] = by_kind(docs, "ServiceMonitor").values()
    api_service = by_kind(docs, "Service")["spinf-api"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        api_service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= \
        {p["name"] for p in api_service["spec"]["ports"]}
    assert [e["path"] for e in monitor["spec"]["endpoints"]] == ["/metrics"]
    # each selector matches its own template
    for owner, _pod in pod_specs(docs):
        assert owner["spec"]["selector"]["matchLabels"].items() <= \
            owner["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_scales_the_bulk_workers_on_the_real_streams(overlay):
    from spinf_worker.queue.keys import GROUP, Keys

    docs = rendered(overlay)
    settings = config(docs)
    keys = Keys(settings["SPINF_PREFIX"])
    [scaled] = by_kind(docs, "ScaledObject").values()
    spec = scaled["spec"]
    assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1
    target = by_kind(docs, "Deployment")[spec["scaleTargetRef"]["name"]]
    assert "replicas" not in target["spec"], "KEDA owns the scaled Deployment's replicas"
    triggers = spec["triggers"]
    assert {t["type"] for t in triggers} == {"redis-streams"}
    bulk = [t["metadata"] for t in triggers if t["metadata"]["stream"] == keys.bulk]
    assert any("lagCount" in m for m in bulk) and any("pendingEntriesCount" in m for m in bulk)
    for t in triggers:
        meta = t["metadata"]
        assert meta["stream"] in keys.streams
        assert meta["consumerGroup"] == GROUP
        # the address comes from the target's env: the ConfigMap, the same Redis as the URL
        variable = meta["addressFromEnv"]
        url = urlsplit(settings["SPINF_REDIS_URL"])
        assert settings[variable] == f"{url.hostname}:{url.port or 6379}"
        [container] = target["spec"]["template"]["spec"]["containers"]
        assert any(s["configMapRef"]["name"].startswith("spinf-config")
                   for s in container["envFrom"])
    # the floor keeps the API ready (/ready needs a live worker) while the bulk pool is at zero
    floor = by_kind(docs, "Deployment")["spinf-worker"]
    assert floor["spec"]["replicas"] >= 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_api_probes_and_security(overlay):
    docs = rendered(overlay)
    [api] = by_kind(docs, "Deployment")["spinf-api"]["spec"]["template"]["spec"]["containers"]
    assert api["livenessProbe"]["httpGet"]["path"] == "/health"
    assert api["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert api["startupProbe"]["httpGet"]["path"] == "/health"
    assert api["image"] == "spinf-serve:api"
    for owner, pod in pod_specs(docs):
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] > 0, \
            owner["metadata"]["name"]


@pytest.mark.parametrize("overlay, device", [("cpu", "cpu"), ("gpu", "cuda")])
def test_worker_device(overlay, device):
    docs = rendered(overlay)
    workers = [d for d in by_kind(docs, "Deployment").values()
               if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"]
    assert {w["metadata"]["name"] for w in workers} == {"spinf-worker", "spinf-worker-bulk"}
    for worker in workers:
        [container] = worker["spec"]["template"]["spec"]["containers"]
        assert container["image"] == f"spinf-serve:{device}"
        assert container["command"] == ["tini", "--", "spinf-serve"]
        assert container["args"][:3] == ["worker", "--name", "$(POD_NAME)"]
        assert container["args"][-2:] == ["--device", device]
        limits = container["resources"]["limits"]
        if device == "cuda":
            assert limits["nvidia.com/gpu"] == 1
            assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
            tolerations = worker["spec"]["template"]["spec"]["tolerations"]
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} \
                in tolerations
        else:
            assert "nvidia.com/gpu" not in limits
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/root/.cache" in mounts


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_statefulset_keeps_an_aof(overlay):
    docs = rendered(overlay)
    redis = by_kind(docs, "StatefulSet")["spinf-redis"]
    [container] = redis["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "everysec"
    assert args[args.index("--dir") + 1] == "/data"
    assert "@sha256:" in container["image"]
    [claim] = redis["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in container["volumeMounts"]
    host = urlsplit(config(docs)["SPINF_REDIS_URL"]).hostname
    assert host == redis["spec"]["serviceName"] and host in by_kind(docs, "Service")


def test_an_external_redis_is_an_overlay_setting(tmp_path):
    """Leaving the redis component out and setting the URL: no StatefulSet, the URL is used."""
    overlay = tmp_path / "external"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "base", overlay)],   # kustomize: relative
        "configMapGenerator": [{"name": "spinf-config", "behavior": "merge", "literals": [
            "SPINF_REDIS_URL=redis://redis.example.internal:6380/2",
            "SPINF_REDIS_ADDRESS=redis.example.internal:6380"]}],
    }))
    docs = list(_render(str(overlay)))
    assert not by_kind(docs, "StatefulSet")
    settings = config(docs)
    assert settings["SPINF_REDIS_URL"] == "redis://redis.example.internal:6380/2"
    assert settings["SPINF_REDIS_ADDRESS"] == "redis.example.internal:6380"

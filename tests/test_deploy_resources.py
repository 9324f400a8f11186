"""deploy/kubernetes validates offline and is wired to what the code does.

Built-in kinds are checked by kubernetes-validate against the Kubernetes 1.37 schemas it
ships (strict: unknown fields fail). KEDA's ScaledObject and the Prometheus Operator's
ServiceMonitor are checked with jsonschema against the schemas in tests/fixtures/crds.
The rest checks the wiring: each ScaledObject watches exactly the streams and group the
workers of its target read (batching/keys.py), grace periods outlast the drains, every
selector finds its pods, and the job queue has a consumer.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from api.process_pool import STOP_GRACE_S as API_STOP_GRACE_S
from batching.config import QueueConfig
from batching.job_record import JOB_QUEUE
from batching.keys import GROUP, Keys
from batching.repository_scan import load_model_config
from tests.procs import ROOT
from workers.supervisor import KILL_GRACE_S, STOP_GRACE_S

KUBERNETES = ROOT / "deploy" / "kubernetes"
CRDS = ROOT / "tests" / "fixtures" / "crds"
KUBERNETES_VERSION = "1.37.0"
CUSTOM = {("keda.sh/v1alpha1", "ScaledObject"): "keda-scaledobject.yaml",
          ("monitoring.coreos.com/v1", "ServiceMonitor"): "prometheus-servicemonitor.yaml"}
"""Custom resources and the fixture schema each is checked against."""

Doc = dict[str, Any]


def manifests() -> list[tuple[Path, Doc]]:
    return [(path, doc) for path in sorted(KUBERNETES.rglob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def of_kind(kind: str) -> dict[str, Doc]:
    return {doc["metadata"]["name"]: doc for _, doc in manifests() if doc["kind"] == kind}


def schema(kind: tuple[str, str]) -> Any:
    return yaml.safe_load((CRDS / CUSTOM[kind]).read_text())


def container(deployment: Doc, name: str | None = None) -> Doc:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if name is None or c["name"] == name)


def command(deployment: Doc) -> list[str]:
    """The first container's command; [] for an image's own (Redis)."""
    return list(container(deployment).get("command", []))


def is_inference_worker(deployment: Doc) -> bool:
    argv = command(deployment)
    return argv[:4] == ["celery", "-A", "workers.app", "worker"] and "--no-inference" not in argv


def environment(deployment: Doc, name: str | None = None) -> dict[str, str]:
    """The container's plain environment: its ConfigMaps, then its own ``env`` over them."""
    maps = of_kind("ConfigMap")
    found: dict[str, str] = {}
    c = container(deployment, name)
    for source in c.get("envFrom", []):
        found.update(maps[source["configMapRef"]["name"]]["data"])
    found.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    return found


def matches(selector: Doc, labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_builtin_kinds_validate_against_kubernetes_strictly() -> None:
    kinds = set()
    for path, doc in manifests():
        key = (doc["apiVersion"], doc["kind"])
        if key in CUSTOM:
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.relative_to(ROOT)} {doc['kind']} {doc['metadata']['name']}: "
                        f"{'.'.join(map(str, exc.path))}: {exc.message}")
        kinds.add(key)
    assert {("apps/v1", "Deployment"), ("autoscaling/v2", "HorizontalPodAutoscaler"),
            ("policy/v1", "PodDisruptionBudget"), ("v1", "Service"), ("v1", "ConfigMap")} <= kinds


def test_kubernetes_validate_refuses_unknown_fields() -> None:
    """Strict mode is what catches a misspelt field; the schemas are really there."""
    deployment = of_kind("Deployment")["conveyor-worker"]
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError, match="terminationGracePeriod"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_custom_resources_validate_against_their_crd_schemas() -> None:
    seen = set()
    for path, doc in manifests():
        key = (doc["apiVersion"], doc["kind"])
        if key not in CUSTOM:
            continue
        validator = jsonschema.Draft202012Validator(schema(key))
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in validator.iter_errors(doc)]
        assert not errors, f"{path.relative_to(ROOT)} {doc['metadata']['name']}: {errors}"
        seen.add(key)
    assert seen == set(CUSTOM)


@pytest.mark.parametrize(("change", "why"), [
    (lambda so: so["spec"]["triggers"][0]["metadata"].update(lagCount=64), "not of type 'string'"),
    (lambda so: so["spec"]["triggers"][0]["metadata"].update(consumergroup="workers"),
     "'consumergroup' was unexpected"),
    (lambda so: so["spec"]["triggers"][0]["metadata"].pop("stream"), "'stream' is a required"),
    (lambda so: so["spec"].update(minReplicas=1), "'minReplicas' was unexpected"),
    (lambda so: so["spec"]["advanced"]["scalingModifiers"].update(metricType="Utilization"),
     "is not one of"),
])
def test_the_scaledobject_schema_refuses_mistakes(change: Any, why: str) -> None:
    key = ("keda.sh/v1alpha1", "ScaledObject")
    scaled = of_kind("ScaledObject")["conveyor-worker"]
    jsonschema.validate(scaled, schema(key), cls=jsonschema.Draft202012Validator)
    change(scaled)
    with pytest.raises(jsonschema.ValidationError, match=re.escape(why)):
        jsonschema.validate(scaled, schema(key), cls=jsonschema.Draft202012Validator)


def test_the_servicemonitor_schema_refuses_mistakes() -> None:
    key = ("monitoring.coreos.com/v1", "ServiceMonitor")
    monitor = of_kind("ServiceMonitor")["conveyor-api"]
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError, match="does not match"):
        jsonschema.validate(monitor, schema(key), cls=jsonschema.Draft202012Validator)


def served_models(deployment: Doc) -> list[str]:
    models = environment(deployment, "worker").get("CONVEYOR_MODELS", "")
    assert models, f"{deployment['metadata']['name']} serves every model: scale it per model"
    return [m.strip() for m in models.split(",")]


def priority_levels(model: str) -> int:
    """From the model's folder when it is in the repository; the default otherwise (the
    GPU pools' example models)."""
    folder = ROOT / "models" / model
    if folder.is_dir():
        return load_model_config(folder).queue.priority_levels
    return QueueConfig().priority_levels


def test_scaledobjects_watch_every_stream_of_their_pools_models() -> None:
    deployments = of_kind("Deployment")
    scaled_objects = of_kind("ScaledObject")
    inference = {name for name, d in deployments.items() if is_inference_worker(d)}
    assert {so["spec"]["scaleTargetRef"]["name"] for so in scaled_objects.values()} == inference
    for name, so in scaled_objects.items():
        spec = so["spec"]
        target = deployments[spec["scaleTargetRef"]["name"]]
        env = environment(target, spec["scaleTargetRef"]["envSourceContainerName"])
        keys = Keys(env["CONVEYOR_KEY_PREFIX"])
        pending: set[str] = set()
        lag: set[str] = set()
        for trigger in spec["triggers"]:
            meta = trigger["metadata"]
            assert trigger["type"] == "redis-streams"
            assert meta["consumerGroup"] == GROUP
            assert meta["addressFromEnv"] in env, f"{name}: {meta['addressFromEnv']} is not set"
            (lag if "lagCount" in meta else pending).add(meta["stream"])
        expected = {keys.queue(model, p) for model in served_models(target)
                    for p in range(1, priority_levels(model) + 1)}
        assert pending == expected, name
        assert lag == expected, name
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"], (
            f"{name}: the API is ready only while every model has a ready worker")


def test_scaling_formula_sums_every_trigger() -> None:
    for name, so in of_kind("ScaledObject").items():
        names = [t["name"] for t in so["spec"]["triggers"]]
        assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in names), names
        modifiers = so["spec"]["advanced"]["scalingModifiers"]
        terms = [term.strip() for term in modifiers["formula"].split("+")]
        assert sorted(terms) == sorted(names) and len(set(names)) == len(names), name
        assert float(modifiers["target"]) > 0


def test_redis_address_for_keda_is_the_redis_of_the_services() -> None:
    data = of_kind("ConfigMap")["conveyor-config"]["data"]
    host, port = data["KEDA_REDIS_ADDRESS"].rsplit(":", 1)
    url = re.fullmatch(r"redis://(?P<host>[^:/]+):(?P<port>\d+)/\d+", data["CONVEYOR_REDIS_URL"])
    assert url is not None
    assert host.split(".")[0] == url["host"] and port == url["port"]
    assert host.endswith(".svc.cluster.local"), "KEDA runs in its own namespace: a full name"


def test_gpu_pools_run_one_inference_process_per_gpu() -> None:
    deployments = of_kind("Deployment")
    pools = {d["metadata"]["name"]: d for path, d in manifests()
             if d["kind"] == "Deployment" and path.parent.name == "gpu"}
    assert len(pools) >= 2, "one Deployment per GPU kind"
    gpu_models: set[str] = set()
    for name, pool in pools.items():
        pod = pool["spec"]["template"]["spec"]
        assert container(pool, "worker")["resources"]["limits"]["nvidia.com/gpu"] == 1, name
        assert pod["nodeSelector"], name
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"]), name
        models = set(served_models(pool))
        assert not models & gpu_models, f"{name}: a model in two pools is scaled twice"
        gpu_models |= models
    assert not gpu_models & set(served_models(deployments["conveyor-worker"]))
    products = {p["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"]
                for p in pools.values()}
    assert len(products) == len(pools)


def test_grace_periods_outlast_the_drains() -> None:
    for name, deployment in of_kind("Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        grace = pod.get("terminationGracePeriodSeconds", 30)
        if command(deployment) == ["python", "-m", "api.serve"]:  # pause, then its processes' stop
            pre_stop = container(deployment)["lifecycle"]["preStop"]["exec"]["command"]
            assert pre_stop[0] == "sleep"
            assert grace > int(pre_stop[1]) + API_STOP_GRACE_S, name
        elif is_inference_worker(deployment):
            assert grace > STOP_GRACE_S + 2 * KILL_GRACE_S, name


def test_hpa_scales_the_api_on_cpu_and_owns_its_replicas() -> None:
    deployments = of_kind("Deployment")
    hpas = of_kind("HorizontalPodAutoscaler")
    assert set(hpas) == {"conveyor-api"}
    hpa = hpas["conveyor-api"]["spec"]
    target = deployments[hpa["scaleTargetRef"]["name"]]
    assert command(target) == ["python", "-m", "api.serve"]
    assert "replicas" not in target["spec"], "kubectl apply would undo the HPA's count"
    assert [m["resource"]["name"] for m in hpa["metrics"]] == ["cpu"]
    assert container(target)["resources"]["requests"]["cpu"]
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]


def test_every_scaled_deployment_leaves_replicas_to_its_scaler() -> None:
    deployments = of_kind("Deployment")
    for so in of_kind("ScaledObject").values():
        assert "replicas" not in deployments[so["spec"]["scaleTargetRef"]["name"]]["spec"]


def test_selectors_find_exactly_their_pods() -> None:
    deployments = of_kind("Deployment")
    templates = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in deployments.items()}
    for name, deployment in deployments.items():
        owners = [other for other, labels in templates.items()
                  if matches(deployment["spec"]["selector"], labels)]
        assert owners == [name], f"{name}'s selector also takes the pods of {owners}"
    budgets = of_kind("PodDisruptionBudget")
    covered = set()
    for name, budget in budgets.items():
        owners = [d for d, labels in templates.items() if matches(budget["spec"]["selector"], labels)]
        assert len(owners) == 1, f"PodDisruptionBudget {name} selects {owners}"
        covered.add(owners[0])
    several = {name for name, d in deployments.items() if d["spec"].get("replicas", 2) > 1}
    assert several <= covered, f"no PodDisruptionBudget for {several - covered}"
    for name, service in of_kind("Service").items():
        owners = [d for d, labels in templates.items() if matches(
            {"matchLabels": service["spec"]["selector"]}, labels)]
        assert len(owners) == 1, f"Service {name} selects {owners}"


def test_a_job_worker_consumes_the_job_queue() -> None:
    job_workers = [d for d in of_kind("Deployment").values()
                   if command(d)[4:6] == ["-Q", JOB_QUEUE]]
    assert len(job_workers) == 1, "without a job worker every job stays PENDING"
    argv = command(job_workers[0])
    assert argv[:4] == ["celery", "-A", "workers.app", "worker"]
    assert "--no-inference" in argv


def test_servicemonitor_scrapes_the_api_metrics_port() -> None:
    monitor = of_kind("ServiceMonitor")["conveyor-api"]["spec"]
    services = [s for s in of_kind("Service").values()
                if matches(monitor["selector"], s["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in services] == ["conveyor-api"]
    ports = {p["name"]: p for p in services[0]["spec"]["ports"]}
    (endpoint,) = monitor["endpoints"]
    assert endpoint["path"] == "/metrics"
    api = container(of_kind("Deployment")["conveyor-api"])
    named = {p["name"]: p["containerPort"] for p in api["ports"]}
    assert named[ports[endpoint["port"]]["targetPort"]] == 8000  # CONVEYOR_HTTP_PORT's default

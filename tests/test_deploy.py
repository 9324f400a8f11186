"""The deployment files stay valid: docker-compose.yml, the Procfile and Kubernetes manifests."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from batching.job_record import JOB_QUEUE
from tests.procs import ROOT


def test_docker_compose_declares_the_services_and_a_gpu_reservation() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "api", "worker", "jobs", "flower"} <= set(services)
    assert "8000:8000" in services["api"]["ports"]
    assert any("5555" in port for port in services["flower"]["ports"])
    gpu = [s for s in services.values()
           if s.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")]
    assert gpu, "no service shows how to reserve a GPU"


def test_docker_compose_runs_a_job_worker() -> None:
    """Jobs are Celery tasks on cv.jobs, which inference workers do not consume: without a
    job worker every job stays PENDING."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    consumers = [s["command"] for s in services.values()
                 if s.get("command", [])[4:6] == ["-Q", JOB_QUEUE] and not s.get("profiles")]
    assert len(consumers) == 1
    assert consumers[0][:4] == ["celery", "-A", "workers.app", "worker"]
    assert "--no-inference" in consumers[0]


def test_docker_compose_config_is_valid() -> None:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (Debian: apt-get install docker-compose)")
    subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                   check=True, cwd=ROOT)


def test_procfile_process_types_honour_port() -> None:
    lines = dict(line.split(":", 1) for line in (ROOT / "Procfile").read_text().splitlines()
                 if line.strip())
    assert {"api", "worker", "flower"} <= set(lines)
    assert all("$PORT" in lines[kind] or "${PORT" in lines[kind]
               for kind in ("api", "worker", "flower"))


def test_kubernetes_manifests_parse_and_probe_the_right_paths() -> None:
    docs = [d for path in sorted((ROOT / "deploy" / "kubernetes").rglob("*.yaml"))
            for d in yaml.safe_load_all(path.read_text()) if d]
    containers = [c for d in docs if d["kind"] == "Deployment"
                  for c in d["spec"]["template"]["spec"]["containers"]]
    (api,) = [c for c in containers if c["name"] == "api"]
    assert api["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert api["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    workers = [c for c in containers if c["name"] == "worker"]
    assert len(workers) >= 3  # the CPU pool and a pool per GPU kind
    for worker in workers:
        assert worker["livenessProbe"]["httpGet"]["path"] == "/live"
        assert worker["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_containers_start_the_api_with_its_guards_and_require_keys() -> None:
    """``python -m api.serve`` everywhere; in containers it listens beyond loopback, so keys."""
    procfile = dict(line.split(":", 1) for line in (ROOT / "Procfile").read_text().splitlines()
                    if line.strip())
    assert "python -m api.serve" in procfile["api"]
    assert "--address=${FLOWER_ADDRESS:-127.0.0.1}" in procfile["flower"]
    assert 'CMD ["python", "-m", "api.serve"]' in (ROOT / "Dockerfile").read_text()

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    api = compose["services"]["api"]
    assert api["command"] == ["python", "-m", "api.serve"]
    assert api["environment"]["CONVEYOR_API_KEYS_FILE"] == "/run/secrets/conveyor-api-keys"
    assert "conveyor-api-keys" in api["secrets"] and "conveyor-api-keys" in compose["secrets"]
    assert compose["services"]["flower"]["ports"] == ["127.0.0.1:5555:5555"]

    docs = [d for path in sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
            for d in yaml.safe_load_all(path.read_text()) if d]
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs
            if d["kind"] == "Deployment"}
    container = pods["conveyor-api"]["containers"][0]
    assert container["command"] == ["python", "-m", "api.serve"]
    keys_file = next(e["value"] for e in container["env"] if e["name"] == "CONVEYOR_API_KEYS_FILE")
    mount = next(m for m in container["volumeMounts"] if keys_file.startswith(m["mountPath"]))
    volume = next(v for v in pods["conveyor-api"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "conveyor-api-keys"
    flower_env = pods["conveyor-flower"]["containers"][0]["env"]
    assert any(e["name"] == "FLOWER_BASIC_AUTH" and "secretKeyRef" in e["valueFrom"]
               for e in flower_env)

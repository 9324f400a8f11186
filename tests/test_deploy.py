"""The deployment files stay valid: docker-compose.yml, the Procfile and Kubernetes manifests."""

from __future__ import annotations

import shutil
import subprocess

import yaml

from tests.procs import ROOT


def test_docker_compose_declares_the_services_and_a_gpu_reservation() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "api", "worker", "flower"} <= set(services)
    assert "8000:8000" in services["api"]["ports"]
    assert any("5555" in port for port in services["flower"]["ports"])
    gpu = [s for s in services.values()
           if s.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")]
    assert gpu, "no service shows how to reserve a GPU"
    if shutil.which("docker-compose"):
        subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                       check=True)


def test_procfile_process_types_honour_port() -> None:
    lines = dict(line.split(":", 1) for line in (ROOT / "Procfile").read_text().splitlines()
                 if line.strip())
    assert {"api", "worker", "flower"} <= set(lines)
    assert all("$PORT" in lines[kind] or "${PORT" in lines[kind]
               for kind in ("api", "worker", "flower"))


def test_kubernetes_manifests_parse_and_probe_the_right_paths() -> None:
    docs = [d for path in sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
            for d in yaml.safe_load_all(path.read_text()) if d]
    containers = {c["name"]: c for d in docs if d["kind"] == "Deployment"
                  for c in d["spec"]["template"]["spec"]["containers"]}
    assert containers["api"]["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert containers["api"]["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert containers["worker"]["readinessProbe"]["httpGet"]["path"] == "/ready"

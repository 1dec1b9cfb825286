"""The deployment files (deploy/, docker-compose.yml), checked as far as this machine allows:
Docker cannot run here, so the Dockerfiles are read (every COPY source exists, each image
installs its own extra); the Kubernetes manifests are validated offline against the schemas
that kubernetes-validate bundles (strict: no unknown field), the InferencePool (a CRD it has no
schema for) by its required fields; and every command line in them parses with the core's and
the gateways' own flag parsers.
"""

from __future__ import annotations

import importlib
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

import core.config
from gateways import __main__ as gateway_main
from gateways.common.config import load as load_gateway
from gateways.common.targets import GENERATE_SERVICE, parse_core_target

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
KUBERNETES = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(KUBERNETES.glob("*.yaml"))
K8S_VERSION = "1.30.0"


def resources() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, doc) for p in MANIFESTS for doc in yaml.safe_load_all(p.read_text()) if doc]


def containers(kind: str | None = None) -> list[dict[str, Any]]:
    return [
        c
        for _, r in resources()
        if r["kind"] == "Deployment"
        for c in r["spec"]["template"]["spec"]["containers"]
        if kind is None or c["image"].startswith(f"trellis-{kind}")
    ]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def dockerfile_lines(name: str) -> list[str]:
    """The instructions of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DOCKER / name).read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("name", ["gateway.Dockerfile", "core.Dockerfile"])
def test_every_copy_source_exists(name):
    copies = [shlex.split(line)[1:-1] for line in dockerfile_lines(name) if line.startswith("COPY ")]
    assert copies
    for sources in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"{name}: COPY {source} does not exist"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "models" in ignored


@pytest.mark.parametrize("name", ["gateway.Dockerfile", "core.Dockerfile"])
def test_every_package_the_install_names_is_copied(name):
    """`pip install .` fails on a package that pyproject.toml lists and the image lacks."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    top = {p.split(".")[0] for p in setuptools["packages"]}
    dirs = {setuptools["package-dir"].get(p, p).split("/")[0] for p in top}
    copies = [shlex.split(line)[1:-1] for line in dockerfile_lines(name) if line.startswith("COPY ")]
    assert dirs <= {source for sources in copies for source in sources}


def test_the_gateway_image_installs_the_gateway_extra_without_torch():
    runs = " ".join(line for line in dockerfile_lines("gateway.Dockerfile") if line.startswith("RUN "))
    assert re.findall(r'pip install "?\.\[(\w+)\]', runs) == ["gateway"]
    assert "torch" not in runs
    assert 'ENTRYPOINT ["trellis-gateway"]' in dockerfile_lines("gateway.Dockerfile")


def test_the_core_image_installs_cpu_torch_then_the_core_extra():
    runs = " ".join(line for line in dockerfile_lines("core.Dockerfile") if line.startswith("RUN "))
    assert re.findall(r'pip install "?\.\[(\w+)\]', runs) == ["core"]
    assert runs.index("torch==2.13.0") < runs.index(".[core]")
    assert 'ENTRYPOINT ["trellis-core"]' in dockerfile_lines("core.Dockerfile")


def test_the_manifests_validate_against_the_kubernetes_schemas():
    checked = 0
    for _, resource in resources():
        if resource["kind"] == "InferencePool":
            continue
        kubernetes_validate.validate(resource, K8S_VERSION, strict=True)
        checked += 1
    kinds = {r["kind"] for _, r in resources()}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "InferencePool"} <= kinds
    assert checked >= 7


def test_cores_have_a_grpc_readiness_probe_a_headless_service_and_metrics():
    (service,) = [r for _, r in resources() if r["kind"] == "Service" and r["metadata"]["name"] == "trellis-core"]
    assert service["spec"]["clusterIP"] == "None"
    for container in containers("core"):
        assert container["readinessProbe"]["grpc"] == {"port": 50051, "service": GENERATE_SERVICE}
        assert {"name": "metrics", "containerPort": 9400} in container["ports"]
    for _, r in resources():
        if r["kind"] == "Deployment":
            annotations = r["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"


def test_the_gateways_find_every_core_through_the_headless_service():
    (gateway,) = [c for c in containers("gateway") if "TRELLIS_GATEWAY_CORE" in env_of(c)]
    target = parse_core_target(env_of(gateway)["TRELLIS_GATEWAY_CORE"])
    assert target.uri.startswith("dns:///trellis-core.") and target.several


def test_the_inference_pool_selects_pods_that_serve_its_port():
    (pool,) = [r for _, r in resources() if r["kind"] == "InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert spec["endpointPickerRef"]["name"] and spec["endpointPickerRef"]["port"]["number"]
    (member,) = [
        r
        for _, r in resources()
        if r["kind"] == "Deployment"
        and spec["selector"]["matchLabels"].items() <= r["spec"]["template"]["metadata"]["labels"].items()
    ]
    ports = {p["containerPort"] for c in member["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert {p["number"] for p in spec["targetPorts"]} <= ports


def test_every_command_line_parses_with_the_processes_own_flags():
    """Core and gateway arguments (manifests and compose) are flags the processes know."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    lines: list[tuple[str, list[str], dict[str, str]]] = []
    for c in containers():
        kind = "core" if c["image"].startswith("trellis-core") else "gateway"
        lines.append((kind, c["args"], env_of(c)))
    for name, service in compose["services"].items():
        dockerfile = service["build"]["dockerfile"]
        assert (ROOT / dockerfile).is_file(), name
        kind = "core" if "core" in dockerfile else "gateway"
        lines.append((kind, service["command"], {k: str(v) for k, v in service.get("environment", {}).items()}))
    gateways = set(gateway_main.GATEWAYS)
    for kind, args, env in lines:
        if kind == "core":
            config = core.config.load(args, env)
            assert config.model.startswith("/models/")
        else:
            name, *rest = args
            assert name in gateways, name
            module = importlib.import_module(f"gateways.{name}")
            load_gateway(name, module.DEFAULT_PORT, module.add_arguments, rest, env)
    assert {args[0] for kind, args, _ in lines if kind == "gateway"} == gateways

"""Deployment files: the compose stack and the Kubernetes manifests, validated offline.

- Prometheus config: the real ``promtool check config`` on the compose ``prometheus.yml`` laid
  out as the stack mounts it (rules and targets beside it).
- Alertmanager config: the real ``amtool check-config`` and ``amtool config routes test``.
- Compose file: parsed and validated by ``compose-spec`` (bindings of the Rust ``compose_spec``
  crate, which implements the Compose Specification and rejects unknown keys), plus checks of
  what a schema cannot see: mounted files exist, published ports are unique, images pinned.
- Kubernetes: the ConfigMaps against the Kubernetes 1.30 OpenAPI schema (``kubernetes-validate``,
  strict); PodMonitor and PrometheusRule against prometheus-operator v0.80's CRD models
  (``cloudcoil-models-prometheus-operator``, pydantic models generated from the CRDs' OpenAPI
  schema: types and enums are validated, and a field the CRD does not define is reported because
  it does not survive the round trip); the kustomization structurally (no kustomize here).
- OpenTelemetry Collector config: a structural check (no collector binary can run here).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import compose_spec
import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.prometheus_operator.v1 import PodMonitor, PrometheusRule

from rankwatch.exporter.config import RankwatchConfig
from tests.servers import REPO, require_binary

COMPOSE_DIR = REPO / "deploy" / "compose"
K8S_DIR = REPO / "deploy" / "kubernetes"
RULES = REPO / "dashboards" / "rules" / "rankwatch.rules.yml"


def _run(binary: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_binary(binary), *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())
    return data


def _mounts(service: str) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts (relative to the compose file)."""
    out = {}
    for volume in _compose()["services"][service].get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = (COMPOSE_DIR / source).resolve()
    return out


# --- Prometheus and Alertmanager -----------------------------------------------------------------


def test_promtool_check_config_of_compose_prometheus(tmp_path: Path) -> None:
    """Lay the files out as the container sees them, then let promtool check all of it."""
    mounts = _mounts("prometheus")
    root = tmp_path / "etc" / "prometheus"
    for target, source in mounts.items():
        assert target.startswith("/etc/prometheus/"), target
        dest = root / target.removeprefix("/etc/prometheus/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, dest)
        else:
            shutil.copy(source, dest)
    result = _run("promtool", "check", "config", str(root / "prometheus.yml"))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "SUCCESS: 1 rule files found" in out
    assert re.search(r"SUCCESS: \d+ rules found", out)


def test_compose_prometheus_scrapes_ranks_and_collector() -> None:
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert "rankwatch" in jobs["rankwatch"]["job_name"]
    collector = jobs["otel-collector"]
    assert collector["honor_labels"] is True
    (target,) = collector["static_configs"][0]["targets"]
    otel = yaml.safe_load((COMPOSE_DIR / "otel-collector.yaml").read_text())
    assert target == "otel-collector:" + otel["exporters"]["prometheus"]["endpoint"].split(":")[1]
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == [
        "alertmanager:9093"
    ]
    # file_sd targets: one per local rank, 9464 + local_rank.
    groups = yaml.safe_load((COMPOSE_DIR / "targets" / "rankwatch.yml").read_text())
    ports = [int(t.rsplit(":", 1)[1]) for g in groups for t in g["targets"]]
    assert ports == list(range(9464, 9464 + len(ports)))


def test_amtool_check_config() -> None:
    result = _run("amtool", "check-config", str(COMPOSE_DIR / "alertmanager.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["alertname=RankwatchStepTimeStragglerCritical", "severity=critical"], "pager"),
        (["alertname=RankwatchDeepEPGlobalDataPathSlowdown", "severity=critical"], "pager"),
        (["alertname=RankwatchExporterDown", "severity=warning"], "default"),
    ],
)
def test_alertmanager_routes_critical_alerts_to_the_pager(labels: list[str], receiver: str) -> None:
    config = str(COMPOSE_DIR / "alertmanager.yml")
    result = _run("amtool", "config", "routes", "test", f"--config.file={config}", *labels)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == receiver


# --- compose ---------------------------------------------------------------------------------


def _compose_text() -> str:
    """The compose file as the validator reads it.

    ``host-gateway`` is Docker Engine's name for the host's address in ``extra_hosts``; the
    Compose Specification only says "host:IP" and the Rust crate insists on an IP literal, so the
    check sees a documentation address in its place.
    """
    text = (COMPOSE_DIR / "compose.yaml").read_text()
    assert text.count(":host-gateway") == 1
    return text.replace(":host-gateway", ":192.0.2.1")


def test_compose_file_is_valid_compose_spec() -> None:
    text = _compose_text()
    project = compose_spec.PyCompose.from_yaml(text)
    project.validate()
    assert set(project.service_names()) == {
        "prometheus",
        "alertmanager",
        "grafana",
        "otel-collector",
    }


def test_compose_validation_rejects_a_typo() -> None:
    """The validator is strict: an unknown service key is an error, not ignored."""
    text = _compose_text().replace("    ports:", "    portz:", 1)
    with pytest.raises(Exception, match="portz"):
        compose_spec.PyCompose.from_yaml(text)


def test_compose_references() -> None:
    services = _compose()["services"]
    published: list[str] = []
    for name, svc in services.items():
        image = svc["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image"
        for dep in svc.get("depends_on", []):
            assert dep in services
        published += [p.split(":")[0] for p in svc.get("ports", [])]
        for target, source in _mounts(name).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) does not exist"
    assert len(published) == len(set(published)), "a host port is published twice"
    # The collector's OTLP ports are the ones the compose file publishes.
    otel = yaml.safe_load((COMPOSE_DIR / "otel-collector.yaml").read_text())
    protocols = otel["receivers"]["otlp"]["protocols"]
    otlp_ports = {p["endpoint"].rsplit(":", 1)[1] for p in protocols.values()}
    assert otlp_ports == {"4317", "4318"} and otlp_ports <= set(published)


def test_otel_collector_config_structure() -> None:
    """Every pipeline component is defined, and every defined component is used."""
    otel = yaml.safe_load((COMPOSE_DIR / "otel-collector.yaml").read_text())
    assert set(otel) == {"receivers", "processors", "exporters", "service"}
    pipelines = otel["service"]["pipelines"]
    assert set(pipelines) == {"metrics", "logs"}
    used: dict[str, set[str]] = {"receivers": set(), "processors": set(), "exporters": set()}
    for pipeline in pipelines.values():
        for kind in used:
            for component in pipeline.get(kind, []):
                assert component in otel[kind], f"{component} is not defined under {kind}"
                used[kind].add(component)
    for kind, names in used.items():
        assert names == set(otel[kind]), f"unused {kind}: {set(otel[kind]) - names}"
    # memory_limiter must come first in a pipeline, batch after it.
    for pipeline in pipelines.values():
        assert pipeline["processors"] == ["memory_limiter", "batch"]
    prom = otel["exporters"]["prometheus"]
    # The translation must add the unit and _total/_ratio suffixes back: the OTel instruments
    # are named without them so that both paths give the catalogue's names.
    assert prom["add_metric_suffixes"] is True
    assert pipelines["metrics"]["exporters"] == ["prometheus"]


# --- Kubernetes -----------------------------------------------------------------------------


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S_DIR / name).read_text()) if d]


def _lost(original: Any, decoded: Any, path: str = "") -> list[str]:
    if isinstance(original, dict):
        if not isinstance(decoded, dict):
            return [path]
        return [
            p
            for k, v in original.items()
            for p in ([f"{path}/{k}"] if k not in decoded else _lost(v, decoded[k], f"{path}/{k}"))
        ]
    if isinstance(original, list):
        if not isinstance(decoded, list) or len(original) != len(decoded):
            return [path]
        return [
            p
            for i, (a, b) in enumerate(zip(original, decoded, strict=True))
            for p in _lost(a, b, f"{path}[{i}]")
        ]
    return [] if original == decoded else [path]


def _crd_check(model: Any, doc: dict[str, Any]) -> list[str]:
    obj = model.model_validate(doc)
    return _lost(doc, obj.model_dump(by_alias=True, exclude_unset=True, mode="json"))


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    assert set(kustomization) <= {"apiVersion", "kind", "resources", "labels", "namespace"}
    manifests = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests


def test_dashboard_configmaps_validate_against_kubernetes_schema() -> None:
    docs = _docs("dashboards.yaml")
    assert {d["metadata"]["name"] for d in docs} == {
        "rankwatch-overview-dashboard",
        "rankwatch-step-time-dashboard",
        "rankwatch-deepep-normal-dashboard",
        "rankwatch-fleet-dashboard",
    }
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
        assert doc["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((key, text),) = doc["data"].items()
        assert text == (REPO / "dashboards" / key).read_text()
        # A ConfigMap holds at most 1 MiB.
        assert len(text.encode()) < 1024 * 1024


def test_kubernetes_schema_check_rejects_a_bad_configmap() -> None:
    doc = _docs("dashboards.yaml")[0]
    doc["metadata"]["lables"] = doc["metadata"].pop("labels")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, "1.30.0", strict=True)


def test_podmonitor_against_crd_schema() -> None:
    (doc,) = _docs("podmonitor.yaml")
    assert _crd_check(PodMonitor, doc) == []
    assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    endpoints = doc["spec"]["podMetricsEndpoints"]
    # One endpoint per local-rank port, named after the local rank.
    assert [e["port"] for e in endpoints] == [f"rankwatch-{i}" for i in range(8)]
    for e in endpoints:
        assert len(e["port"]) <= 15  # an IANA service name, as container port names must be
        assert {"targetLabel": "job", "replacement": "rankwatch", "action": "replace"} in e[
            "relabelings"
        ]


def test_crd_check_catches_unknown_and_invalid_fields() -> None:
    (doc,) = _docs("podmonitor.yaml")
    doc["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    assert _crd_check(PodMonitor, doc) == ["/spec/podMetricsEndpoints[0]/intervall"]
    del doc["spec"]["podMetricsEndpoints"][0]["intervall"]
    doc["spec"]["podMetricsEndpoints"][0]["scheme"] = "ftp"
    with pytest.raises(ValueError, match="scheme"):
        PodMonitor.model_validate(doc)


def test_prometheusrule_is_the_shipped_rule_file(tmp_path: Path) -> None:
    (doc,) = _docs("prometheusrule.yaml")
    assert _crd_check(PrometheusRule, doc) == []
    assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert doc["spec"] == yaml.safe_load(RULES.read_text())
    # And what the operator hands Prometheus passes promtool.
    rule_file = tmp_path / "rules.yml"
    rule_file.write_text(yaml.safe_dump(doc["spec"]))
    result = _run("promtool", "check", "rules", str(rule_file))
    assert result.returncode == 0, result.stdout + result.stderr


def test_example_trainer_sets_the_node_name_and_the_scraped_ports() -> None:
    (job,) = yaml.safe_load_all((K8S_DIR / "example" / "trainer-job.yaml").read_text())
    kubernetes_validate.validate(job, "1.30.0", strict=True)
    pod = job["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    # The variable rankwatch reads by default, filled from the downward API.
    node_var = RankwatchConfig().node_name_env
    assert env[node_var]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"].endswith(":4318")  # default protocol: HTTP
    # The PodMonitor's selector and port names find it.
    (monitor,) = _docs("podmonitor.yaml")
    for key, value in monitor["spec"]["selector"]["matchLabels"].items():
        assert pod["metadata"]["labels"][key] == value
    scraped = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert set(ports) <= scraped
    assert all(ports[f"rankwatch-{i}"] == 9464 + i for i in range(len(ports)))

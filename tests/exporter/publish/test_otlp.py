"""The push path: OTLP metrics and incident log records.

* The golden test publishes the same reports both ways: ``/metrics`` scraped over HTTP, and OTLP
  pushed to a real VictoriaMetrics started with ``-opentelemetry.usePrometheusNaming`` (its
  OTLP-to-Prometheus translation), then queried. Names, label sets and values must agree.
* VictoriaMetrics takes no logs and speaks no gRPC, so log records and the gRPC path go to the
  small real receivers of ``tests/otlp_receiver.py``, which decode ``ExportLogsServiceRequest``
  / ``ExportMetricsServiceRequest`` with ``opentelemetry-proto``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families as parse_text

import rankwatch
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.identity import build_labels, k8s_attributes
from rankwatch.exporter.publish.catalogue import CATALOGUE
from rankwatch.exporter.publish.hub import PublisherHub
from rankwatch.exporter.publish.otlp import (
    OtlpPublisher,
    OtlpSettings,
    otel_resource,
    otlp_settings,
)
from tests.otlp_receiver import GrpcReceiver, HttpReceiver
from tests.publish_reports import (
    T0,
    deepep_window,
    full_report,
    low_latency,
    normal_reports,
    rank_infos,
    step_report,
    window,
)
from tests.servers import REPO, http_get, prom_query, victoria_metrics, wait_until

OTEL_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
    "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_SDK_DISABLED",
    "OTEL_METRICS_EXPORTER",
    "OTEL_LOGS_EXPORTER",
    "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE",
)


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


def scraped(url: str) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    """(name, non-empty labels, value) of every sample on ``/metrics``."""
    out = set()
    for fam in parse_text(http_get(url).decode()):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if v != ""))
            out.add((s.name, labels, float(s.value)))
    return out


def resource_labels(resource_attributes) -> set[str]:
    """Label names VictoriaMetrics derives from resource attributes (dots to underscores)."""
    return {re.sub(r"[^a-zA-Z0-9_]", "_", k) for k in resource_attributes}


@pytest.mark.servers
@pytest.mark.parallel_safe
@pytest.mark.parametrize("in_child", [False, True], ids=["otlp_here", "otlp_in_child"])
def test_golden_prometheus_and_otlp_publish_the_same_series(monkeypatch, in_child):
    with victoria_metrics(["-opentelemetry.usePrometheusNaming"]) as vm:
        monkeypatch.setenv(
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"{vm.url}/opentelemetry/v1/metrics"
        )
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=golden")
        config = RankwatchConfig(
            metrics_port=0,
            run_id="golden",
            otlp_export_interval_seconds=3600.0,
            otlp_process_min_points=1 if in_child else 0,  # 1: every export in a child process
        )
        now = T0 + 30.0
        hub = PublisherHub(config, rank=0, hostname="trainer-0", clock=lambda: now)
        try:
            assert hub.otlp is not None and hub.otlp.settings == OtlpSettings(True, False)
            hub.count_collection_error("gather_timeout")
            # Group "world" gets every engine at once; a DeepEP collector of group "ep" (EP 8)
            # publishes to the same hub in between, so the newest report is never the whole
            # state: both groups must be published side by side, on both paths.
            ep_normal = normal_reports(["pre_combine_delay"] * 3, ep=8, rpn=4)
            hub.publish(
                window(0, n=16, step_time=step_report(16), normal_invalid_reason="counter_reset")
            )
            hub.publish(deepep_window(0, ep_normal[0], ep=8, low_latency_invalid_reason="shape"))
            for i in (1, 2):  # two agreeing windows: incidents open on both engines and groups
                hub.publish(full_report(index=i, ep=16))
                ep_report = deepep_window(i, ep_normal[i], ep=8, low_latency_results=low_latency(8))
                hub.publish(ep_report)
            assert hub.flush(30)
            assert hub.metrics_url is not None
            want = scraped(hub.metrics_url)
            ignored = resource_labels(hub.otlp.resource.attributes)

            def ingested():
                http_get(f"{vm.url}/internal/force_flush")
                res = prom_query(vm, '{__name__=~"rankwatch_.*"}')
                return res if len(res) >= len(want) else None

            result = wait_until(ingested, 30, what="VictoriaMetrics to ingest the OTLP push")
            assert (hub.otlp.export_process_pid is not None) is in_child
        finally:
            hub.close(5)

    got: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    seen_ignored: set[str] = set()
    for r in result:
        metric = dict(r["metric"])
        name = metric.pop("__name__")
        seen_ignored |= set(metric) & ignored
        labels = tuple(sorted((k, v) for k, v in metric.items() if k not in ignored))
        got[(name, labels)] = float(r["value"][1])
    assert {"service_name", "service_instance_id", "rankwatch_run"} <= seen_ignored
    want_map = {(n, labels): v for n, labels, v in want}
    # the same metric names, the same label sets ...
    assert {n for n, _ in got} == {n for n, _ in want_map}
    assert set(got) == set(want_map)
    # ... and the same values. VictoriaMetrics stores 12 significant decimal digits.
    for key, value in want_map.items():
        assert math.isclose(got[key], value, rel_tol=1e-11, abs_tol=0.0), key
    names = {n for n, _ in want_map}
    for needed in (
        "rankwatch_incidents_total",
        "rankwatch_incident_active",
        "rankwatch_diagnosis_info",
        "rankwatch_deepep_window_invalid_total",
        "rankwatch_collection_errors_total",
        "rankwatch_phase_seconds",
        "rankwatch_deepep_notify_ratio",
        "rankwatch_deepep_ll_point_ratio",
        "rankwatch_build_info",
    ):
        assert needed in names
    assert len(want_map) > 1000
    groups: dict[str, set[str]] = {}
    for n, labels in want_map:
        groups.setdefault(n, set()).add(dict(labels)["group"])
    for name in (
        "rankwatch_phase_seconds",
        "rankwatch_diagnosis_info",
        "rankwatch_window_steps",
        "rankwatch_step_outlier_steps",
    ):
        assert groups[name] == {"world"}, name
    for name in (
        "rankwatch_deepep_notify_ratio",
        "rankwatch_deepep_ll_point_ratio",
        "rankwatch_window_index",
        "rankwatch_window_age_seconds",
        "rankwatch_incidents_total",
    ):
        assert groups[name] == {"world", "ep"}, name
    for name in ("rankwatch_exporter_up", "rankwatch_collection_errors_total"):
        assert groups[name] == {"world"}, name  # the process's own series, once
    invalid = {
        (dict(labels)["group"], dict(labels)["reason"])
        for n, labels in want_map
        if n == "rankwatch_deepep_window_invalid_total"
    }
    assert invalid == {("world", "counter_reset"), ("ep", "shape")}
    active = {
        (dict(labels)["group"], dict(labels)["class"])
        for n, labels in want_map
        if n == "rankwatch_incident_active"
    }
    assert ("world", "step_time_straggler") in active
    assert ("ep", "pre_stage_arrival_skew") in active
    assert not any(g == "ep" and c.startswith("step_time") for g, c in active)


def _hub(receiver_endpoint: str, monkeypatch, **config) -> PublisherHub:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver_endpoint)
    cfg = RankwatchConfig(
        metrics_port=0, run_id="r9", otlp_export_interval_seconds=3600.0, **config
    )
    return PublisherHub(cfg, rank=0, hostname="trainer-0")


def test_incident_open_and_close_arrive_once_as_log_records_and_json_lines(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="rankwatch.incidents")
    with HttpReceiver() as receiver:
        hub = _hub(receiver.endpoint, monkeypatch, incident_close_m=2)
        try:
            assert hub.otlp is not None and hub.otlp.settings == OtlpSettings(True, True)
            steps = ["S", "S", "S", ".", "."]
            normal = normal_reports(["pre_combine_delay"] * 3 + ["baseline"] * 2)
            for i, (c, nr) in enumerate(zip(steps, normal, strict=True)):
                st = step_report(16, culprit=11 if c == "S" else None)
                hub.publish(window(i, n=16, step_time=st, normal=nr))
                assert hub.flush(20)
            records = receiver.received.log_records()
        finally:
            hub.close(5)
    names = sorted((r["event_name"], r["attributes"]["rankwatch.incident.class"]) for r in records)
    assert names == [
        ("rankwatch.incident.close", "pre_stage_arrival_skew"),
        ("rankwatch.incident.close", "step_time_straggler"),
        ("rankwatch.incident.open", "pre_stage_arrival_skew"),
        ("rankwatch.incident.open", "step_time_straggler"),
    ]
    by_key = {(r["event_name"], r["attributes"]["rankwatch.incident.class"]): r for r in records}
    opened = by_key[("rankwatch.incident.open", "step_time_straggler")]
    attrs = opened["attributes"]
    assert attrs["rankwatch.incident.severity"] == "critical"
    # openings and closings at one level (WARN = 13); how bad it is is an attribute
    assert opened["severity_text"] == "WARN" and opened["severity_number"] == 13
    assert attrs["rankwatch.incident.culprit_ranks"] == [11]
    assert attrs["rankwatch.incident.hostnames"] == ["node-1"]
    assert attrs["rankwatch.incident.cause"] == "input_straggler"
    assert attrs["rankwatch.incident.evidence"]["victim_rank"] in range(16)
    assert attrs["rankwatch.run"] == "run-1" and attrs["rankwatch.group"] == "world"
    assert "rank 11" in opened["body"]
    skew = by_key[("rankwatch.incident.open", "pre_stage_arrival_skew")]["attributes"]
    assert skew["rankwatch.incident.probe"] == "cached_notify_combine"
    assert skew["rankwatch.incident.culprit_ranks"] == [9]
    closed = by_key[("rankwatch.incident.close", "step_time_straggler")]
    assert closed["attributes"]["rankwatch.incident.id"] == attrs["rankwatch.incident.id"]
    assert closed["severity_text"] == "WARN"
    assert closed["attributes"]["rankwatch.incident.close_reason"] == "clean windows"
    res = opened["resource"]
    assert res["service.name"] == "rankwatch" and res["rankwatch.run"] == "r9"
    assert res["rankwatch.rank"] == 0 and res["host.name"] == "trainer-0"
    assert opened["scope"] == "rankwatch"
    # the same four events as JSON lines, each once
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "rankwatch.incidents"]
    assert sorted((d["event"], d["incident.class"]) for d in lines) == names
    assert {d["incident.id"] for d in lines} == {
        r["attributes"]["rankwatch.incident.id"] for r in records
    }


def test_the_run_end_closes_open_incidents_as_log_records_too(monkeypatch):
    with HttpReceiver() as receiver:
        hub = _hub(receiver.endpoint, monkeypatch, incident_open_k=1, incident_open_n=1)
        hub.publish(window(0, n=4, step_time=step_report(4, culprit=2)))
        assert hub.flush(20)
        hub.close(5)  # the incident is still open: the close goes out before the last export
        records = receiver.received.log_records()
    assert [r["event_name"] for r in records] == [
        "rankwatch.incident.open",
        "rankwatch.incident.close",
    ]
    opened, closed = (r["attributes"] for r in records)
    assert closed["rankwatch.incident.id"] == opened["rankwatch.incident.id"]
    assert closed["rankwatch.incident.close_reason"] == "run ended"
    assert "closed (run ended)" in records[1]["body"]


def test_metrics_push_drops_departed_ranks_and_closed_incidents(monkeypatch):
    with HttpReceiver() as receiver:
        hub = _hub(
            receiver.endpoint,
            monkeypatch,
            incident_open_k=1,
            incident_open_n=1,
            incident_close_m=1,
        )
        try:
            hub.publish(window(0, n=4, step_time=step_report(4, culprit=3)))
            assert hub.flush(20)
            first = receiver.received.metric_points()
            hub.publish(window(1, n=3, step_time=step_report(3, culprit=None), ranks=rank_infos(3)))
            assert hub.flush(20)
            second = receiver.received.metric_points()
        finally:
            hub.close(5)
    by_name = {spec.otel_name: spec for spec in CATALOGUE}
    ranks = {p["attributes"]["rank"] for p in first["rankwatch.phase"]}
    assert ranks == {"0", "1", "2", "3"}
    assert [p["attributes"]["culprit_rank"] for p in first["rankwatch.incident.active"]] == ["3"]
    assert {p["attributes"]["rank"] for p in second["rankwatch.phase"]} == {"0", "1", "2"}
    assert "rankwatch.incident.active" not in second
    assert "rankwatch.incident.score" not in second
    for name, points in second.items():
        spec = by_name[name]
        for p in points:
            assert p["unit"] == spec.otel_unit
            assert set(p["attributes"]) == set(spec.all_labels), name
            assert math.isfinite(p["value"])
            if spec.type == "counter":
                assert p["kind"] == "sum" and p["monotonic"] is True
            else:
                assert p["kind"] == "gauge"
    totals = {
        (p["attributes"]["class"], p["attributes"]["severity"]): p["value"]
        for p in second["rankwatch.incidents"]
    }
    assert totals[("step_time_straggler", "critical")] == 1


def test_grpc_protocol_exports_metrics_and_logs(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with GrpcReceiver() as receiver:
        hub = _hub(receiver.endpoint, monkeypatch)
        try:
            assert hub.otlp is not None
            assert hub.otlp.settings == OtlpSettings(True, True, "grpc", "grpc")
            for i in range(2):
                hub.publish(window(i, n=4, step_time=step_report(4, culprit=1)))
                assert hub.flush(20)
            records = receiver.received.log_records()
            points = receiver.received.metric_points()
        finally:
            hub.close(5)
    assert [r["event_name"] for r in records] == ["rankwatch.incident.open"]
    assert records[0]["attributes"]["rankwatch.incident.culprit_ranks"] == [1]
    (info,) = points["rankwatch.diagnosis.info"]
    assert info["attributes"]["culprit_rank"] == "1"


def test_resource_identity_honours_the_environment(monkeypatch):
    config = RankwatchConfig(run_id="job-7", group_name="ep0")
    a = otel_resource(config, rank=0, local_rank=0, hostname="Host-A")
    b = otel_resource(config, rank=1, local_rank=1, hostname="Host-A")
    assert a.attributes["service.name"] == "rankwatch"
    assert a.attributes["service.instance.id"] != b.attributes["service.instance.id"]
    assert a.attributes["host.name"] == "host-a"
    assert (a.attributes["rankwatch.run"], a.attributes["rankwatch.group"]) == ("job-7", "ep0")
    assert (b.attributes["rankwatch.rank"], b.attributes["rankwatch.local_rank"]) == (1, 1)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "trainer")
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES",
        "service.instance.id=pod-7,rankwatch.run=from-env,deployment.environment=prod",
    )
    a = otel_resource(config, rank=0, hostname="h")
    b = otel_resource(config, rank=1, hostname="h")
    assert a.attributes["service.name"] == "trainer"
    assert a.attributes["rankwatch.run"] == "from-env"
    assert a.attributes["deployment.environment"] == "prod"
    assert (a.attributes["service.instance.id"], b.attributes["service.instance.id"]) == (
        "pod-7-rank0",
        "pod-7-rank1",
    )


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, OtlpSettings(False, False)),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, OtlpSettings(True, True)),
        ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://vm/x"}, OtlpSettings(True, False)),
        ({"OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "http://c/v1/logs"}, OtlpSettings(False, True)),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            OtlpSettings(True, True, "grpc", "grpc"),
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL": "http/protobuf",
            },
            OtlpSettings(True, True, "grpc", "http/protobuf"),
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_METRICS_EXPORTER": "none"},
            OtlpSettings(False, True),
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_LOGS_EXPORTER": "none"},
            OtlpSettings(True, False),
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_SDK_DISABLED": "true"},
            OtlpSettings(False, False),
        ),
    ],
)
def test_settings_follow_the_standard_variables(env, want):
    assert otlp_settings(env) == want


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "udp"}, "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"),
        ({"OTEL_EXPORTER_OTLP_LOGS_PROTOCOL": "thrift"}, "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL"),
    ],
)
def test_unknown_protocol_is_refused_by_variable_name(env, name):
    with pytest.raises(ValueError, match=name):
        otlp_settings(env)


def test_publisher_rejects_bad_input():
    config = RankwatchConfig()
    off = OtlpSettings(False, False)
    with pytest.raises(TypeError, match="config"):
        OtlpPublisher({}, list, settings=off)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="source"):
        OtlpPublisher(config, [], settings=off)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="settings"):
        OtlpPublisher(config, list, settings={"metrics": True})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="on_failure"):
        OtlpPublisher(config, list, settings=off, on_failure=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank"):
        otel_resource(config, rank=-1)
    with pytest.raises(TypeError, match="env"):
        otlp_settings(["OTEL_SDK_DISABLED"])  # type: ignore[arg-type]
    pub = OtlpPublisher(config, list, settings=off)
    try:
        assert not pub.enabled
        with pytest.raises(TypeError, match="event"):
            pub.emit("opened")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="timeout_seconds"):
            pub.flush(-1)
        with pytest.raises(ValueError, match="timeout_seconds"):
            pub.close(float("nan"))
    finally:
        pub.close(1)


def test_no_endpoint_means_no_otlp(monkeypatch):
    hub = PublisherHub(RankwatchConfig(metrics_enabled=False))
    try:
        assert hub.otlp is None
    finally:
        hub.close(1)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    hub = PublisherHub(RankwatchConfig(metrics_enabled=False, otlp_enabled=False))
    try:
        assert hub.otlp is None
    finally:
        hub.close(1)


def test_receiver_decodes_what_it_gets():
    # the receiver itself: a request it cannot route is a 404, not a silent success
    with HttpReceiver() as receiver:
        req = urllib.request.Request(f"{receiver.endpoint}/v1/traces", data=b"", method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=5)
        assert err.value.code == 404


def test_resource_carries_the_version_and_the_kubernetes_identity(monkeypatch, tmp_path):
    for name in ("NODE_NAME", "POD_NAME", "POD_NAMESPACE", "KUBERNETES_SERVICE_HOST", "MY_NODE"):
        monkeypatch.delenv(name, raising=False)
    config = RankwatchConfig()
    plain = otel_resource(config).attributes
    assert plain["service.version"] == rankwatch.__version__
    assert not any(k.startswith("k8s.") for k in plain)
    # The downward API: spec.nodeName, metadata.name, metadata.namespace.
    monkeypatch.setenv("NODE_NAME", "GPU-Node-3")
    monkeypatch.setenv("POD_NAME", "trainer-0")
    monkeypatch.setenv("POD_NAMESPACE", "ml")
    attrs = otel_resource(config).attributes
    assert attrs["host.name"] == "gpu-node-3"  # the node, not the pod
    assert (attrs["k8s.node.name"], attrs["k8s.pod.name"], attrs["k8s.namespace.name"]) == (
        "GPU-Node-3",
        "trainer-0",
        "ml",
    )
    # The variable holding the node name is configurable; an explicit hostname still wins.
    monkeypatch.setenv("MY_NODE", "node-b")
    custom = otel_resource(RankwatchConfig(node_name_env="MY_NODE")).attributes
    assert custom["host.name"] == "node-b" and custom["k8s.node.name"] == "node-b"
    assert otel_resource(config, hostname="Given").attributes["host.name"] == "given"


def test_kubernetes_attributes_fall_back_to_the_pod_hostname_and_namespace_file(tmp_path):
    ns = tmp_path / "namespace"
    ns.write_text("team-a\n")
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "job-worker-3"}
    assert k8s_attributes(env=env, namespace_file=ns) == {
        "k8s.pod.name": "job-worker-3",
        "k8s.namespace.name": "team-a",
    }
    # outside a cluster the machine's HOSTNAME is not a pod name
    assert k8s_attributes(env={"HOSTNAME": "laptop"}, namespace_file=ns) == {}


def test_build_info_is_published_on_both_paths(monkeypatch):
    with HttpReceiver() as receiver:
        hub = _hub(receiver.endpoint, monkeypatch)
        try:
            assert hub.flush(20) and hub.metrics_url is not None
            text = http_get(hub.metrics_url).decode()
            points = receiver.received.metric_points()
        finally:
            hub.close(5)
    version, python, torch_version = build_labels()
    assert version == rankwatch.__version__ and python.count(".") == 2
    assert torch_version == torch.__version__
    (line,) = [ln for ln in text.splitlines() if ln.startswith("rankwatch_build_info{")]
    for label, value in (("version", version), ("python", python), ("torch", torch_version)):
        assert f'{label}="{value}"' in line
    assert line.endswith(" 1.0")
    (point,) = points["rankwatch.build.info"]
    assert point["value"] == 1
    assert {k: point["attributes"][k] for k in ("version", "python", "torch")} == {
        "version": version,
        "python": python,
        "torch": torch_version,
    }


def test_grpc_without_its_extra_names_the_install(monkeypatch):
    # The gRPC exporter is an optional extra: blocked here as if it were not installed.
    script = (
        "import sys; sys.modules['opentelemetry.exporter.otlp.proto.grpc'] = None\n"
        "from rankwatch.exporter.config import RankwatchConfig\n"
        "from rankwatch.exporter.publish.hub import PublisherHub\n"
        "try:\n"
        "    PublisherHub(RankwatchConfig(metrics_port=0))\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc); sys.exit(3)\n"
    )
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
    }
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "OTEL_EXPORTER_OTLP_PROTOCOL" in done.stdout
    assert "pip install 'rankwatch[grpc]'" in done.stdout


GLOBAL_PROVIDERS_SCRIPT = """
import sys
from opentelemetry import _logs, metrics
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.hub import PublisherHub
from tests.publish_reports import normal_reports, step_report, window

endpoint = sys.argv[1]
# The application's own providers, set globally before rankwatch starts.
resource = Resource.create({"service.name": "the-app"})
reader = PeriodicExportingMetricReader(
    OTLPMetricExporter(endpoint=endpoint + "/v1/metrics"), export_interval_millis=300
)
meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
metrics.set_meter_provider(meter_provider)
logger_provider = LoggerProvider(resource=resource)
logger_provider.add_log_record_processor(
    SimpleLogRecordProcessor(OTLPLogExporter(endpoint=endpoint + "/v1/logs"))
)
_logs.set_logger_provider(logger_provider)
metrics.get_meter("the-app").create_counter("app.steps").add(5)

config = RankwatchConfig(
    metrics_port=0, run_id="g1", otlp_use_global_providers=True, otlp_export_interval_seconds=0.2
)
hub = PublisherHub(config, rank=0, hostname="trainer-0")
assert hub.otlp is not None and hub.otlp.uses_global_providers == (True, True)
steps = ["S", "S", "S"]
for i, (c, nr) in enumerate(zip(steps, normal_reports(["baseline"] * 3), strict=True)):
    hub.publish(window(i, n=16, step_time=step_report(16, culprit=11), normal=nr))
    assert hub.flush(20)
hub.close(5)
# rankwatch never shuts the application's providers down: they still export.
metrics.get_meter("the-app").create_counter("app.after_close").add(1)
meter_provider.force_flush()
meter_provider.shutdown()
logger_provider.shutdown()
"""


def test_global_providers_carry_rankwatch_through_the_applications_pipeline(monkeypatch):
    # No OTEL_EXPORTER_OTLP_* variable: the application's providers decide where data goes.
    with HttpReceiver() as receiver:
        done = subprocess.run(
            [sys.executable, "-c", GLOBAL_PROVIDERS_SCRIPT, receiver.endpoint],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        records = receiver.received.log_records()
        requests = len(receiver.received.metric_requests)
        points: dict = {}
        for i in range(requests):
            for name, got in receiver.received.metric_points(i).items():
                points.setdefault(name, []).extend(got)
    # metrics: rankwatch's instruments beside the application's, under the app's resource
    assert "app.steps" in points and "app.after_close" in points
    phase = points["rankwatch.phase"]
    assert {p["scope"] for p in phase} == {"rankwatch"}
    assert {p["resource"]["service.name"] for p in phase} == {"the-app"}
    assert {p["attributes"]["rank"] for p in phase} == {str(r) for r in range(16)}
    assert points["rankwatch.build.info"][0]["attributes"]["version"] == rankwatch.__version__
    # incident events: emitted through the application's LoggerProvider
    opened = [r for r in records if r["event_name"] == "rankwatch.incident.open"]
    assert [r["attributes"]["rankwatch.incident.class"] for r in opened] == ["step_time_straggler"]
    assert opened[0]["resource"]["service.name"] == "the-app"
    assert opened[0]["scope"] == "rankwatch"


def test_global_providers_option_falls_back_when_none_is_set(monkeypatch):
    # This process never sets global providers: rankwatch uses its own, as without the option.
    with HttpReceiver() as receiver:
        hub = _hub(receiver.endpoint, monkeypatch, otlp_use_global_providers=True)
        try:
            assert hub.otlp is not None and hub.otlp.uses_global_providers == (False, False)
            assert hub.flush(20)
            points = receiver.received.metric_points()
        finally:
            hub.close(5)
    assert points["rankwatch.exporter.up"][0]["resource"]["service.name"] == "rankwatch"

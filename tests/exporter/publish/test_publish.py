"""The publishing hub, ``default_publishers`` and ``rankwatch.exporter.init``."""

from __future__ import annotations

import logging
import time

import pytest

import rankwatch.exporter as exporter
from rankwatch.diagnosis.report import WindowReport
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.catalogue import COMMON_LABELS
from rankwatch.exporter.publish.hub import (
    MAX_QUEUED_REPORTS,
    PUBLISH_QUEUE,
    HealthCounters,
    LatestState,
    PublisherHub,
    default_publishers,
)
from rankwatch.exporter.publish.incidents import IncidentEvent, IncidentSnapshot
from rankwatch.exporter.publish.protocol import Publisher
from rankwatch.exporter.publish.recorder import RunRecorder, end_of_run_text, summary_text
from tests.exporter.publish.test_otlp import OTEL_VARS
from tests.publish_reports import T0, full_report, rank_infos, step_report, window
from tests.servers import http_get


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


def quiet_hub(**config) -> PublisherHub:
    return PublisherHub(RankwatchConfig(metrics_enabled=False, **config), otlp=False)


def test_hub_is_a_publisher():
    hub = quiet_hub()
    try:
        assert isinstance(hub, Publisher)
        assert hub.metrics_url is None and hub.otlp is None
    finally:
        hub.close()


def test_a_burst_keeps_the_newest_reports_and_counts_the_dropped():
    hub = quiet_hub()
    try:
        reports = [full_report(index=i, ep=16) for i in range(50)]
        t0 = time.perf_counter()
        for r in reports:
            hub.publish(r)
        burst = time.perf_counter() - t0
        assert hub.flush(30)
        assert hub.state.report is reports[-1]
        dropped = hub.health.snapshot().export_failures[PUBLISH_QUEUE]
        # each EP16 report takes the hub milliseconds; 50 arrive in far less than that
        assert 50 - MAX_QUEUED_REPORTS - 10 <= dropped < 50
        print(f"50 publish() calls took {burst * 1e6:.0f} us; {dropped} reports dropped")
    finally:
        hub.close()


def test_a_report_that_fails_to_publish_does_not_stop_the_hub(caplog):
    hub = quiet_hub()
    try:
        broken = WindowReport("world", 0, T0, rank_infos(2), normal=object())  # type: ignore[arg-type]
        hub.publish(broken)
        assert hub.flush(10)
        assert "publishing window 0 failed" in caplog.text
        hub.publish(window(1, n=4, step_time=step_report(4)))
        assert hub.flush(10)
        assert hub.state.report is not None and hub.state.report.window_index == 1
    finally:
        hub.close()


def test_incident_lines_are_text_when_json_is_off_and_the_run_end_closes_them(caplog):
    caplog.set_level(logging.INFO, logger="rankwatch.incidents")
    events: list[IncidentEvent] = []
    config = RankwatchConfig(
        metrics_enabled=False, log_json=False, incident_open_k=1, incident_open_n=1
    )
    hub = PublisherHub(config, otlp=False, on_incident=events.append)
    try:
        hub.publish(window(0, n=4, step_time=step_report(4, culprit=1)))
        assert hub.flush(10)
    finally:
        hub.close()
    opened, closed = [r for r in caplog.records if r.name == "rankwatch.incidents"]
    # one level for both, so the default level shows the whole lifecycle
    assert (opened.levelname, closed.levelname) == ("WARNING", "WARNING")
    (incident_id,) = {e.incident.incident_id for e in events}
    assert opened.getMessage().startswith(
        f"rankwatch incident {incident_id} opened: critical step_time_straggler"
    )
    assert closed.getMessage().startswith(
        f"rankwatch incident {incident_id} closed (run ended): critical step_time_straggler"
    )
    assert [(e.action, e.reason) for e in events] == [("open", ""), ("close", "run ended")]


def test_collection_errors_and_invalid_windows_are_counted():
    hub = quiet_hub()
    try:
        hub.count_collection_error("gather_timeout")
        hub.count_collection_error("gather_timeout")
        hub.publish(window(0, n=4, normal_invalid_reason="counter_reset"))
        assert hub.flush(10)
        counts = {
            (s.name, s.labels[len(COMMON_LABELS) :]): s.value
            for s in hub.state.samples()
            if s.name.endswith("_total") and s.name != "rankwatch_incidents_total"
        }
        assert counts[("rankwatch_collection_errors_total", ("gather_timeout",))] == 2
        assert counts[("rankwatch_deepep_window_invalid_total", ("counter_reset",))] == 1
        assert counts[("rankwatch_export_failures_total", (PUBLISH_QUEUE,))] == 0
        with pytest.raises(ValueError, match="reason"):
            hub.count_collection_error("")
    finally:
        hub.close()


def test_close_is_idempotent_and_publish_after_close_is_ignored():
    hub = PublisherHub(RankwatchConfig(metrics_port=0, shutdown_timeout_seconds=1.0), otlp=False)
    url = hub.metrics_url
    assert url is not None and b"rankwatch_exporter_up" in http_get(url)
    t0 = time.perf_counter()
    hub.close()
    assert time.perf_counter() - t0 < 1.0
    hub.close()
    hub.publish(window(0, n=2))
    assert hub.state.report is None
    with pytest.raises(OSError):
        http_get(url, timeout=1.0)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"config": {"metrics_port": 0}}, TypeError, "config"),
        ({"local_rank": -1}, ValueError, "local_rank"),
        ({"rank": "0"}, ValueError, "rank"),
        ({"clock": 5.0}, TypeError, "clock"),
        ({"otlp": True}, ValueError, "otlp"),
        ({"otlp": "grpc"}, TypeError, "otlp"),
    ],
)
def test_hub_rejects_bad_arguments(kwargs, exc, match):
    args = {"config": RankwatchConfig(metrics_enabled=False)}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        PublisherHub(**args)


def test_hub_entry_points_reject_bad_input():
    hub = quiet_hub()
    try:
        with pytest.raises(TypeError, match="report"):
            hub.publish({"window_index": 0})  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="timeout_seconds"):
            hub.flush(-1.0)
        with pytest.raises(ValueError, match="timeout_seconds"):
            hub.close(float("inf"))
    finally:
        hub.close()
    with pytest.raises(ValueError, match="exporter"):
        HealthCounters(0.0).export_failed("")
    state = LatestState(RankwatchConfig(), HealthCounters(0.0))
    with pytest.raises(TypeError, match="report"):
        state.update(None, IncidentSnapshot())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="incidents"):
        state.update(window(0, n=2), ())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config"):
        LatestState(None, HealthCounters(0.0))  # type: ignore[arg-type]


def test_rank_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK"):
        quiet_hub()


def test_default_publishers_follow_the_config():
    assert default_publishers(RankwatchConfig(enabled=False), 0) == []
    hub, recorder = default_publishers(RankwatchConfig(metrics_port=0, run_id="r7"), 1)
    try:
        assert isinstance(hub, PublisherHub) and hub.metrics_url is not None
        assert isinstance(recorder, RunRecorder) and recorder.out_dir is None
        assert recorder.run["run_id"] == "r7"
    finally:
        hub.close(2)
        recorder.close(2)
    with pytest.raises(TypeError, match="config"):
        default_publishers(None, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local_rank"):
        default_publishers(RankwatchConfig(), True)  # type: ignore[arg-type]


def _run_a_few_steps(rw, steps: int = 30) -> None:
    for _ in range(steps):
        with rw.step():
            with rw.phase("input_wait"):
                pass
            with rw.phase("forward"):
                sum(range(200))
            with rw.phase("backward"):
                sum(range(400))
        rw.collect()


def test_close_prints_the_run_verdict_and_where_the_summary_is(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("LOCAL_RANK", "0")
    rw = exporter.init(metrics_enabled=False, run_id="end-test", artifact_dir=str(tmp_path))
    _run_a_few_steps(rw)
    rw.close(5.0)
    err = capsys.readouterr().err
    block = err[err.index("rankwatch: run end-test ended") :]
    lines = block.splitlines()
    assert lines[1].startswith("  Verdict: ")
    assert "  Incidents: 0" in lines
    assert f"  Summary: {tmp_path / 'summary.txt'} (and summary.json beside it)" in lines
    assert (tmp_path / "summary.json").is_file()
    # once: a second close prints nothing
    rw.close(5.0)
    assert "ended" not in capsys.readouterr().err


def _incident(cls: str, severity: str) -> dict:
    return {
        "incident_id": f"{cls}-1",
        "class": cls,
        "severity": severity,
        "probe": "",
        "cause": "x",
        "ranks": [1],
        "score": None,
        "opened_at_s": 10.0,
        "closed_at_s": None,
    }


@pytest.mark.parametrize(
    ("incidents", "counted"),
    [
        ([], "0"),
        (
            [("step_time_straggler", "critical"), ("step_time_bottleneck", "warning")],
            "2 (1 critical fault; 1 property, does not page)",
        ),
        (
            [("step_time_straggler", "warning"), ("global_data_path_slowdown", "critical")],
            "2 (1 critical fault; 1 warning fault)",
        ),
        (
            [("step_time_bottleneck", "warning")] * 2 + [("hang_suspect", "critical")] * 2,
            "4 (2 critical faults; 2 properties, do not page)",
        ),
    ],
)
def test_the_end_block_counts_faults_and_properties_apart(incidents, counted):
    summary = {"run": {"run_id": "r"}, "incidents": [_incident(c, s) for c, s in incidents]}
    block = end_of_run_text(summary, None)
    assert f"  Incidents: {counted}\n" in block
    assert f"Incidents of the run: {counted}\n" in summary_text(summary)
    for line in block.splitlines():
        if "step_time_bottleneck" in line:
            assert "a property: does not page" in line


def test_end_of_run_text_rejects_bad_input():
    with pytest.raises(TypeError, match="summary: expected"):
        end_of_run_text(["verdict"], None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="written: expected"):
        end_of_run_text({}, "summary.txt")  # type: ignore[arg-type]
    # an empty run still says what it knows
    assert end_of_run_text({}, None).splitlines()[:2] == [
        "rankwatch: run (unnamed) ended",
        "  Verdict: no window was diagnosed.",
    ]


def test_the_end_of_run_block_is_off_with_one_setting(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANKWATCH_END_SUMMARY", "0")
    rw = exporter.init(metrics_enabled=False, run_id="quiet")
    _run_a_few_steps(rw, 5)
    rw.close(5.0)
    assert "rankwatch: run" not in capsys.readouterr().err
    monkeypatch.setenv("RANKWATCH_END_SUMMARY", "maybe")
    with pytest.raises(ValueError, match="RANKWATCH_END_SUMMARY"):
        exporter.init(metrics_enabled=False)


def test_init_starts_rankwatch_with_the_default_publishers(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    rw = exporter.init(metrics_port=0, run_id="init-test")
    try:
        hub, _ = rw.publishers
        assert isinstance(hub, PublisherHub)
        assert hub.config.run_id == "init-test"
        assert hub.metrics_url is not None
        assert b'run="init-test"' in http_get(hub.metrics_url)
    finally:
        rw.close(5.0)
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        exporter.init(metrics_port=0)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(TypeError, match="no_such_option"):
        exporter.init(no_such_option=1)

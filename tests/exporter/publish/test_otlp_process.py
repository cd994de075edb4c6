"""OTLP metric exports in a child process (``otlp_process_min_points``), against a real receiver.

The child must send the very points the publisher would have sent itself, with the same
resource; its export failures must be counted and logged by the parent as its own are; a child
that dies must not stop the exports; and closing the publisher must end the child.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import pytest

from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.hub import PublisherHub
from rankwatch.exporter.publish.otlp import OtlpPublisher, OtlpSettings
from rankwatch.exporter.publish.samples import Sample
from tests.otlp_receiver import HttpReceiver
from tests.publish_reports import step_report, window
from tests.servers import free_port


@pytest.fixture
def samples() -> Sequence[Sample]:
    """The samples of a 16-rank report with a straggler (a few hundred points)."""
    hub = PublisherHub(RankwatchConfig(), metrics=False, otlp=False)
    try:
        hub.publish(window(0, n=16, step_time=step_report(16, culprit=5)))
        assert hub.flush(20)
        return hub.state.samples()
    finally:
        hub.close(5)


def _publisher(
    endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    samples: Sequence[Sample],
    min_points: int,
    failures: list[str] | None = None,
) -> OtlpPublisher:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"{endpoint}/v1/metrics")
    config = RankwatchConfig(
        run_id="r1", otlp_export_interval_seconds=3600.0, otlp_process_min_points=min_points
    )
    return OtlpPublisher(
        config,
        lambda: samples,
        hostname="trainer-0",
        settings=OtlpSettings(True, False),
        on_failure=None if failures is None else failures.append,
    )


def _points(received: Any, index: int = -1) -> dict[str, list[tuple[Any, ...]]]:
    out: dict[str, list[tuple[Any, ...]]] = {}
    for name, points in received.metric_points(index).items():
        out[name] = sorted(
            (tuple(sorted(p["attributes"].items())), p["value"], p["kind"], p["unit"])
            for p in points
        )
    return out


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_an_export_over_the_threshold_runs_in_a_child_and_sends_the_same_points(
    monkeypatch: pytest.MonkeyPatch, samples: Sequence[Sample]
) -> None:
    assert len(samples) > 100
    with HttpReceiver() as receiver:
        here = _publisher(receiver.endpoint, monkeypatch, samples, min_points=0)
        try:
            assert here.flush(30)
            assert here.export_process_pid is None
        finally:
            here.close(5)
        own = _points(receiver.received)
        child = _publisher(receiver.endpoint, monkeypatch, samples, min_points=len(samples))
        try:
            assert child.flush(60)
            pid = child.export_process_pid
            assert pid is not None and pid != os.getpid()
            exported = len(receiver.received.metric_requests)
            assert child.flush(30)  # the child stays, and exports again
            assert child.export_process_pid == pid
            assert len(receiver.received.metric_requests) == exported + 1
        finally:
            child.close(10)
        resource = receiver.received.metric_points()["rankwatch.phase"][0]["resource"]
        assert _points(receiver.received) == own
        assert resource == dict(child.resource.attributes)
        assert resource["process.pid"] == os.getpid()  # the parent's identity, not the child's
    assert child.export_process_pid is None
    assert _gone(pid)


def test_below_the_threshold_or_with_zero_no_child_is_started(
    monkeypatch: pytest.MonkeyPatch, samples: Sequence[Sample]
) -> None:
    with HttpReceiver() as receiver:
        for min_points in (len(samples) + 1, 0):
            pub = _publisher(receiver.endpoint, monkeypatch, samples, min_points=min_points)
            try:
                assert pub.flush(30)
                assert pub.export_process_pid is None
            finally:
                pub.close(5)
        # Each exported on flush() and once more on close() (the provider's last export).
        assert len(receiver.received.metric_requests) == 4


def test_the_childs_failures_are_counted_and_logged_once_here(
    monkeypatch: pytest.MonkeyPatch, samples: Sequence[Sample], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rankwatch.otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")  # seconds; the child inherits it
    failures: list[str] = []
    dead = f"http://127.0.0.1:{free_port()}"
    pub = _publisher(dead, monkeypatch, samples, min_points=1, failures=failures)
    try:
        for _ in range(2):
            assert pub.flush(60)
        assert pub.export_process_pid is not None
        assert failures == ["otlp_metrics", "otlp_metrics"]
    finally:
        pub.close(10)
    said = [r.getMessage() for r in caplog.records if "otlp_metrics export to" in r.getMessage()]
    assert len(said) == 1 and dead in said[0]


def test_a_child_that_dies_is_replaced_by_exports_from_this_process(
    monkeypatch: pytest.MonkeyPatch, samples: Sequence[Sample], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rankwatch.otlp")
    with HttpReceiver() as receiver:
        pub = _publisher(receiver.endpoint, monkeypatch, samples, min_points=1)
        try:
            assert pub.flush(60)
            pid = pub.export_process_pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while not _gone(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
                os.waitpid(pid, os.WNOHANG)
            assert pub.flush(30)
            assert pub.export_process_pid is None
            assert pub.flush(30)
        finally:
            pub.close(5)
        # The child's export, then two flushes and close() from this process.
        assert len(receiver.received.metric_requests) == 4
        assert _points(receiver.received, -1) == _points(receiver.received, 0)
    said = [r.getMessage() for r in caplog.records if "export process is gone" in r.getMessage()]
    assert len(said) == 1


@pytest.mark.parametrize(
    ("executable", "warning"),
    [
        ("/nonexistent/python3", "cannot start the OTLP export process"),
        ("/bin/false", "export process is gone"),  # starts, exits at once
    ],
)
def test_a_child_that_cannot_start_leaves_the_exports_to_this_process(
    monkeypatch: pytest.MonkeyPatch,
    samples: Sequence[Sample],
    caplog: pytest.LogCaptureFixture,
    executable: str,
    warning: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="rankwatch.otlp")
    with HttpReceiver() as receiver:
        pub = _publisher(receiver.endpoint, monkeypatch, samples, min_points=1)
        monkeypatch.setattr(sys, "executable", executable)
        try:
            assert pub.flush(30)
            assert pub.export_process_pid is None
            assert pub.flush(30)  # no second attempt: one warning, exports from here
        finally:
            pub.close(5)
        assert len(receiver.received.metric_requests) >= 2
        assert _points(receiver.received, 0) == _points(receiver.received, 1)
    said = [r.getMessage() for r in caplog.records if r.name == "rankwatch.otlp"]
    assert len(said) == 1 and warning in said[0]

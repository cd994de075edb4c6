"""An OTLP endpoint that refuses connections or black-holes them costs the caller nothing.

``publish()`` keeps being called throughout (its cost, beside a hub without OTLP, is measured
by ``bench/bench_hostile_inputs.py``), the failures must show up in
``rankwatch_export_failures_total`` on ``/metrics``, the failure is logged once however many
attempts fail, and ``close()`` returns within ``shutdown_timeout_seconds`` even while an export
hangs on a socket that never answers.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from prometheus_client.parser import text_string_to_metric_families as parse_text

from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.hub import PublisherHub
from tests.exporter.publish.test_otlp import OTEL_VARS
from tests.publish_reports import full_report, step_report, window
from tests.servers import free_port, http_get, wait_until

# Real unreachable and hanging endpoints, waited out: seconds each, not in `make test-fast`.
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


@contextmanager
def black_hole_port() -> Iterator[int]:
    """A listening socket that completes TCP handshakes (the kernel does) and never answers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    try:
        yield int(sock.getsockname()[1])
    finally:
        sock.close()


@pytest.fixture
def black_hole() -> Iterator[int]:
    with black_hole_port() as port:
        yield port


def failures(url: str) -> dict[str, float]:
    out = {}
    for fam in parse_text(http_get(url).decode()):
        for s in fam.samples:
            if s.name == "rankwatch_export_failures_total":
                out[s.labels["exporter"]] = s.value
    return out


def publish_timed(hub: PublisherHub, count: int) -> list[float]:
    """Seconds each publish() call took, with a straggler incident opening on the way."""
    reports = [full_report(index=i, ep=16) for i in range(4)]
    took = []
    for i in range(count):
        report = reports[i % len(reports)]
        t0 = time.perf_counter()
        hub.publish(report)
        took.append(time.perf_counter() - t0)
        if i % 10 == 0:
            time.sleep(0.01)  # let the hub thread take reports, as windows would
    return took


def otel_logs(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("opentelemetry.exporter")]


def rankwatch_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "rankwatch.otlp" and r.levelname == "WARNING"]


@pytest.mark.parametrize("kind", ["refused", "black_hole"])
def test_unreachable_endpoint_is_counted_logged_once_and_costs_publish_nothing(
    kind, black_hole, monkeypatch, caplog
):
    caplog.set_level(logging.DEBUG)
    port = free_port() if kind == "refused" else black_hole
    # Credentials in the endpoint are never logged.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://otel:s3cr3t@127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")  # seconds, in the Python exporters
    config = RankwatchConfig(
        metrics_port=0, otlp_export_interval_seconds=0.2, shutdown_timeout_seconds=2.0
    )
    hub = PublisherHub(config)
    try:
        took = publish_timed(hub, 200)
        assert hub.metrics_url is not None
        url = hub.metrics_url
        # at least three failed metric exports and the incident's log record
        wait_until(
            lambda: (
                failures(url).get("otlp_metrics", 0) >= 3 and failures(url).get("otlp_logs", 0) >= 1
            ),
            30,
            what="failed exports to be counted",
        )
        # scraping stays answered while OTLP fails
        assert b"rankwatch_window_index" in http_get(url)
    finally:
        t0 = time.perf_counter()
        hub.close()
        closed_in = time.perf_counter() - t0
    # What publish() costs meanwhile, beside a hub without OTLP, is measured by
    # bench/bench_hostile_inputs.py (docs/benchmarks.md), not bounded here.
    median, worst = statistics.median(took), max(took)
    print(f"{kind}: publish median {median * 1e6:.1f} us, max {worst * 1e3:.2f} ms")
    print(f"{kind}: close took {closed_in:.2f} s (bound {config.shutdown_timeout_seconds} s)")
    assert len(took) == 200
    assert closed_in <= config.shutdown_timeout_seconds + 0.25
    # one warning per signal for the whole outage; the exporters' own lines are muted
    warned = rankwatch_warnings(caplog)
    assert sorted(r.getMessage().split()[1] for r in warned) == ["otlp_logs", "otlp_metrics"]
    assert otel_logs(caplog) == []
    assert all(f"http://otel:(hidden)@127.0.0.1:{port}/v1/" in r.getMessage() for r in warned)
    assert not [r for r in caplog.records if "s3cr3t" in r.getMessage()]


def test_close_is_bounded_while_an_export_hangs(black_hole, monkeypatch):
    # The exporters' default timeout (10 s) is longer than the shutdown bound.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{black_hole}")
    config = RankwatchConfig(metrics_port=0, shutdown_timeout_seconds=1.5)
    hub = PublisherHub(config)
    hub.publish(window(0, n=4, step_time=step_report(4)))
    assert hub.otlp is not None
    hub.otlp.request_export()
    time.sleep(0.3)  # the worker is now inside an export that will not return for 10 s
    assert not hub.otlp.flush(0.2)
    t0 = time.perf_counter()
    hub.close()
    closed_in = time.perf_counter() - t0
    print(f"close with a hanging export took {closed_in:.2f} s")
    assert closed_in <= 1.5 + 0.25
    # closed means closed: /metrics is gone and publish() is a no-op
    with pytest.raises(OSError):
        http_get(hub.metrics_url or "", timeout=1.0)
    hub.publish(window(1, n=4))

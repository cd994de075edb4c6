"""OTLP export cost per window at EP 16 / 64 / 256 against a plain OpenTelemetry SDK export.

One full window report per group size is published; rankwatch's OTLP publisher then exports its
samples (snapshot, observable-instrument collection, protobuf encoding, HTTP POST) to a local
OTLP/HTTP sink. The baseline, measured side by side in the same rounds, is what hand-written
OTel instrumentation of the same series costs: one observable gauge per family returning the
same points from prebuilt attribute dicts, exported by the same SDK exporter to the same sink.
Target: within 1.5x of the baseline (and, in absolute terms, a small fraction of a 5 s window).

``median`` is over all exports, ``spread`` the max - min of the round medians.

Run: ``python -m bench.bench_otlp``.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider, ObservableGauge
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from bench.bench_scrape import report
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.catalogue import by_name
from rankwatch.exporter.publish.hub import PublisherHub
from rankwatch.exporter.publish.otlp import OtlpPublisher, OtlpSettings
from rankwatch.exporter.publish.samples import Sample

SIZES = (16, 64, 256)
ROUNDS = 5
EXPORTS = {16: 10, 64: 6, 256: 4}
TARGET = 1.5


class _Sink(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return


def _baseline(samples: list[Sample], endpoint: str) -> tuple[MeterProvider, Any]:
    """Plain OTel: the same points from prebuilt attributes, one observable gauge per family."""
    points: dict[str, list[Observation]] = {}
    for s in samples:
        attrs = dict(zip(by_name(s.name).all_labels, s.labels, strict=True))
        points.setdefault(s.name, []).append(Observation(s.value, attrs))
    reader = PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=endpoint),
        export_interval_millis=math.inf,
        cardinality_limits={ObservableGauge: 1_000_000},
    )
    provider = MeterProvider(
        resource=Resource.create({"service.name": "baseline"}),
        metric_readers=[reader],
        shutdown_on_exit=False,
    )
    meter = provider.get_meter("baseline")
    for name, obs in points.items():
        meter.create_observable_gauge(name, callbacks=[lambda _o, obs=obs: obs])
    return provider, reader


def measure(ep: int, endpoint: str) -> dict[str, Any]:
    config = RankwatchConfig(metrics_enabled=False, otlp_export_interval_seconds=3600.0)
    hub = PublisherHub(config, otlp=False)
    pub = None
    provider = None
    try:
        hub.publish(report(ep))
        if not hub.flush(60):
            raise RuntimeError("the hub did not publish the report")
        samples = hub.state.samples()
        pub = OtlpPublisher(
            config,
            hub.state.samples,
            settings=OtlpSettings(True, False),
            metric_exporter=OTLPMetricExporter(endpoint=endpoint),
            on_failure=lambda name: (_ for _ in ()).throw(RuntimeError(f"{name} failed")),
        )
        provider, reader = _baseline(samples, endpoint)
        pub.flush(60)
        reader.force_flush(60_000)  # warm both up
        mine_all: list[float] = []
        base_all: list[float] = []
        round_mine: list[float] = []
        for _ in range(ROUNDS):
            m, b = [], []
            for _ in range(EXPORTS[ep]):
                t0 = time.perf_counter()
                if not pub.flush(60):
                    raise RuntimeError("export did not finish")
                m.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                reader.force_flush(60_000)
                b.append(time.perf_counter() - t0)
            mine_all += m
            base_all += b
            round_mine.append(statistics.median(m))
        median, baseline = statistics.median(mine_all), statistics.median(base_all)
        return {
            "name": f"OTLP metrics export per window EP{ep} ({len(samples)} points)",
            "target": TARGET,
            "median": median * 1e3,
            "spread": (max(round_mine) - min(round_mine)) * 1e3,
            "unit": "ms",
            "baseline": baseline * 1e3,
            "ratio": median / baseline,
        }
    finally:
        if pub is not None:
            pub.close(5)
        if provider is not None:
            provider.shutdown()
        hub.close(5)


def run() -> list[dict[str, Any]]:
    """One row per group size: rankwatch's OTLP export, the plain SDK baseline."""
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    sink.daemon_threads = True
    thread = threading.Thread(target=sink.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}/v1/metrics"
    try:
        return [measure(ep, endpoint) for ep in SIZES]
    finally:
        sink.shutdown()
        sink.server_close()


if __name__ == "__main__":
    for row in run():
        print(row)

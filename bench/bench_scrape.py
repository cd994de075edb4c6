"""Scrape latency of ``/metrics`` at EP 16 / 64 / 256 against plain prometheus-client.

For each group size one full window report (a step-time straggler, a DeepEP normal-mode window
under single-HCA pressure, a low-latency matrix) is published through a ``PublisherHub``; its
``/metrics`` is scraped over HTTP. The baseline, measured side by side in the same rounds, is
prometheus-client's own ``start_http_server`` exposing the same series (same names, labels and
values) as plain ``Gauge`` objects. Target: median within 1.5x of the baseline.

Each round scrapes both servers ``SCRAPES`` times, alternating, over keep-alive connections;
``median`` is the median over all scrapes, ``spread`` the max - min of the round medians.

Run: ``python -m bench.bench_scrape``.
"""

from __future__ import annotations

import http.client
import statistics
import time
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from rankwatch.diagnosis.deepep.low_latency import diagnose_low_latency
from rankwatch.diagnosis.deepep.normal.diagnoser import NormalDiagnoser
from rankwatch.diagnosis.deepep.normal.simulator import NormalSimulator
from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.diagnosis.step_time import diagnose_means
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.catalogue import by_name
from rankwatch.exporter.publish.hub import PublisherHub
from rankwatch.exporter.publish.samples import Sample

SIZES = (16, 64, 256)
ROUNDS = 5
SCRAPES = {16: 20, 64: 10, 256: 6}
TARGET = 1.5


def report(ep: int) -> WindowReport:
    """A full report on ``ep`` ranks, built by the real engines."""
    base = {"input_wait": 5.0, "h2d": 1.0, "forward": 30.0, "backward": 60.0}
    means: dict[int, dict[str, float | None]] = {}
    for r in range(ep):
        m: dict[str, float | None] = {**base, "optimizer": 5.0, "step": 100.0}
        if r == 3:
            m.update(input_wait=45.0, backward=20.0, step=60.0)
        means[r] = m
    sim = NormalSimulator(ep, 8, seed=1, slow_rank=9)
    diagnoser = NormalDiagnoser()
    for i in range(4):
        diagnoser.diagnose(sim.window("baseline", i))
    normal = diagnoser.diagnose(sim.window("single_hca_pressure", 4))
    rng = np.random.default_rng(0)
    ll = {}
    for phase in ("dispatch", "combine"):
        mat = rng.uniform(900, 1100, size=(ep, ep))
        mat[:, 5] *= 6.0
        ll[phase] = diagnose_low_latency(mat, phase)
    return WindowReport(
        group="world",
        window_index=4,
        created_at_s=time.time(),
        ranks=tuple(RankInfo(r, f"node-{r // 8}", r % 8) for r in range(ep)),
        run="bench",
        step_time=diagnose_means(means, steps=50),
        normal=normal,
        low_latency=ll,
        diagnosis_seconds={"step_time": 0.001, "normal": 0.002},
    )


def plain_registry(samples: list[Sample]) -> CollectorRegistry:
    """The same series as plain prometheus-client Gauges."""
    registry = CollectorRegistry()
    gauges: dict[str, Gauge] = {}
    for s in samples:
        spec = by_name(s.name)
        g = gauges.get(s.name)
        if g is None:
            g = gauges[s.name] = Gauge(s.name, spec.help, spec.all_labels, registry=registry)
        g.labels(*s.labels).set(s.value)
    return registry


def _scrape(conn: http.client.HTTPConnection) -> tuple[float, int]:
    t0 = time.perf_counter()
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    body = resp.read()
    took = time.perf_counter() - t0
    if resp.status != 200:
        raise RuntimeError(f"scrape failed: {resp.status}")
    return took, body.count(b"\n")


def measure(ep: int) -> dict[str, Any]:
    hub = PublisherHub(RankwatchConfig(metrics_port=0), otlp=False)
    base_server = None
    try:
        hub.publish(report(ep))
        if not hub.flush(60):
            raise RuntimeError("the hub did not publish the report")
        assert hub.metrics_server is not None
        samples = hub.state.samples()
        base_server, _thread = start_http_server(0, "127.0.0.1", plain_registry(samples))
        ours = http.client.HTTPConnection("127.0.0.1", hub.metrics_server.port, timeout=60)
        base = http.client.HTTPConnection("127.0.0.1", base_server.server_address[1], timeout=60)
        _scrape(ours), _scrape(base)  # warm both up
        mine_all: list[float] = []
        base_all: list[float] = []
        round_mine: list[float] = []
        round_base: list[float] = []
        lines = (0, 0)
        for _ in range(ROUNDS):
            m, b = [], []
            for _ in range(SCRAPES[ep]):
                t, n_ours = _scrape(ours)
                m.append(t)
                t, n_base = _scrape(base)
                b.append(t)
                lines = (n_ours, n_base)
            mine_all += m
            base_all += b
            round_mine.append(statistics.median(m))
            round_base.append(statistics.median(b))
        ours.close()
        base.close()
        median, baseline = statistics.median(mine_all), statistics.median(base_all)
        return {
            "name": f"scrape /metrics EP{ep} ({len(samples)} series, {lines[0]}/{lines[1]} lines)",
            "target": TARGET,
            "median": median * 1e3,
            "spread": (max(round_mine) - min(round_mine)) * 1e3,
            "unit": "ms",
            "baseline": baseline * 1e3,
            "ratio": median / baseline,
        }
    finally:
        hub.close(5)
        if base_server is not None:
            base_server.shutdown()
            base_server.server_close()


def run() -> list[dict[str, Any]]:
    """One row per group size: our scrape latency, the plain prometheus-client baseline."""
    return [measure(ep) for ep in SIZES]


if __name__ == "__main__":
    for row in run():
        print(row)

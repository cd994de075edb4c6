"""What the group root's own work costs its training thread, through the interpreter lock.

A group's root diagnoses and publishes inside a training process: whatever of that work holds
Python's interpreter lock, the training thread waits for. Measured here with a training loop on
the main thread (the tiny MLP of ``bench_hot_path``, one torch thread) while one piece of the
root's work runs once on another thread, as it does in a real root:

* ``window``: one window of a group of N ranks in its steady state (every rank's ring of rows
  wrapped): the intake of every rank's shipment, the block sums, the live window (the real
  ``WindowCollector`` fed as in ``bench_scale``); baseline: that thread's CPU time;
* ``report``: one report handed to the ``PublisherHub`` (incident tracker, the samples both
  paths publish), done on the hub's thread as in a real root; baseline: its wall time;
* ``scrape``: one scrape of the root's ``/metrics`` by a client in another process; baseline:
  the scrape's wall time;
* ``OTLP export``: one export of the report's points to a sink in another process, from the
  export child (``otlp_process_min_points``, the default above 2,000 points); baseline: the
  same export from the training process (``otlp_process_min_points=0``, the only way before).

The figure is the training time lost: the loop's step times while the work runs, minus as many
steps at the median of the bare loop measured just before (median over repetitions). The work
repeats every ``interval_seconds`` (window, 5 s), every ``otlp_export_interval_seconds``
(OTLP, 10 s) and every scrape interval (Prometheus: typically 15-60 s).

Usage: ``python -m bench.bench_root_stall``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import threading
import time
from collections.abc import Callable
from http.server import HTTPServer
from typing import Any

from bench.bench_hot_path import _row
from bench.bench_otlp import _Sink
from bench.bench_scale import _fill, _Root, _store

SIZES = (1024, 4096)
REPEATS = 3
BASE_STEPS = 1500


def _scraper(conn: Any, url: str) -> None:
    """A scraping client in a process of its own: one GET of ``url`` per request, its wall
    time (ms) in reply."""
    import urllib.request

    while conn.recv():
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=120) as response:
            response.read()
        conn.send((time.perf_counter() - t0) * 1e3)


def _serve_sink(ports: Any) -> None:
    server = HTTPServer(("127.0.0.1", 0), _Sink)
    ports.put(server.server_address[1])
    server.serve_forever()


class _Training:
    """The tiny MLP's training loop on the calling thread."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.batch = (torch.randn(16, 32), torch.randn(16, 1))
        self.loss = torch.nn.functional.mse_loss

    def steps(self, n: int | None = None, until: threading.Event | None = None) -> list[float]:
        clock, times = time.perf_counter, []
        x, y = self.batch
        while True:
            t0 = clock()
            self.loss(self.model(x), y).backward()
            self.opt.step()
            self.opt.zero_grad()
            times.append(clock() - t0)
            if (n is not None and len(times) >= n) or (until is not None and until.is_set()):
                return times

    def lost_ms(self, work: Callable[[], object]) -> tuple[float, float]:
        """(training ms lost while ``work`` runs on another thread, that thread's CPU ms)."""
        bare = statistics.median(self.steps(BASE_STEPS))
        done = threading.Event()
        cpu: list[float] = []

        def run() -> None:
            c0 = time.thread_time()
            work()
            cpu.append(time.thread_time() - c0)
            done.set()

        thread = threading.Thread(target=run)
        thread.start()
        during = self.steps(until=done)
        thread.join()
        return (sum(during) - len(during) * bare) * 1e3, cpu[0] * 1e3


def _stall(ranks: int, training: _Training, min_points: int) -> list[dict[str, Any]]:
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.publish.hub import PublisherHub
    from rankwatch.exporter.publish.otlp import OtlpPublisher, OtlpSettings

    root = _Root(ranks, _store())
    _fill(root)
    c = root.collector
    live = c.config.diagnosis.step_time.live_window_steps

    def window() -> None:
        c._drain()
        c._window("live", live)

    report = c.latest_report
    assert report is not None
    hub = PublisherHub(RankwatchConfig(metrics_port=0), otlp=False)
    hub.publish(report)
    assert hub.flush(60) and hub.metrics_url is not None
    ctx = mp.get_context("spawn")
    client, server_end = ctx.Pipe()
    scraper = ctx.Process(target=_scraper, args=(server_end, hub.metrics_url), daemon=True)
    scraper.start()
    pubs = {
        child: OtlpPublisher(
            RankwatchConfig(
                otlp_export_interval_seconds=3600.0,
                otlp_process_min_points=min_points if child else 0,
            ),
            hub.state.samples,
            settings=OtlpSettings(True, False),
        )
        for child in (True, False)
    }
    points = len(hub.state.samples())
    out: dict[str, tuple[list[float], list[float]]] = {
        k: ([], []) for k in ("window", "report", "scrape", "otlp_child", "otlp_here")
    }
    try:
        for pub in pubs.values():  # start the child, warm both
            assert pub.flush(120)
        assert pubs[True].export_process_pid is not None
        for _ in range(REPEATS):
            root.ship()
            lost, cpu = training.lost_ms(window)
            out["window"][0].append(lost)
            out["window"][1].append(cpu)
            wall: list[float] = []

            def publish(wall: list[float] = wall) -> None:
                t0 = time.perf_counter()
                hub.publish(report)
                assert hub.flush(60)
                wall.append((time.perf_counter() - t0) * 1e3)

            lost, _ = training.lost_ms(publish)
            out["report"][0].append(lost)
            out["report"][1].append(wall.pop())

            def scrape(wall: list[float] = wall) -> None:
                client.send(True)
                wall.append(client.recv())

            lost, _ = training.lost_ms(scrape)
            out["scrape"][0].append(lost)
            out["scrape"][1].append(wall[0])
            for child, key in ((True, "otlp_child"), (False, "otlp_here")):
                lost, _ = training.lost_ms(lambda p=pubs[child]: p.flush(120))
                out[key][0].append(lost)
    finally:
        client.send(False)
        scraper.join(10)
        for pub in pubs.values():
            pub.close(10)
        hub.close(5)
    out["otlp_child"][1].extend(out["otlp_here"][0])
    what = {
        "window": ("one root window", "the window thread's CPU"),
        "report": ("publishing one report", "its wall time"),
        "scrape": ("one /metrics scrape", "the scrape's wall time"),
        "otlp_child": (
            f"one OTLP export ({points:,} points) from the export child",
            "the same export from the training process",
        ),
    }
    return [
        _row(
            f"training time lost to {piece}, {ranks:,} ranks (baseline: {baseline})",
            None,
            out[key][0],
            "ms",
            out[key][1],
        )
        for key, (piece, baseline) in what.items()
    ]


def run(sizes: tuple[int, ...] = SIZES, min_points: int | None = None) -> list[dict[str, Any]]:
    """Four rows per group size: window, report, scrape, OTLP export (training ms lost each);
    ``min_points`` is the export child's threshold (None: the configuration's default)."""
    from rankwatch.exporter.config import RankwatchConfig

    if min_points is None:
        min_points = RankwatchConfig().otlp_process_min_points
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    sink = ctx.Process(target=_serve_sink, args=(ports,), daemon=True)
    sink.start()
    saved = os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    try:
        endpoint = f"http://127.0.0.1:{ports.get(timeout=60)}/v1/metrics"
        os.environ["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"] = endpoint  # the child inherits it
        training = _Training()
        rows: list[dict[str, Any]] = []
        for ranks in sizes:
            rows += _stall(ranks, training, min_points)
        return rows
    finally:
        if saved is None:
            os.environ.pop("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", None)
        else:
            os.environ["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"] = saved
        sink.kill()
        sink.join(10)


if __name__ == "__main__":
    from bench.run_all import table

    print(table(run()), end="")

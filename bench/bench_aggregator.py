"""What a large group costs its training processes, its aggregator and its root's /metrics.

Issue 46's figures, at 1,024, 4,096, 16,384 and 65,536 ranks, each beside the code before this
design (:mod:`bench.baseline`, the tree of ``BEFORE``, run in a process of its own), in one
run:

* **training time lost per 5 s window, root**: this process is the group's root: a training loop
  (the tiny MLP of ``bench_hot_path``) on its main thread, and beside it everything rankwatch
  runs in a root's training process: its own row shipper, the aggregator's relay, the
  publishing hub with ``/metrics``, the run recorder. The other ranks are real TCP connections
  from :mod:`bench.scale_cluster` (one per node of 8 ranks, as node leaders ship; also one per
  rank at 16,384: ``direct``); the aggregator is the real child process. Each window: every
  rank ships its round (sync mode), the aggregator diagnoses it and the report reaches the hub,
  and the rest of the 5 s interval goes by (the root's threads doing what they do between
  windows). The figure is the CPU time every thread of this process but the training thread
  took meanwhile (the process has one core: time the loop could not run). Target at 16,384
  ranks: under 0.5 % of the 5 s window (25 ms). A scrape of the root's ``/metrics`` is
  measured apart, the same way (once per scrape interval, 15-60 s).
* **training time lost per window, non-root rank**: the same with this process as rank 1 (its
  shipper, and in a group larger than the root's budget its own series from the aggregator's
  answers on its own hub); the root's part runs in the cluster's process.
* **scrape of the root's /metrics** (wall time; target 50 ms at any size), **from the last row
  shipped to the verdict published** (the cluster's last frame of a round to the report
  reaching the root's publishers; target 2 s at 16,384), **aggregator memory** (its resident
  set, rings wrapped) and its **CPU per window**.

Placement: this process runs on CPU 0 alone; the aggregator, the cluster and the scraper on CPU
1, so the figure is what the root's own process costs its training (a GPU node has cores to
spare for a child, not a second interpreter lock). The code before put all of the root's work
in the training process: its figures are its whole window (intake, block sums, live window),
its publication and its scrape, measured by its own benchmark the same way.

Usage: ``python -m bench.bench_aggregator [--sizes 1024 4096] [--no-before]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import threading
import time
from typing import Any

import numpy as np

from bench.bench_hot_path import _row
from bench.scale_cluster import ROWS_PER_ROUND, serve
from bench.training_loop import Training, scraper

SIZES = (1024, 4096, 16384, 65536)
ROUNDS = 3  # measured windows per size, after the rings wrapped
PER_NODE = 8
INTERVAL_SECONDS = 5.0
_PAD = 0.05  # seconds of training after a window's work before the bare steps


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Probe:
    """A publisher that notes when each window's report reached the root's publishers."""

    def __init__(self) -> None:
        self.published: dict[int, float] = {}
        self.event = threading.Event()
        self.latest: Any = None

    def publish(self, report: Any) -> None:
        self.latest = report
        self.published[report.window_index] = time.time()
        self.event.set()

    def close(self, timeout_seconds: float) -> None:
        pass


class _Rows:
    """A step timer stand-in for the measured rank: round ``k``'s 100 rows when asked."""

    def __init__(self, template: np.ndarray) -> None:
        self.template = template
        self.queue: list[np.ndarray] = []
        self.capacity = 1 << 20
        self.gpu = None

    def add_round(self, k: int) -> None:
        rows = self.template.copy()
        rows[:, 0] = np.arange(k * ROWS_PER_ROUND, (k + 1) * ROWS_PER_ROUND)
        self.queue.append(rows)

    def read(self, cursor: int) -> tuple[np.ndarray, int, int]:
        if not self.queue:
            from rankwatch.diagnosis.step_time import ROW_WIDTH

            return np.empty((0, ROW_WIDTH)), cursor, 0
        rows = self.queue.pop(0)
        return rows, cursor + len(rows), 0


def _config(budget: int = 64) -> Any:
    from rankwatch.exporter.config import RankwatchConfig

    return RankwatchConfig.from_env(
        env={},
        async_mode=False,
        interval_seconds=INTERVAL_SECONDS,
        gather_timeout_seconds=120.0,
        metrics_port=0,
        otlp_enabled=False,
        warmup_steps=0,
        root_rank_budget=budget,
        run_id="bench",
    )


def _root_side(ranks: int, config: Any) -> tuple[Any, Any, _Probe, Any]:
    """The root's part: the aggregator's handle and the root's publishers."""
    from rankwatch.exporter.aggregator.process import Aggregator
    from rankwatch.exporter.layout import GroupLayout
    from rankwatch.exporter.publish.hub import PublisherHub
    from rankwatch.exporter.publish.recorder import RunRecorder

    hub = PublisherHub(config, otlp=False)
    probe = _Probe()
    recorder = RunRecorder(config)
    agg = Aggregator(GroupLayout(tuple(range(ranks)), 0), config, [hub, recorder, probe])
    deadline = time.monotonic() + 60
    while agg.address() is None:
        if time.monotonic() > deadline:
            raise RuntimeError("the aggregator did not listen within 60 s")
        time.sleep(0.01)
    return agg, hub, probe, recorder


def _cluster_main(conn: Any, ranks: int, skip: int, per_node: int, hold_root: bool) -> None:
    """The cluster process: optionally the root's part, then every rank but ``skip``."""
    os.sched_setaffinity(0, {1})
    address = None
    if hold_root:
        agg, hub, _, _ = _root_side(ranks, _config())
        os.sched_setaffinity(agg.pid, {1})
        address = agg.address()
        conn.send(("address", address))
    else:
        address = conn.recv()[1]
    serve(conn, address, [r for r in range(ranks) if r != skip], per_node)
    if hold_root:
        agg.stop(10)
        hub.close(5)


class _Measure:
    """One size's measurement from this process (root or rank 1)."""

    def __init__(self, ranks: int, per_node: int, as_root: bool, training: Training) -> None:
        from rankwatch.diagnosis.step_time.artifact import example_window
        from rankwatch.exporter.layout import GroupLayout
        from rankwatch.exporter.publish.hub import PublisherHub
        from rankwatch.exporter.step_time.collector import RowShipper

        self.ranks, self.as_root, self.training = ranks, as_root, training
        me = 0 if as_root else 1
        ctx = mp.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.cluster = ctx.Process(
            target=_cluster_main, args=(child_end, ranks, me, per_node, not as_root), daemon=True
        )
        self.cluster.start()
        config = _config()
        self.agg = self.hub = self.probe = None
        if as_root:
            self.agg, self.hub, self.probe, _ = _root_side(ranks, config)
            os.sched_setaffinity(self.agg.pid, {1})
            address = self.agg.address()
            self.conn.send(("address", address))
            publishers: list[Any] = [self.hub]
        else:
            address = self.conn.recv()[1]
            self.hub = PublisherHub(config, otlp=False)
            publishers = [self.hub]
        template = example_window(2, ROWS_PER_ROUND, slow_rank=None).per_rank[0]
        assert template is not None
        self.rows = _Rows(template)
        self.shipper = RowShipper(
            GroupLayout(tuple(range(ranks)), me),
            self.rows,  # type: ignore[arg-type]
            config,
            publishers,
            lambda: address,
            lambda: "ddp",
            ("node-0", me, "", ""),
        )
        self.shipper.start()
        kind, connections = self.conn.recv()
        assert kind == "ready"
        self.connections = connections
        ctx2 = mp.get_context("spawn")
        self.scrape_conn, scraper_end = ctx2.Pipe()
        assert self.hub is not None and self.hub.metrics_url is not None
        self.scraper = ctx2.Process(
            target=scraper, args=(scraper_end, self.hub.metrics_url), daemon=True
        )
        self.scraper.start()
        os.sched_setaffinity(self.cluster.pid, {1})
        os.sched_setaffinity(self.scraper.pid, {1})
        self.k = 0
        self.lost_ms: list[float] = []
        self.loop_lost_ms: list[float] = []
        self.scrape_lost_ms: list[float] = []
        self.latency_s: list[float] = []
        self.scrape_ms: list[float] = []
        self.agg_cpu_s: list[float] = []

    def _round(self) -> tuple[float, float]:
        """Ship one round from every rank; (the cluster's last frame time, published time)."""
        k = self.k
        self.k += 1
        own_before = None if self.hub is None else self.hub.state._view.own
        frames_before = self.shipper.connection.sent_frames
        self.rows.add_round(k)
        self.shipper.trigger()
        if self.probe is not None:
            self.probe.event.clear()
        self.conn.send(("round", k))
        _, got, sent_at = self.conn.recv()
        assert got == k
        if self.probe is None:
            # A non-root rank: its round is done when its own series came back (a group
            # larger than the root's budget), its rows sent in any case.
            assert self.hub is not None
            deadline = time.monotonic() + 120
            answered = self.ranks <= _config().root_rank_budget  # no answer in a small group
            conn = self.shipper.connection
            while not answered or conn.pending_bytes or conn.sent_frames == frames_before:
                answered = answered or self.hub.state._view.own is not own_before
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank 1 got no own series for round {k} within 120 s")
                time.sleep(0.002)
            return sent_at, time.time()
        if not self.probe.event.wait(120):
            raise RuntimeError(f"no report for round {k} within 120 s")
        return sent_at, self.probe.published[max(self.probe.published)]

    def warm(self) -> None:
        """Rounds until every rank's ring of rows wrapped (a long run's steady state)."""
        from rankwatch.exporter.aggregator.windows import root_tail_rows

        rounds = root_tail_rows(_config(), self.ranks) // ROWS_PER_ROUND + 2
        for _ in range(rounds):
            self._round()

    def measure(self, rounds: int, interval: float = INTERVAL_SECONDS) -> None:
        pid = self.agg.pid if self.agg is not None else None
        for _ in range(rounds):
            marks: dict[str, float] = {}

            def window(marks: dict[str, float] = marks) -> None:
                cpu0 = _cpu_seconds(pid) if pid is not None else 0.0
                sent, published = self._round()
                if pid is not None:
                    self.agg_cpu_s.append(_cpu_seconds(pid) - cpu0)
                marks["latency"] = published - sent

            def scrape(marks: dict[str, float] = marks) -> None:
                self.scrape_conn.send(True)
                marks["scrape"] = self.scrape_conn.recv()

            cpu, loop = self._lost(window, interval)
            self.lost_ms.append(cpu)
            self.loop_lost_ms.append(loop)
            cpu, loop = self._lost(scrape)
            self.scrape_lost_ms.append(cpu)
            self.latency_s.append(marks["latency"])
            self.scrape_ms.append(marks["scrape"])

    def _lost(self, work: Any, interval: float = 0.0) -> tuple[float, float]:
        """What ``work`` (on another thread) cost the training loop on the main thread, over
        ``interval`` seconds from its start (or until it ends, if later): (the CPU time every
        other thread of this process took meanwhile, less the measuring thread's own, ms; the
        loop's step times then, less as many steps just after, ms). The process runs on one
        core, so the first is time the loop could not run; the second says the same, within
        the loop's own noise."""
        done = threading.Event()
        own: list[float] = []

        def run() -> None:
            end = time.monotonic() + interval
            c0 = time.thread_time()
            work()
            own.append(time.thread_time() - c0)
            time.sleep(max(_PAD, end - time.monotonic()))
            done.set()

        p0, m0 = time.process_time(), time.thread_time()
        thread = threading.Thread(target=run)
        thread.start()
        during = self.training.steps(until=done)
        thread.join()
        cpu = (time.process_time() - p0) - (time.thread_time() - m0) - own[0]
        bare = self.training.steps(n=len(during))
        return cpu * 1e3, (sum(during) - sum(bare)) * 1e3

    def memory_mib(self) -> float:
        return _rss_mib(self.agg.pid) if self.agg is not None and self.agg.pid else float("nan")

    def close(self) -> None:
        self.conn.send(("stop",))
        self.scrape_conn.send(False)
        self.shipper.stop(10)
        if self.agg is not None:
            self.agg.stop(10)  # no rank ships final rows here: the summary is not measured
        if self.hub is not None:
            self.hub.close(5)
        for proc in (self.cluster, self.scraper):
            proc.join(60)
            if proc.is_alive():
                proc.kill()


def measure_size(
    ranks: int,
    per_node: int,
    as_root: bool,
    training: Training,
    *,
    rounds: int = ROUNDS,
    interval: float = INTERVAL_SECONDS,
) -> dict[str, Any]:
    m = _Measure(ranks, per_node, as_root, training)
    try:
        m.warm()
        m.measure(rounds, interval)
        return {
            "lost_ms": m.lost_ms,
            "loop_lost_ms": m.loop_lost_ms,
            "scrape_lost_ms": m.scrape_lost_ms,
            "latency_s": m.latency_s,
            "scrape_ms": m.scrape_ms,
            "agg_cpu_s": m.agg_cpu_s,
            "memory_mib": m.memory_mib(),
            "connections": m.connections,
        }
    finally:
        m.close()


def _quiet_incident_lines() -> None:
    """The root's incident lines go nowhere here (written, not shown: their cost stays)."""
    import logging

    incidents = logging.getLogger("rankwatch.incidents")
    incidents.addHandler(logging.NullHandler())
    incidents.propagate = False


def run(
    sizes: tuple[int, ...] = SIZES, before: bool = True, direct: tuple[int, ...] = (16384,)
) -> list[dict[str, Any]]:
    """Rows per size: training ms lost per window on the root and on a non-root rank, the
    root's scrape, last row to verdict, the aggregator's CPU per window and memory; each
    beside the code before where it measured the same."""
    from bench.baseline import before_figures

    os.sched_setaffinity(0, {0})
    _quiet_incident_lines()
    training = Training()
    old = before_figures(sizes) if before else {}
    rows: list[dict[str, Any]] = []
    window_ms = INTERVAL_SECONDS * 1e3
    for ranks in sizes:
        root = measure_size(ranks, PER_NODE, True, training)
        rank1 = measure_size(ranks, PER_NODE, False, training)
        was = old.get(ranks, {})
        nodes = f"{ranks:,} ranks ({root['connections']:,} connections: node leaders of {PER_NODE})"
        rows += [
            _row(
                f"training time lost per 5 s window, root, {nodes} (baseline: the root before)",
                window_ms * 0.005 if ranks == 16384 else None,
                root["lost_ms"],
                "ms",
                was.get("root_lost_ms", [float("nan")]),
            ),
            _row(
                f"training time lost per 5 s window, rank 1, {ranks:,} ranks (baseline: a rank "
                "before, its shipment only)",
                window_ms * 0.005 if ranks == 16384 else None,
                rank1["lost_ms"],
                "ms",
                was.get("rank_lost_ms", [float("nan")]),
            ),
            _row(
                f"scrape of the root's /metrics, {ranks:,} ranks (wall time; baseline: before)",
                50.0,
                root["scrape_ms"],
                "ms",
                was.get("scrape_ms", [float("nan")]),
            ),
            _row(
                f"training time lost per scrape of the root's /metrics, {ranks:,} ranks "
                "(baseline: before)",
                None,
                root["scrape_lost_ms"],
                "ms",
                was.get("scrape_lost_ms", [float("nan")]),
            ),
            _row(
                f"last row shipped to verdict published, {ranks:,} ranks (baseline: the root's "
                "window and publication before)",
                2.0 if ranks == 16384 else None,
                root["latency_s"],
                "s",
                was.get("latency_s", [float("nan")]),
            ),
            _row(
                f"aggregator CPU per window, {ranks:,} ranks (baseline: the root's window CPU "
                "before)",
                None,
                [c * 1e3 for c in root["agg_cpu_s"]],
                "ms",
                was.get("window_cpu_ms", [float("nan")]),
            ),
            _row(
                f"aggregator memory, {ranks:,} ranks (resident; baseline: the root's rows and "
                "blocks before)",
                None,
                [root["memory_mib"]],
                "MiB",
                [was.get("memory_mib", float("nan"))],
            ),
        ]
        if ranks in direct:
            alone = measure_size(ranks, 1, True, training)
            rows.append(
                _row(
                    f"training time lost per 5 s window, root, {ranks:,} ranks, one connection "
                    "per rank (no node leaders; baseline: with them)",
                    window_ms * 0.005,
                    alone["lost_ms"],
                    "ms",
                    root["lost_ms"],
                )
            )
            rows.append(
                _row(
                    f"last row shipped to verdict published, {ranks:,} ranks, one connection per "
                    "rank (baseline: with node leaders)",
                    2.0,
                    alone["latency_s"],
                    "s",
                    root["latency_s"],
                )
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    parser.add_argument("--no-before", action="store_true", help="skip the code before")
    args = parser.parse_args(argv)
    from bench.run_all import table

    print(table(run(tuple(args.sizes), before=not args.no_before)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a large job costs its root: memory, CPU per window, sockets per rank, publishing.

In-process figures drive the real root code (``WindowCollector``: its receive loop, row
buffers, block sums, alignment, diagnosis and a ``PublisherHub``) with synthetic shipments:
every peer's message is encoded as a sender encodes it, and the doorbells are read from a real
c10d ``TCPStore`` exactly as the root polls them. Only the Gloo receive itself is replaced (the
real-process figures include it). CPU is the process's CPU time (the store's server thread
included, as it runs on the root's host), per window of ``interval_seconds`` (5 s by default):
one drain with every rank's shipment, the idle doorbell polls of the rest of the interval, the
live window and its publication.

* ``root CPU per window``: at 8 ... 4,096 ranks, 100 new rows per rank per window, once every
  rank's ring of rows at the root has wrapped (a long run's steady state). Target: under
  5 % of one core at 1,024 ranks (250 ms per 5 s window). Baseline: the same windows through
  the previous path (full row buffers, no block sums, every doorbell read on every poll and
  each received buffer copied), measured side by side.
* ``live window diagnosed``: the diagnosis alone of the 4,096-rank live window (target 100 ms).
* ``summary window``: the final summary at 1,024 ranks x 10,000 steps from block sums; baseline
  the full-row path on the same rows.
* ``root memory``: bytes the root holds for the rows of its group after 100 and 20,000 steps
  (row tails + block records), against the row buffers of the full-row path (measured per rank;
  that path keeps the same bytes for every rank, so its figure is per-rank bytes x ranks).
* ``sockets per rank``: real Gloo worlds of 8, 16 and 32 processes, sockets opened by
  rankwatch's group on a non-root rank and on the root (after one shipment), with
  ``gloo_lazy_connect`` (lazy, the default) against Gloo's full mesh (eager).
* ``real processes``: 8, 16 and 32 Gloo ranks running ``RankWatch`` (default configuration)
  for a few seconds with a 1 s interval: the root thread's CPU share, the sockets RankWatch
  opened on a non-root rank and on the root, how long ``close()`` took, and the rows that
  never reached the root (its last step of each rank against the steps the rank ran).
* ``publish``: one 4,096-rank step-time report through ``/metrics`` (series, bytes, ms) and one
  OTLP export (points, ms), against plain prometheus-client / OTel SDK with the same series.

Run: ``python -m bench.bench_scale`` (or ``make bench-scale``). Options: ``--quick`` skips the
multi-process parts.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from rankwatch.diagnosis.report import WindowReport
from rankwatch.diagnosis.step_time import ROW_WIDTH, diagnose_arrays
from rankwatch.diagnosis.step_time.artifact import example_window
from rankwatch.exporter.cli.ports import free_port
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.hub import PublisherHub
from rankwatch.exporter.step_time.collector import (
    IDLE_POLL_SECONDS,
    WindowCollector,
    root_tail_rows,
    window_arrays,
)
from rankwatch.exporter.step_time.messages import (
    FLAG_END_OF_ROUND,
    RowBuffer,
    encode_message,
    message_buffer,
)
from rankwatch.exporter.step_time.timer import StepTimer
from rankwatch.exporter.step_time.transport import GroupLayout

ROWS_PER_WINDOW = 100
ROW_BYTES = ROW_WIDTH * 8


def _median(fn: Any, repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        times.append(fn())
    return statistics.median(times), max(times) - min(times)


class _FeedTimer(StepTimer):
    """The root's own rows, handed over like a training thread's."""

    def __init__(self) -> None:
        super().__init__(64)
        self.queue: list[np.ndarray] = []

    def read(self, cursor: int) -> tuple[np.ndarray, int, int]:
        if not self.queue:
            return np.empty((0, ROW_WIDTH)), cursor, 0
        rows = self.queue.pop(0)
        return rows, cursor + len(rows), 0


class _StoreTransport:
    """The root side of ``Transport`` without Gloo: doorbells in a real TCPStore (read as the
    real one reads them: the total, then every peer's when it moved), messages from a queue."""

    def __init__(self, store: Any, ranks: tuple[int, ...], legacy: bool = False) -> None:
        self.store = store
        self.legacy = legacy  # the previous poll: every doorbell each time, buffers copied
        self.peers = ranks[1:]
        self.keys = [f"db/{r}" for r in self.peers]
        self.failed = False
        self.broken: set[int] = set()
        self.closed: set[int] = set()
        self.refused: set[int] = set()
        self.queue: list[np.ndarray] = []
        self.consumed = dict.fromkeys(self.peers, 0)
        self.total = -1
        for key in self.keys:
            store.add(key, 0)
        for r in ranks:
            store.set(f"info/{r}", f"node-{r // 8}\n{r % 8}")

    def poll(self) -> list[np.ndarray]:
        total = int(self.store.add("db/any", 0)) if not self.legacy else -2
        if total == self.total and not self.legacy:
            return []
        raw = self.store.multi_get(self.keys)
        for peer, value in zip(self.peers, raw, strict=True):
            self.consumed[peer] = max(self.consumed[peer], int(value))
        out, self.queue, self.total = self.queue, [], total
        return [m.copy() for m in out] if self.legacy else out

    def identity(self, rank: int) -> tuple[str, int] | None:
        host, _, local = self.store.get(f"info/{rank}").decode().partition("\n")
        return host, int(local)


class _Root:
    """A real root collector for ``ranks`` ranks fed with synthetic shipments."""

    def __init__(self, ranks: int, store: Any, *, bounded: bool = True, hub: Any = None) -> None:
        self.config = RankwatchConfig.from_env(env={})
        layout = GroupLayout(tuple(range(ranks)), 0)
        self.timer = _FeedTimer()
        self.transport = _StoreTransport(store, layout.ranks, legacy=not bounded)
        pubs = [hub] if hub is not None else []
        self.collector = WindowCollector(
            layout,
            self.timer,
            self.config,
            pubs,
            self.transport,  # type: ignore[arg-type]
            lambda: "ddp",
            ("node-0", 0),
        )
        if not bounded:  # the previous path: full row buffers, the summary from every row
            cap = self.config.max_buffered_steps
            self.collector._buffers = {r: RowBuffer(cap) for r in layout.ranks}
            self.collector._blocks = None
        self.ranks = ranks
        self.template = example_window(ranks, ROWS_PER_WINDOW, slow_rank=ranks // 2).per_rank
        self.next_step = 0
        self.seq = 0

    def ship(self, steps: int = ROWS_PER_WINDOW) -> None:
        """Queue every rank's next ``steps`` rows (encoded as a sender encodes them)."""
        self.seq += 1
        ids = np.arange(self.next_step, self.next_step + steps, dtype=np.float64)
        for r in range(self.ranks):
            rows = self.template[r]
            assert rows is not None
            rows = np.resize(rows, (steps, ROW_WIDTH))
            rows[:, 0] = ids
            if r == 0:
                self.timer.queue.append(rows)
                continue
            for k in range(0, steps, 512):
                buf = message_buffer()
                last = k + 512 >= steps
                encode_message(
                    buf,
                    rows[k : k + 512],
                    sender=r,
                    seq=self.seq,
                    flags=FLAG_END_OF_ROUND if last else 0,
                    lost=0,
                    strategy="ddp",
                )
                self.transport.queue.append(buf)
                self.transport.store.add(f"db/{r}", 1)
                self.transport.store.add("db/any", 1)
        self.next_step += steps

    def window(self, hub: Any = None) -> tuple[float, float]:
        """(process CPU seconds of one window, seconds of its diagnosis)."""
        idle_polls = int(self.config.interval_seconds / IDLE_POLL_SECONDS) - 1
        t0 = time.process_time()
        self.collector._drain()
        for _ in range(idle_polls):
            self.collector._drain()
        self.collector._window("live", self.config.diagnosis.step_time.live_window_steps)
        if hub is not None:
            hub.flush(60)
        cpu = time.process_time() - t0
        report = self.collector.latest_report
        assert report is not None and report.step_time is not None
        return cpu, report.diagnosis_seconds["step_time"]

    def nbytes(self) -> int:
        c = self.collector
        rows = sum(b._data.nbytes for b in c._buffers.values())
        return rows + (c._blocks.nbytes() if c._blocks is not None else 0)


def _store() -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _fill(root: _Root) -> None:
    """Ship rows until the root's ring of rows of every rank has wrapped: a long run's steady
    state (a root that has seen fewer rows than its ring holds reads its tails more cheaply)."""
    target = root_tail_rows(root.config) + ROWS_PER_WINDOW
    while root.next_step < target:
        root.ship(min(512, target - root.next_step))
        root.window()


def root_cpu(
    sizes: tuple[int, ...] = (8, 64, 1024, 4096), windows: int = 4
) -> list[dict[str, Any]]:
    out = []
    interval = RankwatchConfig.from_env(env={}).interval_seconds
    for ranks in sizes:
        cpu: dict[bool, list[float]] = {True: [], False: []}
        roots = {b: _Root(ranks, _store(), bounded=b) for b in (True, False)}
        for r in roots.values():
            _fill(r)
        for _ in range(windows):
            for bounded, root in roots.items():  # interleaved: same machine load
                root.ship()
                cpu[bounded].append(root.window()[0])
        mine, base = statistics.median(cpu[True]), statistics.median(cpu[False])
        out.append(
            {
                "name": f"root CPU per {interval:g} s window, {ranks:,} ranks (% of one core)",
                "target": 5.0 if ranks == 1024 else None,
                "median": 100 * mine / interval,
                "spread": 100 * (max(cpu[True]) - min(cpu[True])) / interval,
                "unit": "%",
                "baseline": 100 * base / interval,
                "ratio": mine / base,
            }
        )
        if ranks == max(sizes):
            out.append(_live_diagnosis(roots[True], ranks))
    return out


def _live_diagnosis(root: _Root, ranks: int) -> dict[str, Any]:
    """CPU time of the root's live window (tails, alignment, diagnosis); the baseline is the
    previous code on the same buffers (tails of twice the window, then the diagnosis)."""
    c = root.collector
    present, window = list(range(ranks)), c.config.diagnosis.step_time.live_window_steps

    def mine() -> float:
        t0 = time.process_time()
        c._diagnose("live", present, window)
        return time.process_time() - t0

    def base() -> float:
        t0 = time.process_time()
        diagnose_arrays(window_arrays(c._buffers, present, window), strategy="ddp", window=window)
        return time.process_time() - t0

    m, s = _median(mine, 5)
    b, _ = _median(base, 5)
    name = f"live window diagnosed, {ranks:,} ranks x {window} steps (CPU time)"
    return {
        "name": name,
        "target": 100.0,
        "median": m * 1000,
        "spread": s * 1000,
        "unit": "ms",
        "baseline": b * 1000,
        "ratio": m / b,
    }


def summary_cost(ranks: int = 1024, steps: int = 10_000) -> list[dict[str, Any]]:
    root = _Root(ranks, _store())
    per_rank: dict[int, np.ndarray | None] = {}
    tmpl = example_window(ranks, 500, slow_rank=3).per_rank
    for k in range(0, steps, 500):
        for r in range(ranks):
            rows = tmpl[r]
            assert rows is not None
            rows = rows.copy()
            rows[:, 0] += k
            root.collector._keep(r, rows, 0.0)
            if k == 0:
                per_rank[r] = np.resize(rows, (steps, ROW_WIDTH))
        root.collector._blocks.flush()  # type: ignore[union-attr]
    for r in range(ranks):
        arr = per_rank[r]
        assert arr is not None
        arr[:, 0] = np.arange(steps)
    window = root.config.diagnosis.step_time.summary_window_steps

    def mine() -> float:
        t0 = time.process_time()
        root.collector._diagnose("summary", list(range(ranks)), window)
        return time.process_time() - t0

    def base() -> float:
        t0 = time.process_time()
        diagnose_arrays(per_rank, strategy="ddp", window=window)
        return time.process_time() - t0

    m, s = _median(mine, 5)
    b, _ = _median(base, 3)
    return [
        {
            "name": f"summary window, {ranks:,} ranks x {steps:,} steps, from block sums",
            "target": None,
            "median": m * 1000,
            "spread": s * 1000,
            "unit": "ms (CPU)",
            "baseline": b * 1000,
            "ratio": m / b,
        }
    ]


def root_memory(
    sizes: tuple[int, ...] = (8, 64, 1024, 4096), steps_list: tuple[int, ...] = (100, 20_000)
) -> list[dict[str, Any]]:
    """Bytes of row state after ``steps`` steps; the baseline is the full-row buffers."""
    out = []
    cap = RankwatchConfig.from_env(env={}).max_buffered_steps
    for steps in steps_list:
        # Full-row path: every rank holds the same bytes; measured on one rank.
        buf = RowBuffer(cap)
        chunk = np.zeros((min(steps, 500), ROW_WIDTH))
        for k in range(0, steps, 500):
            part = chunk[: min(500, steps - k)].copy()
            part[:, 0] = np.arange(k, k + len(part))
            buf.append(part)
        per_rank_full = buf._data.nbytes
        for ranks in sizes:
            root = _Root(ranks, _store())
            tmpl = example_window(1, 500).per_rank[0]
            assert tmpl is not None
            for k in range(0, steps, 500):
                n = min(500, steps - k)
                rows = tmpl[:n].copy()
                rows[:, 0] = np.arange(k, k + n)
                for r in range(ranks):
                    root.collector._keep(r, rows, 0.0)
                root.collector._blocks.flush()  # type: ignore[union-attr]
            mine = root.nbytes()
            base = per_rank_full * ranks
            out.append(
                {
                    "name": f"root memory, {ranks:,} ranks x {steps:,} steps",
                    "target": None,
                    "median": mine / 2**20,
                    "spread": None,
                    "unit": "MiB",
                    "baseline": base / 2**20,
                    "ratio": mine / base,
                }
            )
    return out


# ---- real processes ------------------------------------------------------------------------

_WORKER = r"""
import json, os, sys, time
from datetime import timedelta
import torch.distributed as dist

def sockets():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n

rank, world, port, mode, out, seconds = sys.argv[1:7]
rank, world, seconds = int(rank), int(world), float(seconds)
# The training group stands in for NCCL: lazily connected, so the sockets counted are ours.
os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=timedelta(seconds=300))
del os.environ["TORCH_GLOO_LAZY_INIT"]
before = sockets()
result = {}
if mode in ("eager", "lazy"):
    import numpy as np
    from rankwatch.diagnosis.step_time.table import ROW_WIDTH
    from rankwatch.exporter.gloo import create_gloo_group, dedicated_store
    from rankwatch.exporter.step_time.messages import FLAG_END_OF_ROUND, encode_message
    from rankwatch.exporter.step_time.transport import GroupLayout, Transport
    if mode == "eager":
        group = dist.new_group(list(range(world)), backend="gloo", timeout=timedelta(seconds=300))
    else:
        group = create_gloo_group(tuple(range(world)), False, timedelta(seconds=300), lazy=True)
    layout = GroupLayout(tuple(range(world)), rank)
    transport = Transport(layout, group, dedicated_store(group))
    if layout.is_root:
        got, deadline = 0, time.monotonic() + 300
        while got < world - 1 and time.monotonic() < deadline:
            got += len(transport.poll())
            time.sleep(0.01)
    else:
        rows = np.zeros((3, ROW_WIDTH)); rows[:, 0] = (0, 1, 2)
        encode_message(transport.send_buffer, rows, sender=rank, seq=1,
                         flags=FLAG_END_OF_ROUND, lost=0, strategy=None)
        transport.send(transport.send_buffer)
else:  # "run": the real exporter for a few seconds
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.step_time.rank_watch import RankWatch
    cfg = RankwatchConfig.from_env(env={}, interval_seconds=1.0, metrics_enabled=False,
                                   otlp_enabled=False, gather_timeout_seconds=30.0)
    dist.barrier()  # the ranks lined up, the training group's own pairs connected
    before = sockets()
    rw = RankWatch(config=cfg, publishers=[])
    t0, wall0, steps = time.thread_time(), time.monotonic(), 0
    while time.monotonic() - wall0 < seconds:
        with rw.step():
            with rw.phase("forward"):
                time.sleep(0.01)
        rw.collect()
        steps += 1
    wall = time.monotonic() - wall0
    c = rw._collector
    result.update(thread_cpu=c.cpu_seconds, wall=wall, steps=steps,
                  windows=c.reports_published, sockets=sockets() - before)
    dist.barrier()
    closing = time.monotonic()
    rw.close(10.0)
    result["close_s"] = time.monotonic() - closing
    if rank == 0:  # what reached the root of each rank's rows, and who the summary missed
        result["last_steps"] = [c._buffers[r].last_step for r in range(world)]
        result["summary_missing"] = list(rw.latest_report.missing_ranks)
result.setdefault("sockets", sockets() - before)
result["fds"] = len(os.listdir("/proc/self/fd"))
dist.barrier()
open(out, "w").write(json.dumps(result))
dist.destroy_process_group()
"""


def _world(world: int, mode: str, seconds: float = 0.0) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(_WORKER)
        port = free_port()
        outs = [Path(tmp) / f"{r}.json" for r in range(world)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(script),
                    str(r),
                    str(world),
                    str(port),
                    mode,
                    str(outs[r]),
                    str(seconds),
                ],
                env=env,
            )
            for r in range(world)
        ]
        for p in procs:
            p.wait(timeout=900)
        return [json.loads(o.read_text()) for o in outs]


def sockets_per_rank(worlds: tuple[int, ...] = (8, 16, 32)) -> list[dict[str, Any]]:
    out = []
    for world in worlds:
        got = {mode: _world(world, mode) for mode in ("lazy", "eager")}
        peer = {m: statistics.median(g["sockets"] for g in got[m][1:]) for m in got}
        out.append(
            {
                "name": f"sockets of rankwatch's group per non-root rank, {world} Gloo ranks",
                "target": 2.0,
                "median": float(peer["lazy"]),
                "spread": float(
                    max(g["sockets"] for g in got["lazy"][1:])
                    - min(g["sockets"] for g in got["lazy"][1:])
                ),
                "unit": "sockets",
                "baseline": float(peer["eager"]),
                "ratio": peer["lazy"] / peer["eager"],
            }
        )
        out.append(
            {
                "name": f"sockets of rankwatch's group on the root, {world} Gloo ranks",
                "target": None,
                "median": float(got["lazy"][0]["sockets"]),
                "spread": None,
                "unit": "sockets",
                "baseline": float(got["eager"][0]["sockets"]),
                "ratio": got["lazy"][0]["sockets"] / got["eager"][0]["sockets"],
            }
        )
    return out


def real_run(world: int = 32, seconds: float = 8.0) -> list[dict[str, Any]]:
    got = _world(world, "run", seconds)
    root = got[0]
    share = 100 * root["thread_cpu"] / root["wall"]
    # Rows a rank timed that never reached the root: its last step there against its steps.
    unshipped = [g["steps"] - 1 - last for g, last in zip(got, root["last_steps"], strict=True)]
    return [
        {
            "name": f"real run, {world} Gloo ranks, 1 s interval: root thread CPU "
            f"({root['windows']} windows, {root['steps']} steps)",
            "target": None,
            "median": share,
            "spread": None,
            "unit": "% of a core",
            "baseline": None,
            "ratio": None,
        },
        {
            "name": f"real run, {world} Gloo ranks: sockets RankWatch opened per non-root rank "
            "(default configuration)",
            "target": 2.0,
            "median": float(statistics.median(g["sockets"] for g in got[1:])),
            "spread": float(
                max(g["sockets"] for g in got[1:]) - min(g["sockets"] for g in got[1:])
            ),
            "unit": "sockets",
            "baseline": None,
            "ratio": None,
        },
        _row_of(
            f"real run, {world} Gloo ranks: sockets RankWatch opened on the root",
            float(root["sockets"]),
            None,
            "sockets",
        ),
        _row_of(
            f"real run, {world} Gloo ranks: slowest close() over the ranks",
            max(g["close_s"] for g in got),
            None,
            "s",
        ),
        _row_of(
            f"real run, {world} Gloo ranks: rows that never reached the root "
            f"(all ranks; summary missed {len(root['summary_missing'])} ranks)",
            float(sum(unshipped)),
            None,
            "rows",
        ),
    ]


# ---- publishing ----------------------------------------------------------------------------


def publish_cost(ranks: int = 4096) -> list[dict[str, Any]]:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from prometheus_client import start_http_server

    from bench.bench_otlp import _baseline, _Sink
    from bench.bench_scrape import _scrape, plain_registry
    from rankwatch.exporter.publish.otlp import OtlpPublisher, OtlpSettings

    root = _Root(ranks, _store())
    root.ship()
    root.window()
    report: WindowReport | None = root.collector.latest_report
    assert report is not None
    config = RankwatchConfig(metrics_port=0, otlp_export_interval_seconds=3600.0)
    hub = PublisherHub(config, otlp=False)
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    sink.daemon_threads = True
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}/v1/metrics"
    base_server = provider = pub = None
    try:
        hub.publish(report)
        published = hub.flush(60)
        assert published and hub.metrics_server is not None, "the hub did not publish"
        samples = hub.state.samples()
        base_server, _ = start_http_server(0, "127.0.0.1", plain_registry(samples))
        ours = http.client.HTTPConnection("127.0.0.1", hub.metrics_server.port, timeout=60)
        base = http.client.HTTPConnection("127.0.0.1", base_server.server_address[1], timeout=60)
        ours.request("GET", "/metrics")
        body = ours.getresponse().read()
        _scrape(base)
        m_s, b_s = [], []
        for _ in range(7):
            m_s.append(_scrape(ours)[0])
            b_s.append(_scrape(base)[0])
        pub = OtlpPublisher(
            config,
            hub.state.samples,
            settings=OtlpSettings(True, False),
            metric_exporter=OTLPMetricExporter(endpoint=endpoint),
        )
        provider, reader = _baseline(samples, endpoint)
        pub.flush(60)
        reader.force_flush(60_000)
        m_o, b_o = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            pub.flush(60)
            m_o.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            reader.force_flush(60_000)
            b_o.append(time.perf_counter() - t0)
        per_rank = len(samples) / ranks
        lines = body.count(b"\n")
        rows = [
            _timed(
                f"scrape /metrics, {ranks:,}-rank step-time report ({len(samples):,} series, "
                f"{per_rank:.1f} per rank, {lines:,} lines, {len(body) / 2**20:.2f} MiB)",
                m_s,
                b_s,
            ),
            _timed(
                f"OTLP export of one window, {ranks:,} ranks ({len(samples):,} points)", m_o, b_o
            ),
        ]
        ours.close()
        base.close()
        return rows
    finally:
        if pub is not None:
            pub.close(5)
        if provider is not None:
            provider.shutdown()
        if base_server is not None:
            base_server.shutdown()
            base_server.server_close()
        sink.shutdown()
        sink.server_close()
        hub.close(5)


def _timed(name: str, mine: list[float], base: list[float], target: float = 1.5) -> dict[str, Any]:
    """A row from timings in seconds against their baseline (ms, target as a ratio)."""
    m, b = statistics.median(mine), statistics.median(base)
    return {
        "name": name,
        "target": target,
        "median": 1000 * m,
        "spread": 1000 * (max(mine) - min(mine)),
        "unit": "ms",
        "baseline": 1000 * b,
        "ratio": m / b,
    }


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Every scale figure in one run (the multi-process parts unless ``quick``)."""
    start_load = os.getloadavg()[0]
    rows = root_cpu()
    rows += summary_cost()
    rows += root_memory()
    rows += publish_cost()
    if not quick:
        rows += sockets_per_rank()
        for world in (8, 16, 32):
            rows += real_run(world)
    # The machine is shared: say how busy it was (runnable processes, 1-minute average).
    rows.append(
        _row_of(
            "machine load average, start of the run / end",
            start_load,
            os.getloadavg()[0],
            "processes",
        )
    )
    return rows


def _row_of(name: str, median: float, baseline: float | None, unit: str) -> dict[str, Any]:
    return {
        "name": name,
        "target": None,
        "median": median,
        "spread": None,
        "unit": unit,
        "baseline": baseline,
        "ratio": None,
    }


if __name__ == "__main__":
    from bench.run_all import table

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    if args.only:
        out = []
        for name in args.only:
            out += globals()[name]()
        print(table(out), end="")
    else:
        print(table(run(args.quick)), end="")
    sys.stdout.flush()

"""What a group costs beyond the aggregator's own figures: the summary window, real worlds.

``bench_aggregator`` measures the training time, latency, scrape and memory of large groups
against the code before. This benchmark adds:

* ``summary window``: the final summary at 1,024 ranks x 10,000 steps, from the block records
  each rank sums and ships and the newest rows (the aggregator's ``GroupWindows``), against the
  same window reduced from every row;
* ``real processes``: 8, 24 and 48 Gloo ranks (48 is about what this machine holds) running
  ``RankWatch`` (default configuration) for a few seconds with a 1 s interval, each world run
  with this code and then with the code before (``bench.baseline``'s commit, the root's work in
  its training process): the CPU the root's process and a non-root rank spent on rankwatch
  besides the training thread, the sockets RankWatch opened there (the aggregator's are its
  child's), how long ``close()`` took, and what the summary missed (ranks, and steps between
  its last and the fewest any rank ran).

Run: ``python -m bench.bench_scale`` (or ``make bench-scale``). Options: ``--quick`` skips the
multi-process parts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.baseline import before_env
from rankwatch.diagnosis.step_time import ROW_WIDTH, diagnose_arrays
from rankwatch.diagnosis.step_time.artifact import example_window
from rankwatch.diagnosis.step_time.blocks import StepBlocks
from rankwatch.exporter.aggregator.windows import GroupWindows
from rankwatch.exporter.aggregator.wire import Blocks, Rows
from rankwatch.exporter.cli.ports import free_port
from rankwatch.exporter.config import RankwatchConfig

ROWS_PER_WINDOW = 100
# Real worlds: the largest is about what this machine holds (48 processes of torch, 2 cores).
WORLDS = (8, 24, 48)


def _median(fn: Any, repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        times.append(fn())
    return statistics.median(times), max(times) - min(times)


def summary_cost(ranks: int = 1024, steps: int = 10_000) -> list[dict[str, Any]]:
    """The summary window from the ranks' block records and the newest rows, against every
    row reduced at once."""
    config = RankwatchConfig.from_env(env={})
    windows = GroupWindows(tuple(range(ranks)), config)
    own = {
        r: StepBlocks((r,), window_steps=steps, tail_rows=200, records=True) for r in range(ranks)
    }
    per_rank: dict[int, np.ndarray | None] = {}
    tmpl = example_window(ranks, 500, slow_rank=3).per_rank
    for k in range(0, steps, 500):
        shipments, blocks = [], []
        for r in range(ranks):
            rows = tmpl[r]
            assert rows is not None
            rows = rows.copy()
            rows[:, 0] += k
            own[r].add(r, rows)
            own[r].flush()
            blocks.append(Blocks(r, own[r].taken_records()[1]))
            shipments.append(Rows(r, 1, 1, "ddp", 0, rows))
            if k == 0:
                per_rank[r] = np.resize(rows, (steps, ROW_WIDTH))
        windows.take_blocks(blocks)
        windows.take_all(shipments, time.monotonic())
    for r in range(ranks):
        arr = per_rank[r]
        assert arr is not None
        arr[:, 0] = np.arange(steps)
    window = config.diagnosis.step_time.summary_window_steps

    def mine() -> float:
        t0 = time.process_time()
        windows._diagnose("summary", list(range(ranks)), window)
        return time.process_time() - t0

    def base() -> float:
        t0 = time.process_time()
        diagnose_arrays(per_rank, strategy="ddp", window=window)
        return time.process_time() - t0

    m, spread = _median(mine, 5)
    b, _ = _median(base, 3)
    return [
        {
            "name": f"summary window, {ranks:,} ranks x {steps:,} steps, from the ranks' "
            "block records (baseline: from every row)",
            "target": None,
            "median": m * 1000,
            "spread": spread * 1000,
            "unit": "ms (CPU)",
            "baseline": b * 1000,
            "ratio": m / b,
        }
    ]


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

rank, world, port, out, seconds = sys.argv[1:6]
rank, world, seconds = int(rank), int(world), float(seconds)
# The training group stands in for NCCL: lazily connected, so the sockets counted are ours.
os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=timedelta(seconds=300))
del os.environ["TORCH_GLOO_LAZY_INIT"]
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.step_time.rank_watch import RankWatch
cfg = RankwatchConfig.from_env(env={}, interval_seconds=1.0, metrics_enabled=False,
                               otlp_enabled=False, gather_timeout_seconds=30.0)
dist.barrier()  # the ranks lined up, the training group's own pairs connected
before = sockets()
rw = RankWatch(config=cfg, publishers=[])
def child_cpu():
    # The aggregator's CPU so far (a child of the root's process; the code before had none).
    pid = getattr(getattr(rw, "_aggregator", None), "pid", None)
    if pid is None:
        return None
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), time.monotonic()

cpu0, main0, wall0, steps = time.process_time(), time.thread_time(), time.monotonic(), 0
settled = None  # the aggregator's CPU once its start (interpreter, imports) is behind it
while time.monotonic() - wall0 < seconds:
    with rw.step():
        with rw.phase("forward"):
            time.sleep(0.01)
    rw.collect()
    steps += 1
    if settled is None and time.monotonic() - wall0 > 2.0:
        settled = child_cpu() or ()
wall = time.monotonic() - wall0
# Everything this process ran besides its training thread (rankwatch's threads only here).
others = (time.process_time() - cpu0) - (time.thread_time() - main0)
latest = rw.latest_report
result = {"cpu": others, "wall": wall, "steps": steps, "sockets": sockets() - before,
          "windows": None if latest is None else latest.window_index + 1}
end = child_cpu()
if settled and end:
    result["aggregator_cpu_share"] = (end[0] - settled[0]) / (end[1] - settled[1])
dist.barrier()
closing = time.monotonic()
rw.close(10.0)
result["close_s"] = time.monotonic() - closing
if rank == 0:  # what reached the aggregator of each rank's rows, and who the summary missed
    st = rw.latest_report.step_time
    result["last_step"] = st.step_range[1] if st.step_range else -1
    result["summary_missing"] = list(rw.latest_report.missing_ranks)
dist.barrier()
open(out, "w").write(json.dumps(result))
dist.destroy_process_group()
"""


def _world(world: int, seconds: float, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(_WORKER)
        port = free_port()
        outs = [Path(tmp) / f"{r}.json" for r in range(world)]
        env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), *map(str, (r, world, port, outs[r], seconds))],
                env=env,
            )
            for r in range(world)
        ]
        for p in procs:
            p.wait(timeout=900)
        return [json.loads(o.read_text()) for o in outs]


def real_run(
    world: int, before: dict[str, str] | None, seconds: float = 8.0
) -> list[dict[str, Any]]:
    """One real world of the new code and, in ``before``'s environment, of the code before
    (``bench.baseline``), one after the other on the same machine."""
    now = _world(world, seconds)
    old = _world(world, seconds, before) if before is not None else None

    def root_cpu(got: list[dict[str, Any]]) -> float:
        return 100 * got[0]["cpu"] / got[0]["wall"]

    def rank_cpu(got: list[dict[str, Any]]) -> float:
        return statistics.median(100 * g["cpu"] / g["wall"] for g in got[1:])

    def sockets(got: list[dict[str, Any]], root: bool) -> float:
        return float(
            got[0]["sockets"] if root else statistics.median(g["sockets"] for g in got[1:])
        )

    def short(got: list[dict[str, Any]]) -> float:
        return float(min(g["steps"] for g in got) - 1 - got[0]["last_step"])

    def was(fn: Any, *args: Any) -> float | None:
        return None if old is None else fn(old, *args)

    head = f"real run, {world} Gloo ranks, 1 s interval"
    return [
        _row_of(
            f"{head}: the root's process CPU besides training ({now[0]['windows']} windows, "
            f"{now[0]['steps']} steps; % of a core)",
            root_cpu(now),
            was(root_cpu),
            "%",
        ),
        _row_of(
            f"{head}: the aggregator process's CPU after its first 2 s "
            "(a child of the root's; before: none)",
            100 * now[0].get("aggregator_cpu_share", math.nan),
            None,
            "%",
        ),
        _row_of(
            f"{head}: a non-root rank's CPU besides training (median)",
            rank_cpu(now),
            was(rank_cpu),
            "%",
        ),
        _row_of(
            f"{head}: sockets RankWatch opened on the root's process",
            sockets(now, True),
            was(sockets, True),
            "sockets",
        ),
        _row_of(
            f"{head}: sockets RankWatch opened per non-root rank (median)",
            sockets(now, False),
            was(sockets, False),
            "sockets",
        ),
        _row_of(
            f"{head}: slowest close() over the ranks",
            max(g["close_s"] for g in now),
            was(lambda got: max(g["close_s"] for g in got)),
            "s",
        ),
        _row_of(
            f"{head}: ranks the summary missed",
            float(len(now[0]["summary_missing"])),
            was(lambda got: float(len(got[0]["summary_missing"]))),
            "ranks",
        ),
        _row_of(
            f"{head}: steps between the summary's last and the fewest any rank ran",
            short(now),
            was(short),
            "steps",
        ),
    ]


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Every figure in one run (the multi-process parts unless ``quick``)."""
    start_load = os.getloadavg()[0]
    rows = summary_cost()
    if not quick:
        with before_env() as before:
            for world in WORLDS:
                rows += real_run(world, before)
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

"""Benchmark of what the fault's unit and the run's own baseline add to a window.

Per live window, the aggregator now also names the fault's unit (``name_fault_unit``), judges
the group's pace against its baseline (``PaceHistory.update``, with the pace of the window's
new steps from ``rows_pace``). Measured at 1,024 and 16,384 ranks, side by side in the
same run with the work a window did before: the window's diagnosis alone (``diagnose_means``
of the same means). The training processes do none of this work (it runs in the aggregator),
and the per-step path is unchanged. Memory: what the baseline holds once formed (tracemalloc),
which stays the same however long the run.

Usage: ``python -m bench.bench_fault_unit`` (or through ``python -m bench.run_all``).
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.run_all import row
from rankwatch.diagnosis.step_time import diagnose_means, name_fault_unit
from rankwatch.diagnosis.step_time.pace import PaceHistory, rows_pace
from rankwatch.diagnosis.step_time.table import ROW_WIDTH, column

SIZES = (1024, 16384)
ROUNDS, REPEAT = 3, 5
PER_NODE = 8


def _window(n: int, seed: int) -> tuple[dict[int, dict[str, float | None]], dict[int, np.ndarray]]:
    """Means of ``n`` ranks (rank 5's node slow) and each rank's 100 rows."""
    rng = np.random.default_rng(seed)
    means: dict[int, dict[str, float | None]] = {}
    rows: dict[int, np.ndarray] = {}
    for r in range(n):
        late = 40.0 if r // PER_NODE == 5 // PER_NODE else 0.0
        fwd = 30.0 + late + float(rng.normal(0, 0.5))
        means[r] = {
            "input_wait": 5.0,
            "h2d": 1.0,
            "forward": fwd,
            "backward": 100.0 - fwd,
            "optimizer": 5.0,
            "step": 136.0,
        }
    block = np.full((100, ROW_WIDTH), np.nan)
    block[:, 0] = np.arange(1, 101)
    block[:, column("cpu", "input_wait")] = 5.0
    block[:, column("cpu", "step")] = 136.0
    for r in range(n):
        rows[r] = block
    return means, rows


def _ms(fn: Callable[[], object]) -> list[float]:
    fn()
    out = []
    for _ in range(REPEAT):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000.0)
    return out


def _memory_kib(n: int) -> float:
    means, _ = _window(n, 0)
    report = diagnose_means(means, steps=100)
    tracemalloc.start()
    history = PaceHistory()
    for i in range(40):  # formed, then long after
        history.update(report, i)
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return size / 1024.0


def _sizes(n: int) -> tuple[list[float], list[float]]:
    """One round at ``n`` ranks: the window's diagnosis alone, and with the unit and pace."""
    means, per_rank = _window(n, n)
    hosts = {r: f"node-{r // PER_NODE}" for r in range(n)}
    report = diagnose_means(means, steps=100)
    history = PaceHistory()
    for i in range(10):
        history.update(report, i)

    def with_unit_and_pace() -> None:
        named = name_fault_unit(diagnose_means(means, steps=100), hosts)
        history.update(named, 11, hosts, rows_pace(per_rank, "cpu", 80))

    return _ms(lambda: diagnose_means(means, steps=100)), _ms(with_unit_and_pace)


def run() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n in SIZES:
        before: list[list[float]] = []
        after: list[list[float]] = []
        for _ in range(ROUNDS):
            b, a = _sizes(n)
            before.append(b)
            after.append(a)
        name = f"window with unit and pace, {n:,} ranks (baseline: diagnosis alone)"
        rows.append(row(name, "ms", after, before))
        rows.append(
            {
                "name": f"baseline memory once formed, {n:,} ranks (40 windows)",
                "target": None,
                "median": _memory_kib(n),
                "spread": 0.0,
                "unit": "KiB",
                "baseline": None,
                "ratio": None,
            }
        )
    return rows


if __name__ == "__main__":
    from bench.run_all import table

    print(table(run()), end="")

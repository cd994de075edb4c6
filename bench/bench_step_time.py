"""Benchmark of the step-time diagnosis: one window from rows, from arrays and from means.

Target: a 1,024-rank x 100-step window diagnosed in under 50 ms. Each figure is the median of
several runs, with the spread (max - min). The baseline, measured side by side, is the numpy
reduction alone: the NaN-aware mean over the window's steps of an already stacked
``[ranks, steps, 13]`` array, i.e. the least work any diagnosis of that window must do. The
"row dicts" figures include reading every ``{"step_id", "cpu": {...}, "gpu": {...}}`` dict in
Python, which dominates them; the "read rows only" row isolates that cost, and the "bare read"
row is the least any pure-Python reader does (one key lookup per value, one float conversion
per value, no checks): the floor of that path on the machine at hand.

Usage: ``python -m bench.bench_step_time`` (or through ``python -m bench.run_all``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from operator import itemgetter
from typing import Any

import numpy as np

from rankwatch.diagnosis.step_time import SIGNALS, diagnose_arrays, diagnose_means, diagnose_steps
from rankwatch.diagnosis.step_time.artifact import example_window
from rankwatch.diagnosis.step_time.row_dicts import _rows_table
from rankwatch.diagnosis.step_time.table import clock_columns

TARGET_MS = 50.0
_CPU, _GPU = clock_columns("cpu"), clock_columns("gpu")


def _measure(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times), max(times) - min(times)


def _rows(arrays: dict[int, Any]) -> dict[int, list[dict[str, Any]]]:
    out = {}
    for rank, arr in arrays.items():
        out[rank] = [
            {
                "step_id": int(row[0]),
                "cpu": dict(zip(SIGNALS, row[_CPU], strict=True)),
                "gpu": dict(zip(SIGNALS, row[_GPU], strict=True)),
            }
            for row in arr.tolist()
        ]
    return out


def _bare_read(items: list[tuple[int, list[dict[str, Any]]]]) -> np.ndarray:
    """Every value of every row fetched and converted once, nothing checked (the floor)."""
    sig = itemgetter(*SIGNALS)
    flat: list[Any] = []
    ext = flat.extend
    for _, rows in items:
        for row in rows:
            ext((row["step_id"], *sig(row["cpu"]), *sig(row["gpu"])))
    return np.fromiter(flat, dtype=np.float64, count=len(flat))


def _row(
    name: str, median: float, spread: float, baseline: float, target: float | None = TARGET_MS
) -> dict[str, Any]:
    return {
        "name": name,
        "target": target,
        "median": median,
        "spread": spread,
        "unit": "ms",
        "baseline": baseline,
        "ratio": median / baseline if baseline > 0 else None,
    }


def run(
    sizes: tuple[int, ...] = (8, 64, 1024), steps: int = 100, summary_steps: int = 10_000
) -> list[dict[str, Any]]:
    """Benchmark rows for windows of ``sizes`` ranks x ``steps``, then the summary window."""
    out: list[dict[str, Any]] = []
    for ranks in sizes:
        repeat = 7 if ranks >= 512 else 21
        arrays: dict[int, Any] = dict(example_window(ranks, steps, slow_rank=ranks // 2).per_rank)
        rows = _rows(arrays)
        means = {
            r: dict(zip(SIGNALS, np.nanmean(a[:, _GPU], axis=0).tolist(), strict=True))
            for r, a in arrays.items()
        }
        cube = np.stack(list(arrays.values()))
        base, _ = _measure(lambda c=cube: np.nanmean(c[:, -steps:, 1:], axis=1), repeat)
        label = f"{ranks:,} ranks x {steps} steps"
        m, s = _measure(lambda r=rows: diagnose_steps(r, window=steps), repeat)
        out.append(_row(f"step_time diagnose_steps, {label}, from row dicts", m, s, base))
        m, s = _measure(lambda a=arrays: diagnose_arrays(a, window=steps), repeat)
        out.append(
            _row(f"step_time diagnose_arrays, {label}, from [n, ROW_WIDTH] arrays", m, s, base)
        )
        m, s = _measure(lambda x=means: diagnose_means(x, steps=steps, clock="gpu"), repeat)
        out.append(_row(f"step_time diagnose_means, {ranks:,} ranks", m, s, base))
        if ranks == max(sizes):
            items = list(rows.items())
            m, s = _measure(lambda i=items: _rows_table(i), repeat)
            out.append(_row(f"step_time read rows only, {label}", m, s, base, target=None))
            m, s = _measure(lambda i=items: _bare_read(i), repeat)
            name = f"step_time bare read of the row dicts (no checks, floor), {label}"
            out.append(_row(name, m, s, base, target=None))
    # The final-summary window: 10,000 steps.
    arrays = dict(example_window(8, summary_steps, slow_rank=3).per_rank)
    cube = np.stack(list(arrays.values()))
    base, _ = _measure(lambda: np.nanmean(cube[:, :, 1:], axis=1), 7)
    m, s = _measure(lambda: diagnose_arrays(arrays, window=summary_steps), 7)
    name = f"step_time diagnose_arrays, 8 ranks x {summary_steps:,} steps (summary)"
    out.append(_row(name, m, s, base))
    return out


if __name__ == "__main__":
    from bench.run_all import table

    print(table(run()), end="")

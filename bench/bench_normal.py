"""Normal-mode diagnosis speed: one window at EP 16, 64, 256 and 1,024 (8 ranks per node).

Each window comes from the simulator in the single-HCA phase (so rows, columns, gateways and a
localized incident are found, not only a clean pass), after three baseline windows have
bootstrapped the global history. The baseline, measured in the same loop, is the bare numpy
work any such rule needs at least: cost / samples, a log and row and column medians of each
Completion matrix. Target: under 50 ms per window at EP 1,024.

Usage: ``python -m bench.bench_normal``.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np

from rankwatch.diagnosis.deepep.normal import COMPLETION_PROBES, NormalDiagnoser, NormalSimulator

EP_SIZES = (16, 64, 256, 1024)
RANKS_PER_NODE = 8
TARGET_MS = 50.0


def _bare_passes(window: Any) -> float:
    """The baseline: the minimum numpy passes over the same matrices."""
    total = 0.0
    for probe in COMPLETION_PROBES:
        cost, samples, _ = window.completion[probe]
        with np.errstate(invalid="ignore", divide="ignore"):
            x = np.log(cost / samples)
        total += float(np.median(x, axis=1).sum() + np.median(x, axis=0).sum())
    return total


def _repeats(ep: int) -> int:
    return 15


def _row(name: str, unit: str, samples: list[float], baseline: list[float]) -> dict[str, Any]:
    med, base = float(np.median(samples)), float(np.median(baseline))
    q1, q3 = np.percentile(samples, [25, 75])
    return {
        "name": name,
        "target": TARGET_MS,
        "median": med,
        "spread": float(q3 - q1),
        "unit": unit,
        "baseline": base,
        "ratio": med / base if base > 0 else None,
    }


def run() -> list[dict[str, Any]]:
    """Two rows per EP size: wall time and process CPU time of one diagnose call, in ms.

    Spread is the interquartile range. The CPU-time row is there because the machine is
    shared: other processes stretch wall time, not the work this process does.
    """
    rows: list[dict[str, Any]] = []
    # The single-HCA phase at every size; at EP 1,024 also one slow link, the case that also
    # scores point residuals (a spread over all million cells).
    cases = [(ep, "single_hca_pressure") for ep in EP_SIZES] + [(EP_SIZES[-1], "slow_link")]
    for ep, phase in cases:
        sim = NormalSimulator(ep, RANKS_PER_NODE, seed=0)
        diagnoser = NormalDiagnoser()
        for _ in range(3):
            diagnoser.diagnose(sim.window("baseline"))
        window = sim.window(phase)
        wall: list[float] = []
        cpu: list[float] = []
        base_wall: list[float] = []
        base_cpu: list[float] = []
        for _ in range(_repeats(ep)):
            # Interleaved, so both see the same machine load.
            # A fresh copy each time (untimed): local anomalies do not stop the per-class
            # history from learning, and every repetition must see the same history.
            fresh = copy.deepcopy(diagnoser)
            t0, c0 = time.perf_counter(), time.process_time()
            report = fresh.diagnose(window)
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
            t0, c0 = time.perf_counter(), time.process_time()
            _bare_passes(window)
            base_wall.append((time.perf_counter() - t0) * 1e3)
            base_cpu.append((time.process_time() - c0) * 1e3)
        assert [i.cls for i in report.incidents] == ["localized_data_path_slowdown"]
        name = f"normal_diagnose_window_ep{ep}" + (
            "" if phase == "single_hca_pressure" else f"_{phase}"
        )
        rows.append(_row(name, "ms", wall, base_wall))
        rows.append(_row(f"{name}_cpu", "ms (CPU)", cpu, base_cpu))
    return rows


def main() -> None:
    for row in run():
        print(
            f"{row['name']:<32} median {row['median']:8.2f} {row['unit']}  "
            f"IQR {row['spread']:6.2f}  target < {row['target']:.0f}  "
            f"bare passes {row['baseline']:8.2f}  ratio {row['ratio']:.2f}"
        )


if __name__ == "__main__":
    main()

"""What a misbehaving OTLP collector costs a training loop: step time with OTLP off, with a
healthy collector, and with a collector that refuses connections, black-holes them, answers
after the client gave up, answers 500 or answers 503.

The fault test (``tests/e2e/test_faults_otlp.py``) checks the behaviour: every step runs,
nothing raises into training, no export runs on the training thread, the failures are counted.
How long the steps take is measured here, with its loop and collectors: a 256-1024-256 MLP
(a few ms per step, one torch thread) inside a real ``RankWatch`` (a group of one, windows every
0.2 s) publishing through a ``PublisherHub`` whose OTLP worker exports every 0.2 s with a 1 s
exporter timeout, so that failing exports overlap the steps.

Each round trains ``STEPS`` steps under every kind of collector, the order reversed every
other round so that a drift in machine load favours none. Rows per kind: the median step
(median over every step of every round; spread: max - min of the round medians) and the 99th
percentile (pooled; spread: max - min of the round p99s), each beside OTLP off from the same
rounds. A training thread that waited on the network would show steps as long as the
exporter's timeout (1 s); the target is the fault test's former bound, 1.5x the median without
OTLP. Last row: the machine's load average at the start and end.

Run: ``python -m bench.bench_otlp_faults``.
"""

from __future__ import annotations

import logging
import os
import statistics
from typing import Any

import pytest

from bench.run_all import row
from tests.e2e.test_faults_otlp import FAULTS, run_case

ROUNDS = 3
STEPS = 400
KINDS = ("off", "healthy", *FAULTS)
TARGET_RATIO = 1.5


def _p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * len(values))]


def measure() -> dict[str, list[list[float]]]:
    """Step times in ms, per kind of collector, one list per round."""
    logging.getLogger().setLevel(logging.ERROR)  # each outage warns once: not wanted here
    took: dict[str, list[list[float]]] = {kind: [] for kind in KINDS}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
        for rnd in range(ROUNDS):
            for kind in KINDS if rnd % 2 == 0 else reversed(KINDS):
                got = run_case(kind, env, steps=STEPS, record_training_thread=False)
                took[kind].append([s * 1e3 for s in got["took"]])
                print(
                    f"   round {rnd} {kind:>10}: median {statistics.median(took[kind][-1]):.2f} "
                    f"ms, p99 {_p99(took[kind][-1]):.2f} ms, max {max(took[kind][-1]):.1f} ms",
                    flush=True,
                )
    return took


def run() -> list[dict[str, Any]]:
    """Median and p99 step time per kind of collector, beside OTLP off, and the load."""
    load_start = os.getloadavg()[0]
    took = measure()
    rows = []
    off = took["off"]
    for kind in KINDS[1:]:
        rows.append(
            row(
                f"training step, median, OTLP collector {kind} (baseline: OTLP off)",
                "ms",
                took[kind],
                off,
                target=TARGET_RATIO * statistics.median(x for r in off for x in r),
            )
        )
        p99s = [_p99(r) for r in took[kind]]
        mine, base = _p99([x for r in took[kind] for x in r]), _p99([x for r in off for x in r])
        rows.append(
            {
                "name": f"training step, p99, OTLP collector {kind} (baseline: OTLP off)",
                "target": None,
                "median": mine,
                "spread": max(p99s) - min(p99s),
                "unit": "ms",
                "baseline": base,
                "ratio": mine / base,
            }
        )
    rows.append(
        {
            "name": "machine load average, start of the run / end",
            "target": None,
            "median": load_start,
            "spread": None,
            "unit": "processes",
            "baseline": os.getloadavg()[0],
            "ratio": None,
        }
    )
    return rows


if __name__ == "__main__":
    from bench.run_all import table

    print(table(run()), end="")

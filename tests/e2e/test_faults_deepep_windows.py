"""Bad counter data on the DeepEP collector path: each fault rejects one window by name and the
next good window is diagnosed as if nothing had happened.

The path is the real one the root runs: gathered ``[EP, 6 + 9*EP]`` int64 blocks go through
``CounterWindows.feed`` and the windows it forms through ``NormalDiagnoser.diagnose``. The
counters are the seeded simulator's, written cumulatively the way DeepEP's kernels count. For
every fault the test checks four figures: exactly one rejected window (or one raised
``InvalidWindowError``), its reason, the exact counter deltas of the next good window, and that
the next window's report matches a run without the fault.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from rankwatch.diagnosis.deepep.normal import NormalDiagnoser
from rankwatch.diagnosis.deepep.normal.simulator import NormalSimulator
from rankwatch.diagnosis.deepep.normal.window import (
    InvalidWindowError,
    NormalWindow,
    snapshot_counters,
)
from rankwatch.exporter.deepep.snapshot import CounterWindows, DeepEPWindow

pytestmark = pytest.mark.parallel_safe

EP, RPN = 16, 8
BASELINE = 4  # windows that bootstrap the global history before the fault
PHASE = "single_hca_pressure"  # what the window after the fault must still find


def deltas(window: NormalWindow) -> np.ndarray:
    """The int64 counter block whose difference is ``window`` (exact, for comparisons)."""
    return snapshot_counters(window)


def verdict(report: Any) -> dict[str, Any]:
    """What a user acts on: each probe's status and the incidents (class, scope, ranks)."""
    return {
        "status": {p: r.status for p, r in report.probes.items()},
        "incidents": sorted((i.cls, i.scope, tuple(i.ranks)) for i in report.incidents),
    }


@dataclass
class Run:
    """One pass through CounterWindows + NormalDiagnoser, keeping what came out."""

    windows: list[DeepEPWindow]
    raised: list[InvalidWindowError]
    reports: list[Any]


class Feeder:
    """Cumulative counters of a simulated EP16 group, fed to the root's window builder."""

    def __init__(self, seed: int = 3) -> None:
        self.sim = NormalSimulator(EP, RPN, seed=seed, slow_rank=9)
        self.total = np.zeros((EP, 6 + 9 * EP), dtype=np.int64)
        self.t = 1000.0
        self.k = 0
        self.cw = CounterWindows(EP, RPN, normal=True, low_latency=False, started_at_s=self.t)
        self.diagnoser = NormalDiagnoser()
        self.run = Run([], [], [])

    def advance(self, phase: str = "baseline") -> np.ndarray:
        """Let the kernels count one more interval; return that interval's delta block."""
        win = self.sim.window(phase, self.k)
        self.k += 1
        delta = deltas(win)
        self.total = self.total + delta
        return delta

    def feed(self, block: Any, dt: float = 1.0) -> DeepEPWindow | None:
        self.t += dt
        try:
            out = self.cw.feed(self.t, normal=block)
        except InvalidWindowError as exc:
            self.run.raised.append(exc)
            return None
        if out is not None:
            self.run.windows.append(out)
            if out.normal is not None:
                self.run.reports.append(self.diagnoser.diagnose(out.normal))
        return out


# ---- the faults: each takes the feeder after the baseline and feeds one bad reading ----------


def reset(f: Feeder) -> np.ndarray:
    """Rank 5 restarts: its block starts again from zero and counts one interval."""
    f.advance()
    f.total[5] = 0
    f.feed(f.total.copy())
    # After a reset the new reading is the boundary: the next window is just the next interval.
    return np.zeros_like(f.total)


def wraparound(f: Feeder) -> np.ndarray:
    """One reading with a counter past int64's top (negative); the block then reads fine."""
    lost = f.advance()
    bad = f.total.copy()
    bad[3, 7] = -(2**62)
    f.feed(bad)
    return lost  # that interval is not lost: the next window spans it


def all_zero(f: Feeder) -> np.ndarray:
    """An idle interval: no Notify launch, no Completion sample on any rank."""
    f.feed(f.total.copy())
    return np.zeros_like(f.total)


def nan_inf(f: Feeder) -> np.ndarray:
    """A gathered block that arrived as float with NaN and inf in it."""
    lost = f.advance()
    bad = f.total.astype(np.float64)
    bad[0, 0], bad[9, 40] = math.nan, math.inf
    f.feed(bad)
    return lost


def fractional(f: Feeder) -> np.ndarray:
    """A float block whose values are not whole counts."""
    lost = f.advance()
    bad = f.total.astype(np.float64)
    bad[2, 2] += 0.5
    f.feed(bad)
    return lost


def wrong_ep(f: Feeder) -> np.ndarray:
    """A block laid out for EP 8 (a different group size) reaches the EP16 root."""
    lost = f.advance()
    f.feed(np.zeros((8, 6 + 9 * 8), dtype=np.int64))
    return lost


def wrong_width(f: Feeder) -> np.ndarray:
    """Right number of ranks, one counter short per rank."""
    lost = f.advance()
    f.feed(f.total[:, :-1].copy())
    return lost


def stale(f: Feeder) -> np.ndarray:
    """A snapshot taken before the previous one arrives after it."""
    lost = f.advance()
    f.feed(f.total.copy(), dt=-5.0)
    f.t += 5.0
    return lost


FAULTS: dict[str, tuple[Callable[[Feeder], np.ndarray], str]] = {
    "reset": (reset, "counter_reset"),
    "wraparound": (wraparound, "counter_wraparound"),
    "all_zero": (all_zero, "empty_window"),
    "nan_inf": (nan_inf, "non_finite"),
    "fractional": (fractional, "bad_value"),
    "wrong_ep": (wrong_ep, "shape_mismatch"),
    "wrong_width": (wrong_width, "shape_mismatch"),
    "stale": (stale, "stale_snapshot"),
}


def reference_verdict() -> dict[str, Any]:
    """The PHASE window's verdict in a run without any fault."""
    f = Feeder()
    for _ in range(BASELINE):
        f.advance()
        f.feed(f.total.copy())
    f.advance(PHASE)
    f.feed(f.total.copy())
    assert len(f.run.reports) == BASELINE + 1
    found = verdict(f.run.reports[-1])
    # The simulated slow HCA sits behind local ranks 0 and 1 of both nodes.
    assert found["incidents"] == [("localized_data_path_slowdown", "local", (0, 1, 8, 9))]
    return found


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_bad_reading_rejects_one_window_by_name_then_diagnosis_resumes(fault: str) -> None:
    inject, reason = FAULTS[fault]
    f = Feeder()
    for _ in range(BASELINE):
        f.advance()
        f.feed(f.total.copy())
    assert [w.normal_invalid_reason for w in f.run.windows] == [None] * BASELINE

    carried = inject(f)

    # Exactly one rejection, with its reason: either a rejected window or a raised error.
    rejected = [w for w in f.run.windows[BASELINE:] if w.normal_invalid_reason is not None]
    named = [w.normal_invalid_reason for w in rejected] + [e.reason for e in f.run.raised]
    assert named == [reason], named
    for w in rejected:
        assert w.normal is None and w.normal_invalid_detail
        assert w.normal_invalid_detail.startswith(reason)
    assert len(f.run.reports) == BASELINE  # nothing bad reached the diagnoser

    # The next good reading forms a window with exactly the counts since the last usable
    # boundary (an unusable reading is skipped, its interval carried into this window).
    phase_delta = f.advance(PHASE)
    good = f.feed(f.total.copy())
    assert good is not None and good.normal is not None and good.normal_invalid_reason is None
    np.testing.assert_array_equal(deltas(good.normal), carried + phase_delta)
    # Window indices stay consecutive: a raised shape error consumed none.
    indices = [w.window_index for w in f.run.windows]
    assert indices == list(range(len(indices)))

    report = f.run.reports[-1]
    assert len(f.run.reports) == BASELINE + 1
    assert all(r.status != "insufficient" for r in report.probes.values())
    # The slow HCA is still found, on the same ranks, as in a run without the fault (a window
    # that spans two intervals carries twice the samples, which changes no verdict).
    assert verdict(report) == reference_verdict()


def test_wrapped_counters_stay_rejected_until_the_block_is_zeroed() -> None:
    """A real wraparound does not heal by itself: every reading stays negative. Each is
    rejected; re-zeroing the block is a reset (one more rejection), then windows resume."""
    f = Feeder()
    for _ in range(BASELINE):
        f.advance()
        f.feed(f.total.copy())
    wrap_bias = np.zeros_like(f.total)
    wrap_bias[3, 7] = -(2**63) + 1  # as if that counter had passed int64's top
    for _ in range(3):
        f.advance()
        f.feed(f.total + wrap_bias)
    f.total[:] = 0  # DeepEP's block is zeroed again
    f.advance()
    f.feed(f.total.copy())
    reasons = [w.normal_invalid_reason for w in f.run.windows[BASELINE:]]
    assert reasons == ["counter_wraparound"] * 3 + ["counter_reset"]
    delta = f.advance(PHASE)
    good = f.feed(f.total.copy())
    assert good is not None and good.normal is not None
    np.testing.assert_array_equal(deltas(good.normal), delta)
    assert verdict(f.run.reports[-1]) == reference_verdict()


def test_low_latency_nan_is_rejected_and_not_taken_as_the_next_boundary() -> None:
    """Casting a NaN block to int64 would give a huge negative count; that reading must be
    rejected as non-finite and the next window must hold the true waits."""
    rng = np.random.default_rng(0)
    cw = CounterWindows(4, 2, normal=False, low_latency=True, started_at_s=0.0)
    total = np.zeros((4, 2, 4), dtype=np.int64)
    step = [rng.integers(1, 1000, size=(4, 2, 4)) for _ in range(3)]
    total += step[0]
    first = cw.feed(1.0, low_latency=total.copy())
    assert first is not None and first.low_latency is not None
    total += step[1]
    bad = total.astype(np.float64)
    bad[1, 0, 2] = math.nan
    rejected = cw.feed(2.0, low_latency=bad)
    assert rejected is not None and rejected.low_latency is None
    assert rejected.low_latency_invalid_reason == "non_finite"
    total += step[2]
    good = cw.feed(3.0, low_latency=total.copy())
    assert good is not None and good.low_latency is not None
    want = step[1] + step[2]
    np.testing.assert_array_equal(good.low_latency["dispatch"], want[:, 0, :])
    np.testing.assert_array_equal(good.low_latency["combine"], want[:, 1, :])
    assert [first.window_index, rejected.window_index, good.window_index] == [0, 1, 2]


def feed_readings(f: Feeder, count: int, bad: bool = True) -> None:
    """``count`` readings into ``f``: every other one bad (cycling through a NaN, a wrapped
    counter, a stale reading and a wrong shape), or all good with ``bad=False``."""
    kinds = ["nan", "wrap", "stale", "shape"]
    for i in range(count):
        f.advance()
        if i % 2 == 0 or not bad:
            f.feed(f.total.copy())
            continue
        kind = kinds[(i // 2) % len(kinds)]
        if kind == "nan":
            reading = f.total.astype(np.float64)
            reading[i % EP, 0] = math.nan
            f.feed(reading)
        elif kind == "wrap":
            reading = f.total.copy()
            reading[i % EP, 1] = -1
            f.feed(reading)
        elif kind == "stale":
            f.feed(f.total.copy(), dt=-100.0)
            f.t += 100.0
        else:
            f.feed(f.total[:, :-EP].copy())


def test_one_thousand_alternating_bad_readings_never_reach_the_diagnoser() -> None:
    """Every other reading is bad (cycling through the faults): 500 rejections counted by
    reason, 500 windows diagnosed, none with NaN in its JSON. How many readings a second go
    through is measured by ``bench/bench_hostile_inputs.py``."""
    import json

    f = Feeder(seed=11)
    feed_readings(f, 1000)
    reasons: dict[str, int] = {}
    for w in f.run.windows:
        if w.normal_invalid_reason is not None:
            reasons[w.normal_invalid_reason] = reasons.get(w.normal_invalid_reason, 0) + 1
    for e in f.run.raised:
        reasons[e.reason] = reasons.get(e.reason, 0) + 1
    print(f"1000 readings (500 bad): {reasons}")
    assert reasons == {
        "non_finite": 125,
        "counter_wraparound": 125,
        "stale_snapshot": 125,
        "shape_mismatch": 125,
    }
    assert len(f.run.reports) == 500
    for r in f.run.reports:
        json.dumps(r.to_dict(), allow_nan=False)
    # Each good window holds two intervals (the bad reading's interval is carried over).
    assert all(int(w.normal.notify["notify_dispatch"][1][0]) > 0 for w in f.run.windows if w.normal)

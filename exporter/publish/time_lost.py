"""Time lost: what an incident costs the group, in rank-seconds (one rank is one GPU).

A synchronous group runs at the pace of its last rank. When the straggler rule names a culprit,
every rank of the group waits, each step, about the culprit's *gap*: the median rank's visible
(synchronising) wait minus the culprit's. So a window of a straggler or slow-node incident costs

    gap_ms / 1000 x new steps x ranks in the group

where *new steps* are the window's steps not counted by an earlier window (live windows
overlap: each holds the last ``live_window_steps`` steps, and one comes every interval). A job
slowdown costs the excess of its new steps over the run's own baseline in place of the gap (a
window's mean still holds steps from before the change); its streak's windows before it was
reported count too. A hang costs its stalled seconds (from the watcher's budget on) times the
ranks, counted as they grow.

The cost of an incident is counted from the windows that opened it on (the k of n that agreed
included): a candidate that never opens was noise and costs nothing. The steps after the last
live window (the summary window at shutdown reaches them) cost an incident still open at its
latest window's rate. The goodput ratio is one
minus the time lost over the group's time since its first window (wall seconds x ranks).

What it cannot see: time lost before the first window (warm-up), and by a job slow from its
start (its baseline is its own pace).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "SECONDS_PER_HOUR",
    "goodput_ratio",
    "hang_cost_rank_seconds",
    "late_cost_rank_seconds",
    "new_steps",
    "time_lost_text",
]

SECONDS_PER_HOUR = 3600.0


def new_steps(step_range: tuple[int, int] | None, counted_through: int | None) -> int:
    """Steps of a window (``step_range``: its first and last step id) after the last step an
    earlier window counted (``counted_through``; None: nothing counted yet)."""
    if step_range is None:
        return 0
    first, last = int(step_range[0]), int(step_range[1])
    if counted_through is not None:
        first = max(first, counted_through + 1)
    return max(0, last - first + 1)


def late_cost_rank_seconds(gap_ms: float | None, steps: int, ranks: int) -> float:
    """What a window of a late culprit (a rank or a node) cost: the gap every rank waited per
    step, times the steps and the ranks; 0 for an unmeasured or negative gap."""
    if gap_ms is None or not math.isfinite(gap_ms) or gap_ms <= 0:
        return 0.0
    return gap_ms / 1000.0 * max(0, steps) * max(0, ranks)


def hang_cost_rank_seconds(stalled_s: float | None, counted_s: float, ranks: int) -> float:
    """The growth of a hang's stalled seconds since ``counted_s``, times the ranks."""
    if stalled_s is None or not math.isfinite(stalled_s) or stalled_s <= counted_s:
        return 0.0
    return (stalled_s - counted_s) * max(0, ranks)


def goodput_ratio(lost_rank_seconds: float, elapsed_s: float, ranks: int) -> float | None:
    """1 - lost / (elapsed x ranks), within [0, 1]; None before any time has passed."""
    total = elapsed_s * ranks
    if not (math.isfinite(total) and total > 0):
        return None
    return min(1.0, max(0.0, 1.0 - lost_rank_seconds / total))


def _amount(rank_seconds: float) -> str:
    hours = rank_seconds / SECONDS_PER_HOUR
    if hours >= 0.1:
        return f"{hours:.1f} GPU-hours"
    return f"{rank_seconds:.0f} rank-seconds"


def _to_what(inc: Mapping[str, Any]) -> str:
    ranks = ",".join(str(r) for r in inc.get("ranks") or ())
    hosts = ",".join(inc.get("hostnames") or ())
    cls, cause = str(inc.get("class", "")), str(inc.get("cause", "") or "")
    if cls == "hang":
        return "a hang" + (f" (rank {ranks})" if ranks else "")
    if cls == "step_time_slow_node":
        return f"node {hosts} (ranks {ranks}, {cause.replace('_', ' ')})"
    where = f" on {hosts}" if hosts else ""
    what = f"rank {ranks}" if ranks else cls
    return f"{what}{where} ({cause.replace('_', ' ') or cls})"


def time_lost_text(incidents: Sequence[Mapping[str, Any]]) -> str:
    """One line of what the run lost and to what, largest first: ``"lost 1.9 GPU-hours: 1.6
    to rank 17 on node-c (input straggler), 0.3 to a hang"``; empty when nothing was lost."""
    costs = [
        (float(inc.get("lost_rank_seconds") or 0.0), inc)
        for inc in incidents
        if float(inc.get("lost_rank_seconds") or 0.0) > 0
    ]
    if not costs:
        return ""
    costs.sort(key=lambda c: -c[0])
    total = sum(c for c, _ in costs)
    in_hours = total / SECONDS_PER_HOUR >= 0.1
    parts = [f"{c / SECONDS_PER_HOUR:.1f}" if in_hours else f"{c:.0f}" for c, _ in costs]
    return f"lost {_amount(total)}: " + ", ".join(
        f"{p} to {_to_what(inc)}" for p, (_, inc) in zip(parts, costs, strict=True)
    )

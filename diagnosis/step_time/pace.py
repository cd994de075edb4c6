"""The run against itself: is the whole group slower than its own healthy pace?

The straggler rule compares ranks with each other inside one window, so a job whose every rank
slows together (a degraded fabric, a storage slowdown, a thermal event on every node) shows no
rank later than another. :class:`PaceHistory` keeps, per group, a baseline of the run's own pace
and compares each live window with it:

* **Pace.** A window's pace is the median over its ranks of the outer step (input wait + step,
  ms; from the rows: each rank's median step, below), less the straggler's gap when the window
  names one at warning or above (that slowdown is the straggler's incident, not the job's). Per
  phase, the median over ranks of: input wait, H2D, forward and backward (without their
  synchronisation waits when timed), optimizer, the collective waits (``forward_wait +
  backward_wait``) and the time outside the timed phases.
* **Baseline.** The first ``pace_warmup_windows`` windows are warm-up (compile, caches, the
  loader filling); the next ``pace_baseline_windows`` form the baseline: the median of each
  quantity over them, so one bad window among them does not move it. Until then the report
  says which of the two it is waiting for (``state``, ``reason``). The baseline then stays
  fixed, so a slow drift adds up against it, until :meth:`PaceHistory.rebaseline` (the user
  changed the batch or sequence length) starts warm-up and formation again.
* **Slowdown.** ``ratio = pace / baseline``. From ``job_slowdown_windows`` consecutive windows at
  ``job_slowdown_warning_ratio`` or above, the report carries a ``JOB_SLOWDOWN`` finding:
  warning, critical from ``job_slowdown_critical_ratio``; ``since_window`` is the streak's first
  window, ``phase`` the phase that grew the most per step, and the unit is every rank, the
  ranks of some hosts, or some ranks: the ranks whose own work (outer step less their
  synchronisation waits) grew by the warning ratio over their own baseline.
* **Per rank.** ``rank_ratios``: each rank's own work over its own baseline, for a heatmap that
  shows a rank degrading before it is a straggler.

Windows with fewer than ``min_steps_critical`` aligned steps (as a page needs) neither form nor
judge. Fed the window's rows (:func:`rows_pace`, as the aggregator does), the pace is the
median over ranks of each rank's *median* outer step, so an evaluation or a checkpoint inside
a few steps does not move it; the cost is counted on the mean of the window's new steps. Memory is
bounded: the baseline windows' per-rank values (``pace_baseline_windows`` x ranks) and a few
numbers per window; each window costs one pass over its ranks.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankwatch.diagnosis.config import StepTimeConfig, config_or_default
from rankwatch.diagnosis.step_time.report import StepTimeReport
from rankwatch.diagnosis.step_time.table import IW, MEAN_KEYS, STEP, clock_columns

__all__ = [
    "FORMED",
    "FORMING",
    "PACE_PHASES",
    "RECENT_SAMPLE_RANKS",
    "WARMING_UP",
    "PaceHistory",
    "PaceReport",
    "RowsPace",
    "rows_pace",
]

# What grew: the phases a job slowdown is attributed to, in the order ties break.
PACE_PHASES: tuple[str, ...] = (
    "input_wait",
    "h2d",
    "forward",
    "backward",
    "optimizer",
    "collective_wait",
    "outside",
)
WARMING_UP, FORMING, FORMED = "warming_up", "forming", "formed"
_EPSILON = 1e-9
# The recent steps' pace is a median over ranks: an even sample of this many is enough, and
# keeps its cost the same at any size.
RECENT_SAMPLE_RANKS = 128


@dataclass(frozen=True)
class PaceReport:
    """The group's pace against its own baseline, for one window.

    ``state``: ``warming_up`` / ``forming`` (no baseline yet: ``reason`` says what it waits
    for) or ``formed``. ``ratio`` is the window's pace over the baseline (None without one);
    ``severity`` is set only once the slowdown lasted ``job_slowdown_windows`` windows, with
    ``since_window`` the first of them, ``phase`` what grew the most and ``phase_growth_ms``
    each phase's growth per step. ``slow_ranks`` are the ranks whose own work grew by the
    warning ratio; ``unit`` is ``"every rank"``, ``"hosts"`` (``hosts`` names them) or
    ``"ranks"``. ``rank_ratios``: each rank's own work over its own baseline.
    """

    state: str
    reason: str = ""
    window_index: int = 0
    pace_ms: float | None = None
    baseline_ms: float | None = None
    ratio: float | None = None
    severity: str | None = None
    since_window: int | None = None
    phase: str = ""
    phase_growth_ms: dict[str, float] = field(default_factory=dict)
    slow_ranks: tuple[int, ...] = ()
    unit: str = ""
    hosts: tuple[str, ...] = ()
    rank_ratios: dict[int, float] = field(default_factory=dict)
    rebaselines: int = 0
    streak: int = 0  # windows in a row at the warning ratio or above, this one included
    # The pace of the window's steps that no earlier window held (what its cost is counted
    # on: a window's mean still holds steps from before a change), and how many.
    recent_pace_ms: float | None = None
    recent_steps: int = 0
    # Whether the new steps alone are at the warning ratio or above (a change shows in them
    # windows before it moves the window's median steps: their cost counts from then).
    recent_slow: bool = False

    @property
    def kind(self) -> str:
        """``JOB_SLOWDOWN`` while a slowdown is reported, else empty."""
        return "JOB_SLOWDOWN" if self.severity else ""

    def to_dict(self) -> dict[str, Any]:
        def clean(v: float | None) -> float | None:
            return None if v is None or not math.isfinite(v) else float(v)

        return {
            "state": self.state,
            "reason": self.reason,
            "window_index": self.window_index,
            "pace_ms": clean(self.pace_ms),
            "baseline_ms": clean(self.baseline_ms),
            "ratio": clean(self.ratio),
            "severity": self.severity,
            "since_window": self.since_window,
            "phase": self.phase,
            "phase_growth_ms": {k: clean(v) for k, v in self.phase_growth_ms.items()},
            "slow_ranks": list(self.slow_ranks),
            "unit": self.unit,
            "hosts": list(self.hosts),
            "rank_ratios": {str(r): clean(v) for r, v in self.rank_ratios.items()},
            "rebaselines": self.rebaselines,
            "streak": self.streak,
            "recent_pace_ms": clean(self.recent_pace_ms),
            "recent_steps": self.recent_steps,
            "recent_slow": self.recent_slow,
        }

    @property
    def recent_excess_ms(self) -> float | None:
        """What each of the window's new steps took over the baseline (ms), or None."""
        pace = self.recent_pace_ms if self.recent_pace_ms is not None else self.pace_ms
        if pace is None or self.baseline_ms is None or not math.isfinite(pace - self.baseline_ms):
            return None
        return pace - self.baseline_ms


def _window_values(report: StepTimeReport) -> tuple[list[int], np.ndarray, np.ndarray]:
    """``(ranks, phases[rank, PACE_PHASES], (outer, own_work)[rank, 2])`` of the window's
    present ranks; NaN where unmeasured. One table built at once, then numpy."""
    ranks = [int(r) for r in report.rank_means]
    # None (unmeasured) becomes NaN in a float array.
    m = np.array(
        [[means.get(k) for k in MEAN_KEYS] for means in report.rank_means.values()],
        dtype=float,
    ).reshape(len(ranks), len(MEAN_KEYS))
    iw, h2d, fwd, bwd, opt, step, res, fww, bww = m.T  # MEAN_KEYS' order
    outer = iw + step
    # Each wait is taken off its own phase where it was timed (a job may synchronise only in
    # its backward: no forward wait at all).
    fw_timed, bw_timed = np.isfinite(fww), np.isfinite(bww)
    timed = fw_timed | bw_timed
    waits = np.where(timed, np.where(fw_timed, fww, 0.0) + np.where(bw_timed, bww, 0.0), np.nan)
    fwd = np.where(fw_timed, np.maximum(0.0, fwd - fww), fwd)
    bwd = np.where(bw_timed, np.maximum(0.0, bwd - bww), bwd)
    own = outer - np.where(timed, waits, 0.0)
    phases = np.stack([iw, h2d, fwd, bwd, opt, waits, res], axis=1)
    keep = np.isfinite(outer)
    work = np.stack([outer, own], axis=1)
    return [r for r, k in zip(ranks, keep.tolist(), strict=True) if k], phases[keep], work[keep]


@dataclass(frozen=True)
class RowsPace:
    """The window's pace read from its rows (:func:`rows_pace`): ``window_ms`` the median over
    ranks of each rank's *median* outer step (a few slow steps, an evaluation or a checkpoint
    inside a step, do not move it; a slower job does), ``recent_ms`` the median over ranks of
    the mean outer step of the ``recent_steps`` steps no earlier window held (what their cost
    is counted on)."""

    window_ms: float | None
    recent_ms: float | None
    recent_steps: int


def rows_pace(
    per_rank: Mapping[int, np.ndarray | None], clock: str, after_step: int | None
) -> RowsPace:
    """The window's :class:`RowsPace` from its step-time rows per rank (in step order), new
    steps being those after ``after_step`` (every row when None); at most
    :data:`RECENT_SAMPLE_RANKS` ranks, evenly spread, are read."""
    arrays = [a for a in per_rank.values() if a is not None and len(a)]
    if len(arrays) > RECENT_SAMPLE_RANKS:
        pick = np.linspace(0, len(arrays) - 1, RECENT_SAMPLE_RANKS).astype(int)
        arrays = [arrays[i] for i in pick]
    first = clock_columns(clock).start
    medians: list[float] = []
    recents: list[float] = []
    steps = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for rows in arrays:
            outer = rows[:, first + IW] + rows[:, first + STEP]
            median = float(np.nanmedian(outer))
            if math.isfinite(median):
                medians.append(median)
            start = (
                0 if after_step is None else int(np.searchsorted(rows[:, 0], after_step, "right"))
            )
            mean = float(np.nanmean(outer[start:])) if start < len(rows) else math.nan
            if math.isfinite(mean):
                recents.append(mean)
                steps = max(steps, len(rows) - start)
    return RowsPace(
        float(np.median(medians)) if medians else None,
        float(np.median(recents)) if recents else None,
        steps if recents else 0,
    )


def _median(values: np.ndarray, axis: int = 0) -> np.ndarray:
    with warnings.catch_warnings():  # an unmeasured phase (all NaN) is simply absent
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.asarray(np.nanmedian(values, axis=axis))


class PaceHistory:
    """A group's baseline of its own pace and the current slowdown streak (see the module
    docstring). One per group, fed every live window in order; not thread-safe."""

    def __init__(self, config: StepTimeConfig | None = None) -> None:
        self.config = config_or_default(config, StepTimeConfig)
        self.rebaselines = 0
        self.rebaseline_reason = ""
        self._reset()

    def _reset(self) -> None:
        self._warmup_left = self.config.pace_warmup_windows
        self._forming: list[tuple[float, np.ndarray, dict[int, float]]] = []
        self._baseline: tuple[float, np.ndarray, dict[int, float]] | None = None
        self._streak: list[int] = []  # window indices of the current slowdown streak

    def rebaseline(self, reason: str) -> None:
        """Forget the baseline (the batch or sequence length changed on purpose): warm-up and
        formation start again with the next window. ``reason`` is kept for the report."""
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"reason: expected a non-empty string, got {reason!r}")
        self.rebaselines += 1
        self.rebaseline_reason = reason.strip()[:200]
        self._reset()

    def update(
        self,
        report: StepTimeReport,
        window_index: int,
        hostnames: Mapping[int, str] | None = None,
        rows: RowsPace | None = None,
    ) -> PaceReport:
        """Judge one live window against the baseline (or add it to the baseline).
        ``rows``: the window's pace read from its rows (:func:`rows_pace`): the pace is then
        its median steps' (else the window's means'), and the pace of its new steps is carried
        for their cost; a straggler's gap is taken off both. Feed one or the other for a
        whole run, not both."""
        if not isinstance(report, StepTimeReport):
            raise TypeError(f"report: expected StepTimeReport, got {type(report).__name__}")
        cfg = self.config
        if report.steps < cfg.min_steps_critical:
            # As a page needs: a window this short is too noisy to judge the job's pace by.
            return self._waiting("the window has too few aligned steps", window_index)
        ranks, phases, work = _window_values(report)
        if not ranks:
            return self._waiting("no rank's step was measured in the window", window_index)
        pace = float(_median(work[:, 0]))
        if rows is not None and rows.window_ms is not None:
            pace = rows.window_ms
        gap = _straggler_gap_ms(report, cfg)
        pace = max(0.0, pace - gap)
        phase_medians = _median(phases)
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return self._waiting(
                f"warm-up: {self._warmup_left + 1} of {cfg.pace_warmup_windows} windows left",
                window_index,
                state=WARMING_UP,
            )
        if self._baseline is None:
            own = dict(zip(ranks, work[:, 1].tolist(), strict=True))
            self._forming.append((pace, phase_medians, own))
            if len(self._forming) < cfg.pace_baseline_windows:
                return self._waiting(
                    f"forming the baseline: {len(self._forming)} of "
                    f"{cfg.pace_baseline_windows} windows",
                    window_index,
                    state=FORMING,
                )
            self._baseline = self._formed(self._forming)
            self._forming = []
        base_pace, base_phases, base_own = self._baseline
        ratio = pace / base_pace if base_pace > 0 else math.nan
        base = np.array([base_own.get(r, math.nan) for r in ranks])
        with np.errstate(all="ignore"):
            ratios = work[:, 1] / base
        ok = np.isfinite(ratios) & (base > 0)
        rank_ratios = dict(zip(np.asarray(ranks)[ok].tolist(), ratios[ok].tolist(), strict=True))
        slow = _at_least(ratio, cfg.job_slowdown_warning_ratio)
        self._streak = [*self._streak, window_index] if slow else []
        recent_pace, recent_steps = (
            (None, 0) if rows is None else (rows.recent_ms, rows.recent_steps)
        )
        if recent_pace is not None:
            recent_pace = max(0.0, recent_pace - gap)
        out = PaceReport(
            state=FORMED,
            reason=self._why_formed(),
            window_index=window_index,
            recent_pace_ms=recent_pace,
            recent_steps=recent_steps,
            recent_slow=recent_pace is not None
            and base_pace > 0
            and _at_least(recent_pace / base_pace, cfg.job_slowdown_warning_ratio),
            pace_ms=pace,
            baseline_ms=base_pace,
            ratio=ratio,
            rank_ratios=rank_ratios,
            rebaselines=self.rebaselines,
            streak=len(self._streak),
        )
        if len(self._streak) < cfg.job_slowdown_windows:
            return out
        growth = {
            name: float(now - then)
            for name, now, then in zip(PACE_PHASES, phase_medians, base_phases, strict=True)
            if math.isfinite(now) and math.isfinite(then)
        }
        phase = max(growth, key=lambda n: (growth[n], -PACE_PHASES.index(n)), default="")
        warning = cfg.job_slowdown_warning_ratio
        slow_ranks = tuple(sorted(r for r, v in rank_ratios.items() if _at_least(v, warning)))
        unit, hosts = _unit(slow_ranks, ranks, hostnames or {})
        critical = _at_least(ratio, cfg.job_slowdown_critical_ratio)
        return dataclasses.replace(
            out,
            severity="critical" if critical else "warning",
            since_window=self._streak[0],
            phase=phase,
            phase_growth_ms=growth,
            slow_ranks=slow_ranks,
            unit=unit,
            hosts=hosts,
        )

    def _why_formed(self) -> str:
        if self.rebaselines:
            return f"baseline formed again after: {self.rebaseline_reason}"
        return ""

    def _waiting(self, reason: str, window_index: int, state: str | None = None) -> PaceReport:
        if state is None:
            state = (
                FORMED
                if self._baseline is not None
                else (WARMING_UP if self._warmup_left > 0 else FORMING)
            )
        if self._baseline is not None:
            # A window that cannot be judged neither extends nor ends a streak.
            return PaceReport(
                state=FORMED,
                reason=reason,
                window_index=window_index,
                baseline_ms=self._baseline[0],
                rebaselines=self.rebaselines,
            )
        note = f"; after: {self.rebaseline_reason}" if self.rebaselines else ""
        return PaceReport(
            state=state,
            reason=f"no baseline yet ({reason}{note})",
            window_index=window_index,
            rebaselines=self.rebaselines,
        )

    @staticmethod
    def _formed(
        windows: list[tuple[float, np.ndarray, dict[int, float]]],
    ) -> tuple[float, np.ndarray, dict[int, float]]:
        pace = float(np.median([w[0] for w in windows]))
        phases = _median(np.stack([w[1] for w in windows]))
        ranks = sorted({r for w in windows for r in w[2]})
        own = {}
        for r in ranks:
            values = [w[2][r] for w in windows if r in w[2] and math.isfinite(w[2][r])]
            if values:
                own[r] = float(np.median(values))
        return pace, phases, own


def _at_least(value: float, threshold: float) -> bool:
    return math.isfinite(value) and value >= threshold - _EPSILON


def _straggler_gap_ms(report: StepTimeReport, cfg: StepTimeConfig) -> float:
    """The gap of the window's straggler (or slow node) at warning or above, else 0: that
    slowdown is the straggler's incident, not the job's."""
    for f in report.findings:
        if f.is_straggler and f.severity in ("warning", "critical") and f.gap_ms is not None:
            return max(0.0, f.gap_ms)
    return 0.0


def _unit(
    slow: tuple[int, ...], ranks: list[int], hostnames: Mapping[int, str]
) -> tuple[str, tuple[str, ...]]:
    """``("every rank", ())`` when every rank's own work grew; ``("hosts", names)`` when the
    ranks that grew are exactly the ranks of some hosts; ``("ranks", ())`` otherwise."""
    if not slow:
        return "", ()
    if set(slow) >= set(ranks):
        return "every rank", ()
    hosts = sorted({hostnames.get(r, "") for r in slow})
    if all(hosts):
        on_hosts = {r for r in ranks if hostnames.get(r, "") in hosts}
        if on_hosts == set(slow):
            return "hosts", tuple(hosts)
    return "ranks", ()

"""Step-time diagnosis: is one rank of a DDP/FSDP job a straggler, which one, why, how sure.

The policy runs on one window of per-rank means on one clock (see :mod:`.table` for how
rows become means). In short:

* **Straggler.** Each eligible rank has a *visible* synchronisation phase: ``backward``
  (DDP) or ``forward + backward`` (FSDP); rankwatch's extension, when every present rank
  timed the waits at the synchronisation points on the window's clock (CPU or GPU; DDP or
  FSDP), compares those waits instead (``forward_wait + backward_wait``, see
  :func:`_visible`). The rank that waited least in it (minimum visible, ties to the lower
  rank id) arrived last: the *culprit*. The *victim* is the upper median of the eligible
  ranks sorted by ``(visible, rank)``. The score is the visible gap over the victim's outer
  step, ``(visible_victim - visible_culprit) / (input_wait_victim + step_victim)``: below
  0.10 no finding, warning from 0.10, critical from 0.20.
* **Attribution.** Culprit-minus-victim excess of input wait, H2D (measured on both ranks)
  and forward (DDP only, measured on both; with the sync waits: forward and backward without
  their waits) as bounded coverage of the visible gap; the best
  (ties: input > h2d > compute) names the kind when it reaches 0.80, else ``STRAGGLER``.
* **Bottlenecks.** Medians across ranks of each rank's share of its outer step:
  ``INPUT_BOUND``, ``H2D_BOUND`` (GPU clock only), ``RESIDUAL_HEAVY`` (warning from 0.10,
  critical from 0.20) and ``COMPUTE_BOUND`` (info, compute share >= 0.90 with no other share
  reaching 0.10).
* **Mesh.** With a :class:`~.mesh.MeshLayout` (``mesh=``), the straggler rule runs in each
  comparison group (the ranks of one pipeline stage; every rank without a pipeline dimension)
  and keeps the highest-scoring group's evidence (ties: the lowest stage); the evidence says
  which group and where the culprit sits. When every stage names its member of one pipeline
  replica at the warning score or above, the replica is named (``slow_group``): the slow rank
  within it cannot be told. Without a mesh: one group of every rank.
* **Robust windows.** The reduction leaves a rank's rare outlier steps out of its means
  (``outlier_step_factor``, ``outlier_steps_max_fraction``; see :mod:`.table`).
* **Gates.** Fewer than 2 aligned steps: ``WARMUP``. Fewer than 20 steps, or FSDP: every
  finding capped at warning. Findings sort by severity then score (a straggler wins an exact
  tie). No finding: ``INCOMPLETE_DATA`` when a rule abstained for an unmeasured signal, else
  ``BALANCED``.

Strategy: ``None`` or ``""`` means ``"ddp"``; ``"ddp"``/``"fsdp"`` (any case) are accepted; any
other string or type is a ``ValueError``. Lenient mapping of advisory runtime metadata
(where an unrecognised value means DDP) is :func:`strategy_from_metadata`'s job.

Thresholds come from :class:`~rankwatch.diagnosis.config.StepTimeConfig`. Comparisons with a
threshold allow ``1e-9`` of floating-point slack, so a score that is 0.10 up to rounding of
window means counts as 0.10.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rankwatch.diagnosis.config import StepTimeConfig, config_or_default
from rankwatch.diagnosis.headroom import headroom_shift
from rankwatch.diagnosis.step_time.mesh import ComparisonGroup, MeshLayout
from rankwatch.diagnosis.step_time.report import (
    COMPONENTS,
    GPU_TIMING,
    RANK_MEAN_KEYS,
    SCORE_HELD_AT_ONE,
    STATUS_KINDS,
    STRAGGLER_KINDS,
    UNATTRIBUTED,
    VISIBLE_DDP,
    VISIBLE_FSDP,
    VISIBLE_NONE,
    VISIBLE_SYNC,
    Finding,
    StepTimeReport,
    StragglerEvidence,
)
from rankwatch.diagnosis.step_time.row_dicts import _rows_table
from rankwatch.diagnosis.step_time.table import (
    BWD,
    BWW,
    CLOCKS,
    FWD,
    FWW,
    H2D,
    IW,
    MEAN_KEYS,
    OPT,
    RES,
    ROW_WIDTH,
    SIGNALS,
    STEP,
    OutlierRule,
    WindowMeans,
    _reduce_table,
    rank_items,
    reduce_cube_window,
    reduce_window,
    validate_window,
)
from rankwatch.diagnosis.vocabulary import SEVERITY_LEVELS

__all__ = [
    "STRATEGIES",
    "diagnose_arrays",
    "diagnose_means",
    "diagnose_steps",
    "diagnose_window",
    "normalize_strategy",
    "outlier_rule",
    "strategy_from_metadata",
]

STRATEGIES: tuple[str, ...] = ("ddp", "fsdp")
EPSILON = 1e-9  # slack when comparing a score or share with a threshold

_BOTTLENECK_ORDER = ("INPUT_BOUND", "H2D_BOUND", "RESIDUAL_HEAVY", "COMPUTE_BOUND")
# Missing-signal tuples by bit pattern (bit k = SIGNALS[k] unmeasured), built once.
_MISSING_BY_CODE: tuple[tuple[str, ...], ...] = tuple(
    tuple(s for k, s in enumerate(SIGNALS) if code >> k & 1) for code in range(1 << len(SIGNALS))
)
_BITS = 1 << np.arange(len(SIGNALS))


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def normalize_strategy(strategy: object) -> str:
    """``None``/``""`` -> ``"ddp"``; ``"ddp"``/``"fsdp"`` in any case; else ``ValueError``."""
    if strategy is None:
        return "ddp"
    if not isinstance(strategy, str):
        raise ValueError(
            f"field strategy: value {strategy!r} ({type(strategy).__name__}) is not a string; "
            "expected 'ddp', 'fsdp' or None"
        )
    name = strategy.strip().lower()
    if name == "":
        return "ddp"
    if name not in STRATEGIES:
        raise ValueError(
            f"field strategy: value {strategy!r} is not a known strategy; expected 'ddp', "
            "'fsdp' or None (use strategy_from_metadata for advisory runtime metadata)"
        )
    return name


def strategy_from_metadata(value: object) -> str:
    """Advisory runtime metadata -> ``"ddp"``/``"fsdp"``; anything unrecognised means DDP.

    Recognises FSDP under the names ``fsdp``, ``fsdp1``, ``fsdp2``, ``fully_shard`` and
    ``fully_sharded_data_parallel`` (any case, ``-`` for ``_``).
    """
    if isinstance(value, str):
        name = value.strip().lower().replace("-", "_")
        if name in ("fsdp", "fsdp1", "fsdp2", "fully_shard", "fully_sharded_data_parallel"):
            return "fsdp"
    return "ddp"


def _config(config: StepTimeConfig | None) -> StepTimeConfig:
    # ValueError, not TypeError: every bad input of this engine is a ValueError (documented).
    return config_or_default(config, StepTimeConfig, ValueError)


def outlier_rule(config: StepTimeConfig) -> OutlierRule:
    """The reduction's outlier rule from the config's two options."""
    return OutlierRule(config.outlier_step_factor, config.outlier_steps_max_fraction)


def _mesh(mesh: object) -> MeshLayout | None:
    if mesh is None or isinstance(mesh, MeshLayout):
        return mesh
    raise ValueError(f"field mesh: value of type {type(mesh).__name__} is not a MeshLayout or None")


def _mean_value(rank: int, key: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise ValueError(
            f"rank {rank}: field {key}: value {value!r} is not a number of milliseconds"
        )
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"rank {rank}: field {key}: value {value!r} is not finite")
    if out < 0:
        raise ValueError(f"rank {rank}: field {key}: value {value!r} is negative")
    return out


def _means_window(means: Mapping[Any, Any], steps: int, clock: str) -> WindowMeans:
    if not isinstance(means, Mapping):
        raise ValueError(
            f"field means: value of type {type(means).__name__} is not a mapping "
            "{rank: {signal: ms}}"
        )
    if not means:
        raise ValueError("field means: value {} is empty (no rank expected)")
    items = rank_items(means)
    n = len(items)
    values = np.zeros((n, len(MEAN_KEYS)))
    measured = np.zeros((n, len(MEAN_KEYS)), dtype=bool)
    allowed = set(MEAN_KEYS)
    for i, (rank, row) in enumerate(items):
        if row is None:
            continue
        if not isinstance(row, Mapping):
            raise ValueError(
                f"rank {rank}: field means: value {row!r} is not a mapping {{signal: ms}}"
            )
        unknown = set(row) - allowed
        if unknown:
            key = sorted(unknown, key=str)[0]
            raise ValueError(
                f"rank {rank}: field {key}: unknown signal (expected one of "
                f"{', '.join(MEAN_KEYS)}), value {row[key]!r}"
            )
        for k, key in enumerate(MEAN_KEYS):
            v = _mean_value(rank, key, row.get(key))
            if v is not None:
                values[i, k] = v
                measured[i, k] = True
    derive = ~measured[:, RES] & measured[:, STEP] & measured[:, FWD] & measured[:, BWD]
    with np.errstate(over="ignore", invalid="ignore"):
        derived = np.maximum(
            values[:, STEP] - values[:, H2D] - values[:, FWD] - values[:, BWD] - values[:, OPT], 0.0
        )
    values[derive, RES] = derived[derive]
    measured[derive, RES] = True
    present: np.ndarray = np.asarray(measured.any(axis=1))
    return WindowMeans(tuple(r for r, _ in items), values, measured, present, steps, clock)


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def diagnose_arrays(
    per_rank: Mapping[int, np.ndarray | None],
    *,
    strategy: str | None = None,
    window: int = 100,
    config: StepTimeConfig | None = None,
    mesh: MeshLayout | None = None,
) -> StepTimeReport:
    """Diagnose one window from columnar arrays: ``{rank: float64 [n, ROW_WIDTH]}``.

    The collectors' fast path. ``None`` or an empty array marks an expected rank that sent
    nothing. ``window`` keeps the last N step ids common to all present ranks. ``mesh``: the
    job's device mesh (compare ranks within its comparison groups), None for one group.
    """
    cfg = _config(config)
    strat = normalize_strategy(strategy)
    layout = _mesh(mesh)
    wm = reduce_window(per_rank, window=window, outliers=outlier_rule(cfg))
    return diagnose_window(wm, strategy=strat, config=cfg, mesh=layout)


def diagnose_cube(
    ranks: Sequence[int],
    present_ranks: Sequence[int],
    cube: np.ndarray,
    *,
    strategy: str | None = None,
    window: int = 100,
    config: StepTimeConfig | None = None,
    mesh: MeshLayout | None = None,
) -> StepTimeReport:
    """:func:`diagnose_arrays` for rows already side by side (``reduce_cube_window``): every
    expected rank in ``ranks``, the present ones' last rows in ``cube``. The same report."""
    cfg = _config(config)
    strat = normalize_strategy(strategy)
    layout = _mesh(mesh)
    wm = reduce_cube_window(ranks, present_ranks, cube, window=window, outliers=outlier_rule(cfg))
    return diagnose_window(wm, strategy=strat, config=cfg, mesh=layout)


def diagnose_steps(
    per_rank_rows: Mapping[int, Sequence[Mapping[str, Any]] | None],
    *,
    strategy: str | None = None,
    window: int = 100,
    config: StepTimeConfig | None = None,
    mesh: MeshLayout | None = None,
) -> StepTimeReport:
    """Diagnose one window from row dictionaries: ``{rank: [{"step_id", "cpu", "gpu"}, ...]}``.

    A rank mapped to ``None`` or ``[]`` is expected but missing; ``mesh`` as
    :func:`diagnose_arrays`.
    """
    cfg = _config(config)
    strat = normalize_strategy(strategy)
    layout = _mesh(mesh)
    win = validate_window(window)
    if not isinstance(per_rank_rows, Mapping):
        raise ValueError(
            f"field per_rank_rows: value of type {type(per_rank_rows).__name__} is not a "
            "mapping {rank: rows}"
        )
    if not per_rank_rows:
        raise ValueError("field per_rank_rows: value {} is empty (no rank expected)")
    items = rank_items(per_rank_rows)
    present: list[tuple[int | None, Sequence[Mapping[str, Any]]]] = []
    for rank, rows in items:
        if rows is None:
            continue
        if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence):
            raise ValueError(
                f"rank {rank}: field rows: value of type {type(rows).__name__} is not a "
                "sequence of row mappings"
            )
        if len(rows):
            present.append((rank, rows))
    if present:
        table, lengths = _rows_table(present)
    else:
        table, lengths = np.empty((0, ROW_WIDTH)), []
    present_ranks = [int(r) for r, _ in present if r is not None]
    wm = _reduce_table([r for r, _ in items], present_ranks, table, lengths, win, outlier_rule(cfg))
    return diagnose_window(wm, strategy=strat, config=cfg, mesh=layout)


def diagnose_means(
    means: Mapping[int, Mapping[str, float | None] | None],
    *,
    steps: int,
    strategy: str | None = None,
    clock: str = "cpu",
    config: StepTimeConfig | None = None,
    mesh: MeshLayout | None = None,
) -> StepTimeReport:
    """Diagnose per-rank window means (ms) over ``steps`` aligned steps on ``clock``.

    Keys are the six signals plus an optional ``residual`` that overrides the derived one; a
    missing key or None is unmeasured, a rank mapped to None is expected but missing;
    ``mesh`` as :func:`diagnose_arrays`.
    """
    cfg = _config(config)
    strat = normalize_strategy(strategy)
    layout = _mesh(mesh)
    if isinstance(steps, (bool, np.bool_)) or not isinstance(steps, (int, np.integer)):
        raise ValueError(f"field steps: value {steps!r} is not an int number of steps")
    if steps < 0:
        raise ValueError(f"field steps: value {steps!r} is negative")
    if clock not in CLOCKS:
        raise ValueError(f"field clock: value {clock!r} is not one of {', '.join(CLOCKS)}")
    wm = _means_window(means, int(steps), clock)
    return diagnose_window(wm, strategy=strat, config=cfg, mesh=layout)


# --------------------------------------------------------------------------------------------
# The policy
# --------------------------------------------------------------------------------------------


def _at_least(value: float, threshold: float) -> bool:
    return value >= threshold - EPSILON


def _severity(value: float, warning: float, critical: float, capped: bool) -> str | None:
    if not _at_least(value, warning):
        return None
    if _at_least(value, critical) and not capped:
        return "critical"
    return "warning"


def _straggler_evidence(
    wm: WindowMeans,
    fsdp: bool,
    visible: np.ndarray,
    eligible: np.ndarray,
    cfg: StepTimeConfig,
    definition: str,
) -> StragglerEvidence | None:
    idx = np.flatnonzero(eligible)
    if idx.size < 2:
        return None
    m, k = wm.means, wm.measured
    ranks = np.asarray(wm.ranks)
    order = idx[np.lexsort((ranks[idx], visible[idx]))]
    c, v = int(order[0]), int(order[order.size // 2])
    gap = float(visible[v] - visible[c])
    # On consistent timings the visible phase lies inside the step, so the score is at most 1;
    # a larger quotient (or one past float range: a subnormal step) means the victim's phases
    # and step disagree, and the score is held at 1 with the reason stated.
    score = gap / float(m[v, IW] + m[v, STEP])
    score_note = ""
    if not score <= 1.0:
        score, score_note = 1.0, SCORE_HELD_AT_ONE
    excess: dict[str, float] = {}
    missing: list[str] = []
    if k[c, IW] and k[v, IW]:  # always true on the seed's definitions (eligibility)
        excess["input"] = float(m[c, IW] - m[v, IW])
    else:
        missing.append("input_wait")
    if k[c, H2D] and k[v, H2D]:
        excess["h2d"] = float(m[c, H2D] - m[v, H2D])
    else:
        missing.append("h2d")
    if fsdp:
        # Measured but not attributable: collectives mask compute under FSDP.
        excess["compute"] = 0.0
    elif k[c, FWD] and k[v, FWD]:
        # A forward of 0 is not a measurement of compute: its excess counts as 0.
        fwd_c, fwd_v = float(m[c, FWD]), float(m[v, FWD])
        forward = fwd_c - fwd_v if fwd_c > 0 and fwd_v > 0 else 0.0
        if definition == VISIBLE_SYNC:
            # Compute is the local work of both passes: forward minus its pre-forward wait,
            # backward minus its trailing wait (a backward straggler shows up here).
            forward = max(0.0, fwd_c - m[c, FWW]) - max(0.0, fwd_v - m[v, FWW])
            forward = forward if fwd_c > 0 and fwd_v > 0 else 0.0
            backward = max(0.0, m[c, BWD] - m[c, BWW]) - max(0.0, m[v, BWD] - m[v, BWW])
            excess["compute"] = float(forward + backward)
        else:
            excess["compute"] = forward
    else:
        missing.append("forward")
    # Evidence shows excesses floored at 0: a culprit faster than the victim has no excess.
    excess = {name: max(0.0, e) for name, e in excess.items()}
    coverage = {name: (min(1.0, e / gap) if gap > 0 else 0.0) for name, e in excess.items()}
    best = max(COMPONENTS, key=lambda n: (coverage.get(n, -1.0), -COMPONENTS.index(n)))
    component = (
        best
        if best in coverage and _at_least(coverage[best], cfg.cause_coverage_min)
        else UNATTRIBUTED
    )
    return StragglerEvidence(
        culprit_rank=int(ranks[c]),
        victim_rank=int(ranks[v]),
        score=score,
        visible_culprit_ms=float(visible[c]),
        visible_victim_ms=float(visible[v]),
        component_excesses_ms=excess,
        component_coverage=coverage,
        component=component,
        eligible_ranks=tuple(int(r) for r in ranks[idx]),
        missing_signals=tuple(s for s in SIGNALS if s in missing),
        visible_definition=definition,
        score_note=score_note,
    )


def _visible(wm: WindowMeans, fsdp: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """``(visible, visible_measured, eligible, definition)`` of the window.

    Rankwatch's extension: when every present rank timed the waits at the synchronisation
    points (``forward_wait``, ``backward_wait``) on the window's clock, the visible value is
    that wait, wherever the job synchronises (DDP: a buffer broadcast before forward, the
    gradient reduction after backward; FSDP: every unit's all-gather and reduce-scatter). On
    the CPU clock that is host time blocked in the collective; on the GPU clock the time the
    compute stream sat behind it (the report's ``clock`` says which). Under FSDP the seed's
    ``forward + backward`` holds the late rank's extra compute and its peers' wait for it
    alike, so a rank slow in its forward or backward is only seen in the waits. Otherwise
    (a rank without the waits: older rankwatch, a step whose device wait could not be timed)
    the seed's definitions: ``backward`` (DDP/default) or ``forward + backward`` (FSDP).
    """
    m, k = wm.means, wm.measured
    outer_positive = (m[:, IW] + m[:, STEP]) > 0
    anchored = k[:, STEP] & k[:, BWD] & (m[:, BWD] > 0) & outer_positive
    has_waits = k[:, FWW] & k[:, BWW]
    if bool(has_waits[wm.present].all()) and int((anchored & has_waits).sum()) >= 2:
        # The input wait is not needed to compare waits: a prefetching loader (whose wait the
        # hooks cannot see) still gets its culprit named; attribution then lacks ``input``.
        return m[:, FWW] + m[:, BWW], has_waits, anchored & has_waits, VISIBLE_SYNC
    if fsdp:
        eligible = anchored & k[:, IW] & k[:, FWD] & (m[:, FWD] > 0)
        return m[:, FWD] + m[:, BWD], k[:, FWD] & k[:, BWD], eligible, VISIBLE_FSDP
    return m[:, BWD].copy(), k[:, BWD].copy(), anchored & k[:, IW], VISIBLE_DDP


def _outliers_by_rank(ranks: Sequence[int], counts: Sequence[int]) -> list[tuple[int, int]]:
    """``(rank, steps left out)`` of the ranks that left any out (``counts`` may be empty)."""
    return [(r, n) for r, n in zip(ranks, counts, strict=False) if n]


def _unmeasured(measured: np.ndarray, columns: list[int]) -> tuple[str, ...]:
    """Signals among ``columns`` unmeasured on at least one of the given ranks."""
    if measured.shape[0] == 0:
        return ()
    gaps = np.asarray(~measured[:, columns].all(axis=0))
    return tuple(SIGNALS[c] for c, gap in zip(columns, gaps, strict=True) if gap)


def _bottlenecks(wm: WindowMeans, cfg: StepTimeConfig) -> list[tuple[Finding, float]]:
    m, k = wm.means, wm.measured
    ranks = np.asarray(wm.ranks)
    outer = m[:, IW] + m[:, STEP]
    base = k[:, IW] & k[:, STEP] & (outer > 0)
    safe_outer = np.where(base, outer, 1.0)
    warn = cfg.bottleneck_warning_share

    def share(numerator: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, float | None]:
        # A share of the outer step lies in [0, 1]; means whose phases add up to more than
        # their step (clocks that disagree) are held at 1 rather than overflowing past it.
        with np.errstate(over="ignore", divide="ignore"):
            values = np.minimum(numerator / safe_outer, 1.0)
        return values, (float(np.median(values[mask])) if mask.any() else None)

    found: list[tuple[Finding, float]] = []
    medians: dict[str, float | None] = {}
    no_residual = ~k[:, RES]
    rules: list[tuple[str, str, np.ndarray, np.ndarray, tuple[str, ...]]] = [
        ("INPUT_BOUND", "input", m[:, IW], base, _unmeasured(k, [IW, STEP])),
        ("H2D_BOUND", "h2d", m[:, H2D], base & k[:, H2D], _unmeasured(k, [IW, STEP, H2D])),
        (
            "RESIDUAL_HEAVY",
            "residual",
            m[:, RES],
            base & k[:, RES],
            _unmeasured(k, [IW, STEP]) + _unmeasured(k[no_residual], [FWD, BWD]),
        ),
    ]
    for kind, name, numerator, mask, missing in rules:
        values, median = share(numerator, mask)
        medians[name] = median
        if kind == "H2D_BOUND" and wm.clock != "gpu":
            continue
        if median is None:
            continue
        # A share is a steady property of the job, not a fault: a warning at most, never
        # critical (critical pages; see vocabulary.PROPERTY_CLASSES).
        if _at_least(median, warn):
            blamed = tuple(int(r) for r in ranks[mask & (values >= warn - EPSILON)])
            found.append(
                (Finding(kind, "warning", median, blamed, missing_signals=missing), median)
            )
    compute_mask = base & k[:, FWD] & k[:, BWD]
    values, median = share(m[:, FWD] + m[:, BWD] + m[:, OPT], compute_mask)
    # H2D bottlenecks exist on the GPU clock only: the CPU clock's H2D share does not gate.
    others_low = all(
        x is None or not _at_least(x, warn)
        for name, x in medians.items()
        if name != "h2d" or wm.clock == "gpu"
    )
    if median is not None and _at_least(median, cfg.compute_bound_share) and others_low:
        blamed = tuple(
            int(r) for r in ranks[compute_mask & (values >= cfg.compute_bound_share - EPSILON)]
        )
        missing = _unmeasured(k, [IW, STEP, FWD, BWD])
        found.append(
            (Finding("COMPUTE_BOUND", "info", median, blamed, missing_signals=missing), median)
        )
    return found


def _abstentions(wm: WindowMeans) -> np.ndarray:
    """``[ranks, SIGNALS]``: a rule needed this signal on this rank and it was unmeasured.

    Straggler: input_wait, step, backward (+ forward under FSDP). Input/residual/compute
    shares: input_wait, step, forward, backward. H2D share (GPU clock only): h2d.
    """
    needed = np.zeros(len(SIGNALS), dtype=bool)
    needed[[IW, STEP, FWD, BWD]] = True
    if wm.clock == "gpu":
        needed[H2D] = True
    return ~wm.measured[:, : len(SIGNALS)] & needed


def diagnose_window(
    wm: WindowMeans,
    *,
    strategy: str | None = None,
    config: StepTimeConfig | None = None,
    mesh: MeshLayout | None = None,
) -> StepTimeReport:
    """The policy on already reduced window means (all entry points end here). ``mesh``
    must hold every rank of the window."""
    cfg = _config(config)
    strat = normalize_strategy(strategy)
    layout = _mesh(mesh)
    if layout is not None:
        outside = sorted(set(wm.ranks) - set(layout.ranks))
        if outside:
            raise ValueError(
                f"field mesh: value {layout.dim_names!r} {layout.shape!r} does not hold "
                f"rank {outside[0]} of the window"
            )
    # Means near the float maximum may overflow to infinity in sums; the report then carries
    # None for them (``to_dict``) instead of warnings on every window.
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return _diagnose(wm, strat, cfg, layout)


def _scaled_back(ev: StragglerEvidence, shift: int) -> StragglerEvidence:
    """Evidence of scaled means with its milliseconds back at the given scale (a value past
    float range is infinite, published as absent); scores and coverage are ratios, unchanged."""
    return dataclasses.replace(
        ev,
        visible_culprit_ms=float(np.ldexp(ev.visible_culprit_ms, shift)),
        visible_victim_ms=float(np.ldexp(ev.visible_victim_ms, shift)),
        component_excesses_ms={
            name: float(np.ldexp(e, shift)) for name, e in ev.component_excesses_ms.items()
        },
    )


def _group_evidence(
    wm: WindowMeans,
    fsdp: bool,
    visible: np.ndarray,
    eligible: np.ndarray,
    cfg: StepTimeConfig,
    definition: str,
    mesh: MeshLayout | None,
) -> StragglerEvidence | None:
    """The straggler rule in each comparison group of ``mesh`` (one group without it): the
    highest-scoring group's evidence (ties: the lowest stage), saying which group it is."""
    if mesh is None:
        return _straggler_evidence(wm, fsdp, visible, eligible, cfg, definition)
    row = {r: i for i, r in enumerate(wm.ranks)}
    found: list[tuple[StragglerEvidence, ComparisonGroup]] = []
    groups = mesh.comparison_groups()
    for group in groups:
        members = np.zeros(len(wm.ranks), dtype=bool)
        members[[row[r] for r in group.ranks if r in row]] = True
        ev = _straggler_evidence(wm, fsdp, visible, eligible & members, cfg, definition)
        if ev is not None:
            found.append((ev, group))
    if not found:
        return None
    # A NaN score (a sum that overflowed) ranks last.
    best, group = min(
        found,
        key=lambda eg: (-eg[0].score if math.isfinite(eg[0].score) else math.inf, eg[1].stage or 0),
    )
    slow_group, slow_ranks = "", ()
    replicas = {mesh.pipeline_replica(ev.culprit_rank) for ev, _ in found}
    if (
        len(groups) > 1
        and len(found) == len(groups)
        and len(replicas) == 1
        and all(_at_least(ev.score, cfg.straggler_warning_score) for ev, _ in found)
    ):
        # Every stage's culprit is the same pipeline's member: that pipeline is late as a
        # whole (its slow rank cannot be told from its stages' waits).
        slow_group = mesh.replica_text(best.culprit_rank)
        slow_ranks = mesh.pipeline_replica(best.culprit_rank)
    return dataclasses.replace(
        best,
        compared_ranks=group.ranks,
        compared_group=group.text,
        culprit_position=mesh.position_text(best.culprit_rank),
        slow_group=slow_group,
        slow_group_ranks=slow_ranks,
    )


def _diagnose(
    wm: WindowMeans, strat: str, cfg: StepTimeConfig, mesh: MeshLayout | None = None
) -> StepTimeReport:
    fsdp = strat == "fsdp"
    m, k = wm.means, wm.measured
    shift = headroom_shift(m)
    if shift:  # the policy sees scaled means (see headroom); the report shows the given ones
        wm = dataclasses.replace(wm, means=np.ldexp(m, -shift))
    ranks = tuple(wm.ranks)
    visible, visible_measured, eligible, definition = _visible(wm, fsdp)
    # A CPU clock that cannot contain the wait (collectives that do not block the host) must
    # not be compared across ranks: the straggler rule abstains and says so.
    blind = wm.clock == "cpu" and wm.async_collectives

    # Per-rank means and missing signals (one pass over ranks, no per-step work).
    table = np.concatenate([m, np.ldexp(visible, shift)[:, None]], axis=1).astype(object)
    table[~np.concatenate([k, visible_measured[:, None]], axis=1)] = None
    rank_means = {
        r: dict(zip(RANK_MEAN_KEYS, row, strict=True))
        for r, row in zip(ranks, table.tolist(), strict=True)
    }
    codes = (~k[:, : len(SIGNALS)] @ _BITS).tolist()
    missing_signals = {r: _MISSING_BY_CODE[c] for r, c in zip(ranks, codes, strict=True) if c}
    missing_ranks = tuple(r for r, p in zip(ranks, wm.present.tolist(), strict=True) if not p)

    def report(findings: list[Finding], evidence: StragglerEvidence | None) -> StepTimeReport:
        top = findings[0]
        return StepTimeReport(
            kind=top.kind,
            severity=None if top.kind in STATUS_KINDS else top.severity,
            findings=tuple(findings),
            clock=wm.clock,
            strategy=strat,
            steps=wm.steps,
            ranks=ranks,
            rank_means=rank_means,
            missing_signals=missing_signals,
            straggler=evidence,
            missing_ranks=missing_ranks,
            step_range=wm.step_range,
            visible_definition=VISIBLE_NONE if blind else definition,
            mesh=mesh,
            outlier_steps=wm.most_outlier_steps,
            outlier_steps_by_rank=dict(_outliers_by_rank(ranks, wm.outlier_steps)),
        )

    abstained = _abstentions(wm)
    abstained_ranks = np.flatnonzero(abstained.any(axis=1))

    def incomplete() -> Finding:
        union = int(abstained.any(axis=0) @ _BITS)
        blamed = tuple(ranks[i] for i in abstained_ranks)
        missing = _MISSING_BY_CODE[union]
        if blind:
            blamed = tuple(r for r, p in zip(ranks, wm.present.tolist(), strict=True) if p)
            missing = (*missing, GPU_TIMING)
        return Finding("INCOMPLETE_DATA", "info", 0.0, blamed, missing_signals=missing)

    if not wm.present.any():
        return report([incomplete()], None)
    evidence = (
        _group_evidence(wm, fsdp, visible, eligible, cfg, definition, mesh)
        if wm.steps > 0 and not blind
        else None
    )
    if evidence is not None and shift:
        evidence = _scaled_back(evidence, shift)
    if wm.steps < cfg.min_steps_warning:
        return report([Finding("WARMUP", "info", 0.0)], evidence)

    capped = wm.steps < cfg.min_steps_critical or fsdp
    ranked: list[tuple[Finding, float]] = []
    if evidence is not None:
        sev = _severity(
            evidence.score, cfg.straggler_warning_score, cfg.straggler_critical_score, capped
        )
        if sev is not None:
            finding = Finding(
                STRAGGLER_KINDS[evidence.component],
                sev,
                evidence.score,
                (evidence.culprit_rank,),
                culprit_rank=evidence.culprit_rank,
                victim_rank=evidence.victim_rank,
                component=evidence.component,
                visible_culprit_ms=evidence.visible_culprit_ms,
                visible_victim_ms=evidence.visible_victim_ms,
                component_excesses_ms=dict(evidence.component_excesses_ms),
                component_coverage=dict(evidence.component_coverage),
                missing_signals=evidence.missing_signals,
                compared_ranks=evidence.compared_ranks,
                compared_group=evidence.compared_group,
                culprit_position=evidence.culprit_position,
                slow_group=evidence.slow_group,
                slow_group_ranks=evidence.slow_group_ranks,
            )
            ranked.append((finding, evidence.score))
    ranked.extend(_bottlenecks(wm, cfg))
    if ranked:
        # Scores equal within EPSILON rank in the fixed order of kinds: two shares that are
        # the same fraction computed two ways (window means, or rows summed step by step) can
        # differ in their last bit, and must not change the headline between the two paths.
        ranked.sort(
            key=lambda fs: (
                -SEVERITY_LEVELS[fs[0].severity],
                -round(fs[1] / EPSILON),
                0 if fs[0].is_straggler else 1 + _BOTTLENECK_ORDER.index(fs[0].kind),
            )
        )
        findings = [f for f, _ in ranked]
        if blind:  # the abstained straggler rule still says why, after the findings
            findings.append(incomplete())
        return report(findings, evidence)
    if abstained_ranks.size or blind:
        return report([incomplete()], evidence)
    return report([Finding("BALANCED", "info", 0.0)], evidence)

"""The samples of the metric catalogue: what both publishing paths publish, computed once.

:func:`build_samples` turns the state of one group (window report, incidents, the exporter's
own counters) into a flat list of :class:`Sample` — ``(Prometheus name, label values, value)``
for every family of :mod:`.catalogue`. The Prometheus collector and the OTel
callbacks both read such lists and nothing else, so the two paths cannot drift apart.

It is the concatenation of smaller pieces, which the publishing hub
(:class:`~rankwatch.exporter.publish.hub.LatestState`) assembles itself because one process
publishes several groups and engines at once: :func:`engine_samples` (one engine's part of a
report; the engines' families are disjoint), :func:`window_samples` (the window itself),
:func:`incident_samples` and :func:`window_invalid_samples` (per group),
:func:`health_samples` (the process's own health) and :func:`clock_samples` (the window's age).
Every piece labels its samples with one report's ``run`` and ``group``, so a group's samples never
carry another group's labels.

Rules the list obeys:

* **No NaN, no infinity.** A value that is not finite is left out (an unmeasured phase, an
  invalid matrix cell, a ratio over a zero median): absent means "not measured", never zero.
* **Labels** are the family's ``all_labels`` in order (``run``, ``group``, then its own).
  ``hostname`` is lower case (as dcgm-exporter writes it). Rank labels are plain decimal
  integers. A missing value (no culprit, no severity) is the empty string, which Prometheus
  and OTLP back-ends treat as an absent label.
* **Bounded cardinality.** A DeepEP completion matrix with more than ``cell_budget`` cells
  publishes only its flagged cells (at most ``cell_budget``, costliest first) besides its row and
  column medians, which are always published. Low-latency point ratios exist only for flagged
  cells (also capped). Everything else grows with the number of ranks, not its square.
* **Nothing stale.** The list is rebuilt from the latest state: a rank missing from the latest
  window (of its group and engine) and an incident that has closed have no samples, so their
  series end at the next scrape or collection.

Normal-mode arrays are indexed by EP rank; when the report lists exactly ``ep_size`` ranks, index
``i`` is labelled with the global rank of ``report.ranks[i]`` (the same mapping is applied to
anomaly ``src``/``dst``; block anomalies use node indices written ``n<node>``).

Low-latency matrices are ``[receiver, peer]``: row ``i`` is the rank that waited, column ``j`` the
peer it waited for, so a point ``(i, j)`` is labelled ``src_rank=j`` (the sender) and
``dst_rank=i`` (the receiver).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.diagnosis.vocabulary import (
    HANG_CLASS,
    HANG_SUSPECT,
    INCIDENT_CLASSES,
    INCIDENT_SEVERITIES,
    SEVERITY_LEVELS,
)
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.identity import build_labels
from rankwatch.exporter.publish.catalogue import CATALOGUE, MetricSpec, by_name
from rankwatch.exporter.publish.incidents import IncidentSnapshot

__all__ = [
    "ENGINES",
    "PHASES",
    "RESIDUAL_SCOPES",
    "SEVERITY_LEVELS",
    "ExporterHealth",
    "Sample",
    "build_samples",
    "clock_samples",
    "engine_samples",
    "group_by_family",
    "health_samples",
    "incident_samples",
    "own_means_samples",
    "report_samples",
    "state_samples",
    "window_invalid_samples",
    "window_samples",
]

# Per-rank phases published by rankwatch_phase_seconds, in the step-time report's keys.
PHASES: tuple[str, ...] = (
    "input_wait",
    "h2d",
    "forward",
    "backward",
    "optimizer",
    "step",
    "residual",
    "visible",
)
# Anomaly scopes published as residual slowdown factors ("rank" is the Notify ratio and
# "global" has its own family).
RESIDUAL_SCOPES: frozenset[str] = frozenset(
    {"row", "column", "point", "block", "src_gateway", "dst_gateway", "edge"}
)


class Sample(NamedTuple):
    """One series value: the Prometheus family name, its label values in the order of the
    family's ``all_labels``, and a finite float."""

    name: str
    labels: tuple[str, ...]
    value: float

    def label_dict(self) -> dict[str, str]:
        """Labels as ``{name: value}`` (the catalogue gives the names)."""
        return dict(zip(by_name(self.name).all_labels, self.labels, strict=True))


@dataclass(frozen=True)
class ExporterHealth:
    """The exporter's own state: when it started, whether it is up, and its counters.

    Counter mappings are cumulative since start, keyed by the family's single label value
    (exporter, reason). Keys present with value 0 publish a zero so ``rate()`` works at once.
    """

    started_at_s: float
    up: bool = True
    export_failures: Mapping[str, int] = field(default_factory=dict)
    collection_errors: Mapping[str, int] = field(default_factory=dict)
    storage_errors: Mapping[str, int] = field(default_factory=dict)
    window_invalid: Mapping[str, int] = field(default_factory=dict)


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (None, NaN, inf, non-numbers)."""
    if value is None or isinstance(value, (bool, np.bool_)):
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class _Out:
    """Collects samples for one family at a time; drops non-finite values."""

    __slots__ = ("common", "samples")

    def __init__(self, common: tuple[str, str, str]) -> None:
        self.common = common
        self.samples: list[Sample] = []

    def add(self, spec: MetricSpec, labels: tuple[str, ...], value: Any) -> None:
        f = _finite(value)
        if f is not None:
            self.samples.append(Sample(spec.name, self.common + labels, f))


_S = {spec.name.removeprefix("rankwatch_"): spec for spec in CATALOGUE}


def _rank_label(value: Any) -> str:
    return "" if value is None else str(int(value))


# --- step time ----------------------------------------------------------------------------------


def _step_time(out: _Out, report: WindowReport) -> None:
    st = report.step_time
    if st is None:
        return
    straggler = getattr(st, "straggler", None)
    if straggler is not None:
        out.add(_S["straggler_score"], (), getattr(straggler, "score", None))
        for comp, cov in sorted((getattr(straggler, "component_coverage", None) or {}).items()):
            out.add(_S["cause_coverage_ratio"], (str(comp),), cov)
        excesses = getattr(straggler, "component_excesses_ms", None) or {}
        for comp, ms in sorted(excesses.items()):
            f = _finite(ms)
            if f is not None:
                out.add(_S["component_excess_seconds"], (str(comp),), f / 1000.0)
    for rank in sorted(getattr(st, "rank_means", None) or {}):
        _rank_phases(out, report.rank_info(int(rank)), st.rank_means[rank])
    severity = getattr(st, "severity", None)
    kind = str(getattr(st, "kind", "") or "")
    primary = None
    for finding in getattr(st, "findings", ()) or ():
        if getattr(finding, "kind", None) == kind:
            primary = finding
            break
    culprit = getattr(primary, "culprit_rank", None) if primary is not None else None
    victim = getattr(primary, "victim_rank", None) if primary is not None else None
    component = getattr(primary, "component", None) if primary is not None else None
    out.add(
        _S["diagnosis_info"],
        (
            kind,
            severity or "",
            _rank_label(culprit),
            _rank_label(victim),
            component or "",
            str(getattr(st, "clock", "") or ""),
            str(getattr(st, "strategy", "") or ""),
        ),
        1.0,
    )
    out.add(_S["diagnosis_severity"], (), SEVERITY_LEVELS.get(severity, 0))
    out.add(_S["window_steps"], (), getattr(st, "steps", None))
    out.add(_S["step_outlier_steps"], (), getattr(st, "outlier_steps", None))


# --- DeepEP normal mode -------------------------------------------------------------------------


def _row_medians(matrix: np.ndarray, axis: int) -> list[tuple[int, float]]:
    """Median over the finite cells of each row (axis=1) or column (axis=0); empty ones skipped."""
    finite = np.isfinite(matrix)
    # Sorting puts NaN last; the k-th finite value of each line is then at index k.
    ordered = np.sort(np.where(finite, matrix, np.nan), axis=axis)
    counts = finite.sum(axis=axis)
    if axis == 0:
        ordered = ordered.T
    out: list[tuple[int, float]] = []
    for i, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        line = ordered[i]
        mid = n // 2
        med = float(line[mid]) if n % 2 else 0.5 * (float(line[mid - 1]) + float(line[mid]))
        out.append((i, med))
    return out


def _flagged_cells(
    matrix: np.ndarray, mask: np.ndarray, budget: int
) -> list[tuple[int, int, float]]:
    """Flagged finite cells, costliest first, at most ``budget`` (ties by position)."""
    cells = np.argwhere(mask & np.isfinite(matrix))
    if len(cells) == 0:
        return []
    values = matrix[cells[:, 0], cells[:, 1]]
    order = np.lexsort((cells[:, 1], cells[:, 0], -values))[:budget]
    return [(int(cells[k, 0]), int(cells[k, 1]), float(values[k])) for k in order]


def _normal(out: _Out, report: WindowReport, budget: int) -> None:
    normal = report.normal
    if normal is None:
        return
    ep = int(normal.ep_size)
    if len(report.ranks) == ep:
        ranks = [str(r.rank) for r in report.ranks]
    else:
        ranks = [str(i) for i in range(ep)]

    def rank_of(i: Any) -> str:
        if i is None:
            return ""
        i = int(i)
        return ranks[i] if 0 <= i < len(ranks) else str(i)

    ratio, duration = _S["deepep_notify_ratio"], _S["deepep_notify_duration_seconds"]
    cell, row, col = (
        _S["deepep_completion_cycles_per_sample"],
        _S["deepep_completion_row_cycles_per_sample"],
        _S["deepep_completion_column_cycles_per_sample"],
    )
    residual = _S["deepep_residual_slowdown_factor"]
    for inc in normal.incidents:
        if inc.cls == HANG_SUSPECT:
            stage = str(inc.evidence.get("stage", ""))
            for r in inc.ranks:
                out.add(_S["deepep_stalled_rank"], (rank_of(r), stage), 1.0)
    for probe in sorted(normal.probes):
        result = normal.probes[probe]
        out.add(_S["deepep_probe_anomalous"], (probe,), 1.0 if result.anomalous else 0.0)
        out.add(_S["deepep_global_slowdown_factor"], (probe,), result.global_factor)
        if result.notify_ratio is not None:
            for i, v in enumerate(np.asarray(result.notify_ratio, dtype=np.float64).tolist()):
                out.add(ratio, (probe, rank_of(i)), v)
        if result.mean_duration_ns is not None:
            ns = np.asarray(result.mean_duration_ns, dtype=np.float64)
            for i, v in enumerate((ns / 1e9).tolist()):
                out.add(duration, (probe, rank_of(i)), v)
        if result.cost_per_sample is not None:
            matrix = np.asarray(result.cost_per_sample, dtype=np.float64)
            if matrix.size <= budget:
                src_idx, dst_idx = np.nonzero(np.isfinite(matrix))
                for s, d in zip(src_idx.tolist(), dst_idx.tolist(), strict=True):
                    out.add(cell, (probe, rank_of(s), rank_of(d)), matrix[s, d])
            else:
                for s, d, v in _flagged_cells(matrix, normal.flagged_mask(probe), budget):
                    out.add(cell, (probe, rank_of(s), rank_of(d)), v)
            for i, v in _row_medians(matrix, axis=1):
                out.add(row, (probe, rank_of(i)), v)
            for j, v in _row_medians(matrix, axis=0):
                out.add(col, (probe, rank_of(j)), v)
        # One series per (scope, src, dst): a repeated location keeps its largest factor.
        factors: dict[tuple[str, str, str], float] = {}
        for a in result.anomalies:
            f = _finite(a.factor)
            if a.scope not in RESIDUAL_SCOPES or f is None:
                continue
            if a.scope == "block":
                src = "" if a.src is None else f"n{int(a.src)}"
                dst = "" if a.dst is None else f"n{int(a.dst)}"
            else:
                src, dst = rank_of(a.src), rank_of(a.dst)
            key = (a.scope, src, dst)
            factors[key] = max(f, factors.get(key, f))
        for (scope, src, dst), f in sorted(factors.items()):
            out.add(residual, (probe, scope, src, dst), f)


# --- DeepEP low-latency mode --------------------------------------------------------------------


def _low_latency(out: _Out, report: WindowReport, budget: int) -> None:
    if not report.low_latency:
        return
    row, col, point = (
        _S["deepep_ll_row_ratio"],
        _S["deepep_ll_column_ratio"],
        _S["deepep_ll_point_ratio"],
    )
    for phase in sorted(report.low_latency):
        result = report.low_latency[phase]
        for i, v in enumerate(np.asarray(result.row_ratios, dtype=np.float64).tolist()):
            out.add(row, (phase, str(i)), v)
        for j, v in enumerate(np.asarray(result.col_ratios, dtype=np.float64).tolist()):
            out.add(col, (phase, str(j)), v)
        points = sorted(result.abnormal_points, key=lambda p: (-float(p[3]), p[0], p[1]))
        seen: set[tuple[int, int]] = set()
        for i, j, _value, r in points[:budget]:
            if (int(i), int(j)) in seen:
                continue
            seen.add((int(i), int(j)))
            out.add(point, (phase, str(int(j)), str(int(i))), r)


def _pace(out: _Out, report: WindowReport) -> None:
    """The group's pace against its own baseline, and each rank's own work against its own
    (for the ranks the report holds: a bounded report, a bounded set)."""
    pace = report.pace
    if pace is None:
        return
    ratio, baseline = _finite(pace.ratio), _finite(pace.baseline_ms)
    if ratio is not None:
        out.add(_S["job_pace_ratio"], (), ratio)
    if baseline is not None:
        out.add(_S["job_baseline_step_seconds"], (), baseline / 1000.0)
    st = report.step_time
    held = set(st.rank_means) if st is not None else set()
    for rank in sorted(r for r in pace.rank_ratios if r in held):
        value = _finite(pace.rank_ratios[rank])
        if value is None:
            continue
        info = report.rank_info(rank)
        ident = (str(rank), str(info.local_rank), info.hostname.lower(), info.gpu, info.gpu_uuid)
        out.add(_S["rank_pace_ratio"], ident, value)


# --- the pieces and the whole -------------------------------------------------------------------


def _rank_phases(out: _Out, info: RankInfo, means: Mapping[str, Any]) -> None:
    """One rank's ``rankwatch_phase_seconds`` (its window means, in ms, keyed by phase)."""
    phase = _S["phase_seconds"]
    ident = (
        str(int(info.rank)),
        str(info.local_rank),
        info.hostname.lower(),
        info.gpu,
        info.gpu_uuid,
    )
    for name in PHASES:
        ms = _finite(means.get(name))
        if ms is not None:
            out.add(phase, (*ident, name), ms / 1000.0)


def own_means_samples(
    info: RankInfo, means: Mapping[str, Any], run: str, group: str, attempt: int = 0
) -> list[Sample]:
    """A rank's own ``rankwatch_phase_seconds``, served on its own ``/metrics`` in a group
    whose root publishes only some ranks' series (the aggregator sends each rank its means)."""
    out = _Out((run, group, str(attempt)))
    _rank_phases(out, info, means)
    return out.samples


def _common(report: WindowReport | None, config: RankwatchConfig) -> tuple[str, str, str]:
    # The attempt is the process's own (every rank of one start shares it): not in the report.
    attempt = str(config.attempt)
    if report is None:
        return (config.run_id, config.group_name, attempt)
    return (report.run or config.run_id, report.group or config.group_name, attempt)


def _check(report: Any, config: Any) -> None:
    if report is not None and not isinstance(report, WindowReport):
        raise TypeError(f"report: expected WindowReport or None, got {type(report).__name__}")
    if not isinstance(config, RankwatchConfig):
        raise TypeError(f"config: expected RankwatchConfig, got {type(config).__name__}")


# The engines whose part of a report engine_samples() publishes; their families are disjoint.
ENGINES: tuple[str, ...] = ("step_time", "normal", "low_latency")


def engine_samples(report: WindowReport, config: RankwatchConfig, engine: str) -> list[Sample]:
    """Samples of one engine's part of ``report`` (``"step_time"``, ``"normal"`` or
    ``"low_latency"``); empty when that engine has no result in it.

    The engines' families are disjoint, so a publisher may take each part from a different
    report of the same group (the hub does) without ever producing one series twice.
    """
    _check(report, config)
    if report is None:
        raise TypeError("report: expected WindowReport, got None")
    out = _Out(_common(report, config))
    if engine == "step_time":
        _step_time(out, report)
        _pace(out, report)
    elif engine == "normal":
        _normal(out, report, config.cell_budget)
    elif engine == "low_latency":
        _low_latency(out, report, config.cell_budget)
    else:
        raise ValueError(f"engine: expected one of {ENGINES}, got {engine!r}")
    return out.samples


def window_samples(report: WindowReport, config: RankwatchConfig) -> list[Sample]:
    """Samples of the window itself: index, timestamp, missing ranks, group size and the
    diagnosis time of every engine in ``report.diagnosis_seconds``."""
    _check(report, config)
    if report is None:
        raise TypeError("report: expected WindowReport, got None")
    out = _Out(_common(report, config))
    out.add(_S["window_index"], (), report.window_index)
    out.add(_S["window_timestamp_seconds"], (), report.created_at_s)
    out.add(_S["window_missing_ranks"], (), len(report.missing_ranks))
    out.add(_S["group_ranks"], (), report.size)
    for engine, seconds in sorted(report.diagnosis_seconds.items()):
        out.add(_S["diagnosis_duration_seconds"], (str(engine),), seconds)
    return out.samples


def report_samples(report: WindowReport | None, config: RankwatchConfig) -> list[Sample]:
    """Samples that depend only on the window report (cacheable per report): every engine's
    part, then the window's own."""
    _check(report, config)
    if report is None:
        return []
    out: list[Sample] = []
    for engine in ENGINES:
        out += engine_samples(report, config, engine)
    return out + window_samples(report, config)


def _counter_samples(out: _Out, spec: MetricSpec, counts: Mapping[str, int]) -> None:
    for key in sorted(counts):
        out.add(spec, (str(key),), counts[key])


def _check_state(report: Any, config: Any, name: str, value: Any, kind: type) -> None:
    _check(report, config)
    if not isinstance(value, kind):
        raise TypeError(f"{name}: expected {kind.__name__}, got {type(value).__name__}")


def incident_samples(
    report: WindowReport | None, incidents: IncidentSnapshot, config: RankwatchConfig
) -> list[Sample]:
    """Samples of the incidents of ``report``'s group: openings so far by class and severity
    (every known pair from the start), and one active/score series per open incident."""
    _check_state(report, config, "incidents", incidents, IncidentSnapshot)
    out = _Out(_common(report, config))
    totals = incidents.opened_total
    # Every known class and severity from the start, so increase() sees the first incident.
    keys = {(c, s) for c in INCIDENT_CLASSES for s in INCIDENT_SEVERITIES} | set(totals)
    for cls, sev in sorted(keys):
        out.add(_S["incidents_total"], (cls, sev), totals.get((cls, sev), 0))
    active: dict[tuple[str, ...], tuple[float, float | None]] = {}
    for inc in incidents.open:
        labels: tuple[str, ...] = (
            inc.cls,
            inc.severity,
            inc.probe,
            ",".join(str(r) for r in inc.ranks),
            ",".join(inc.hostnames),
            inc.cause,
        )
        active.setdefault(labels, (1.0, inc.score))
    for labels, (one, score) in active.items():
        out.add(_S["incident_active"], labels, one)
        out.add(_S["incident_score"], labels, score)
    # Time lost (time_lost.py): only the culprits of incidents are labels.
    for (cls, cause, ranks, hosts), lost in sorted(incidents.lost_total.items()):
        out.add(_S["time_lost_seconds_total"], (cls, cause, ranks, hosts), lost)
    if incidents.goodput_ratio is not None:
        out.add(_S["goodput_ratio"], (), incidents.goodput_ratio)
    _hang(out, incidents)
    return out.samples


def _hang(out: _Out, incidents: IncidentSnapshot) -> None:
    """The ``rankwatch_hang_*`` series of an open hang incident."""
    for inc in incidents.open:
        if inc.cls != HANG_CLASS:
            continue
        ev = inc.evidence if isinstance(inc.evidence, Mapping) else {}
        coll = ev.get("collective") if isinstance(ev.get("collective"), Mapping) else None
        op = str(coll.get("op", "")) if coll else ""
        ranks = ",".join(str(r) for r in inc.ranks)
        out.add(_S["hang_active"], (inc.cause, ranks, inc.probe, op), 1.0)
        out.add(_S["hang_stalled_seconds"], (inc.cause,), ev.get("stalled_seconds"))
        if coll:
            out.add(
                _S["hang_collective_seq"],
                (inc.cause, str(coll.get("group", "")), op),
                coll.get("seq"),
            )


def window_invalid_samples(
    report: WindowReport | None, counts: Mapping[str, int], config: RankwatchConfig
) -> list[Sample]:
    """``rankwatch_deepep_window_invalid_total`` of ``report``'s group: rejected DeepEP
    windows so far, by reason."""
    _check_state(report, config, "counts", counts, Mapping)
    out = _Out(_common(report, config))
    _counter_samples(out, _S["deepep_window_invalid_total"], counts)
    return out.samples


def health_samples(
    report: WindowReport | None, health: ExporterHealth, config: RankwatchConfig
) -> list[Sample]:
    """Samples of the exporter's own health and counters (``health.window_invalid`` included)
    and its build (``rankwatch_build_info``)."""
    _check_state(report, config, "health", health, ExporterHealth)
    out = _Out(_common(report, config))
    _counter_samples(out, _S["deepep_window_invalid_total"], health.window_invalid)
    _counter_samples(out, _S["collection_errors_total"], health.collection_errors)
    _counter_samples(out, _S["storage_errors_total"], health.storage_errors)
    _counter_samples(out, _S["export_failures_total"], health.export_failures)
    out.add(_S["exporter_up"], (), 1.0 if health.up else 0.0)
    out.add(_S["exporter_start_time_seconds"], (), health.started_at_s)
    out.add(_S["build_info"], build_labels(), 1.0)
    return out.samples


def state_samples(
    report: WindowReport | None,
    incidents: IncidentSnapshot,
    health: ExporterHealth,
    config: RankwatchConfig,
) -> list[Sample]:
    """Samples of the incidents and of the exporter's own health and counters."""
    return incident_samples(report, incidents, config) + health_samples(report, health, config)


def clock_samples(report: WindowReport | None, config: RankwatchConfig, now: float) -> list[Sample]:
    """Samples that change with the clock alone: the age of the latest window."""
    _check(report, config)
    if _finite(now) is None:
        raise ValueError(f"now: expected a finite unix time in seconds, got {now!r}")
    if report is None:
        return []
    out = _Out(_common(report, config))
    out.add(_S["window_age_seconds"], (), max(0.0, float(now) - report.created_at_s))
    return out.samples


def build_samples(
    report: WindowReport | None,
    incidents: IncidentSnapshot,
    health: ExporterHealth,
    config: RankwatchConfig,
    now: float,
) -> list[Sample]:
    """Every sample of the catalogue for the latest state at time ``now`` (unix seconds).

    The concatenation of :func:`report_samples`, :func:`state_samples` and
    :func:`clock_samples`; publishers may cache the first per report. Pure: the same inputs give
    the same list. Raises ``TypeError``/``ValueError`` naming the bad argument.
    """
    return (
        report_samples(report, config)
        + state_samples(report, incidents, health, config)
        + clock_samples(report, config, now)
    )


def group_by_family(samples: Iterable[Sample]) -> dict[str, list[Sample]]:
    """Samples grouped by family name, in catalogue order (families without samples absent)."""
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.name, []).append(s)
    return {spec.name: groups[spec.name] for spec in CATALOGUE if spec.name in groups}

"""Incident signals: what one window says about each incident identity.

The tracker (``incidents.py``) decides when a finding has persisted long enough to open an
incident and when it has gone; this module only reads one :class:`WindowReport` and turns its
findings into :class:`Signal` values, each with the identity key it is tracked under (see the
tracker's module docstring for the identities): step-time findings, the job's pace against its
own baseline, normal-mode DeepEP incidents and the hang watcher's verdict. A bottleneck finding
that blames only the straggler's culprit is folded into the straggler's signal here (one fault,
one signal).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from rankwatch.diagnosis.report import WindowReport
from rankwatch.diagnosis.vocabulary import (
    BOTTLENECK_CLASS,
    GLOBAL_DATA_PATH_SLOWDOWN,
    HANG_CLASS,
    INCIDENT_SEVERITIES,
    JOB_SLOWDOWN_CLASS,
    PRE_STAGE_ARRIVAL_SKEW,
    SLOW_NODE_CLASS,
    STRAGGLER_CLASS,
    STRAGGLER_KINDS,
)

__all__ = [
    "ENGINE_HANG",
    "ENGINE_NORMAL",
    "ENGINE_STEP_TIME",
    "LATE_CLASSES",
    "SEVERITY_ORDER",
    "Signal",
    "caused_by",
    "finite_or_none",
    "fold",
    "signals_from_report",
]

_STRAGGLER_KINDS = frozenset(STRAGGLER_KINDS.values())
# The classes the others wait for: a rank, or a host's ranks together.
LATE_CLASSES = (STRAGGLER_CLASS, SLOW_NODE_CLASS)
SEVERITY_ORDER = {s: i for i, s in enumerate(INCIDENT_SEVERITIES)}

# Which engine a signal comes from: only windows in which that engine ran count for it.
ENGINE_STEP_TIME = "step_time"
ENGINE_NORMAL = "normal"
ENGINE_HANG = "hang"


@dataclass(frozen=True)
class Signal:
    """One window's evidence for one incident identity (``key``)."""

    key: tuple[Any, ...]
    engine: str
    cls: str
    severity: str
    probe: str
    cause: str
    ranks: tuple[int, ...]
    score: float | None
    evidence: Mapping[str, Any] = field(default_factory=dict)


def finite_or_none(value: object) -> float | None:
    """``value`` as a finite float, else None (absent, a bool, not a number, inf or nan)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        f = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _step_time_signals(report: WindowReport) -> list[Signal]:
    st = report.step_time
    if st is None:
        return []
    out: list[Signal] = []
    for finding in getattr(st, "findings", ()) or ():
        severity = getattr(finding, "severity", None)
        if severity not in SEVERITY_ORDER:
            continue
        kind = str(getattr(finding, "kind", ""))
        culprit = getattr(finding, "culprit_rank", None)
        victim = getattr(finding, "victim_rank", None)
        ranks_attr = tuple(int(r) for r in (getattr(finding, "ranks", ()) or ()))
        evidence: dict[str, Any] = {
            "kind": kind,
            "score": finite_or_none(getattr(finding, "score", None)),
            "culprit_rank": culprit,
            "victim_rank": victim,
            "component": getattr(finding, "component", None),
            "component_excesses_ms": dict(getattr(finding, "component_excesses_ms", {}) or {}),
            "component_coverage": dict(getattr(finding, "component_coverage", {}) or {}),
            "gap_ms": getattr(finding, "gap_ms", None),
            "clock": getattr(st, "clock", None),
            "strategy": getattr(st, "strategy", None),
            "steps": getattr(st, "steps", None),
        }
        # With a mesh: where the culprit sits and which ranks it was compared with.
        for name in ("culprit_position", "compared_group", "slow_group"):
            text = getattr(finding, name, "")
            if text:
                evidence[name] = text
        ranks: tuple[int, ...]
        slow_host = str(getattr(finding, "slow_host", "") or "")
        if kind in _STRAGGLER_KINDS and slow_host:
            # The fault's unit is a host: one identity per host, whichever rank was last.
            key: tuple[Any, ...] = (SLOW_NODE_CLASS, slow_host)
            cls, ranks = SLOW_NODE_CLASS, ranks_attr
            evidence["slow_host"] = slow_host
            evidence["slow_host_ranks"] = list(ranks_attr)
            on_host = int(getattr(finding, "slow_host_size", 0) or 0)
            evidence["slow_host_share"] = "most" if on_host > len(ranks_attr) else "all"
        elif kind in _STRAGGLER_KINDS and culprit is not None:
            key = (STRAGGLER_CLASS, int(culprit))
            cls, ranks = STRAGGLER_CLASS, (int(culprit),)
        else:
            ranks = ranks_attr or ((int(culprit),) if culprit is not None else ())
            key = (BOTTLENECK_CLASS, kind, ranks)
            cls = BOTTLENECK_CLASS
            # A property of the job: a warning at most (also from a report of an older engine).
            severity = "warning"
            evidence["pages"] = False
        out.append(
            Signal(
                key=key,
                engine=ENGINE_STEP_TIME,
                cls=cls,
                severity=str(severity),
                probe="",
                cause=kind.lower(),
                ranks=ranks,
                score=finite_or_none(getattr(finding, "score", None)),
                evidence=evidence,
            )
        )
    stragglers = [s for s in out if s.cls in LATE_CLASSES]
    if not stragglers:
        return out
    straggler = stragglers[0]  # the engine names at most one straggler per window
    related = [s for s in out if caused_by(s, straggler.ranks)]
    if not related:
        return out
    return [fold(straggler, related) if s is straggler else s for s in out if s not in related]


def caused_by(sig: Signal, culprit_ranks: tuple[int, ...]) -> bool:
    """Whether a bottleneck signal is the straggler's own slowness seen as a share: it blames
    the straggler's culprit and nobody else (see the module docstring)."""
    return sig.cls == BOTTLENECK_CLASS and bool(sig.ranks) and set(sig.ranks) <= set(culprit_ranks)


def fold(straggler: Signal, related: list[Signal]) -> Signal:
    """The straggler signal with its related bottleneck findings folded in: the most severe of
    them all, and each related finding listed in the evidence under ``related``."""
    severity = max(
        (straggler.severity, *(s.severity for s in related)), key=SEVERITY_ORDER.__getitem__
    )
    evidence = dict(straggler.evidence)
    evidence["related"] = [*evidence.get("related", ()), *(_related_entry(s) for s in related)]
    return replace(straggler, severity=severity, evidence=evidence)


def _related_entry(sig: Signal) -> dict[str, Any]:
    return {
        "kind": sig.evidence.get("kind", sig.cause.upper()),
        "severity": sig.severity,
        "score": sig.score,
        "ranks": list(sig.ranks),
    }


def _normal_score(report: WindowReport, cls: str, probes: tuple[str, ...]) -> float | None:
    """Largest slowdown factor (data path) or smallest Notify ratio (arrival skew)."""
    normal = report.normal
    if normal is None:
        return None
    values: list[float] = []
    for probe in probes:
        result = normal.probes.get(probe)
        if result is None:
            continue
        for anomaly in result.anomalies:
            f = finite_or_none(anomaly.factor)
            if f is not None:
                values.append(f)
        g = finite_or_none(result.global_factor)
        if g is not None and cls == GLOBAL_DATA_PATH_SLOWDOWN:
            values.append(g)
    if not values:
        return None
    return min(values) if cls == PRE_STAGE_ARRIVAL_SKEW else max(values)


def _normal_signals(report: WindowReport) -> list[Signal]:
    normal = report.normal
    if normal is None:
        return []
    out: list[Signal] = []
    for inc in normal.incidents:
        probes = tuple(sorted(inc.probes))
        ranks = tuple(sorted({int(r) for r in inc.ranks}))
        evidence = dict(inc.to_dict().get("evidence") or {})
        evidence["scope"] = inc.scope
        out.append(
            Signal(
                key=("normal", inc.cls, probes, ranks),
                engine=ENGINE_NORMAL,
                cls=inc.cls,
                severity=inc.severity,
                probe=",".join(probes),
                cause=inc.scope,
                ranks=ranks,
                score=_normal_score(report, inc.cls, probes),
                evidence=evidence,
            )
        )
    return out


def _pace_signals(report: WindowReport) -> list[Signal]:
    """The group slower than its own baseline for k windows (its own debounce): one identity
    per group; its cause is the phase that grew the most."""
    pace = report.pace
    if pace is None or not pace.severity:
        return []
    evidence = pace.to_dict()
    evidence.pop("rank_ratios", None)  # one per rank: on the per-rank series instead
    excess = None
    if pace.pace_ms is not None and pace.baseline_ms is not None:
        excess = pace.pace_ms - pace.baseline_ms
    evidence["excess_ms"] = excess
    evidence["recent_excess_ms"] = pace.recent_excess_ms
    return [
        Signal(
            key=(JOB_SLOWDOWN_CLASS,),
            engine=ENGINE_STEP_TIME,
            cls=JOB_SLOWDOWN_CLASS,
            severity=pace.severity,
            probe="",
            cause=pace.phase,
            ranks=() if pace.unit == "every rank" else pace.slow_ranks,
            score=finite_or_none(pace.ratio),
            evidence=evidence,
        )
    ]


def _hang_signals(report: WindowReport) -> list[Signal]:
    """The hang watcher's verdict: one identity per group (its class may change while it
    lasts: a mismatch seen later refines a stuck rank), critical."""
    hang = report.hang
    if hang is None or hang.verdict is None:
        return []
    v = hang.verdict
    return [
        Signal(
            key=(HANG_CLASS,),
            engine=ENGINE_HANG,
            cls=HANG_CLASS,
            severity="critical",
            probe=v.phase,
            cause=v.cause,
            ranks=v.ranks,
            score=v.stalled_seconds,
            evidence=hang.evidence(),
        )
    ]


def signals_from_report(report: WindowReport) -> list[Signal]:
    """The incident signals of one window: warning/critical step-time findings and normal-mode
    incidents, each with its identity key. Duplicated identities keep the most severe signal."""
    if not isinstance(report, WindowReport):
        raise TypeError(f"report: expected WindowReport, got {type(report).__name__}")
    by_key: dict[tuple[Any, ...], Signal] = {}
    signals = (
        _step_time_signals(report)
        + _pace_signals(report)
        + _normal_signals(report)
        + _hang_signals(report)
    )
    for sig in signals:
        prev = by_key.get(sig.key)
        if prev is None or SEVERITY_ORDER[sig.severity] > SEVERITY_ORDER[prev.severity]:
            by_key[sig.key] = sig
    return list(by_key.values())

"""What the normal-mode diagnoser reports: anomalies, per-probe results, incidents, the window.

All types are frozen dataclasses. ``to_dict()`` returns JSON-ready data: NaN and infinities
become ``None`` and numpy scalars become Python numbers, so ``json.dumps(report.to_dict(),
allow_nan=False)`` always works.

Scopes an :class:`Anomaly` can have, and what ``src``/``dst`` mean for each:

=============== ============================================ ==================================
scope           meaning                                      src / dst
=============== ============================================ ==================================
``rank``        a Notify late arrival of one rank            src = the rank, dst = None
``row``         a slow source row of a dense matrix          src = source rank, dst = None
``column``      a slow destination column of a dense matrix  src = None, dst = destination rank
``point``       one slow source -> destination cell           src, dst = ranks
``block``       a slow source-node x destination-node block  src, dst = *node* indices
``src_gateway`` a slow RDMA sender (RDMA receive row)        src = sending rank, dst = None
``dst_gateway`` a slow RDMA receiver (RDMA receive column)   src = None, dst = receiving rank
``edge``        one slow RDMA edge (same GPU index)          src, dst = ranks
``global``      the probe as a whole is slower than history  src = dst = None
=============== ============================================ ==================================
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankwatch.diagnosis.vocabulary import INCIDENT_SEVERITIES, NORMAL_INCIDENT_CLASSES

__all__ = [
    "GLOBAL_STATUSES",
    "LINK_CLASSES",
    "PROBE_KINDS",
    "PROBE_STATUSES",
    "SCOPES",
    "ZERO_SPREAD",
    "Anomaly",
    "Incident",
    "NormalReport",
    "ProbeResult",
    "json_ready",
]

SCOPES: tuple[str, ...] = (
    "rank",
    "row",
    "column",
    "point",
    "block",
    "src_gateway",
    "dst_gateway",
    "edge",
    "global",
)
PROBE_KINDS: tuple[str, ...] = ("notify", "completion")
# ``not_applicable``: the probe can have no path in this topology (RDMA receive on one node);
# it counts as normal evidence for correlation, unlike ``insufficient`` (paths exist, no sample).
PROBE_STATUSES: tuple[str, ...] = ("ok", "anomalous", "insufficient", "not_applicable")
# Link classes of the global-slowdown history: dense probes compare intra-node and inter-node
# paths separately, the RDMA receive probe its gateway edges.
LINK_CLASSES: tuple[str, ...] = ("intra_node", "inter_node", "gateway")
GLOBAL_STATUSES: tuple[str, ...] = ("bootstrapping", "normal", "slow")
# Why an anomaly has no robust score (``Anomaly.score_note``).
ZERO_SPREAD = (
    "no finite score: more than half of its peers are identical (spread 0), so any real "
    "deviation from them is an outlier"
)
_ARRAY_FIELDS = ("notify_ratio", "mean_duration_ns", "cost_per_sample", "tokens_per_sample")


def json_ready(value: Any) -> Any:
    """Convert numpy values, tuples and non-finite floats into plain JSON data (NaN -> None)."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "fc":
            obj = value.astype(object)
            obj[~np.isfinite(value)] = None
            return obj.tolist()
        return value.tolist()
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return f if math.isfinite(f) else None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, Mapping):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def _check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name}: must be one of {list(choices)}, got {value!r}")


@dataclass(frozen=True)
class Anomaly:
    """One piece of evidence from one probe, at one scope.

    ``factor`` is the slowdown factor (>= 1 means slower than its reference) or, for the
    ``rank`` scope, the Notify ratio (small means the rank arrived late). ``score`` is the
    robust within-window outlier score where the rule uses one, else None. ``ranks`` lists the
    global ranks involved (for ``block`` every rank of both nodes; empty for ``global``).
    ``load_ratio`` is the load context of a Completion anomaly: tokens per sample inside its
    scope over tokens per sample of the rest of the probe's matrix (None when unknown). Well
    above 1 means the slow place also carried much more traffic (an expert hot spot).

    ``score`` is finite or None. A deviation from peers whose spread is zero (more than half of
    them identical) is an outlier however small its z-score denominator: the rule flags it, the
    anomaly keeps no score and ``score_note`` says why (:data:`ZERO_SPREAD`).
    """

    probe: str
    scope: str
    src: int | None
    dst: int | None
    factor: float
    score: float | None = None
    ranks: tuple[int, ...] = ()
    load_ratio: float | None = None
    score_note: str = ""

    def __post_init__(self) -> None:
        _check_choice("Anomaly", "scope", self.scope, SCOPES)
        if self.score is not None and not math.isfinite(self.score):
            # The modified z-score of a deviation over a zero spread is infinite: no number.
            object.__setattr__(self, "score", None)
            object.__setattr__(self, "score_note", ZERO_SPREAD)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "probe": self.probe,
            "scope": self.scope,
            "src": None if self.src is None else int(self.src),
            "dst": None if self.dst is None else int(self.dst),
            "factor": json_ready(self.factor),
            "score": json_ready(self.score),
            "ranks": [int(r) for r in self.ranks],
            "load_ratio": json_ready(self.load_ratio),
            **({"score_note": self.score_note} if self.score_note else {}),
        }


@dataclass(frozen=True, eq=False)
class ProbeResult:
    """The independent diagnosis of one probe in one window.

    Notify probes fill ``notify_ratio`` and ``mean_duration_ns`` ([EP], NaN where a rank made
    no launch); Completion probes fill ``cost_per_sample`` and ``tokens_per_sample`` ([src, dst],
    NaN where a cell had no sample), ``aggregate`` (the whole probe's cost per sample: the
    geometric mean of its node-block medians, for logs and artifacts; the history compares the
    per-class aggregates), ``global_factor`` (None until the history is bootstrapped) and
    ``global_status`` (None for Notify probes and for an ``insufficient`` Completion probe).
    The global part is kept per link class: ``class_aggregates`` holds this window's aggregate
    of each class (cycles per sample), ``class_factors`` each class against its own history
    (None while bootstrapping); ``global_factor`` is the factor of ``global_class``, the class
    that is slow or, when none is, the slowest one. ``detail`` says in words why a probe is
    ``insufficient`` or ``not_applicable`` (or that point anomalies were capped).
    """

    probe: str
    kind: str
    status: str
    anomalies: tuple[Anomaly, ...] = ()
    notify_ratio: np.ndarray | None = None
    mean_duration_ns: np.ndarray | None = None
    cost_per_sample: np.ndarray | None = None
    global_factor: float | None = None
    global_status: str | None = None
    aggregate: float | None = None
    tokens_per_sample: np.ndarray | None = None
    detail: str = ""
    global_class: str | None = None
    class_aggregates: Mapping[str, float] = field(default_factory=dict)
    class_factors: Mapping[str, float | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_choice("ProbeResult", "kind", self.kind, PROBE_KINDS)
        _check_choice("ProbeResult", "status", self.status, PROBE_STATUSES)
        if self.global_status is not None:
            _check_choice("ProbeResult", "global_status", self.global_status, GLOBAL_STATUSES)

    @property
    def anomalous(self) -> bool:
        return self.status == "anomalous"

    def to_dict(self, include_arrays: bool = True) -> dict[str, Any]:
        """JSON-ready form; ``include_arrays=False`` leaves out the per-rank/per-cell arrays."""
        out: dict[str, Any] = {
            "probe": self.probe,
            "kind": self.kind,
            "status": self.status,
            "anomalies": [a.to_dict() for a in self.anomalies],
            "global_factor": json_ready(self.global_factor),
            "global_status": self.global_status,
            "aggregate": json_ready(self.aggregate),
            "detail": self.detail,
            "global_class": self.global_class,
            "class_aggregates": json_ready(self.class_aggregates),
            "class_factors": json_ready(self.class_factors),
        }
        if include_arrays:
            for name in _ARRAY_FIELDS:
                arr = getattr(self, name)
                out[name] = None if arr is None else json_ready(arr)
        return out


@dataclass(frozen=True)
class Incident:
    """A conclusion drawn from one or more probes (see the correlation table in the docs).

    Severity rule: data-path slowdowns (global or localized) are ``critical`` because every
    token pays for them; ``pre_stage_arrival_skew`` and ``unclassified`` are ``warning``.
    """

    cls: str
    probes: tuple[str, ...]
    scope: str
    ranks: tuple[int, ...]
    evidence: dict[str, Any] = field(default_factory=dict)
    severity: str = "warning"

    def __post_init__(self) -> None:
        _check_choice("Incident", "cls", self.cls, NORMAL_INCIDENT_CLASSES)
        _check_choice("Incident", "severity", self.severity, INCIDENT_SEVERITIES)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; the class is under the key ``"class"``."""
        return {
            "class": self.cls,
            "probes": list(self.probes),
            "scope": self.scope,
            "ranks": [int(r) for r in self.ranks],
            "evidence": json_ready(self.evidence),
            "severity": self.severity,
        }


@dataclass(frozen=True, eq=False)
class NormalReport:
    """Everything the normal-mode diagnoser concluded from one window.

    ``probes`` always holds all six probes. ``raw_anomalies`` are the Notify anomalies that did
    not become a ``pre_stage_arrival_skew`` incident because downstream Completion evidence was
    anomalous or insufficient.
    """

    window_index: int
    ep_size: int
    ranks_per_node: int
    probes: dict[str, ProbeResult]
    incidents: tuple[Incident, ...] = ()
    raw_anomalies: tuple[Anomaly, ...] = ()
    instance_id: str = ""

    @property
    def anomalous(self) -> bool:
        """True when any probe reported an anomaly."""
        return any(p.anomalous for p in self.probes.values())

    def flagged_mask(self, probe: str) -> np.ndarray:
        """Where the probe's anomalies lie: bool [EP] for Notify, bool [src, dst] for Completion.

        Rows, columns, gateways and blocks mark every cell they cover; ``global`` marks none
        (it has no location). Meant for outlining flagged cells in pictures.
        """
        if probe not in self.probes:
            raise ValueError(f"probe: unknown probe {probe!r}, expected one of {list(self.probes)}")
        result = self.probes[probe]
        ep, rpn = self.ep_size, self.ranks_per_node
        if result.kind == "notify":
            mask = np.zeros(ep, dtype=bool)
            for a in result.anomalies:
                if a.src is not None:
                    mask[a.src] = True
            return mask
        mask2 = np.zeros((ep, ep), dtype=bool)
        for a in result.anomalies:
            if a.scope in ("row", "src_gateway") and a.src is not None:
                mask2[a.src, :] = True
            elif a.scope in ("column", "dst_gateway") and a.dst is not None:
                mask2[:, a.dst] = True
            elif a.scope in ("point", "edge") and a.src is not None and a.dst is not None:
                mask2[a.src, a.dst] = True
            elif a.scope == "block" and a.src is not None and a.dst is not None:
                mask2[a.src * rpn : (a.src + 1) * rpn, a.dst * rpn : (a.dst + 1) * rpn] = True
        if result.cost_per_sample is not None:
            # Only cells that carried samples can be flagged (sparse RDMA matrices).
            mask2 &= np.isfinite(result.cost_per_sample)
        return mask2

    def to_dict(self, include_arrays: bool = True) -> dict[str, Any]:
        """JSON-ready form; ``include_arrays=False`` leaves out per-rank/per-cell arrays."""
        return {
            "window_index": int(self.window_index),
            "ep_size": int(self.ep_size),
            "ranks_per_node": int(self.ranks_per_node),
            "instance_id": self.instance_id,
            "probes": {k: v.to_dict(include_arrays) for k, v in self.probes.items()},
            "incidents": [i.to_dict() for i in self.incidents],
            "raw_anomalies": [a.to_dict() for a in self.raw_anomalies],
        }

"""The step-time report model: findings, straggler evidence, the report of one window.

Plain frozen dataclasses; the exporter publishes from their fields. ``to_dict()`` gives JSON
with NaN and infinities mapped to ``None`` and rank-keyed maps keyed by strings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rankwatch.diagnosis.step_time.mesh import MeshLayout
from rankwatch.diagnosis.step_time.table import MEAN_KEYS
from rankwatch.diagnosis.vocabulary import (
    COMPONENTS,
    KINDS,
    SEVERITIES,
    STATUS_KINDS,
    STRAGGLER_KINDS,
    UNATTRIBUTED,
)

__all__ = [
    "COMPONENTS",
    "GPU_TIMING",
    "KINDS",
    "RANK_MEAN_KEYS",
    "SCORE_HELD_AT_ONE",
    "SEVERITIES",
    "STATUS_KINDS",
    "STRAGGLER_KINDS",
    "UNATTRIBUTED",
    "VISIBLE_DDP",
    "VISIBLE_DEFINITIONS",
    "VISIBLE_FSDP",
    "VISIBLE_NONE",
    "VISIBLE_SYNC",
    "Finding",
    "StepTimeReport",
    "StragglerEvidence",
]

RANK_MEAN_KEYS: tuple[str, ...] = (*MEAN_KEYS, "visible")
# Which value the straggler rule compared across ranks (``visible_definition``):
# forward_wait + backward_wait (rankwatch's extension) on the report's clock, CPU or GPU
VISIBLE_SYNC = "sync_wait"
VISIBLE_DDP = "backward"  # the seed's DDP/default definition
VISIBLE_FSDP = "forward+backward"  # the seed's FSDP definition
VISIBLE_NONE = "none"  # the rule abstained: the CPU clock cannot contain the wait
VISIBLE_DEFINITIONS: tuple[str, ...] = (VISIBLE_SYNC, VISIBLE_DDP, VISIBLE_FSDP, VISIBLE_NONE)
# Named in ``missing_signals`` when the straggler rule abstains for want of GPU timing.
GPU_TIMING = "gpu_timing"
# Why a straggler score is not the plain quotient (``StragglerEvidence.score_note``).
SCORE_HELD_AT_ONE = (
    "held at 1: the visible gap exceeds the victim's outer step (input wait + step), so its "
    "phase timings and its step disagree"
)


def _finite_or_none(value: float | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _clean_map(values: Mapping[str, float]) -> dict[str, float | None]:
    return {k: _finite_or_none(v) for k, v in values.items()}


@dataclass(frozen=True)
class StragglerEvidence:
    """The straggler rule's numbers for a window, published whether or not they crossed 0.10.

    ``component`` is what attribution would name (``input``/``h2d``/``compute`` or
    ``sync_or_unattributed``). Maps are keyed by component; a component unmeasured on the
    culprit or the victim (or ``compute`` under FSDP) is absent from both.
    ``missing_signals`` names the signals that kept a component out of attribution.
    ``visible_definition`` names the visible value compared (``VISIBLE_DEFINITIONS``).
    ``score`` is always finite, in ``[0, 1]``: a quotient above 1 (or past float range, as a
    subnormal step gives) is held at 1 and ``score_note`` says why (empty otherwise).

    With a mesh (:class:`~.mesh.MeshLayout`): ``compared_ranks`` and ``compared_group`` are
    the comparison group the evidence comes from (``"pipeline stage 1 (ranks 2, 3)"``),
    ``culprit_position`` the culprit's place in the mesh (``"rank 3: pp 1, dp 1"``), and
    ``slow_group``/``slow_group_ranks`` name a group when only the group can be told (every
    pipeline stage names its member of one pipeline replica: ``"pipeline replica dp 1 (ranks
    1, 3)"``). Without a mesh they are empty.
    """

    culprit_rank: int
    victim_rank: int
    score: float
    visible_culprit_ms: float
    visible_victim_ms: float
    component_excesses_ms: dict[str, float]
    component_coverage: dict[str, float]
    component: str
    eligible_ranks: tuple[int, ...] = ()
    missing_signals: tuple[str, ...] = ()
    visible_definition: str = VISIBLE_DDP
    compared_ranks: tuple[int, ...] = ()
    compared_group: str = ""
    culprit_position: str = ""
    slow_group: str = ""
    slow_group_ranks: tuple[int, ...] = ()
    score_note: str = ""

    def to_dict(self) -> dict[str, Any]:
        note = {"score_note": self.score_note} if self.score_note else {}
        return {
            "culprit_rank": self.culprit_rank,
            "victim_rank": self.victim_rank,
            "score": _finite_or_none(self.score),
            "visible_culprit_ms": _finite_or_none(self.visible_culprit_ms),
            "visible_victim_ms": _finite_or_none(self.visible_victim_ms),
            "component_excesses_ms": _clean_map(self.component_excesses_ms),
            "component_coverage": _clean_map(self.component_coverage),
            "component": self.component,
            "eligible_ranks": list(self.eligible_ranks),
            "missing_signals": list(self.missing_signals),
            "visible_definition": self.visible_definition,
            **_mesh_fields(self),
            **note,
        }


def _mesh_fields(item: StragglerEvidence | Finding) -> dict[str, Any]:
    # Without a mesh the keys are left out: a report of a job without one reads as before.
    if not item.compared_group:
        return {}
    return {
        "compared_ranks": list(item.compared_ranks),
        "compared_group": item.compared_group,
        "culprit_position": item.culprit_position,
        "slow_group": item.slow_group,
        "slow_group_ranks": list(item.slow_group_ranks),
    }


@dataclass(frozen=True)
class Finding:
    """One diagnosis of a window.

    ``score`` is the straggler score for straggler kinds, the median share for bottleneck
    kinds and 0 for the status kinds (``WARMUP``, ``INCOMPLETE_DATA``, ``BALANCED``).
    ``ranks`` are the ranks the finding points at: the culprit for a straggler, the ranks whose
    own share crosses the warning threshold for a bottleneck (the compute-bound threshold for
    ``COMPUTE_BOUND``), the ranks a rule abstained on for ``INCOMPLETE_DATA``.
    ``missing_signals`` names signals whose absence made a rule abstain (``INCOMPLETE_DATA``,
    bottlenecks) or kept a component out of attribution (stragglers).
    A straggler finding repeats its evidence's mesh fields (see :class:`StragglerEvidence`).
    ``slow_host``/``slow_host_ranks``: the host whose ranks are late together, when the
    fault's unit is a host rather than one rank (:func:`~.units.name_fault_unit`); then
    ``ranks`` are those ranks too, and ``slow_host_size`` counts the host's ranks in the
    compared group. Empty otherwise.
    """

    kind: str
    severity: str
    score: float
    ranks: tuple[int, ...] = ()
    culprit_rank: int | None = None
    victim_rank: int | None = None
    component: str | None = None
    visible_culprit_ms: float | None = None
    visible_victim_ms: float | None = None
    component_excesses_ms: dict[str, float] = field(default_factory=dict)
    component_coverage: dict[str, float] = field(default_factory=dict)
    missing_signals: tuple[str, ...] = ()
    compared_ranks: tuple[int, ...] = ()
    compared_group: str = ""
    culprit_position: str = ""
    slow_group: str = ""
    slow_group_ranks: tuple[int, ...] = ()
    # The fault's unit when it is a host (see :mod:`.units`): its name and its late ranks.
    slow_host: str = ""
    slow_host_ranks: tuple[int, ...] = ()
    slow_host_size: int = 0  # the host's ranks in the compared group

    @property
    def is_straggler(self) -> bool:
        return self.kind in STRAGGLER_KINDS.values()

    @property
    def gap_ms(self) -> float | None:
        """A straggler's visible gap, victim minus culprit (what every rank waited for it per
        step), or None when either is unmeasured or the difference is not finite."""
        if self.visible_victim_ms is None or self.visible_culprit_ms is None:
            return None
        return _finite_or_none(self.visible_victim_ms - self.visible_culprit_ms)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "severity": self.severity,
            "score": _finite_or_none(self.score),
            "ranks": list(self.ranks),
            "culprit_rank": self.culprit_rank,
            "victim_rank": self.victim_rank,
            "component": self.component,
            "visible_culprit_ms": _finite_or_none(self.visible_culprit_ms),
            "visible_victim_ms": _finite_or_none(self.visible_victim_ms),
            "component_excesses_ms": _clean_map(self.component_excesses_ms),
            "component_coverage": _clean_map(self.component_coverage),
        }
        out["missing_signals"] = list(self.missing_signals)
        out.update(_mesh_fields(self))
        if self.slow_host:  # left out otherwise: a report without one reads as before
            out["slow_host"] = self.slow_host
            out["slow_host_ranks"] = list(self.slow_host_ranks)
            out["slow_host_size"] = self.slow_host_size
        return out


@dataclass(frozen=True)
class StepTimeReport:
    """The step-time diagnosis of one window; ``findings[0]`` is the diagnosis.

    ``kind``/``severity`` repeat ``findings[0]``, except that ``severity`` is None for the
    status kinds (``WARMUP``, ``INCOMPLETE_DATA``, ``BALANCED``): no finding, nothing to page.
    ``rank_means[rank]`` holds the window means in ms keyed ``RANK_MEAN_KEYS`` (None =
    unmeasured). ``missing_signals`` lists, per rank with any, the unmeasured signals;
    ``missing_ranks`` the expected ranks that sent nothing. ``straggler`` is the straggler
    rule's evidence whenever two ranks were eligible, even below the warning score.
    ``visible_definition`` says which visible value the straggler rule compared
    (``VISIBLE_DEFINITIONS``; ``"none"`` when it abstained because the CPU clock cannot
    contain the wait). ``mesh`` is the layout the straggler rule compared by (None: every
    rank with every other). ``outlier_steps`` is the most steps left out of one rank's means
    as outliers, ``outlier_steps_by_rank`` the count per rank that left any out.
    """

    kind: str
    severity: str | None
    findings: tuple[Finding, ...]
    clock: str
    strategy: str
    steps: int
    ranks: tuple[int, ...]
    rank_means: dict[int, dict[str, float | None]]
    missing_signals: dict[int, tuple[str, ...]]
    straggler: StragglerEvidence | None = None
    missing_ranks: tuple[int, ...] = ()
    step_range: tuple[int, int] | None = None
    visible_definition: str = VISIBLE_DDP
    mesh: MeshLayout | None = None
    outlier_steps: int = 0
    outlier_steps_by_rank: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: rank-keyed maps use string keys, unmeasured values are None, no NaN."""
        return {
            "kind": self.kind,
            "severity": self.severity,
            "clock": self.clock,
            "strategy": self.strategy,
            "steps": self.steps,
            "visible_definition": self.visible_definition,
            "step_range": None if self.step_range is None else list(self.step_range),
            "ranks": list(self.ranks),
            "missing_ranks": list(self.missing_ranks),
            "findings": [f.to_dict() for f in self.findings],
            "straggler": None if self.straggler is None else self.straggler.to_dict(),
            "rank_means": {
                str(r): {k: _finite_or_none(v) for k, v in m.items()}
                for r, m in self.rank_means.items()
            },
            "missing_signals": {str(r): list(s) for r, s in self.missing_signals.items()},
            "mesh": None if self.mesh is None else self.mesh.to_dict(),
            "outlier_steps": self.outlier_steps,
            "outlier_steps_by_rank": {str(r): n for r, n in self.outlier_steps_by_rank.items()},
        }

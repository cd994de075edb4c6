"""Cross-probe correlation: turn the six independent probe results into conservative incidents.

The table (rows are checked in this order; the per-probe results are never altered):

=========================================================== =================================
evidence                                                    result
=========================================================== =================================
``notify_dispatch`` / ``cached_notify_dispatch`` anomaly,    ``pre_stage_arrival_skew`` for
both ``dispatch_final`` and ``dispatch_rdma_recv`` ok          that Notify probe
``cached_notify_combine`` anomaly, ``combine_logical_recv`` ok ``pre_stage_arrival_skew``
a Notify anomaly whose downstream probes are anomalous or    the Notify anomalies are kept as
insufficient                                                 raw anomalies, no incident
``dispatch_final`` and ``combine_logical_recv`` both          ``global_data_path_slowdown``
globally slow
local anomalies of ``dispatch_final`` and                     ``localized_data_path_slowdown``
``combine_logical_recv`` share ranks                          over the shared ranks
any Completion anomaly explained by none of the above        ``unclassified`` (one per probe)
=========================================================== =================================

``dispatch_rdma_recv`` evidence joins a data-path incident when it points the same way: its
global slowdown joins the global incident, its local anomalies join the localized incident when
they share ranks with it. The gateway matrix is not read as a fixed HCA-to-rank map.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .report import Anomaly, Incident, ProbeResult
from .schema import COMPLETION_PROBES, NOTIFY_PROBES

__all__ = ["DOWNSTREAM", "MAX_EVIDENCE_ANOMALIES", "correlate"]

# The Completion probes that follow each Notify probe in the same stage.
DOWNSTREAM: dict[str, tuple[str, ...]] = {
    "notify_dispatch": ("dispatch_final", "dispatch_rdma_recv"),
    "cached_notify_dispatch": ("dispatch_final", "dispatch_rdma_recv"),
    "cached_notify_combine": ("combine_logical_recv",),
}
# Evidence lists are bounded so an incident stays a readable event.
MAX_EVIDENCE_ANOMALIES = 16

_DISPATCH, _RDMA, _COMBINE = "dispatch_final", "dispatch_rdma_recv", "combine_logical_recv"


def _evidence_list(anomalies: Sequence[Anomaly]) -> dict[str, Any]:
    shown = [a.to_dict() for a in anomalies[:MAX_EVIDENCE_ANOMALIES]]
    return {"count": len(anomalies), "anomalies": shown}


def _local(result: ProbeResult) -> list[Anomaly]:
    return [a for a in result.anomalies if a.scope != "global"]


def _ranks_of(anomalies: Sequence[Anomaly]) -> set[int]:
    out: set[int] = set()
    for a in anomalies:
        out.update(a.ranks)
    return out


def _pre_stage(
    probes: Mapping[str, ProbeResult],
) -> tuple[list[Incident], list[Anomaly]]:
    incidents: list[Incident] = []
    raw: list[Anomaly] = []
    for name in NOTIFY_PROBES:
        result = probes[name]
        if result.status != "anomalous":
            continue
        downstream = {d: probes[d].status for d in DOWNSTREAM[name]}
        if all(status == "ok" for status in downstream.values()):
            late = result.anomalies
            incidents.append(
                Incident(
                    cls="pre_stage_arrival_skew",
                    probes=(name,),
                    scope="rank",
                    ranks=tuple(sorted({r for a in late for r in a.ranks})),
                    evidence={
                        "notify_ratio": {str(a.src): a.factor for a in late},
                        "downstream_status": downstream,
                    },
                    severity="warning",
                )
            )
        else:
            raw.extend(result.anomalies)
    return incidents, raw


def correlate(
    probes: Mapping[str, ProbeResult],
) -> tuple[tuple[Incident, ...], tuple[Anomaly, ...]]:
    """Apply the correlation table; returns ``(incidents, raw_anomalies)``.

    ``probes`` must hold all six probe results.
    """
    missing = [p for p in NOTIFY_PROBES + COMPLETION_PROBES if p not in probes]
    if missing:
        raise ValueError(f"probes: missing result(s) for {missing}")
    incidents, raw = _pre_stage(probes)
    dispatch, rdma, combine = probes[_DISPATCH], probes[_RDMA], probes[_COMBINE]
    # Anomalies that some data-path incident explains, per probe (by identity).
    explained: dict[str, set[int]] = {p: set() for p in COMPLETION_PROBES}

    def mark(probe: str, anomalies: Sequence[Anomaly]) -> None:
        explained[probe].update(id(a) for a in anomalies)

    if dispatch.global_status == "slow" and combine.global_status == "slow":
        involved = [_DISPATCH, _COMBINE]
        factors: dict[str, Any] = {
            _DISPATCH: dispatch.global_factor,
            _COMBINE: combine.global_factor,
        }
        if rdma.global_status == "slow":
            involved.insert(1, _RDMA)
            factors[_RDMA] = rdma.global_factor
        for p in involved:
            mark(p, [a for a in probes[p].anomalies if a.scope == "global"])
        incidents.append(
            Incident(
                cls="global_data_path_slowdown",
                probes=tuple(involved),
                scope="global",
                ranks=(),
                evidence={"global_factor": factors},
                severity="critical",
            )
        )

    dispatch_local, combine_local = _local(dispatch), _local(combine)
    shared = _ranks_of(dispatch_local) & _ranks_of(combine_local)
    if shared:
        parts = {
            _DISPATCH: [a for a in dispatch_local if shared.intersection(a.ranks)],
            _COMBINE: [a for a in combine_local if shared.intersection(a.ranks)],
        }
        rdma_support = [a for a in _local(rdma) if shared.intersection(a.ranks)]
        involved = [_DISPATCH, _COMBINE]
        if rdma_support:
            parts[_RDMA] = rdma_support
            involved.insert(1, _RDMA)
        for p, anomalies in parts.items():
            mark(p, anomalies)
        incidents.append(
            Incident(
                cls="localized_data_path_slowdown",
                probes=tuple(involved),
                scope="local",
                ranks=tuple(sorted(shared)),
                evidence={p: _evidence_list(parts[p]) for p in involved},
                severity="critical",
            )
        )

    for p in COMPLETION_PROBES:
        left = [a for a in probes[p].anomalies if id(a) not in explained[p]]
        if not left:
            continue
        incidents.append(
            Incident(
                cls="unclassified",
                probes=(p,),
                scope="global" if any(a.scope == "global" for a in left) else "local",
                ranks=tuple(sorted(_ranks_of(left))),
                evidence={p: _evidence_list(left)},
                severity="warning",
            )
        )
    return tuple(incidents), tuple(raw)

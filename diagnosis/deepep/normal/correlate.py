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
``combine_logical_recv`` describe the same place              over that place
any Completion anomaly explained by none of the above        ``unclassified`` (one per probe)
=========================================================== =================================

"The same place" means the same granularity and corresponding roles (see :class:`_Place`):
token owners (dispatch rows, combine columns), experts (dispatch columns, combine rows), and
node pairs (blocks, ``(owner node, expert node)``). A node block never vouches for a single
link or row, nor the other way round.

``dispatch_rdma_recv`` evidence joins a data-path incident when it points the same way: its
global slowdown joins the global incident, its local anomalies join the localized incident when
they name one of its ranks. The gateway matrix is not read as a fixed HCA-to-rank map.
Localized and unclassified incidents carry the load context of their anomalies
(``evidence["load"]``: the highest ``load_ratio`` and whether it reaches ``hot_load_ratio``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rankwatch.diagnosis.deepep.normal.report import Anomaly, Incident, ProbeResult
from rankwatch.diagnosis.deepep.normal.schema import COMPLETION_PROBES, NOTIFY_PROBES
from rankwatch.diagnosis.vocabulary import (
    GLOBAL_DATA_PATH_SLOWDOWN,
    LOCALIZED_DATA_PATH_SLOWDOWN,
    PRE_STAGE_ARRIVAL_SKEW,
    UNCLASSIFIED,
)

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


@dataclass(frozen=True)
class _Place:
    """Where a local anomaly lies, in roles that mean the same in dispatch and combine.

    Token owners send in dispatch and receive in combine; experts receive in dispatch and send
    back in combine. Rank-level scopes name owner and expert ranks, node blocks a pair of
    ``(owner node, expert node)``: the two granularities never meet, so a node block cannot
    vouch for a single link (nor a link for a block).
    """

    owners: frozenset[int] = frozenset()
    experts: frozenset[int] = frozenset()
    node_pairs: frozenset[tuple[int, int]] = frozenset()


def _place(a: Anomaly) -> _Place:
    src = frozenset(() if a.src is None else (int(a.src),))
    dst = frozenset(() if a.dst is None else (int(a.dst),))
    if a.scope == "block":
        pair = (int(a.src or 0), int(a.dst or 0))
        # dispatch: owner node -> expert node; combine: expert node -> owner node.
        return _Place(node_pairs=frozenset({pair if a.probe == _DISPATCH else pair[::-1]}))
    if a.probe == _DISPATCH:  # rows are owners, columns experts
        return _Place(owners=src, experts=dst)
    return _Place(owners=dst, experts=src)  # combine: rows are experts, columns owners


def _union(places: Sequence[_Place]) -> _Place:
    return _Place(
        frozenset().union(*(p.owners for p in places)),
        frozenset().union(*(p.experts for p in places)),
        frozenset().union(*(p.node_pairs for p in places)),
    )


def _meets(place: _Place, shared: _Place) -> bool:
    return bool(
        place.owners & shared.owners
        or place.experts & shared.experts
        or place.node_pairs & shared.node_pairs
    )


def _load_context(anomalies: Sequence[Anomaly], hot_load_ratio: float) -> dict[str, Any]:
    """The heaviest load ratio among an incident's anomalies and whether it is a hot spot."""
    ratios = [a.load_ratio for a in anomalies if a.load_ratio is not None]
    top = max(ratios) if ratios else None
    return {"load_ratio": top, "hot": top is not None and top >= hot_load_ratio}


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
        # Not applicable (no RDMA path on one node) is normal evidence, not missing evidence.
        if all(status in ("ok", "not_applicable") for status in downstream.values()):
            late = result.anomalies
            incidents.append(
                Incident(
                    cls=PRE_STAGE_ARRIVAL_SKEW,
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
    ranks_per_node: int = 1,
    hot_load_ratio: float = 1.5,
) -> tuple[tuple[Incident, ...], tuple[Anomaly, ...]]:
    """Apply the correlation table; returns ``(incidents, raw_anomalies)``.

    ``probes`` must hold all six probe results. ``ranks_per_node`` turns a node pair into the
    ranks an incident names; ``hot_load_ratio`` decides when the load context says "hot".
    """
    rpn = ranks_per_node
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
        link_classes: dict[str, Any] = {
            _DISPATCH: dispatch.global_class,
            _COMBINE: combine.global_class,
        }
        if rdma.global_status == "slow":
            involved.insert(1, _RDMA)
            factors[_RDMA] = rdma.global_factor
            link_classes[_RDMA] = rdma.global_class
        for p in involved:
            mark(p, [a for a in probes[p].anomalies if a.scope == "global"])
        incidents.append(
            Incident(
                cls=GLOBAL_DATA_PATH_SLOWDOWN,
                probes=tuple(involved),
                scope="global",
                ranks=(),
                evidence={"global_factor": factors, "link_class": link_classes},
                severity="critical",
            )
        )

    dispatch_local, combine_local = _local(dispatch), _local(combine)
    d_places = [_place(a) for a in dispatch_local]
    c_places = [_place(a) for a in combine_local]
    d_all, c_all = _union(d_places), _union(c_places)
    shared = _Place(
        d_all.owners & c_all.owners,
        d_all.experts & c_all.experts,
        d_all.node_pairs & c_all.node_pairs,
    )
    if shared.owners or shared.experts or shared.node_pairs:
        ranks = set(shared.owners | shared.experts)
        for owner_node, expert_node in shared.node_pairs:
            for node in (owner_node, expert_node):
                ranks.update(range(node * rpn, (node + 1) * rpn))
        parts = {
            _DISPATCH: [
                a for a, p in zip(dispatch_local, d_places, strict=True) if _meets(p, shared)
            ],
            _COMBINE: [
                a for a, p in zip(combine_local, c_places, strict=True) if _meets(p, shared)
            ],
        }
        # RDMA corroborates (gateway ranks are not a fixed HCA map): it joins when it names a
        # rank of the incident.
        rdma_support = [a for a in _local(rdma) if ranks.intersection(a.ranks)]
        involved = [_DISPATCH, _COMBINE]
        if rdma_support:
            parts[_RDMA] = rdma_support
            involved.insert(1, _RDMA)
        for p, anomalies in parts.items():
            mark(p, anomalies)
        evidence: dict[str, Any] = {p: _evidence_list(parts[p]) for p in involved}
        if shared.node_pairs:
            evidence["node_pairs"] = [list(p) for p in sorted(shared.node_pairs)]
        evidence["load"] = _load_context([a for p in involved for a in parts[p]], hot_load_ratio)
        incidents.append(
            Incident(
                cls=LOCALIZED_DATA_PATH_SLOWDOWN,
                probes=tuple(involved),
                scope="local",
                ranks=tuple(sorted(ranks)),
                evidence=evidence,
                severity="critical",
            )
        )

    for p in COMPLETION_PROBES:
        left = [a for a in probes[p].anomalies if id(a) not in explained[p]]
        if not left:
            continue
        incidents.append(
            Incident(
                cls=UNCLASSIFIED,
                probes=(p,),
                scope="global" if any(a.scope == "global" for a in left) else "local",
                ranks=tuple(sorted(_ranks_of(left))),
                evidence={p: _evidence_list(left), "load": _load_context(left, hot_load_ratio)},
                severity="warning",
            )
        )
    return tuple(incidents), tuple(raw)

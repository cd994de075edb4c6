"""Cross-probe correlation: one test per row of the table, on real probe results."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rankwatch.diagnosis.deepep.normal import Anomaly, NormalDiagnoser, ProbeResult
from rankwatch.diagnosis.deepep.normal.correlate import correlate
from tests.diagnosis.deepep.normal_support import block_factor, col_factor, make_window, row_factor

DF, RD, CB = "dispatch_final", "dispatch_rdma_recv", "combine_logical_recv"
ND, CND, CNC = "notify_dispatch", "cached_notify_dispatch", "cached_notify_combine"


def late(rank: int, ratio: float = 0.05) -> np.ndarray:
    out = np.full(16, 1000.0)
    out[rank] = 1000.0 * ratio
    return out


def bootstrapped() -> NormalDiagnoser:
    d = NormalDiagnoser()
    for _ in range(3):
        d.diagnose(make_window())
    return d


def classes(report) -> list[tuple[str, tuple[str, ...], tuple[int, ...]]]:
    return [(i.cls, i.probes, i.ranks) for i in report.incidents]


# Row 1: notify_dispatch / cached_notify_dispatch anomaly, dispatch_final and rdma both ok.
@pytest.mark.parametrize("probe", [ND, CND])
def test_dispatch_notify_with_normal_downstream_is_pre_stage_skew(probe):
    report = bootstrapped().diagnose(make_window(notify_ns={probe: late(9)}))
    assert classes(report) == [("pre_stage_arrival_skew", (probe,), (9,))]
    (incident,) = report.incidents
    assert incident.scope == "rank"
    assert incident.severity == "warning"
    assert incident.evidence["notify_ratio"] == {"9": pytest.approx(0.05)}
    assert incident.evidence["downstream_status"] == {DF: "ok", RD: "ok"}
    assert report.raw_anomalies == ()


def test_several_late_ranks_make_one_incident_per_probe():
    durations = late(3)
    durations[12] = 10.0
    report = bootstrapped().diagnose(make_window(notify_ns={ND: durations}))
    assert classes(report) == [("pre_stage_arrival_skew", (ND,), (3, 12))]


# Row 2: cached_notify_combine anomaly with combine_logical_recv ok.
def test_combine_notify_with_normal_combine_is_pre_stage_skew():
    # A slow dispatch path does not matter to the combine stage.
    w = make_window(notify_ns={CNC: late(9)}, factors={DF: row_factor(16, 2, 1.5)})
    report = bootstrapped().diagnose(w)
    assert ("pre_stage_arrival_skew", (CNC,), (9,)) in classes(report)


# Row 3: Notify anomaly with anomalous or insufficient downstream: raw anomaly only.
def test_notify_anomaly_with_anomalous_downstream_is_kept_raw():
    w = make_window(notify_ns={ND: late(9)}, factors={DF: row_factor(16, 2, 1.5)})
    report = bootstrapped().diagnose(w)
    assert [c for c, _, _ in classes(report)] == ["unclassified"]
    assert [(a.probe, a.scope, a.src) for a in report.raw_anomalies] == [(ND, "rank", 9)]


def test_notify_anomaly_with_insufficient_downstream_is_kept_raw():
    # Two nodes but no RDMA sample at all: paths exist, evidence is missing.
    w = make_window(notify_ns={CND: late(4)})
    cost, _, tokens = w.completion[RD]
    w = dataclasses.replace(w, completion={**w.completion, RD: (cost, np.zeros_like(cost), tokens)})
    report = NormalDiagnoser().diagnose(w)
    assert report.probes[RD].status == "insufficient"
    assert report.incidents == ()
    assert [(a.probe, a.src) for a in report.raw_anomalies] == [(CND, 4)]


def test_rdma_on_one_node_is_not_applicable_and_counts_as_normal():
    w = make_window(16, 16, notify_ns={CND: late(4)})
    report = NormalDiagnoser().diagnose(w)
    assert report.probes[RD].status == "not_applicable"
    assert "not applicable" in report.probes[RD].detail
    assert classes(report) == [("pre_stage_arrival_skew", (CND,), (4,))]


def test_combine_notify_with_slow_combine_is_kept_raw():
    w = make_window(notify_ns={CNC: late(1)}, factors={CB: col_factor(16, 5, 1.5)})
    report = bootstrapped().diagnose(w)
    assert [(a.probe, a.src) for a in report.raw_anomalies] == [(CNC, 1)]
    assert classes(report) == [("unclassified", (CB,), (5,))]


# Row 4: dispatch_final and combine both globally slow.
def test_both_globally_slow_is_a_global_data_path_slowdown_with_rdma_attached():
    w = make_window(factors={DF: 1.4, RD: 1.5, CB: 1.45})
    report = bootstrapped().diagnose(w)
    assert classes(report) == [("global_data_path_slowdown", (DF, RD, CB), ())]
    (incident,) = report.incidents
    assert incident.scope == "global" and incident.severity == "critical"
    assert incident.evidence["global_factor"][RD] == pytest.approx(1.5)


def test_rdma_not_slow_is_not_attached_to_the_global_incident():
    report = bootstrapped().diagnose(make_window(factors={DF: 1.4, CB: 1.45}))
    assert classes(report) == [("global_data_path_slowdown", (DF, CB), ())]


def test_only_one_globally_slow_probe_is_unclassified():
    report = bootstrapped().diagnose(make_window(factors={CB: 1.6}))
    assert classes(report) == [("unclassified", (CB,), ())]
    assert report.incidents[0].scope == "global"


# Row 5: intersecting local scopes.
def test_intersecting_local_scopes_are_a_localized_slowdown():
    fac_d = row_factor(16, 0, 1.6) * row_factor(16, 8, 1.6)
    fac_c = col_factor(16, 0, 1.6) * col_factor(16, 8, 1.6)
    fac_r = row_factor(16, 8, 1.8)
    w = make_window(factors={DF: fac_d, CB: fac_c, RD: fac_r})
    report = bootstrapped().diagnose(w)
    assert classes(report) == [("localized_data_path_slowdown", (DF, RD, CB), (0, 8))]
    (incident,) = report.incidents
    assert incident.scope == "local" and incident.severity == "critical"
    assert incident.evidence[DF]["count"] == 2
    assert (
        incident.evidence[RD]["anomalies"][0]["scope"] == "edge"
    )  # EP16: rank 8's one RDMA edge (to 0)


def test_rdma_evidence_elsewhere_is_not_attached():
    w = make_window(
        factors={
            DF: row_factor(16, 3, 1.6),
            CB: col_factor(16, 3, 1.6),
            RD: row_factor(16, 12, 1.8),
        }
    )
    report = bootstrapped().diagnose(w)
    assert classes(report) == [
        ("localized_data_path_slowdown", (DF, CB), (3,)),
        ("unclassified", (RD,), (4, 12)),  # EP16: sender 12's one RDMA edge, to rank 4
    ]


def test_a_block_never_vouches_for_a_row():
    # Different granularity: a node block names a node pair, a row one rank.
    w = make_window(factors={DF: block_factor(16, 8, 0, 1, 1.5), CB: row_factor(16, 12, 1.5)})
    report = bootstrapped().diagnose(w)
    assert [c for c, _, _ in classes(report)] == ["unclassified", "unclassified"]


def test_blocks_of_the_same_node_pair_correlate():
    # Dispatch owners on node 0 -> experts on node 1; combine comes back node 1 -> node 0.
    w = make_window(
        factors={DF: block_factor(16, 8, 0, 1, 1.5), CB: block_factor(16, 8, 1, 0, 1.5)}
    )
    report = bootstrapped().diagnose(w)
    assert classes(report) == [("localized_data_path_slowdown", (DF, CB), tuple(range(16)))]
    assert report.incidents[0].evidence["node_pairs"] == [[0, 1]]


def test_blocks_of_opposite_node_pairs_do_not_correlate():
    w = make_window(
        factors={DF: block_factor(16, 8, 0, 1, 1.5), CB: block_factor(16, 8, 0, 1, 1.5)}
    )
    report = bootstrapped().diagnose(w)
    assert [c for c, _, _ in classes(report)] == ["unclassified", "unclassified"]


def test_roles_correspond_owner_with_owner():
    # Dispatch row 3 (owner 3 sends) and combine row 3 (3 returns expert outputs): different
    # roles, no shared place; dispatch row 3 with combine column 3 is the token owner 3.
    w = make_window(factors={DF: row_factor(16, 3, 1.6), CB: row_factor(16, 3, 1.6)})
    report = bootstrapped().diagnose(w)
    assert [c for c, _, _ in classes(report)] == ["unclassified", "unclassified"]


# Row 6: anything else is unclassified.
def test_disjoint_local_scopes_are_unclassified_per_probe():
    w = make_window(factors={DF: row_factor(16, 2, 1.6), CB: col_factor(16, 9, 1.6)})
    report = bootstrapped().diagnose(w)
    assert classes(report) == [("unclassified", (DF,), (2,)), ("unclassified", (CB,), (9,))]
    assert all(i.severity == "warning" and i.scope == "local" for i in report.incidents)


def test_anomalies_outside_the_shared_ranks_stay_unclassified():
    fac_d = row_factor(16, 4, 1.6) * row_factor(16, 6, 1.6)
    w = make_window(factors={DF: fac_d, CB: col_factor(16, 4, 1.6)})
    report = bootstrapped().diagnose(w)
    assert classes(report) == [
        ("localized_data_path_slowdown", (DF, CB), (4,)),
        ("unclassified", (DF,), (6,)),
    ]


def test_probe_results_are_kept_beside_incidents():
    report = bootstrapped().diagnose(make_window(factors={DF: 1.4, CB: 1.45}))
    assert set(report.probes) == {ND, CND, CNC, DF, RD, CB}
    assert report.probes[DF].status == "anomalous"


def test_evidence_is_bounded():
    rng = np.random.default_rng(5)
    noise = np.exp(rng.normal(0.0, 0.01, (2, 64, 64)))  # keeps the MAD above 0
    fac = noise[0].copy()
    slow = np.arange(0, 64, 3)  # 22 slow rows, at most 3 per node: not whole blocks
    fac[slow, :] *= 1.6
    fac_c = noise[1].copy()
    fac_c[:, slow] *= 1.6
    report = NormalDiagnoser().diagnose(make_window(64, 8, factors={DF: fac, CB: fac_c}))
    (incident,) = [i for i in report.incidents if i.cls == "localized_data_path_slowdown"]
    assert incident.ranks == tuple(slow)
    assert incident.evidence[DF]["count"] == 22
    assert len(incident.evidence[DF]["anomalies"]) == 16


def test_missing_probe_results_raise():
    ok = ProbeResult(probe=DF, kind="completion", status="ok")
    with pytest.raises(ValueError, match="missing"):
        correlate({DF: ok})


def test_correlate_on_hand_built_results():
    def notify(name, anomalies=()):
        return ProbeResult(name, "notify", "anomalous" if anomalies else "ok", tuple(anomalies))

    def completion(name, status="ok", gs="normal"):
        return ProbeResult(name, "completion", status, global_status=gs)

    probes = {
        ND: notify(ND, [Anomaly(ND, "rank", 2, None, 0.1, None, (2,))]),
        CND: notify(CND),
        CNC: notify(CNC),
        DF: completion(DF),
        RD: completion(RD, "insufficient", None),
        CB: completion(CB),
    }
    incidents, raw = correlate(probes)
    assert incidents == ()
    assert [a.src for a in raw] == [2]

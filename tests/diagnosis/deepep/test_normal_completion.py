"""Completion rule: thresholds at their boundaries, scopes, widest-scope-once, invalid cells."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rankwatch.diagnosis.config import NormalConfig
from rankwatch.diagnosis.deepep.normal import NormalDiagnoser
from rankwatch.diagnosis.deepep.normal.completion import cost_per_sample, diagnose_completion
from rankwatch.diagnosis.deepep.normal.report import ZERO_SPREAD
from tests.diagnosis.deepep.normal_support import (
    block_factor,
    cell_factor,
    col_factor,
    gateway_mask,
    make_window,
    row_factor,
    scopes,
)

DF, RD, CB = "dispatch_final", "dispatch_rdma_recv", "combine_logical_recv"
CFG = NormalConfig()


def probe_result(window, probe, config=CFG):
    cost, samples, tokens = window.completion[probe]
    return diagnose_completion(cost, samples, probe, window.ranks_per_node, config, tokens)


# --- rows, columns, points at their thresholds ------------------------------------------------


@pytest.mark.parametrize(("factor", "flagged"), [(1.25, True), (1.2499, False), (1.6, True)])
def test_row_slowdown_threshold_is_inclusive(factor, flagged):
    w = make_window(factors={DF: row_factor(16, 3, factor)})
    res = probe_result(w, DF)
    assert scopes(res) == ([("row", 3, None)] if flagged else [])
    if flagged:
        assert res.anomalies[0].factor == pytest.approx(factor, rel=1e-6)
        assert res.anomalies[0].ranks == (3,)
        assert res.status == "anomalous"
    else:
        assert res.status == "ok"


@pytest.mark.parametrize(("factor", "flagged"), [(1.25, True), (1.2499, False)])
def test_column_slowdown_threshold_is_inclusive(factor, flagged):
    w = make_window(factors={CB: col_factor(16, 12, factor)})
    res = probe_result(w, CB)
    assert scopes(res) == ([("column", None, 12)] if flagged else [])


@pytest.mark.parametrize(("factor", "flagged"), [(2.0, True), (1.999, False), (5.0, True)])
def test_point_slowdown_threshold_is_inclusive(factor, flagged):
    w = make_window(factors={DF: cell_factor(16, 2, 13, factor)})
    res = probe_result(w, DF)
    assert scopes(res) == ([("point", 2, 13)] if flagged else [])
    if flagged:
        assert res.anomalies[0].factor == pytest.approx(factor, rel=1e-6)
        assert res.anomalies[0].ranks == (2, 13)


def test_fast_cells_are_never_flagged():
    w = make_window(factors={DF: row_factor(16, 3, 0.2) * cell_factor(16, 5, 5, 0.1)})
    assert probe_result(w, DF).status == "ok"


def _spread_rows(target_log: float) -> tuple[np.ndarray, np.ndarray]:
    """Row log factors: 15 rows spread evenly over +-0.12, row 0 at ``target_log``."""
    v = np.concatenate(([target_log], 0.12 * (np.arange(15) - 7) / 7))
    return v, np.exp(v)[:, None] * np.ones((1, 16))


def _expected_z(v: np.ndarray) -> float:
    med = np.median(v)
    mad = np.median(np.abs(v - med))
    return 0.6745 * (v[0] - med) / mad


@pytest.mark.parametrize(("z", "flagged"), [(3.45, False), (3.55, True)])
def test_row_needs_a_robust_score_of_3_5(z, flagged):
    # One node: the reference is the median of all cells, so row effects are exactly the row
    # log factors minus their median, and the expected score is computable by hand.
    # Median and MAD do not depend on row 0 as long as it stays the largest value.
    v0, _ = _spread_rows(1.0)
    med = np.median(v0)
    mad = np.median(np.abs(v0 - med))
    target = med + z * mad / 0.6745
    v, fac = _spread_rows(target)
    assert _expected_z(v) == pytest.approx(z, rel=1e-9)
    assert math.exp(target - np.median(v)) >= 1.25  # the factor test alone would flag it
    w = make_window(16, 16, factors={DF: fac})
    res = probe_result(w, DF)
    assert [a.src for a in res.anomalies if a.scope == "row"] == ([0] if flagged else [])
    if flagged:
        assert res.anomalies[0].score == pytest.approx(z, rel=1e-5)


def test_robust_score_threshold_is_configurable():
    v, fac = _spread_rows(0.5)
    z = _expected_z(v)
    w = make_window(16, 16, factors={DF: fac})
    lower = probe_result(w, DF, NormalConfig(robust_score=z - 0.01))
    higher = probe_result(w, DF, NormalConfig(robust_score=z + 0.01))
    assert scopes(lower) == [("row", 0, None)]
    assert scopes(higher) == []


def test_mad_zero_and_a_real_deviation_is_an_outlier():
    # All rows but one identical: the MAD is 0, so the slow row's z-score is infinite. The
    # anomaly is flagged, keeps no score (never inf) and says why.
    w = make_window(factors={DF: row_factor(16, 7, 1.3)})
    (a,) = probe_result(w, DF).anomalies
    assert a.score is None
    assert a.score_note == ZERO_SPREAD
    assert a.to_dict()["score"] is None and a.to_dict()["score_note"] == ZERO_SPREAD


def test_mad_zero_still_needs_the_factor():
    # Four rows, one 3x slow: flagged even among so few peers; 1.2x stays under 1.25x.
    w = make_window(4, 4, factors={DF: row_factor(4, 1, 3.0)})
    assert scopes(probe_result(w, DF)) == [("row", 1, None)]
    w = make_window(4, 4, factors={DF: row_factor(4, 1, 1.2)})
    assert probe_result(w, DF).anomalies == ()


# --- node blocks ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("factor", "flagged"), [(1.25, True), (1.2499, False)])
def test_block_slowdown_against_its_class(factor, flagged):
    w = make_window(factors={DF: block_factor(16, 8, 0, 1, factor)})
    res = probe_result(w, DF)
    assert scopes(res) == ([("block", 0, 1)] if flagged else [])
    if flagged:
        (a,) = res.anomalies
        assert a.ranks == tuple(range(16))
        assert a.factor == pytest.approx(factor, rel=1e-6)
        assert a.score is None


def test_intra_blocks_compare_with_intra_blocks_only():
    # Inter-node cells are 3x intra by design: that is topology, not a slow block.
    w = make_window(32, 8, base_intra=100.0, base_inter=900.0)
    assert probe_result(w, DF).status == "ok"
    slow = make_window(32, 8, factors={CB: block_factor(32, 8, 2, 2, 1.5)})
    res = probe_result(slow, CB)
    assert scopes(res) == [("block", 2, 2)]
    assert res.anomalies[0].ranks == tuple(range(16, 24))


# --- widest scope, once -------------------------------------------------------------------------


def test_slow_row_is_not_reported_again_as_points():
    w = make_window(factors={DF: row_factor(16, 4, 6.0)})
    assert scopes(probe_result(w, DF)) == [("row", 4, None)]


def test_row_slow_only_on_inter_node_paths_is_one_row():
    fac = np.ones((16, 16))
    fac[4, 8:] = 6.0  # half the row, its residual is still past 2x
    assert scopes(probe_result(make_window(factors={DF: fac}), DF)) == [("row", 4, None)]


def test_slow_column_is_not_reported_again_as_points():
    w = make_window(factors={CB: col_factor(16, 10, 4.0)})
    assert scopes(probe_result(w, CB)) == [("column", None, 10)]


def test_slow_block_is_not_reported_again_as_rows_or_points():
    w = make_window(factors={DF: block_factor(16, 8, 1, 0, 4.0)})
    assert scopes(probe_result(w, DF)) == [("block", 1, 0)]


def test_row_and_point_elsewhere_are_both_reported_once():
    fac = row_factor(16, 1, 1.5) * cell_factor(16, 9, 3, 3.0)
    assert sorted(scopes(probe_result(make_window(factors={DF: fac}), DF))) == [
        ("point", 9, 3),
        ("row", 1, None),
    ]


def test_row_and_column_crossing():
    fac = row_factor(16, 2, 1.6) * col_factor(16, 11, 1.6)
    assert scopes(probe_result(make_window(factors={DF: fac}), DF)) == [
        ("row", 2, None),
        ("column", None, 11),
    ]


# --- gateway probe ------------------------------------------------------------------------------


@pytest.mark.parametrize(("factor", "flagged"), [(1.25, True), (1.2499, False)])
def test_source_gateway_threshold(factor, flagged):
    # EP32: four nodes, so sender 9 has three RDMA edges (to 1, 17 and 25).
    w = make_window(32, factors={RD: row_factor(32, 9, factor)})
    res = probe_result(w, RD)
    assert scopes(res) == ([("src_gateway", 9, None)] if flagged else [])


def test_destination_gateway():
    w = make_window(32, factors={RD: col_factor(32, 3, 1.4)})
    assert scopes(probe_result(w, RD)) == [("dst_gateway", None, 3)]


@pytest.mark.parametrize(("factor", "flagged"), [(2.0, True), (1.999, False)])
def test_gateway_edge_threshold(factor, flagged):
    w = make_window(32, factors={RD: cell_factor(32, 12, 20, factor)})
    res = probe_result(w, RD)
    assert scopes(res) == ([("edge", 12, 20)] if flagged else [])


@pytest.mark.parametrize("slow", ["row", "column", "cell"])
def test_two_nodes_a_slow_rdma_sender_receiver_or_edge_is_that_edge(slow):
    # EP16 in the kernel's layout: rank 9 sends over RDMA only to rank 1 and receives only
    # from it, so a slow sender, a slow receiver and a slow edge all look the same. Read as a
    # relay rank and a destination on the relay's node, this probe saw nothing here.
    factor = {
        "row": row_factor(16, 9, 1.6),
        "column": col_factor(16, 1, 1.6),
        "cell": cell_factor(16, 9, 1, 1.6),
    }[slow]
    res = probe_result(make_window(factors={RD: factor}), RD)
    assert scopes(res) == [("edge", 9, 1)]
    assert res.anomalies[0].ranks == (9, 1)
    assert res.anomalies[0].factor == pytest.approx(1.6)


def test_the_local_lane_is_not_an_rdma_edge():
    # The diagonal (a rank's own tokens for its own node) never crosses the network.
    w = make_window(32, factors={RD: cell_factor(32, 5, 5, 4.0)})
    res = probe_result(w, RD)
    assert scopes(res) == []
    assert res.cost_per_sample[5, 5] == pytest.approx(8000.0)


def test_gateway_reference_is_the_median_edge_and_aggregate():
    w = make_window(base_rdma=2500.0)
    res = probe_result(w, RD)
    assert res.aggregate == pytest.approx(2500.0)
    assert np.isnan(res.cost_per_sample[0, 1])  # different GPU index: no RDMA edge
    assert res.cost_per_sample[0, 8] == pytest.approx(2500.0)


def test_single_node_gateway_probe_is_insufficient():
    w = make_window(8, 8)
    res = probe_result(w, RD)
    assert res.status == "insufficient"
    assert "no inter-node RDMA edge" in res.detail
    assert res.aggregate is None


# --- invalid cells ------------------------------------------------------------------------------


def test_zero_samples_are_invalid_not_zero_cost():
    smp = np.full((16, 16), 64.0)
    smp[5, :12] = 0.0  # most of row 5 carried nothing; its 4 valid cells are normal
    w = make_window(samples={DF: smp})
    res = probe_result(w, DF)
    assert res.status == "ok"
    assert np.isnan(res.cost_per_sample[5, :12]).all()
    assert np.isfinite(res.cost_per_sample[5, 12:]).all()


def test_zero_sample_cells_do_not_hide_a_slow_row():
    smp = np.full((16, 16), 64.0)
    smp[5, :12] = 0.0
    w = make_window(samples={DF: smp}, factors={DF: row_factor(16, 5, 1.5)})
    assert scopes(probe_result(w, DF)) == [("row", 5, None)]


def test_cost_per_sample_is_nan_without_samples():
    out = cost_per_sample(np.array([[0.0, 10.0]]), np.array([[0.0, 5.0]]))
    assert np.isnan(out[0, 0])
    assert out[0, 1] == 2.0


def test_all_zero_probe_is_insufficient():
    z = np.zeros((16, 16))
    res = diagnose_completion(z, z, DF, 8, CFG)
    assert res.status == "insufficient"
    assert np.isnan(res.cost_per_sample).all()


def test_zero_cost_cells_with_samples_are_floored_not_infinite():
    cost = np.full((16, 16), 640.0)
    samples = np.full((16, 16), 64.0)
    cost[3, 3] = 0.0
    res = diagnose_completion(cost, samples, DF, 8, CFG)
    assert res.cost_per_sample[3, 3] == 0.0
    assert res.status == "ok"  # a fast cell is not a slowdown


def test_aggregate_is_the_geometric_mean_of_block_medians():
    w = make_window(base_intra=100.0, base_inter=400.0)
    assert probe_result(w, DF).aggregate == pytest.approx(200.0)


# --- bad input ----------------------------------------------------------------------------------


def test_bad_shapes_and_layout_raise():
    z = np.ones((4, 4))
    with pytest.raises(ValueError, match="square"):
        diagnose_completion(np.ones((4, 3)), np.ones((4, 3)), DF, 2, CFG)
    with pytest.raises(ValueError, match="square"):
        diagnose_completion(z, np.ones((3, 3)), DF, 2, CFG)
    with pytest.raises(ValueError, match="ranks_per_node"):
        diagnose_completion(z, z, DF, 3, CFG)
    with pytest.raises(TypeError, match="ranks_per_node"):
        diagnose_completion(z, z, DF, 2.0, CFG)  # type: ignore[arg-type]


def test_gateway_matrix_helper_matches_the_simulator_layout():
    from rankwatch.diagnosis.deepep.normal import NormalSimulator

    w = NormalSimulator(16, 8, seed=3).window("baseline")
    assert np.array_equal(w.completion[RD][1] > 0, gateway_mask(16, 8))


def test_diagnoser_reports_the_same_local_anomalies():
    w = make_window(factors={DF: row_factor(16, 3, 1.5)})
    report = NormalDiagnoser().diagnose(w)
    assert scopes(report.probes[DF]) == [("row", 3, None)]
    assert report.probes[DF].global_status == "bootstrapping"


def test_worked_example_of_the_docs():
    # docs/diagnosis-deepep.md: EP 8 on two nodes, row 5 1.5x, path 1 -> 6 2.5x.
    w = make_window(8, 4, factors={DF: row_factor(8, 5, 1.5) * cell_factor(8, 1, 6, 2.5)})
    report = NormalDiagnoser().diagnose(w)
    row, point = report.probes[DF].anomalies
    assert (row.scope, row.src, row.factor, row.score) == (
        "row",
        5,
        pytest.approx(1.5, rel=1e-6),
        None,  # seven of eight rows are identical: zero spread, a real deviation
    )
    assert row.score_note == point.score_note == ZERO_SPREAD
    assert (point.scope, point.src, point.dst, point.factor, point.score) == (
        "point",
        1,
        6,
        pytest.approx(2.5, rel=1e-6),
        None,
    )
    assert report.probes[DF].aggregate == pytest.approx(1732.05, abs=0.01)
    (incident,) = report.incidents
    assert (incident.cls, incident.ranks) == ("unclassified", (1, 5, 6))


def test_rdma_samples_outside_the_kernel_layout_are_left_out_and_said():
    # Samples between ranks of different GPU indices cannot come from the internode kernel.
    smp = np.where(gateway_mask(16, 8), 64.0, 0.0)
    smp[3, 12] = 64.0  # 3 % 8 != 12 % 8
    fac = cell_factor(16, 3, 12, 10.0)
    res = probe_result(make_window(factors={RD: fac}, samples={RD: smp}), RD)
    assert scopes(res) == []
    assert "1 cell(s) with samples outside the internode kernel's layout" in res.detail

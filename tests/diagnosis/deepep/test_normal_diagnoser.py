"""The public entry points: NormalDiagnoser, the report, the simulator; bad input everywhere."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankwatch.diagnosis.config import NormalConfig
from rankwatch.diagnosis.deepep.normal import (
    COMPLETION_PROBES,
    NOTIFY_PROBES,
    PROBES,
    Anomaly,
    Incident,
    InvalidWindowError,
    NormalDiagnoser,
    NormalReport,
    NormalSimulator,
    NormalWindow,
    ProbeResult,
    phase_timeline,
)
from rankwatch.diagnosis.deepep.normal.simulator import SimulatorProfile
from tests.diagnosis.deepep.normal_support import block_factor, cell_factor, make_window, row_factor

DF, RD, CB = "dispatch_final", "dispatch_rdma_recv", "combine_logical_recv"


# --- the API of the issue ---------------------------------------------------------------------


def test_public_api_shape():
    d = NormalDiagnoser()
    report = d.diagnose(make_window())
    assert isinstance(report, NormalReport)
    assert set(report.probes) == set(PROBES)
    assert isinstance(report.probes["notify_dispatch"], ProbeResult)
    assert report.probes["notify_dispatch"].kind == "notify"
    assert report.probes[DF].kind == "completion"
    assert isinstance(report.incidents, tuple)
    data = report.to_dict()
    json.dumps(data, allow_nan=False)
    assert set(data["probes"]) == set(PROBES)
    assert (data["ep_size"], data["ranks_per_node"]) == (16, 8)


def test_to_dict_maps_nan_to_none():
    smp = np.full((16, 16), 64.0)
    smp[0, 0] = 0.0
    report = NormalDiagnoser().diagnose(make_window(samples={DF: smp}))
    cps = report.to_dict()["probes"][DF]["cost_per_sample"]
    assert cps[0][0] is None and cps[0][1] == pytest.approx(1000.0)
    rd = report.to_dict()["probes"][RD]["cost_per_sample"]
    assert rd[0][1] is None  # different GPU index: no RDMA edge
    light = report.to_dict(include_arrays=False)["probes"][DF]
    assert "cost_per_sample" not in light


def test_incident_to_dict_has_the_class_key():
    report = NormalDiagnoser().diagnose(
        make_window(notify_ns={"notify_dispatch": np.r_[np.full(9, 1000.0), 10.0, np.full(6, 1e3)]})
    )
    (incident,) = report.incidents
    data = incident.to_dict()
    assert data["class"] == "pre_stage_arrival_skew"
    assert data["ranks"] == [9] and data["probes"] == ["notify_dispatch"]
    json.dumps(data, allow_nan=False)


def test_same_windows_give_the_same_reports():
    sim_a, sim_b = NormalSimulator(seed=11), NormalSimulator(seed=11)
    da, db = NormalDiagnoser(), NormalDiagnoser()
    for phase in ("baseline", "baseline", "baseline", "all_hca_pressure", "single_hca_pressure"):
        ra = da.diagnose(sim_a.window(phase))
        rb = db.diagnose(sim_b.window(phase))
        assert json.dumps(ra.to_dict()) == json.dumps(rb.to_dict())


def test_diagnosis_does_not_modify_the_window():
    w = make_window(factors={DF: row_factor(16, 1, 2.0)})
    before = [m.copy() for m in w.completion[DF]]
    NormalDiagnoser().diagnose(w)
    assert all(np.array_equal(a, b) for a, b in zip(before, w.completion[DF], strict=True))


def test_missing_probes_are_insufficient():
    full = make_window()
    w = NormalWindow(
        ep_size=16,
        ranks_per_node=8,
        notify={"notify_dispatch": full.notify["notify_dispatch"]},
        completion={DF: full.completion[DF]},
    )
    report = NormalDiagnoser().diagnose(w)
    assert report.probes["cached_notify_combine"].status == "insufficient"
    assert report.probes[CB].status == "insufficient"
    assert report.probes[DF].status == "ok"
    assert report.incidents == ()


def test_config_from_environment_changes_decisions():
    w = make_window(factors={DF: cell_factor(16, 1, 2, 2.5)})
    assert NormalDiagnoser().diagnose(w).probes[DF].status == "anomalous"
    cfg = NormalConfig.from_env({"DEEPEP_DIAGNOSE_POINT_SLOWDOWN": "3"})
    assert NormalDiagnoser(cfg).diagnose(w).probes[DF].status == "ok"
    cfg = NormalConfig.from_env({"DEEPEP_DIAGNOSE_AXIS_SLOWDOWN": "1.1"})
    w2 = make_window(factors={DF: block_factor(16, 8, 0, 0, 1.15)})
    assert [a.scope for a in NormalDiagnoser(cfg).diagnose(w2).probes[DF].anomalies] == ["block"]


def test_flagged_mask_covers_each_scope():
    fac = block_factor(16, 8, 1, 0, 2.0) * row_factor(16, 2, 1.6) * cell_factor(16, 4, 13, 3.0)
    report = NormalDiagnoser().diagnose(make_window(factors={DF: fac, RD: row_factor(16, 9, 1.6)}))
    mask = report.flagged_mask(DF)
    assert mask[8:, :8].all() and mask[2, :].all() and mask[4, 13]
    assert mask.sum() == 64 + 16 + 1  # the row and the cell lie outside the block
    rd = report.flagged_mask(RD)
    # EP16: sender 9's only RDMA edge goes to rank 1 (same GPU index on the other node).
    assert rd[9, 1] and rd.sum() == 1
    assert not report.flagged_mask("notify_dispatch").any()
    with pytest.raises(ValueError, match="probe"):
        report.flagged_mask("nope")


# --- windows from cumulative counters ---------------------------------------------------------


def test_counter_reset_makes_the_window_invalid():
    sim = NormalSimulator(seed=2)
    first = sim.advance("baseline")
    second = sim.advance("baseline")
    with pytest.raises(InvalidWindowError) as err:
        NormalWindow.from_snapshots(second, type(first)(first.counters, sequence=3), 8)
    assert err.value.reason == "counter_reset"


def test_zero_sample_cells_from_snapshots_are_invalid():
    sim = NormalSimulator(seed=2)
    a = sim.advance("baseline")
    b = sim.advance("baseline")
    w = NormalWindow.from_snapshots(a, b, 8)
    report = NormalDiagnoser().diagnose(w)
    samples = w.completion[RD][1]
    assert np.array_equal(np.isnan(report.probes[RD].cost_per_sample), samples == 0)


# --- the simulator ------------------------------------------------------------------------------


def test_simulator_is_seeded():
    a = NormalSimulator(seed=4).advance("all_hca_pressure").counters
    b = NormalSimulator(seed=4).advance("all_hca_pressure").counters
    c = NormalSimulator(seed=5).advance("all_hca_pressure").counters
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_simulator_layout_and_realism():
    sim = NormalSimulator(16, 8, seed=0)
    w = sim.window("baseline")
    cps = w.cost_per_sample(DF)
    inter = (np.arange(16)[:, None] // 8) != (np.arange(16)[None, :] // 8)
    assert np.median(cps[inter]) > 2 * np.median(cps[~inter])  # RDMA paths cost more
    assert sim.pressured_ranks == (0, 1, 8, 9)
    snap = sim.advance("baseline")
    assert snap.counters.dtype == np.int64 and snap.counters.shape == (16, 6 + 9 * 16)


def test_simulator_extra_cost_factor():
    sim = NormalSimulator(seed=1)
    d = NormalDiagnoser()
    w = sim.window("baseline", extra_cost_factor={CB: row_factor(16, 6, 1.8)})
    assert [(a.scope, a.src) for a in d.diagnose(w).probes[CB].anomalies] == [("row", 6)]


def test_phase_timeline():
    timeline = list(phase_timeline(windows_per_phase=2, baseline_windows=3))
    assert [p for _, p in timeline[:3]] == ["baseline"] * 3
    assert [i for i, _ in timeline] == list(range(len(timeline)))
    assert [p for _, p in timeline[3:6]] == ["pre_dispatch_delay"] * 2 + ["baseline"]
    assert timeline[-2][1] == "single_hca_pressure"


def test_simulator_scales_to_large_groups():
    w = NormalSimulator(256, 8, seed=0).window("single_hca_pressure")
    report = NormalDiagnoser().diagnose(w)
    (incident,) = report.incidents
    assert incident.cls == "localized_data_path_slowdown"
    assert incident.ranks == tuple(r for r in range(256) if r % 8 in (0, 1))


# --- bad input ----------------------------------------------------------------------------------


def test_bad_input_raises_naming_the_field():
    with pytest.raises(TypeError, match="config"):
        NormalDiagnoser({"notify_ratio": 0.3})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="window"):
        NormalDiagnoser().diagnose({"ep_size": 16})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="notify_ratio"):
        NormalConfig(notify_ratio=0.0)
    with pytest.raises(ValueError, match="phase"):
        NormalSimulator().window("slow")
    with pytest.raises(ValueError, match="ranks_per_node"):
        NormalSimulator(16, 5)
    with pytest.raises(TypeError, match="ep_size"):
        NormalSimulator(16.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slow_rank"):
        NormalSimulator(16, 8, slow_rank=16)
    with pytest.raises(ValueError, match="pressured_local_ranks"):
        NormalSimulator(16, 8, pressured_local_ranks=(8,))
    with pytest.raises(ValueError, match="extra_cost_factor"):
        NormalSimulator().window("baseline", extra_cost_factor={DF: np.ones(3)})
    with pytest.raises(ValueError, match="extra_cost_factor"):
        NormalSimulator().window("baseline", extra_cost_factor={"nope": 2.0})
    with pytest.raises(ValueError, match="channels"):
        SimulatorProfile(channels=0)
    with pytest.raises(ValueError, match="dispatch_cycles"):
        SimulatorProfile(dispatch_cycles=(1.0, float("nan")))
    with pytest.raises(ValueError, match="windows_per_phase"):
        list(phase_timeline(windows_per_phase=-1))
    with pytest.raises(ValueError, match="phases"):
        list(phase_timeline(phases=("storm",)))


def test_report_types_validate_their_choices():
    with pytest.raises(ValueError, match="scope"):
        Anomaly("dispatch_final", "cell", 1, 2, 2.0)
    with pytest.raises(ValueError, match="status"):
        ProbeResult("dispatch_final", "completion", "bad")
    with pytest.raises(ValueError, match="kind"):
        ProbeResult("dispatch_final", "matrix", "ok")
    with pytest.raises(ValueError, match="global_status"):
        ProbeResult("dispatch_final", "completion", "ok", global_status="fast")
    with pytest.raises(ValueError, match="cls"):
        Incident("slow", (), "rank", ())
    with pytest.raises(ValueError, match="severity"):
        Incident("unclassified", (), "local", (), severity="info")


# --- properties -----------------------------------------------------------------------------------


def _layouts():
    return st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (6, 3), (8, 4), (8, 8)])


@st.composite
def windows(draw):
    ep, rpn = draw(_layouts())
    values = st.one_of(st.just(0.0), st.floats(0.0, 1e12, allow_nan=False, allow_infinity=False))
    counts = st.one_of(st.just(0.0), st.integers(0, 10_000).map(float))

    def mat(elements):
        return np.array(draw(st.lists(elements, min_size=ep * ep, max_size=ep * ep))).reshape(
            ep, ep
        )

    def vec(elements):
        return np.array(draw(st.lists(elements, min_size=ep, max_size=ep)))

    notify = {p: (vec(values), vec(counts)) for p in NOTIFY_PROBES}
    completion = {p: (mat(values), mat(counts), mat(values)) for p in COMPLETION_PROBES}
    return NormalWindow(ep_size=ep, ranks_per_node=rpn, notify=notify, completion=completion)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(windows(), min_size=1, max_size=5))
def test_any_finite_non_negative_input_gives_a_report_without_nan(ws):
    d = NormalDiagnoser()
    for w in ws:
        report = d.diagnose(w)
        assert set(report.probes) == set(PROBES)
        data = report.to_dict()
        json.dumps(data, allow_nan=False)
        for result in report.probes.values():
            assert result.status in ("ok", "anomalous", "insufficient", "not_applicable")
            for a in result.anomalies:
                assert np.isfinite(a.factor)
                # Finite or absent (a zero spread: the note says so), never inf or NaN.
                assert a.score is None or np.isfinite(a.score)
                assert all(0 <= r < w.ep_size for r in a.ranks)
        for incident in report.incidents:
            assert all(0 <= r < w.ep_size for r in incident.ranks)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 15),
    st.sampled_from(["row", "column", "block"]),
    st.floats(1.3, 20.0),
)
def test_a_shared_slowdown_is_reported_once_at_its_widest_scope(index, scope, factor):
    if scope == "row":
        fac = row_factor(16, index, factor)
    elif scope == "column":
        fac = np.ones((16, 16))
        fac[:, index] = factor
    else:
        fac = block_factor(16, 8, index // 8, index % 2, factor)
    result = NormalDiagnoser().diagnose(make_window(factors={DF: fac})).probes[DF]
    assert [a.scope for a in result.anomalies] == [scope]

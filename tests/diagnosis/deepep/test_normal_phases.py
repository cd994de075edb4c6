"""The five validation phases, simulated at EP16 (two nodes of 8), diagnosed end to end.

Counters go the long way: cumulative snapshots in the gathered layout, windows from their
differences, exactly as the collectors produce them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from rankwatch.diagnosis.deepep.normal import NormalDiagnoser, NormalSimulator, NormalWindow

DF, RD, CB = "dispatch_final", "dispatch_rdma_recv", "combine_logical_recv"
ND, CND, CNC = "notify_dispatch", "cached_notify_dispatch", "cached_notify_combine"
BASELINE_WINDOWS = 4  # 3 bootstrap the global history, the 4th is checked against it
WINDOWS_PER_PHASE = 3


def run_phase(sim, diagnoser, prev, phase, n):
    reports = []
    for _ in range(n):
        cur = sim.advance(phase)
        window = NormalWindow.from_snapshots(prev, cur, 8, window_index=sim.window_index - 1)
        reports.append(diagnoser.diagnose(window))
        prev = cur
    return prev, reports


@pytest.fixture(scope="module", params=[0, 1, 2])
def phase_reports(request):
    """Reports per phase, phases in the validation order, each after a return to baseline."""
    sim = NormalSimulator(16, 8, seed=request.param)
    d = NormalDiagnoser()
    prev, base = run_phase(sim, d, sim.zero_snapshot(), "baseline", BASELINE_WINDOWS)
    out = {"baseline": base}
    for phase in ("pre_dispatch_delay", "pre_combine_delay", "all_hca_pressure"):
        prev, out[phase] = run_phase(sim, d, prev, phase, WINDOWS_PER_PHASE)
        prev, _ = run_phase(sim, d, prev, "baseline", 1)
    prev, out["single_hca_pressure"] = run_phase(sim, d, prev, "single_hca_pressure", 3)
    return out


def incident_set(report):
    return sorted((i.cls, i.probes, i.ranks) for i in report.incidents)


def test_baseline_has_no_diagnosis(phase_reports):
    for report in phase_reports["baseline"]:
        assert report.incidents == ()
        assert report.raw_anomalies == ()
        assert all(p.status == "ok" for p in report.probes.values())
    assert phase_reports["baseline"][-1].probes[DF].global_status == "normal"


def test_pre_dispatch_delay_is_two_arrival_skews_of_rank_9(phase_reports):
    for report in phase_reports["pre_dispatch_delay"]:
        assert incident_set(report) == [
            ("pre_stage_arrival_skew", (CND,), (9,)),
            ("pre_stage_arrival_skew", (ND,), (9,)),
        ]
        assert report.probes[ND].notify_ratio[9] < 0.1
        assert report.probes[CND].notify_ratio[9] < 0.1
        assert report.probes[CNC].status == "ok"
        assert all(report.probes[p].status == "ok" for p in (DF, RD, CB))


def test_pre_combine_delay_is_one_arrival_skew_of_rank_9(phase_reports):
    for report in phase_reports["pre_combine_delay"]:
        assert incident_set(report) == [("pre_stage_arrival_skew", (CNC,), (9,))]
        assert report.probes[CNC].notify_ratio[9] < 0.1


def test_all_hca_pressure_is_a_global_data_path_slowdown(phase_reports):
    for report in phase_reports["all_hca_pressure"]:
        assert incident_set(report) == [("global_data_path_slowdown", (DF, RD, CB), ())]
        factors = [report.probes[p].global_factor for p in (DF, RD, CB)]
        assert factors == pytest.approx([1.371, 1.447, 1.514], rel=0.03)


def test_single_hca_pressure_is_localized_on_ranks_0_1_8_9(phase_reports):
    for report in phase_reports["single_hca_pressure"]:
        assert incident_set(report) == [
            ("localized_data_path_slowdown", (DF, RD, CB), (0, 1, 8, 9))
        ]
        assert {a.src for a in report.probes[DF].anomalies} == {0, 1, 8, 9}
        assert {a.dst for a in report.probes[CB].anomalies} == {0, 1, 8, 9}
        # Two nodes: each pressured rank has one RDMA edge out, reported as that edge.
        assert {a.scope for a in report.probes[RD].anomalies} == {"edge"}
        assert report.probes[DF].global_status == "normal"


def test_every_report_is_json_without_nan(phase_reports):
    for reports in phase_reports.values():
        for report in reports:
            json.dumps(report.to_dict(), allow_nan=False)


def test_from_snapshots_reproduces_the_simulated_window():
    sim = NormalSimulator(16, 8, seed=7)
    first = sim.advance("baseline")
    second = sim.advance("single_hca_pressure")
    direct = sim.last_window
    rebuilt = NormalWindow.from_snapshots(first, second, 8)
    for probe in (ND, CND, CNC):
        for a, b in zip(rebuilt.notify[probe], direct.notify[probe], strict=True):
            assert np.array_equal(a, b)
    for probe in (DF, RD, CB):
        for a, b in zip(rebuilt.completion[probe], direct.completion[probe], strict=True):
            assert np.array_equal(a, b)

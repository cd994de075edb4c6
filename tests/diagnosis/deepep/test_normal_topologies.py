"""The numbered failures of the normal-mode engine on real topologies, one test each.

Every window comes from the simulator with its default 2 % lognormal per-window noise, through
:class:`NormalDiagnoser`, exactly as the collectors feed it.
"""

from __future__ import annotations

import numpy as np

from rankwatch.diagnosis.config import NormalConfig
from rankwatch.diagnosis.deepep.normal import NormalDiagnoser, NormalSimulator
from rankwatch.diagnosis.deepep.normal.completion import diagnose_completion
from rankwatch.diagnosis.deepep.normal.robust import modified_zscores

DF, RD, CB = "dispatch_final", "dispatch_rdma_recv", "combine_logical_recv"
ND, CND, CNC = "notify_dispatch", "cached_notify_dispatch", "cached_notify_combine"


def _inter(ep: int, rpn: int) -> np.ndarray:
    node = np.arange(ep) // rpn
    return node[:, None] != node[None, :]


def _bootstrapped(ep=16, rpn=8, seed=0, windows=4, **kw):
    sim = NormalSimulator(ep, rpn, seed=seed, **kw)
    d = NormalDiagnoser()
    for _ in range(windows):
        report = d.diagnose(sim.window("baseline"))
        assert report.incidents == ()
    return sim, d


def _classes(report):
    return sorted(i.cls for i in report.incidents)


def test_1_a_node_block_never_vouches_for_an_unrelated_link():
    """Dispatch inter-node block 0->1 1.5x slower + combine link 3->5 2.5x: no localized."""
    for seed in range(3):
        sim, d = _bootstrapped(seed=seed)
        df = np.ones((16, 16))
        df[0:8, 8:16] = 1.5
        cb = np.ones((16, 16))
        cb[3, 5] = 2.5
        report = d.diagnose(sim.window(extra_cost_factor={DF: df, CB: cb}))
        assert {a.scope for a in report.probes[DF].anomalies} >= {"block"}
        assert any(a.scope == "point" for a in report.probes[CB].anomalies)
        assert "localized_data_path_slowdown" not in _classes(report), report.incidents
        assert "unclassified" in _classes(report)


def test_2_inter_node_only_slowdown_on_two_nodes_is_global():
    """All inter-node paths 1.5x slower at EP16 on two nodes (all-HCA pressure): global."""
    inter = _inter(16, 8)
    for seed in range(3):
        sim, d = _bootstrapped(seed=seed)
        slow = np.where(inter, 1.5, 1.0)
        report = d.diagnose(sim.window(extra_cost_factor={DF: slow, RD: 1.5, CB: slow}))
        assert [i.cls for i in report.incidents] == ["global_data_path_slowdown"], report.incidents
        assert report.probes[DF].global_factor > 1.4
        assert report.probes[DF].global_class == "inter_node"
        assert report.probes[CB].global_class == "inter_node"


def test_3_slow_windows_are_never_learned_into_the_baseline():
    """Ten inter-node-slow windows, then every path 1.5x slower: still read as 1.5x."""
    inter = _inter(16, 8)
    sim, d = _bootstrapped(seed=1)
    slow = np.where(inter, 1.5, 1.0)
    for _ in range(10):
        d.diagnose(sim.window(extra_cost_factor={DF: slow, RD: 1.5, CB: slow}))
    report = d.diagnose(sim.window(extra_cost_factor={DF: 1.5, RD: 1.5, CB: 1.5}))
    assert "global_data_path_slowdown" in _classes(report)
    for probe in (DF, CB):
        assert abs(report.probes[probe].global_factor - 1.5) < 0.08, probe


def test_3_an_aggregate_outside_the_normal_band_is_not_learned():
    """Ten windows 1.2x slower everywhere (under 1.3x, so not globally slow), then 1.5x."""
    sim, d = _bootstrapped(seed=2)
    for _ in range(10):
        report = d.diagnose(sim.window(extra_cost_factor={DF: 1.2, RD: 1.2, CB: 1.2}))
        assert "global_data_path_slowdown" not in _classes(report)
    report = d.diagnose(sim.window(extra_cost_factor={DF: 1.5, RD: 1.5, CB: 1.5}))
    assert "global_data_path_slowdown" in _classes(report)
    assert abs(report.probes[DF].global_factor - 1.5) < 0.08


def test_4_a_persistent_local_fault_does_not_block_global_detection():
    """One slow link from the first window; later every path 1.5x slower: a global incident."""
    link = np.ones((16, 16))
    link[3, 12] = 2.5
    sim = NormalSimulator(16, 8, seed=3)
    d = NormalDiagnoser()
    for _ in range(5):
        d.diagnose(sim.window(extra_cost_factor={DF: link}))
    assert d.history.baseline(DF) is not None
    both = {DF: link * 1.5, RD: 1.5, CB: 1.5}
    report = d.diagnose(sim.window(extra_cost_factor=both))
    assert "global_data_path_slowdown" in _classes(report), report.incidents


def _noise_free_rows(rows, factor):
    ep, rpn = 16, 8
    base = np.where(_inter(ep, rpn), 3000.0, 1000.0)
    base[list(rows), :] *= factor
    samples = np.full((ep, ep), 10.0)
    return base * samples, samples


def test_5_noise_free_slow_rows_are_flagged():
    """Four identical 1.6x rows in noise-free data: all four flag (zero MAD, real deviation)."""
    cost, samples = _noise_free_rows((0, 1, 8, 9), 1.6)
    result = diagnose_completion(cost, samples, DF, 8, NormalConfig())
    rows = sorted(a.src for a in result.anomalies if a.scope == "row")
    assert rows == [0, 1, 8, 9]


def test_5_zero_spread_scores_follow_the_seed():
    """With a zero MAD a nonzero deviation is an infinite score, no deviation scores 0."""
    scores = modified_zscores(np.array([0.0] * 12 + [0.47] * 4))
    assert np.all(scores[:12] == 0.0)
    assert np.all(np.isinf(scores[12:])) and np.all(scores[12:] > 0)


def test_5_noise_free_slow_rows_are_not_learned_as_normal():
    """Through the diagnoser, noise-free slow rows are anomalous (the window is not ok)."""
    d = NormalDiagnoser()
    cost, samples = _noise_free_rows((), 1.0)
    from rankwatch.diagnosis.deepep.normal import NormalWindow

    def window(c, s):
        return NormalWindow(16, 8, notify={}, completion={DF: (c, s, s), CB: (c.T.copy(), s, s)})

    for _ in range(3):
        d.diagnose(window(cost, samples))
    cost, samples = _noise_free_rows((0, 1, 8, 9), 1.6)
    report = d.diagnose(window(cost, samples))
    assert report.probes[DF].status == "anomalous"


def test_6_one_node_late_rank_before_dispatch_is_a_pre_stage_skew():
    """EP8 on one node: RDMA has no possible path, which is not missing evidence."""
    for seed in range(3):
        sim, d = _bootstrapped(ep=8, rpn=8, seed=seed, slow_rank=3)
        report = d.diagnose(sim.window("pre_dispatch_delay"))
        assert sorted((i.cls, i.probes, i.ranks) for i in report.incidents) == [
            ("pre_stage_arrival_skew", (CND,), (3,)),
            ("pre_stage_arrival_skew", (ND,), (3,)),
        ]
        rdma = report.probes[RD]
        assert rdma.status == "not_applicable"
        assert "not applicable" in rdma.detail


def test_hot_expert_is_said_to_be_a_hot_spot_in_the_summary():
    """A hot expert is localized on its rank, with load context, and the summary says so."""
    from rankwatch.exporter.publish.verdicts import normal_verdict

    sim, d = _bootstrapped(seed=4, hot_rank=10)
    report = d.diagnose(sim.window("hot_expert"))
    (incident,) = report.incidents
    assert (incident.cls, incident.ranks) == ("localized_data_path_slowdown", (10,))
    assert incident.evidence["load"]["hot"] is True
    assert incident.evidence["load"]["load_ratio"] > 2.5
    verdict = normal_verdict(report)
    assert "hot spot" in verdict.why and "routing" in verdict.action


def test_a_hardware_fault_carries_normal_load():
    sim, d = _bootstrapped(seed=4)
    report = d.diagnose(sim.window("single_hca_pressure"))
    (incident,) = report.incidents
    assert incident.evidence["load"]["hot"] is False
    assert 0.8 < incident.evidence["load"]["load_ratio"] < 1.25


def test_simulator_is_seeded_and_faults_touch_only_their_paths():
    a = NormalSimulator(16, 8, seed=11).window(("slow_link", "all_hca_pressure"))
    b = NormalSimulator(16, 8, seed=11).window(("slow_link", "all_hca_pressure"))
    for probe in (DF, RD, CB):
        pairs = zip(a.completion[probe], b.completion[probe], strict=True)
        assert all(np.array_equal(x, y) for x, y in pairs)
    # Same seed, same draws: the only difference is the fault.
    quiet = NormalSimulator(16, 8, seed=11).window("baseline").cost_per_sample(DF)
    loaded = NormalSimulator(16, 8, seed=11).window("all_hca_pressure").cost_per_sample(DF)
    ratio = loaded / quiet
    inter = _inter(16, 8)
    assert np.allclose(ratio[~inter], 1.0, atol=1e-4)  # NVLink paths untouched
    assert np.allclose(ratio[inter], 1.371, rtol=1e-3)


def test_network_faults_do_nothing_on_one_node():
    for phase in ("all_hca_pressure", "single_hca_pressure", "node_pair_pressure"):
        sim, d = _bootstrapped(ep=8, rpn=8, seed=6, slow_rank=3)
        report = d.diagnose(sim.window(phase))
        assert report.incidents == (), phase

"""Global slowdown: bootstrap after exactly 3 normal windows, horizon 16, never learn anomalies."""

from __future__ import annotations

import numpy as np
import pytest

from rankwatch.diagnosis.config import NormalConfig
from rankwatch.diagnosis.deepep.normal import GlobalHistory, NormalDiagnoser
from tests.diagnosis.deepep.normal_support import make_window, row_factor

DF, RD, CB = "dispatch_final", "dispatch_rdma_recv", "combine_logical_recv"


def scaled(factor: float, **kw):
    return make_window(factors={DF: factor, RD: factor, CB: factor}, **kw)


def test_bootstrapping_until_three_normal_windows():
    d = NormalDiagnoser()
    statuses = [d.diagnose(scaled(1.0)).probes[DF].global_status for _ in range(3)]
    assert statuses == ["bootstrapping"] * 3
    res = d.diagnose(scaled(1.3)).probes[DF]
    assert res.global_status == "slow"
    assert res.global_factor == pytest.approx(1.3)
    assert ("global", None, None) in [(a.scope, a.src, a.dst) for a in res.anomalies]


def test_two_normal_windows_are_not_enough():
    d = NormalDiagnoser()
    for _ in range(2):
        d.diagnose(scaled(1.0))
    res = d.diagnose(scaled(2.0)).probes[DF]
    assert res.global_status == "bootstrapping"
    assert res.global_factor is None
    assert res.status == "ok"


@pytest.mark.parametrize(("factor", "status"), [(1.3, "slow"), (1.2999, "normal"), (0.5, "normal")])
def test_global_threshold_is_inclusive(factor, status):
    d = NormalDiagnoser()
    for _ in range(3):
        d.diagnose(scaled(1.0))
    assert d.diagnose(scaled(factor)).probes[CB].global_status == status


def test_anomalous_windows_are_never_learned():
    d = NormalDiagnoser()
    for _ in range(3):
        d.diagnose(scaled(1.0))
    for _ in range(20):  # a lasting slowdown stays a slowdown
        assert d.diagnose(scaled(1.5)).probes[DF].global_status == "slow"
    # One history per link class: the intra-node (1000) and inter-node (3000) block medians.
    assert d.history.values(DF, "intra_node") == pytest.approx((1000.0,) * 3)
    assert d.history.values(DF, "inter_node") == pytest.approx((3000.0,) * 3)


def test_a_local_anomaly_does_not_stop_learning():
    # A slow row does not move the block medians: the class aggregates are still normal.
    d = NormalDiagnoser()
    d.diagnose(make_window(factors={DF: row_factor(16, 2, 2.0)}))
    assert d.history.values(DF, "intra_node") == pytest.approx((1000.0,))
    assert d.history.values(DF, "inter_node") == pytest.approx((3000.0,))


def test_only_the_slow_class_stops_learning():
    inter = (np.arange(16)[:, None] // 8) != (np.arange(16)[None, :] // 8)
    d = NormalDiagnoser()
    for _ in range(3):
        d.diagnose(scaled(1.0))
    res = d.diagnose(make_window(factors={DF: np.where(inter, 1.5, 1.0)})).probes[DF]
    assert (res.global_status, res.global_class) == ("slow", "inter_node")
    assert res.global_factor == pytest.approx(1.5)
    assert res.class_factors == pytest.approx({"intra_node": 1.0, "inter_node": 1.5})
    assert len(d.history.values(DF, "intra_node")) == 4
    assert len(d.history.values(DF, "inter_node")) == 3


def test_creep_guard_keeps_out_what_is_outside_the_normal_band():
    d = NormalDiagnoser()
    for _ in range(3):
        d.diagnose(scaled(1.0))
    assert d.diagnose(scaled(1.2)).probes[DF].global_status == "normal"  # under 1.3x
    assert len(d.history.values(DF, "intra_node")) == 3  # but outside 1.15x: not learned
    d.diagnose(scaled(1.1))
    assert len(d.history.values(DF, "intra_node")) == 4


def test_horizon_keeps_the_last_16_and_the_median_follows():
    d = NormalDiagnoser()
    for i in range(20):
        d.diagnose(scaled(1.0 + 0.01 * i))  # a slow drift, each step within 1.3x
    values = d.history.values(DF, "inter_node")
    assert len(values) == 16
    base = 3000.0
    assert values[0] == pytest.approx(base * 1.04)
    assert d.history.baseline(DF, "inter_node") == pytest.approx(
        np.median([base * (1.0 + 0.01 * i) for i in range(4, 20)])
    )


def test_history_constants_are_configurable():
    d = NormalDiagnoser(NormalConfig(history_bootstrap=1, history_horizon=2, global_slowdown=1.1))
    d.diagnose(scaled(1.0))
    assert d.diagnose(scaled(1.1)).probes[DF].global_status == "slow"
    d.diagnose(scaled(1.05))
    d.diagnose(scaled(1.05))
    assert len(d.history.values(DF)) == 2


def test_layout_change_starts_a_fresh_history():
    d = NormalDiagnoser()
    for _ in range(3):
        d.diagnose(scaled(1.0))
    assert d.diagnose(scaled(1.0, ep=8, rpn=4)).probes[DF].global_status == "bootstrapping"


def test_reset_forgets():
    d = NormalDiagnoser()
    for _ in range(3):
        d.diagnose(scaled(1.0))
    d.reset()
    assert d.diagnose(scaled(2.0)).probes[DF].global_status == "bootstrapping"


def test_notify_probes_have_no_global_part():
    res = NormalDiagnoser().diagnose(scaled(1.0)).probes["notify_dispatch"]
    assert res.global_status is None and res.global_factor is None and res.aggregate is None


def test_bad_input():
    h = GlobalHistory()
    with pytest.raises(ValueError, match="aggregate"):
        h.assess(DF, float("nan"))
    with pytest.raises(ValueError, match="aggregate"):
        h.learn(DF, -1.0)
    with pytest.raises(TypeError, match="aggregate"):
        h.learn(DF, "3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config"):
        GlobalHistory({"global_slowdown": 1.3})  # type: ignore[arg-type]

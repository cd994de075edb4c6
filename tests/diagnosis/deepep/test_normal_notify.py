"""Notify rule: ratio to the peer median, inclusive 0.25 threshold, probes never merged."""

from __future__ import annotations

import numpy as np
import pytest

from rankwatch.diagnosis.config import NormalConfig
from rankwatch.diagnosis.deepep.normal import NormalDiagnoser
from rankwatch.diagnosis.deepep.normal.notify import diagnose_notify, notify_ratios
from tests.diagnosis.deepep.normal_support import make_window

CFG = NormalConfig()


@pytest.mark.parametrize(("late_ns", "flagged"), [(250.0, True), (250.01, False), (10.0, True)])
def test_ratio_threshold_is_inclusive(late_ns, flagged):
    durations = np.full(16, 1000.0)
    durations[9] = late_ns
    res = diagnose_notify(durations, "notify_dispatch", CFG)
    assert [a.src for a in res.anomalies] == ([9] if flagged else [])
    assert res.notify_ratio[9] == pytest.approx(late_ns / 1000.0)
    if flagged:
        (a,) = res.anomalies
        assert (a.scope, a.dst, a.ranks, a.score) == ("rank", None, (9,), None)
        assert a.factor == pytest.approx(late_ns / 1000.0)


def test_peer_median_excludes_the_rank_itself():
    durations = np.array([100.0, 400.0, 800.0, 1200.0])
    # Rank 0's peers: 400, 800, 1200 -> median 800.
    assert notify_ratios(durations)[0] == pytest.approx(100.0 / 800.0)
    assert notify_ratios(durations)[3] == pytest.approx(1200.0 / 400.0)


def test_rank_without_launches_is_invalid_not_late():
    durations = np.full(8, 1000.0)
    durations[2] = np.nan
    res = diagnose_notify(durations, "cached_notify_combine", CFG)
    assert res.status == "ok"
    assert np.isnan(res.notify_ratio[2])


def test_zero_launches_through_the_window_is_nan():
    w = make_window(notify_ns={"notify_dispatch": np.full(16, 1000.0)})
    duration, count = w.notify["notify_dispatch"]
    count = count.copy()
    count[4] = 0
    w2 = type(w)(
        ep_size=16,
        ranks_per_node=8,
        notify={"notify_dispatch": (duration, count)},
        completion=w.completion,
    )
    report = NormalDiagnoser().diagnose(w2)
    assert np.isnan(report.probes["notify_dispatch"].notify_ratio[4])
    assert report.probes["notify_dispatch"].status == "ok"


def test_one_rank_is_insufficient():
    res = diagnose_notify(np.array([1000.0, np.nan, np.nan]), "notify_dispatch", CFG)
    assert res.status == "insufficient"
    assert "1 rank" in res.detail


def test_zero_peer_median_gives_no_ratio():
    res = diagnose_notify(np.array([5.0, 0.0, 0.0]), "notify_dispatch", CFG)
    assert np.isnan(res.notify_ratio[0])
    # The zero-duration ranks: their peers' median is 2.5 > 0, ratio 0 -> late.
    assert [a.src for a in res.anomalies] == [1, 2]


def test_threshold_comes_from_config_and_environment():
    durations = np.full(16, 1000.0)
    durations[3] = 400.0
    assert diagnose_notify(durations, "notify_dispatch", CFG).anomalies == ()
    cfg = NormalConfig.from_env({"DEEPEP_DIAGNOSE_NOTIFY_RATIO": "0.4"})
    assert [a.src for a in diagnose_notify(durations, "notify_dispatch", cfg).anomalies] == [3]


def test_the_three_notify_probes_are_independent():
    late = np.full(16, 1000.0)
    late[5] = 20.0
    w = make_window(notify_ns={"cached_notify_dispatch": late})
    report = NormalDiagnoser().diagnose(w)
    assert report.probes["cached_notify_dispatch"].status == "anomalous"
    assert report.probes["notify_dispatch"].status == "ok"
    assert report.probes["cached_notify_combine"].status == "ok"


def test_bad_input():
    with pytest.raises(ValueError, match="mean_duration_ns"):
        diagnose_notify(np.ones((2, 2)), "notify_dispatch", CFG)

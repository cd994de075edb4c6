"""Time lost: what incidents cost the group in rank-seconds (``publish/time_lost.py``), as the
incident tracker counts it, the samples serve it and the end block says it."""

from __future__ import annotations

import dataclasses

import pytest

from rankwatch.diagnosis.hang.classify import HangReport, HangVerdict
from rankwatch.diagnosis.step_time import diagnose_means
from rankwatch.exporter.publish.incidents import IncidentTracker
from rankwatch.exporter.publish.recorder import end_of_run_text
from rankwatch.exporter.publish.time_lost import (
    goodput_ratio,
    hang_cost_rank_seconds,
    late_cost_rank_seconds,
    new_steps,
    time_lost_text,
)
from tests.publish_reports import BALANCED_MS, T0, window

GAP_MS = 40.0


def _straggling(i: int, steps: tuple[int, int], culprit: int | None = 2):
    """4 ranks; ``culprit`` spends GAP_MS more per step in forward, the others wait for it in
    backward. ``steps``: the window's first and last step id."""
    means = {}
    for r in range(4):
        extra = GAP_MS if r == culprit else 0.0
        wait = 0.0 if culprit is None or r == culprit else GAP_MS
        means[r] = dict(
            BALANCED_MS, forward=30.0 + extra, backward=60.0 + wait, step=100.0 + GAP_MS
        )
    st = dataclasses.replace(diagnose_means(means, steps=50), step_range=steps)
    return window(i, n=4, step_time=st)


def test_new_steps_counts_what_no_earlier_window_counted():
    assert new_steps(None, None) == 0
    assert new_steps((1, 100), None) == 100
    assert new_steps((51, 150), 100) == 50  # overlapping live windows
    assert new_steps((101, 150), 100) == 50
    assert new_steps((1, 100), 150) == 0  # an older window (a rank came back late)


def test_costs_and_goodput():
    assert late_cost_rank_seconds(40.0, 50, 4) == pytest.approx(8.0)
    assert late_cost_rank_seconds(None, 50, 4) == 0.0
    assert late_cost_rank_seconds(-3.0, 50, 4) == 0.0
    assert late_cost_rank_seconds(float("nan"), 50, 4) == 0.0
    assert hang_cost_rank_seconds(20.0, 15.0, 4) == pytest.approx(20.0)
    assert hang_cost_rank_seconds(10.0, 15.0, 4) == 0.0
    assert hang_cost_rank_seconds(None, 0.0, 4) == 0.0
    assert goodput_ratio(10.0, 10.0, 4) == pytest.approx(0.75)
    assert goodput_ratio(0.0, 0.0, 4) is None
    assert goodput_ratio(100.0, 1.0, 4) == 0.0


def test_a_straggler_costs_its_gap_on_every_rank_once_per_step():
    t = IncidentTracker(2, 3, 3)
    events = []
    # Live windows of 100 steps, one every 50 steps: each window brings 50 new steps.
    for i in range(6):
        events += t.update(_straggling(i, (max(1, 50 * i - 49), 50 * i + 50)))
    (opened,) = [e for e in events if e.action == "open"]
    per_window = GAP_MS / 1000 * 50 * 4  # 8 rank-seconds
    # It opened on its second window: both windows count.
    assert opened.incident.lost_rank_seconds == pytest.approx(2 * per_window)
    snap = t.snapshot()
    (inc,) = snap.open
    total = 6 * per_window
    assert inc.lost_rank_seconds == pytest.approx(total)
    assert snap.lost_total == {
        ("step_time_straggler", "compute_straggler", "2", "node-0"): pytest.approx(total)
    }
    # 5 windows of 5 s after the first, 4 ranks: 100 rank-seconds of wall time.
    assert snap.goodput_ratio == pytest.approx(1 - total / 100.0)
    (closed,) = t.close_all()
    assert closed.incident.lost_rank_seconds == pytest.approx(total)
    assert "lost 48 rank-seconds" in __import__(
        "rankwatch.exporter.publish.events", fromlist=["event_message"]
    ).event_message(closed)


def test_a_candidate_that_never_opens_costs_nothing():
    t = IncidentTracker(2, 3, 3)
    t.update(_straggling(0, (1, 100)))
    for i in range(1, 5):
        t.update(_straggling(i, (50 * i + 1, 50 * i + 100), culprit=None))
    assert t.snapshot().lost_total == {}
    assert t.snapshot().goodput_ratio == 1.0


def _hang(i: int, stalled_s: float):
    verdict = HangVerdict(
        hang_class="STUCK_RANK",
        ranks=(1,),
        phase="forward",
        phase_seconds=stalled_s,
        collective=None,
        culprit_collective=None,
        frames=[],
        waiting_ranks=(0, 2, 3),
        waiting_frames=[],
        stalled_seconds=stalled_s,
    )
    report = window(i, n=4)
    return dataclasses.replace(report, hang=HangReport(verdict, budget_seconds=15.0))


def test_a_hang_costs_its_stalled_seconds_on_every_rank():
    t = IncidentTracker(2, 3, 3)
    for i, stalled in enumerate((15.0, 20.0, 30.0)):
        t.update(_hang(i, stalled))
    (inc,) = t.snapshot().open
    assert inc.lost_rank_seconds == pytest.approx(30.0 * 4)


def test_the_end_block_says_what_the_run_lost_and_to_what():
    incidents = [
        {
            "class": "step_time_straggler",
            "cause": "input_straggler",
            "ranks": [17],
            "hostnames": ["node-c"],
            "lost_rank_seconds": 1.6 * 3600,
        },
        {
            "class": "hang",
            "cause": "stuck_rank",
            "ranks": [3],
            "hostnames": [],
            "lost_rank_seconds": 0.3 * 3600,
        },
        {"class": "step_time_bottleneck", "cause": "input_bound", "ranks": [], "hostnames": []},
    ]
    assert time_lost_text(incidents) == (
        "lost 1.9 GPU-hours: 1.6 to rank 17 on node-c (input straggler), 0.3 to a hang (rank 3)"
    )
    assert time_lost_text(incidents[2:]) == ""
    small = [dict(incidents[0], lost_rank_seconds=42.0)]
    assert time_lost_text(small) == (
        "lost 42 rank-seconds: 42 to rank 17 on node-c (input straggler)"
    )
    summary = {
        "run": {"run_id": "r1", "started_at_s": T0},
        "incidents": [
            dict(
                inc,
                incident_id=f"x-{n}",
                severity="critical",
                probe="",
                score=None,
                opened_at_s=T0 + 10,
                closed_at_s=None,
            )
            for n, inc in enumerate(incidents[:2])
        ],
    }
    text = end_of_run_text(summary, None)
    assert "  Time lost: lost 1.9 GPU-hours: 1.6 to rank 17 on node-c" in text
    assert "still open, lost 5760 rank-seconds" in text


def test_a_job_slowdown_is_one_incident_at_once_and_costs_its_excess():
    from rankwatch.diagnosis.step_time.pace import PaceHistory

    history = PaceHistory()
    t = IncidentTracker(2, 3, 3)
    events = []
    for i in range(14):
        extra = 30.0 if i >= 8 else 0.0  # every rank 30 ms slower in forward from window 8
        means = {r: dict(BALANCED_MS, forward=30.0 + extra, step=100.0 + extra) for r in range(4)}
        st = dataclasses.replace(
            diagnose_means(means, steps=50), step_range=(50 * i + 1, 50 * i + 50)
        )
        report = dataclasses.replace(window(i, n=4, step_time=st), pace=history.update(st, i))
        events += t.update(report)
    (opened,) = events
    inc = opened.incident
    assert (inc.cls, inc.cause, inc.ranks, inc.severity) == (
        "job_slowdown",
        "forward",
        (),
        "warning",
    )
    assert opened.window_index == 10 and inc.evidence["since_window"] == 8
    assert inc.score == pytest.approx(135 / 105)
    # Its streak's windows (8 and 9, before it was reported) and its own (10 to 13): 30 ms x
    # 50 new steps x 4 ranks per window, 6 windows.
    (now,) = t.snapshot().open
    assert now.lost_rank_seconds == pytest.approx(6 * 0.030 * 50 * 4)
    assert "all ranks" in __import__(
        "rankwatch.exporter.publish.events", fromlist=["event_message"]
    ).event_message(opened)


def test_the_steps_after_the_last_live_window_cost_an_open_incident():
    t = IncidentTracker(2, 3, 3)
    for i in range(3):
        t.update(_straggling(i, (max(1, 50 * i - 49), 50 * i + 50)))
    (before,) = t.snapshot().open
    # The summary window at shutdown reaches 30 steps further.
    summary = dataclasses.replace(_straggling(3, (1, 180)), window_kind="summary")
    assert t.update(summary) == []
    (after,) = t.snapshot().open
    assert after.lost_rank_seconds - before.lost_rank_seconds == pytest.approx(
        GAP_MS / 1000 * 30 * 4
    )

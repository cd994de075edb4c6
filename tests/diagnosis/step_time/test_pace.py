"""The run against itself: the group's pace against its own baseline (``step_time/pace.py``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rankwatch.diagnosis.config import StepTimeConfig
from rankwatch.diagnosis.step_time import diagnose_means
from rankwatch.diagnosis.step_time.pace import FORMED, FORMING, WARMING_UP, PaceHistory

BASE = {"input_wait": 5.0, "h2d": 1.0, "forward": 30.0, "backward": 60.0, "optimizer": 5.0}


def _window(extra: dict[str, float] | None = None, n: int = 4, per_rank=None, slow=None):
    """A DDP window of ``n`` ranks; ``extra`` ms added to phases of every rank (``per_rank``:
    only of those ranks); ``slow``: one straggler rank, 40 ms late in forward."""
    means = {}
    for r in range(n):
        m = dict(BASE)
        if extra and (per_rank is None or r in per_rank):
            for k, v in extra.items():
                m[k] += v
        late = 40.0 if slow is not None and r == slow else 0.0
        wait = 40.0 if slow is not None and r != slow else 0.0
        m["forward"] += late
        m["backward"] += wait
        m["step"] = m["h2d"] + m["forward"] + m["backward"] + m["optimizer"]
        means[r] = m
    return diagnose_means(means, steps=50)


def _formed(history: PaceHistory, start: int = 0) -> int:
    """Feed warm-up and baseline windows; return the next window index."""
    cfg = history.config
    i = start
    for _ in range(cfg.pace_warmup_windows + cfg.pace_baseline_windows):
        history.update(_window(), i)
        i += 1
    return i


def test_warm_up_then_forming_then_formed_say_so():
    h = PaceHistory()
    states = [h.update(_window(), i) for i in range(9)]
    assert [s.state for s in states[:3]] == [WARMING_UP] * 3
    assert "warm-up" in states[0].reason and "no baseline yet" in states[0].reason
    assert [s.state for s in states[3:7]] == [FORMING] * 4
    assert "forming the baseline: 1 of 5" in states[3].reason
    assert states[7].state == FORMED and states[7].ratio == pytest.approx(1.0)
    assert states[7].baseline_ms == pytest.approx(101.0)


def test_every_rank_slower_in_forward_is_a_job_slowdown_after_k_windows():
    h = PaceHistory()
    i = _formed(h)
    got = [h.update(_window({"forward": 30.0}), i + j) for j in range(4)]
    assert [g.severity for g in got] == [None, None, "warning", "warning"]
    top = got[2]
    assert top.kind == "JOB_SLOWDOWN" and top.ratio == pytest.approx(131 / 101)
    assert top.since_window == i and top.phase == "forward"
    assert top.phase_growth_ms["forward"] == pytest.approx(30.0)
    assert top.unit == "every rank" and top.slow_ranks == (0, 1, 2, 3)
    assert all(v == pytest.approx(131 / 101) for v in top.rank_ratios.values())


def test_critical_from_the_critical_ratio_and_a_clean_window_ends_the_streak():
    h = PaceHistory()
    i = _formed(h)
    got = [h.update(_window({"input_wait": 60.0}), i + j) for j in range(3)]
    assert got[-1].severity == "critical" and got[-1].phase == "input_wait"
    assert h.update(_window(), i + 3).severity is None
    assert h.update(_window({"input_wait": 60.0}), i + 4).severity is None


def test_a_straggler_is_not_a_job_slowdown():
    h = PaceHistory()
    i = _formed(h)
    got = [h.update(_window(slow=2), i + j) for j in range(5)]
    assert all(g.severity is None for g in got)
    assert got[-1].ratio == pytest.approx(1.0)


def test_variable_step_lengths_do_not_page():
    rng = np.random.default_rng(7)
    h = PaceHistory()
    for i in range(60):
        # A window's mean over 50 steps of lengths varying +-30 % moves by a few percent.
        jitter = float(rng.normal(0, 0.3 / math.sqrt(50))) * 101
        assert h.update(_window({"forward": jitter}), i).severity is None


def test_a_gradual_drift_adds_up_against_the_fixed_baseline():
    h = PaceHistory()
    i = _formed(h)
    severities = [
        h.update(_window({"forward": 101 * 0.02 * (j + 1)}), i + j).severity for j in range(12)
    ]
    first = severities.index("warning")
    assert 7 <= first <= 10  # +2 % a window reaches 1.15 after 8, then k windows


def test_hosts_unit_when_the_ranks_that_grew_are_whole_hosts():
    h = PaceHistory()
    i = _formed(h)
    hosts = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
    # Ranks 2 and 3 do more work; 0 and 1 do not (the collective wait is theirs: not own work).
    got = [h.update(_window({"optimizer": 40.0}, per_rank={2, 3}), i + j, hosts) for j in range(3)]
    assert got[-1].unit == "hosts" and got[-1].hosts == ("node-b",)
    assert got[-1].slow_ranks == (2, 3)


def test_rebaseline_starts_warm_up_again_and_says_why():
    h = PaceHistory()
    i = _formed(h)
    h.rebaseline("sequence length 2048 -> 4096")
    r = h.update(_window({"forward": 60.0}), i)
    assert r.state == WARMING_UP and "sequence length 2048 -> 4096" in r.reason
    for j in range(1, 8):
        r = h.update(_window({"forward": 60.0}), i + j)
    assert r.state == FORMED and r.ratio == pytest.approx(1.0) and r.severity is None
    assert r.rebaselines == 1 and "formed again" in r.reason


def test_too_few_steps_neither_form_nor_judge():
    h = PaceHistory()
    short = diagnose_means({r: dict(BASE, step=96.0) for r in range(4)}, steps=1)
    r = h.update(short, 0)
    assert r.state == WARMING_UP and "too few aligned steps" in r.reason


def test_bad_input_names_the_field():
    h = PaceHistory()
    with pytest.raises(TypeError, match="report: expected StepTimeReport"):
        h.update({"steps": 3}, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reason: expected a non-empty string"):
        h.rebaseline("  ")
    with pytest.raises(TypeError, match="config: expected StepTimeConfig"):
        PaceHistory({"pace_warmup_windows": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("job_slowdown_warning_ratio", 1.0),
        ("job_slowdown_critical_ratio", 1.1),  # below the warning ratio
        ("job_slowdown_windows", 0),
        ("pace_baseline_windows", 0),
        ("pace_warmup_windows", -1),
    ],
)
def test_settings_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        StepTimeConfig(**{field: value})


def _rows(first: int, n: int, outer_ms: float) -> np.ndarray:
    from rankwatch.diagnosis.step_time.table import ROW_WIDTH, column

    rows = np.full((n, ROW_WIDTH), np.nan)
    rows[:, 0] = np.arange(first, first + n)
    rows[:, column("cpu", "input_wait")] = 1.0
    rows[:, column("cpu", "step")] = outer_ms - 1.0
    return rows


def test_rows_pace_reads_median_steps_and_the_new_steps_mean():
    from rankwatch.diagnosis.step_time.pace import rows_pace

    slow_tail = np.concatenate([_rows(1, 80, 10.0), _rows(81, 20, 40.0)])
    per_rank = {0: slow_tail, 1: slow_tail.copy(), 2: None}
    got = rows_pace(per_rank, "cpu", 80)
    assert got.window_ms == pytest.approx(10.0)  # 20 slow steps of 100 do not move the median
    assert (got.recent_ms, got.recent_steps) == (pytest.approx(40.0), 20)
    every = rows_pace(per_rank, "cpu", None)
    assert every.recent_steps == 100 and every.recent_ms == pytest.approx(16.0)
    assert rows_pace(per_rank, "cpu", 100).recent_steps == 0
    assert rows_pace({}, "cpu", None).window_ms is None


def test_rows_pace_samples_a_bounded_number_of_ranks():
    from rankwatch.diagnosis.step_time.pace import RECENT_SAMPLE_RANKS, rows_pace

    many = {r: _rows(1, 5, 10.0 + (r % 3)) for r in range(4 * RECENT_SAMPLE_RANKS)}
    got = rows_pace(many, "cpu", None)
    assert got.recent_steps == 5 and got.recent_ms == pytest.approx(11.0)


def test_an_evaluation_inside_a_few_steps_is_not_a_slowdown():
    from rankwatch.diagnosis.step_time.pace import rows_pace

    h = PaceHistory()
    steady = {r: _rows(1, 100, 101.0) for r in range(4)}
    for i in range(8):
        h.update(_window(), i, rows=rows_pace(steady, "cpu", None))
    # 30 of 100 steps hold an evaluation (the window's mean grows by 50 %): not the job's pace.
    with_eval = {r: np.concatenate([_rows(1, 70, 101.0), _rows(71, 30, 270.0)]) for r in range(4)}
    got = [h.update(_window(), 8 + j, rows=rows_pace(with_eval, "cpu", 70)) for j in range(4)]
    assert all(g.severity is None for g in got)
    assert got[-1].ratio == pytest.approx(1.0)


def test_a_collective_slower_on_every_rank_is_the_collective_wait_that_grew():
    # The job synchronises only in its backward (no forward wait was timed): the backward
    # wait grew, not the backward's own work.
    def sync_window(wait_ms: float):
        means = {
            r: dict(
                BASE, backward=60.0 + wait_ms, backward_wait=10.0 + wait_ms, step=101.0 + wait_ms
            )
            for r in range(4)
        }
        for m in means.values():
            m["step"] = m["h2d"] + m["forward"] + m["backward"] + m["optimizer"]
        return diagnose_means(means, steps=50)

    h = PaceHistory()
    for i in range(8):
        h.update(sync_window(0.0), i)
    got = [h.update(sync_window(30.0), 8 + j) for j in range(3)]
    assert got[-1].severity == "warning" and got[-1].phase == "collective_wait"
    assert got[-1].phase_growth_ms["backward"] == pytest.approx(0.0)

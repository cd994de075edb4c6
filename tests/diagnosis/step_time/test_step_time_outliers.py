"""Robust windows: a rank's rare outlier steps are left out of its means, common ones stay."""

from __future__ import annotations

import numpy as np
import pytest

from rankwatch.diagnosis.config import StepTimeConfig
from rankwatch.diagnosis.step_time import diagnose_arrays
from rankwatch.diagnosis.step_time.blocks import StepBlocks
from rankwatch.diagnosis.step_time.table import ROW_WIDTH, OutlierRule, column, reduce_window

STEPS = 100
KEEP_ALL = StepTimeConfig(outlier_steps_max_fraction=0.0)


def rank_rows(steps: int = STEPS, first: int = 0) -> np.ndarray:
    """A healthy DDP rank on the CPU clock with the sync waits timed (ms)."""
    out = np.full((steps, ROW_WIDTH), np.nan)
    out[:, 0] = np.arange(first, first + steps)
    for signal, ms in (
        ("input_wait", 1.0),
        ("h2d", 0.0),
        ("forward", 10.0),
        ("backward", 30.0),
        ("optimizer", 5.0),
        ("step", 50.0),
        ("forward_wait", 1.0),
        ("backward_wait", 5.0),
    ):
        out[:, column("cpu", signal)] = ms
    return out


def _wait(rows: np.ndarray, at: int, signal: str, ms: float) -> None:
    """``ms`` more of a wait on step index ``at`` (the step and its phase grow with it)."""
    phase = "forward" if signal == "forward_wait" else "backward"
    for name in (signal, phase, "step"):
        rows[at, column("cpu", name)] += ms


def _stragglers(report: object) -> list[object]:
    return [f for f in report.findings if f.is_straggler]  # type: ignore[attr-defined]


def test_a_checkpoint_save_on_one_rank_no_longer_opens_a_straggler() -> None:
    world = {r: rank_rows() for r in range(4)}
    # Rank 0 saves a checkpoint after step 50's optimizer (100x a step, in its residual); the
    # others wait for it at step 51's pre-forward broadcast.
    world[0][50, column("cpu", "step")] += 4950.0
    for r in (1, 2, 3):
        _wait(world[r], 51, "forward_wait", 4950.0)
    before = diagnose_arrays(world, config=KEEP_ALL)
    assert _stragglers(before) and before.findings[0].culprit_rank == 0
    assert before.findings[0].severity == "critical"
    after = diagnose_arrays(world)
    assert not _stragglers(after), after.findings
    assert after.outlier_steps == 1
    assert after.outlier_steps_by_rank == {0: 1, 1: 1, 2: 1, 3: 1}
    assert after.to_dict()["outlier_steps"] == 1
    assert after.rank_means[0]["step"] == pytest.approx(50.0)


def test_a_first_step_start_up_wait_on_two_ranks_no_longer_opens_a_straggler() -> None:
    # FSDP2's first all-gather: ranks 0 and 1 wait 4.5 s for ranks 2 and 3, which started later.
    world = {r: rank_rows() for r in range(4)}
    for r in (0, 1):
        _wait(world[r], 0, "forward_wait", 4500.0)
    before = diagnose_arrays(world, config=KEEP_ALL)
    assert _stragglers(before) and before.findings[0].culprit_rank == 2
    assert before.findings[0].severity == "critical"
    after = diagnose_arrays(world)
    assert not _stragglers(after), after.findings
    assert after.outlier_steps_by_rank == {0: 1, 1: 1}


def test_a_straggler_on_every_step_is_still_found() -> None:
    world = {r: rank_rows() for r in range(4)}
    world[3][:, column("cpu", "forward")] += 20.0
    world[3][:, column("cpu", "step")] += 20.0
    for r in (0, 1, 2):
        world[r][:, column("cpu", "backward_wait")] += 20.0
        world[r][:, column("cpu", "backward")] += 20.0
        world[r][:, column("cpu", "step")] += 20.0
    report = diagnose_arrays(world)
    assert _stragglers(report) and report.findings[0].culprit_rank == 3
    assert report.outlier_steps == 0 and report.outlier_steps_by_rank == {}


def test_outliers_on_more_than_the_fraction_of_steps_are_the_job_s_normal() -> None:
    world = {r: rank_rows() for r in range(2)}
    for at in range(0, STEPS, 10):  # an evaluation pause every 10 steps: 10 % of the window
        world[0][at, column("cpu", "step")] += 1000.0
    report = diagnose_arrays(world)
    assert report.outlier_steps == 0
    assert report.rank_means[0]["step"] == pytest.approx(150.0)


def test_outlier_rule_bounds_and_small_windows() -> None:
    rule = OutlierRule(5.0, 0.05)
    assert rule.kept(np.full((2, 19), 1.0)) is None  # 5 % of 19 steps is no step
    spiky = np.ones((1, 40))
    spiky[0, 3] = 6.0
    kept = rule.kept(spiky)
    assert kept is not None and kept.sum() == 39 and not kept[0, 3]
    for bad in (
        lambda: OutlierRule(0.5, 0.05),
        lambda: OutlierRule(5.0, -0.1),
        lambda: OutlierRule(float("nan"), 0.05),
    ):
        with pytest.raises(ValueError, match="field"):
            bad()
    with pytest.raises(ValueError, match="field outliers: value of type float"):
        reduce_window({0: rank_rows()}, outliers=0.05)
    with pytest.raises(ValueError, match="field outliers"):
        StepBlocks((0,), window_steps=100, tail_rows=200, outliers=(5.0, 0.05))
    for name, value in (("outlier_step_factor", 1.0), ("outlier_steps_max_fraction", 0.6)):
        with pytest.raises(ValueError, match=name):
            StepTimeConfig(**{name: value})


def test_step_blocks_judge_outliers_per_block_and_match_reduce_window_on_the_rows() -> None:
    rule = OutlierRule(5.0, 0.05)
    rows = {r: rank_rows(1000) for r in range(2)}
    rows[0][150, column("cpu", "step")] += 5000.0  # an old step, in a closed block
    rows[0][980, column("cpu", "step")] += 5000.0  # a step in the kept rows
    blocks = StepBlocks((0, 1), window_steps=1000, tail_rows=300, outliers=rule)
    for r, arr in rows.items():
        blocks.add(r, arr)
    tails = {r: arr[-300:] for r, arr in rows.items()}
    summary = blocks.reduce(tails, 1000)
    assert summary.outlier_steps == (2, 0)
    assert summary.means[0, 5] == pytest.approx(50.0)  # step (MEAN_KEYS order)
    live = blocks.reduce(tails, 100)
    want = reduce_window(tails, window=100, outliers=rule)
    np.testing.assert_array_equal(live.means, want.means)
    assert live.outlier_steps == want.outlier_steps == (1, 0)

"""``sync_wait()``: crediting a wait at a synchronisation point the hooks do not see.

One process, the timer's own clock; times are checked from below only (a sleep of s ms lasts
at least s ms) or against another measurement of the same row.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from rankwatch.diagnosis.step_time.table import column
from rankwatch.exporter.step_time.rank_watch import RankWatch
from rankwatch.exporter.step_time.timer import StepTimer
from tests.exporter.step_time.test_timer import rows_of, single_config

FWD, BWD = column("cpu", "forward"), column("cpu", "backward")
FWW, BWW = column("cpu", "forward_wait"), column("cpu", "backward_wait")
STEP = column("cpu", "step")


def test_a_wait_before_the_forward_counts_as_forward_and_forward_wait() -> None:
    timer = StepTimer(4)
    with timer.step():
        with timer.sync_wait():  # e.g. a token-count all-gather after the batch fetch
            time.sleep(0.01)
        with timer.phase("forward"):
            time.sleep(0.002)
    row = rows_of(timer)[0]
    assert row[FWW] >= 10.0
    # forward holds the wait and its own work: compute (forward - forward_wait) is the work,
    # and the wait is not left in the residual (step - forward).
    assert row[FWD] - row[FWW] >= 2.0
    assert row[FWD] >= row[FWW] + 2.0
    assert row[STEP] - row[FWD] < row[FWW]
    assert math.isnan(row[BWW])  # only what was timed


def test_a_wait_inside_forward_or_backward_is_not_counted_twice() -> None:
    timer = StepTimer(4)
    with timer.step():
        with timer.phase("forward"), timer.sync_wait():  # an all-reduce inside forward
            time.sleep(0.01)
        with timer.phase("backward"), timer.sync_wait():
            time.sleep(0.005)
    row = rows_of(timer)[0]
    assert row[FWW] >= 10.0 and row[BWW] >= 5.0
    # The phase already holds the wait: it contains it once (forward was only the wait).
    assert row[FWD] >= row[FWW] and row[FWD] < 2 * row[FWW]
    assert row[BWD] >= row[BWW] and row[BWD] < 2 * row[BWW]


def test_waits_accumulate_and_a_wait_before_the_step_goes_to_the_next_step() -> None:
    timer = StepTimer(4)
    with timer.sync_wait():  # no step open yet: credited to the step that opens next
        time.sleep(0.004)
    with timer.step(), timer.sync_wait():
        time.sleep(0.004)
    row = rows_of(timer)[0]
    assert row[FWW] >= 8.0 and row[FWD] >= 8.0


def test_sync_wait_blocks_do_not_nest_and_an_exception_still_credits_the_wait() -> None:
    timer = StepTimer(4)
    wait = timer.sync_wait()
    with timer.step():
        with (
            wait,
            pytest.raises(RuntimeError, match="sync_wait: already inside"),
            timer.sync_wait(),
        ):
            pass
        with pytest.raises(ValueError, match="boom"), timer.sync_wait():
            time.sleep(0.003)
            raise ValueError("boom")
        with timer.sync_wait():  # usable again after both
            pass
    row = rows_of(timer)[0]
    assert row[FWW] >= 3.0


def test_rankwatch_sync_wait_times_on_an_active_rank_and_is_inert_when_disabled() -> None:
    off = RankWatch(config=single_config(enabled=False))
    with off.sync_wait(), off.sync_wait():  # inert: nesting is harmless when nothing is timed
        pass
    off.close(1.0)
    rw = RankWatch(config=single_config())
    try:
        assert rw.timer is not None
        with rw.step():
            with rw.sync_wait():
                time.sleep(0.003)
            with rw.phase("forward"):
                torch.zeros(1)
        row = rows_of(rw.timer)[0]
        assert row[FWW] >= 3.0
        with pytest.raises(RuntimeError, match="nest"), rw.sync_wait(), rw.sync_wait():
            pass
    finally:
        rw.close(2.0)

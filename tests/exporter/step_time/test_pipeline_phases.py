"""The pipeline schedule's actions held as phases (the timer's hold, the class shadows), and
its sends and receives timed as collective waits.

The real schedule (a 2-stage GPipe on Gloo, with work outside the watched module and a slow
loss) is in ``test_collective_waits.py``.
"""

from __future__ import annotations

import math

import pytest

from rankwatch.diagnosis.step_time.table import column
from rankwatch.exporter.step_time.pipeline import (
    install_pipeline_phases,
    pipeline_p2p_targets,
    pipeline_phase_targets,
)
from rankwatch.exporter.step_time.timer import BACKWARD, FORWARD, StepTimer


def test_the_schedule_actions_are_found_once_the_job_imported_pipelining() -> None:
    import torch.distributed.pipelining  # noqa: F401 - what building a stage does

    names = {name for _, name in pipeline_phase_targets()}
    assert names == {
        "forward_one_chunk",
        "_maybe_compute_loss",
        "backward_one_chunk",
        "backward_weight_one_chunk",
    }


def test_a_held_phase_ignores_the_marks_inside_it_and_times_the_whole() -> None:
    clock = iter(range(0, 10**9, 10**6)).__next__  # 1 ms a read
    timer = StepTimer(4)
    timer._clock = clock
    timer.start_step()
    assert timer.hold(FORWARD)
    assert not timer.hold(FORWARD)  # held already: not again
    timer.begin(FORWARD)  # a module's hook inside the action
    assert timer.end(FORWARD)  # "still timed": the hook goes on (watches the output)
    assert timer.phase_open(FORWARD)
    timer.release(FORWARD)
    assert not timer.phase_open(FORWARD)
    timer.begin(BACKWARD)
    assert not timer.hold(BACKWARD)  # open already (a user's phase): left to its owner
    timer.end(BACKWARD)
    timer.end_step()
    rows, _, _ = timer.read(0)
    # The step opens at 0 ms, the hold reads 1 ms, the release 2 ms: the marks inside read
    # no clock.
    assert rows[0][column("cpu", "forward")] == pytest.approx(1.0)
    assert not math.isnan(rows[0][column("cpu", "backward")])


def test_bad_timer_is_refused_with_the_field_named() -> None:
    for bad in (None, "timer", 3, object()):
        with pytest.raises(TypeError, match="install_pipeline_phases: field timer"):
            install_pipeline_phases(bad)  # type: ignore[arg-type]


def test_install_and_remove_restore_torch_and_nest_per_timer() -> None:
    import torch.distributed.pipelining  # noqa: F401

    targets = pipeline_phase_targets()
    assert targets
    before = {(id(o), n): vars(o)[n] for o, n in targets}
    timer, other = StepTimer(4), StepTimer(4)
    first, second = install_pipeline_phases(timer), install_pipeline_phases(other)
    assert all(vars(o)[n] is not before[(id(o), n)] for o, n in targets)
    for h in first:
        h.remove()
    assert all(vars(o)[n] is not before[(id(o), n)] for o, n in targets)  # other's still
    for h in second:
        h.remove()
        h.remove()  # idempotent
    assert all(vars(o)[n] is before[(id(o), n)] for o, n in targets)


def test_the_schedule_sends_and_receives_are_timed_as_a_collective_wait() -> None:
    import torch.distributed.pipelining.schedules as schedules

    assert pipeline_p2p_targets() == [(schedules, "_batch_p2p")]
    original = schedules._batch_p2p
    clock = iter(range(0, 10**9, 10**6)).__next__  # 1 ms a read
    timer = StepTimer(4)
    timer._clock = clock
    handles = install_pipeline_phases(timer)
    try:
        assert schedules._batch_p2p is not original
        assert schedules._batch_p2p.__wrapped__ is original  # type: ignore[attr-defined]
        timer.start_step()
        assert timer.hold(FORWARD)
        assert schedules._batch_p2p([]) == []  # what the schedule calls, looked up each time
        timer.release(FORWARD)
        timer.end_step()
    finally:
        for h in handles:
            h.remove()
    assert schedules._batch_p2p is original
    rows, _, _ = timer.read(0)
    assert rows[0][column("cpu", "forward_wait")] == pytest.approx(1.0)

"""The waits of a plain module (a pipeline stage, a tensor-parallel model, a module whose
wrapper a framework holds) and waits counted once where two timings meet.

In-process: the timer and the hooks on real modules, the waits made by ``rw.sync_wait()``
blocks around sleeps at the points a collective would wait.
"""

from __future__ import annotations

import _thread
import math
import threading
import time
from typing import Any

import torch

from rankwatch.diagnosis.step_time.table import column
from rankwatch.exporter.step_time.collectives import _backward_worker
from rankwatch.exporter.step_time.hooks import install
from rankwatch.exporter.step_time.timer import BACKWARD, FORWARD, FORWARD_WAIT, StepTimer

FWW, BWW = column("cpu", "forward_wait"), column("cpu", "backward_wait")
BWD = column("cpu", "backward")
SLEEP_S = 0.05


class _WaitAtInput(torch.autograd.Function):
    """Identity whose backward waits in a sync wait: placed at the model's input, its backward
    runs after every parameter gradient (a collective at the end of the backward pass)."""

    timer: StepTimer | None = None

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        assert _WaitAtInput.timer is not None
        with _WaitAtInput.timer.sync_wait():
            time.sleep(SLEEP_S)
        return grad


class _Stage(torch.nn.Module):
    def __init__(self, wait_at_input: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.wait_at_input = wait_at_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wait_at_input:
            x = _WaitAtInput.apply(x.requires_grad_())
        return self.lin(x)


def _steps(model: torch.nn.Module, timer: StepTimer, steps: int = 3) -> list[list[float]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    handles = install(timer, model, [opt])
    try:
        for _ in range(steps):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
    finally:
        for h in handles:
            h.remove()
    rows, _, _ = timer.read(0)
    return rows.tolist()


def test_a_plain_module_times_both_waits_on_every_step() -> None:
    rows = _steps(_Stage(), StepTimer(16))
    assert len(rows) == 3
    for row in rows:
        # Both measured (not NaN): a step where nothing waited compares as 0, not as unknown.
        assert row[FWW] == 0.0
        assert not math.isnan(row[BWW]) and 0.0 <= row[BWW] <= row[BWD]


def test_a_wait_after_the_last_gradient_is_counted_once() -> None:
    timer = StepTimer(16)
    _WaitAtInput.timer = timer
    try:
        rows = _steps(_Stage(wait_at_input=True), timer)
    finally:
        _WaitAtInput.timer = None
    for row in rows:
        # The trailing stretch after the last gradient holds the sync wait; both timings saw
        # it, and it is credited once: about one sleep, not two.
        assert row[BWW] >= 0.8 * SLEEP_S * 1e3
        assert row[BWW] < 1.6 * SLEEP_S * 1e3
        assert row[BWW] <= row[BWD]


def test_a_wait_inside_ddps_timed_forward_stretch_is_counted_once() -> None:
    timer = StepTimer(4)
    timer.start_step()
    timer.begin(FORWARD)
    timer.begin(FORWARD_WAIT)  # what the DDP hooks open around the wrapper's pre-forward work
    with timer.sync_wait():
        time.sleep(SLEEP_S)
    timer.end(FORWARD_WAIT)
    timer.end(FORWARD)
    timer.end_step()
    row = timer.read(0)[0][0]
    assert 0.8 * SLEEP_S * 1e3 <= row[FWW] < 1.6 * SLEEP_S * 1e3


def test_only_the_autograd_engines_threads_count_during_a_backward() -> None:
    timer = StepTimer(4)
    wait = timer.sync_wait()
    seen: dict[str, bool] = {}

    def python_thread() -> None:
        seen["python"] = _backward_worker(wait)

    def foreign_thread(done: threading.Event) -> None:
        # A thread threading did not start (as the engine's C++ device threads are).
        seen["foreign"] = _backward_worker(wait)
        done.set()

    def run_both() -> None:
        t = threading.Thread(target=python_thread)
        t.start()
        t.join()
        done = threading.Event()
        _thread.start_new_thread(foreign_thread, (done,))
        assert done.wait(10)

    run_both()
    assert seen == {"python": False, "foreign": False}  # no backward being timed
    timer.start_step()
    timer.begin(BACKWARD)
    run_both()
    assert seen == {"python": False, "foreign": True}
    timer.end(BACKWARD)
    timer.end_step()


def test_untimed_collectives_leave_control_traffic_out(tmp_path: Any) -> None:
    import torch.distributed as dist

    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        rw = RankWatch(config=RankwatchConfig.from_env(env={}, async_mode=False))
        rw.watch()  # no model: only the collective waits
        assert rw.timer is not None
        t = torch.ones(2)
        with rw.step():
            dist.all_reduce(t)  # timed: the wait is a measured column (0 or more)
        with rw.step():
            with rw.untimed_collectives(), rw.untimed_collectives():  # blocks nest
                dist.all_reduce(t)
            dist.barrier()  # timed again after the blocks
        with rw.step(), rw.untimed_collectives():
            dist.all_reduce(t)  # not timed: the wait stays absent
        rows = rw.timer.read(0)[0]
        rw.close(2.0)
    finally:
        dist.destroy_process_group()
    assert not math.isnan(rows[0][FWW]) and not math.isnan(rows[1][FWW])
    assert math.isnan(rows[2][FWW])

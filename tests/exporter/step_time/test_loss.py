"""A loss computed outside the watched module (``timed_loss``): its forward and its backward
are the step's, not residual; outside a step it runs untouched."""

from __future__ import annotations

import time
from typing import Any

import torch

from rankwatch.diagnosis.step_time.table import column
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.step_time.loss import timed_loss
from rankwatch.exporter.step_time.rank_watch import RankWatch

LOSS_FORWARD_S = 0.03
LOSS_BACKWARD_S = 0.04
STEPS = 4


class _SlowHead(torch.autograd.Function):
    """The output projection's stand-in: sleeps in forward and in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        time.sleep(LOSS_FORWARD_S)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(LOSS_BACKWARD_S)
        return grad * 2


def _loss(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(_SlowHead.apply(hidden), target)


def _rows(loss_fn: Any) -> Any:
    rw = RankWatch(config=RankwatchConfig.from_env(env={}, end_summary=False))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = timed_loss(rw.timer, loss_fn) if loss_fn is _loss else loss_fn
    batches = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(STEPS)]
    for x, y in rw.watch(model, opt, batches):
        loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    rw.close(1.0)
    timer = rw.timer
    return timer.ring[: timer.written]


def test_the_loss_forward_and_backward_are_the_steps_not_residual() -> None:
    rows = _rows(_loss)
    fwd, bwd = rows[:, column("cpu", "forward")], rows[:, column("cpu", "backward")]
    step = rows[:, column("cpu", "step")]
    assert len(rows) == STEPS
    assert (fwd >= LOSS_FORWARD_S * 1e3).all(), fwd.tolist()
    assert (bwd >= LOSS_BACKWARD_S * 1e3).all(), bwd.tolist()
    # What the phases leave of the step is small: the loss is not residual.
    residual = step - fwd - bwd - rows[:, column("cpu", "optimizer")]
    assert (residual < 10.0).all(), residual.tolist()


def test_without_it_the_loss_is_outside_the_phases() -> None:
    rows = _rows(lambda h, t: _loss(h, t))
    fwd, bwd = rows[:, column("cpu", "forward")], rows[:, column("cpu", "backward")]
    assert (fwd < LOSS_FORWARD_S * 1e3).all(), fwd.tolist()
    assert (bwd < LOSS_BACKWARD_S * 1e3).all(), bwd.tolist()


def test_outside_a_step_the_loss_runs_untouched() -> None:
    rw = RankWatch(config=RankwatchConfig.from_env(env={}, end_summary=False))
    loss = timed_loss(rw.timer, _loss)
    value = loss(torch.ones(2, requires_grad=True), torch.zeros(2))
    value.backward()
    assert rw.timer.written == 0 and not rw.timer.in_step
    with torch.no_grad():
        assert float(loss(torch.ones(2), torch.zeros(2))) == 4.0
    rw.close(1.0)

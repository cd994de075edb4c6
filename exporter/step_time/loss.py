"""A loss computed outside the watched module, timed as the step's forward and backward.

A trainer may leave the output projection to its loss function: torchtitan's
``ChunkedLossWrapper`` runs the language-model head and the cross-entropy in chunks after the
model returns its hidden states (the model skips its ``lm_head``). That work is compute of the
step, forward and backward, but outside the watched module's hooks: without this it is
residual time, a large share of a small model's step.

:func:`timed_loss` wraps the loss function: while a step is open on the training thread its
call is held as ``forward`` (:meth:`StepTimer.hold`), and the backward pass is held as
``backward`` from the loss's own gradient (a pre hook on its autograd node, before any of the
model's) to the end of the pass (a callback queued from a callback, so after the final
callbacks FSDP and DDP queue during the pass, as the model's own backward tracking ends). The
model's hooks inside leave the held phase alone, and their waits land in ``forward_wait`` /
``backward_wait`` of it as before. Outside a step (an evaluation), on another thread, or
while ``torch.compile`` traces, the loss runs untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from threading import get_ident
from typing import Any

import torch

from rankwatch.exporter.step_time.timer import BACKWARD, FORWARD, StepTimer

__all__ = ["timed_loss"]


def _hold_backward_from(timer: StepTimer, loss: Any) -> None:
    """Hold ``backward`` from ``loss``'s gradient to the end of its backward pass."""
    node = getattr(loss, "grad_fn", None)
    if not isinstance(loss, torch.Tensor) or node is None:
        return
    engine = torch.autograd.Variable._execution_engine

    def release() -> None:
        timer.release(BACKWARD)

    def on_loss_grad(*_: Any) -> None:
        if timer.in_step and timer.hold(BACKWARD):
            engine.queue_callback(lambda: engine.queue_callback(release))

    node.register_prehook(on_loss_grad)


def timed_loss(timer: StepTimer, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``loss_fn`` timed as the step's forward, its backward as the step's backward (module
    docstring); called from the thread that made it."""
    thread = get_ident()

    def loss_in_step(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or get_ident() != thread or not timer.in_step:
            return loss_fn(*args, **kwargs)
        held = timer.hold(FORWARD)
        try:
            loss = loss_fn(*args, **kwargs)
        finally:
            if held:
                timer.release(FORWARD)
        if torch.is_grad_enabled():
            _hold_backward_from(timer, loss)
        return loss

    return loss_in_step

"""rankwatch for the Hugging Face ``Trainer``: one callback.

::

    from rankwatch.exporter.integrations.transformers import RankwatchCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[RankwatchCallback()])
    trainer.train()

When training begins (``torch.distributed`` is initialised by then, on every rank) the
callback starts rankwatch with :func:`rankwatch.exporter.init` (keyword arguments are its
overrides, e.g. ``metrics_port=9500``; or pass ``rankwatch=`` a function returning your own
``RankWatch``) and watches what the Trainer trains with:

* the model it hands to callbacks (the model under DDP; the FSDP wrapper under FSDP, so the
  strategy is detected): forward and backward hooks;
* the optimizer inside Accelerate's ``AcceleratedOptimizer``: step hooks; its step closes the
  training step (Accelerate calls it once per optimizer step, after the accumulated
  micro-batches);
* the training dataloader (Accelerate's ``DataLoaderShard``): the Trainer iterates the object
  it holds, so that object is made to time each ``next()`` as ``input_wait`` (see
  :func:`~rankwatch.exporter.integrations.watch_loader_in_place`). Accelerate moves the batch
  to the device inside that ``next()``: the copy counts as input wait and ``h2d`` is absent.

When training ends the loader gets its class back and rankwatch is closed (the root publishes
the summary window).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from ..rankwatch import RankWatch
from . import RankwatchStarter, unwrap_optimizer, watch_loader_in_place

__all__ = ["RankwatchCallback"]

log = logging.getLogger("rankwatch.integrations.transformers")


def _warn_early_collectives(args: Any, model: Any) -> None:
    """Say so when the Trainer synchronises the ranks before the forward pass.

    DDP rules take the backward pass as the place where ranks wait for each other. The Trainer
    may synchronise earlier in the step: its token-count all-gather
    (``average_tokens_across_devices``) and DDP's buffer broadcast (``ddp_broadcast_buffers``,
    for a model with buffers). A late rank then makes the others wait there, outside every
    timed phase, and windows say ``RESIDUAL_HEAVY`` instead of naming it.
    """
    if getattr(args, "world_size", 1) <= 1:
        return
    early = []
    if getattr(args, "average_tokens_across_devices", False):
        early.append("average_tokens_across_devices=True (a token-count all-gather)")
    has_buffers = model is not None and any(True for _ in model.buffers())
    if has_buffers and getattr(args, "ddp_broadcast_buffers", None) is not False:
        early.append("ddp_broadcast_buffers unset or True (a buffer broadcast in forward)")
    if early:
        log.warning(
            "rankwatch: the Trainer synchronises ranks before the forward pass (%s); a late "
            "rank's wait falls outside the timed phases and is reported as residual time. "
            "Turn them off to have stragglers named (see the integration docs).",
            "; ".join(early),
        )


class RankwatchCallback(TrainerCallback, RankwatchStarter):
    """A ``TrainerCallback`` that times every training step and closes rankwatch at train end.

    Arguments as :class:`~rankwatch.exporter.integrations.RankwatchStarter`; the ``RankWatch``
    is made when each ``train()`` begins.
    """

    def __init__(
        self,
        rankwatch: Callable[[], RankWatch] | None = None,
        *,
        close_timeout_seconds: float = 5.0,
        **overrides: Any,
    ) -> None:
        RankwatchStarter.__init__(
            self, rankwatch, close_timeout_seconds=close_timeout_seconds, **overrides
        )
        self._restore_loader: Callable[[], None] = lambda: None
        self._steps_closed_by_callback = False

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        train_dataloader: Any = None,
        **kwargs: Any,
    ) -> None:
        """Start rankwatch and watch the model, the optimizer and the training dataloader."""
        self.close()  # a previous train() that ended with an exception
        rw = self._start_rankwatch()
        inner = unwrap_optimizer(optimizer)
        if optimizer is not None and inner is None:
            log.warning(
                "rankwatch: no torch optimizer inside %s; the optimizer phase is not timed",
                type(optimizer).__name__,
            )
        rw.watch(model, inner)
        # Without optimizer hooks nothing would close the step the hooks opened: on_step_end
        # (once per optimizer step) does.
        self._steps_closed_by_callback = inner is None
        if train_dataloader is not None:
            self._restore_loader = watch_loader_in_place(rw, train_dataloader)
        if rw.is_root:
            _warn_early_collectives(args, model)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Close the step when no optimizer hook does (``rw.step()`` adopts the open step)."""
        if self._steps_closed_by_callback and self.rankwatch is not None:
            with self.rankwatch.step():
                pass

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Restore the dataloader and close rankwatch (on every rank)."""
        self.close()

    def close(self) -> None:
        """Restore the dataloader and close rankwatch; idempotent."""
        self._restore_loader()
        self._restore_loader = lambda: None
        self._close_rankwatch()

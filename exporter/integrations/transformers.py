"""rankwatch for the Hugging Face ``Trainer``: one callback.

::

    from rankwatch.exporter.integrations.transformers import RankwatchCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[RankwatchCallback()])
    trainer.train()

When training begins (``torch.distributed`` is initialised by then, on every rank) the
callback starts rankwatch with :func:`rankwatch.exporter.init` (keyword arguments are its
overrides, e.g. ``metrics_port=9500``; or pass ``rankwatch=`` a function returning your own
``RankWatch``) and watches what the Trainer trains with:

* the model: the Trainer's DDP wrapper under DDP (so the waits at DDP's synchronisation
  points are timed); the FSDP wrapper under FSDP (so the strategy is detected); else the
  model it hands to callbacks. Forward and backward hooks. Callbacks get no Trainer: it is
  found on the call stack when training begins, or given with :meth:`RankwatchCallback.attach`;
* the optimizer inside Accelerate's ``AcceleratedOptimizer``: step hooks; its step closes the
  training step (Accelerate calls it once per optimizer step, after the accumulated
  micro-batches);
* the training dataloader (Accelerate's ``DataLoaderShard``): the Trainer iterates the object
  it holds, so that object is made to time each ``next()`` as ``input_wait`` (see
  :func:`~rankwatch.exporter.integrations.watch_loader_in_place`). Accelerate moves the batch
  to the device inside that ``next()``: the copy counts as input wait and ``h2d`` is absent;
* the Trainer's all-gathers in the training loop: the token count
  (``average_tokens_across_devices``, before the forward pass) and the training loss (every
  logging step, after the optimizer step): run inside
  :meth:`~rankwatch.exporter.RankWatch.sync_wait`, so the ranks' wait there joins
  ``forward_wait``. Without it a late rank's peers wait for it at the loss gather, outside
  every phase, and a slow optimizer step or slow work after the step names nobody.

When training ends the loader gets its class back, the Trainer its gathers, and rankwatch
is closed (the root publishes the summary window).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from transformers import TrainerCallback

from rankwatch.exporter.integrations import (
    RankwatchStarter,
    in_sync_wait,
    undo_in_reverse,
    unwrap_optimizer,
    watch_loader_in_place,
)
from rankwatch.exporter.step_time.rank_watch import RankWatch

__all__ = ["RankwatchCallback"]

log = logging.getLogger("rankwatch.integrations.transformers")

# Frames between the callback's event method and the Trainer's training loop (the handler's
# event method and its dispatcher), with room for a subclass or a wrapper in between.
_TRAINER_FRAME_DEPTH = 8


def _calling_trainer() -> Any:
    """The ``Trainer`` whose callback handler is running this event, or None.

    Callbacks receive the unwrapped model only; the Trainer calls its handler from its own
    training loop, so the Trainer is the ``self`` of a frame a few levels up the stack.
    """
    from transformers import Trainer

    frame: FrameType | None = sys._getframe(2)
    for _ in range(_TRAINER_FRAME_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back
    return None


def _ddp_of(trainer: Any, model: Any) -> Any:
    """The Trainer's DDP wrapper of ``model`` (``trainer.model_wrapped``), or None."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = getattr(trainer, "model_wrapped", None)
    if isinstance(wrapped, DistributedDataParallel) and wrapped.module is model:
        return wrapped
    return None


def _time_gathers(rw: RankWatch, trainer: Any) -> Callable[[], None]:
    """Time the Trainer's all-gathers of the training loop as sync waits; returns the undo.

    Both line the ranks up, and the ranks that got there early wait for the late one:

    * the token count (``average_tokens_across_devices``), after fetching a step's batches and
      before its forward pass (``Trainer._get_num_items_in_batch``);
    * the training loss, at every logging step, after the optimizer step (``nested_gather``
      of ``transformers.trainer``; ``Trainer._nested_gather`` in 4.x).
    """
    args = trainer.args
    if getattr(args, "world_size", 1) <= 1:
        return lambda: None
    undo: list[Callable[[], None]] = []
    count = "_get_num_items_in_batch"
    if (
        getattr(args, "average_tokens_across_devices", False)
        and callable(getattr(trainer, count, None))
        and count not in vars(trainer)  # already replaced: leave it alone
    ):
        undo.append(in_sync_wait(rw, trainer, count))
    if callable(getattr(trainer, "_nested_gather", None)):
        if "_nested_gather" not in vars(trainer):
            undo.append(in_sync_wait(rw, trainer, "_nested_gather"))
    else:  # the training loop calls its module's function
        module = sys.modules.get("transformers.trainer")
        if module is not None and callable(getattr(module, "nested_gather", None)):
            undo.append(in_sync_wait(rw, module, "nested_gather"))
    return undo_in_reverse(undo)


def _warn_early_collectives(args: Any, model: Any, *, ddp_seen: bool, gather_timed: bool) -> None:
    """Say so when the Trainer synchronises the ranks where rankwatch cannot time the wait.

    The Trainer may synchronise before the forward pass: its token-count all-gather
    (``average_tokens_across_devices``) and DDP's buffer broadcast (``ddp_broadcast_buffers``,
    for a model with buffers). Both are timed as sync waits when the callback finds the
    Trainer; otherwise a late rank makes the others wait outside every timed phase, and
    windows say ``RESIDUAL_HEAVY`` instead of naming it.
    """
    if getattr(args, "world_size", 1) <= 1:
        return
    early = []
    if getattr(args, "average_tokens_across_devices", False) and not gather_timed:
        early.append("average_tokens_across_devices=True (a token-count all-gather)")
    has_buffers = model is not None and any(True for _ in model.buffers())
    if has_buffers and getattr(args, "ddp_broadcast_buffers", None) is not False and not ddp_seen:
        early.append("ddp_broadcast_buffers unset or True (a buffer broadcast in forward)")
    if early:
        log.warning(
            "rankwatch: the Trainer synchronises ranks before the forward pass (%s) and the "
            "callback could not reach the Trainer to time the wait: a late rank's wait is "
            "reported as residual time. Pass the Trainer with callback.attach(trainer), or "
            "turn them off (see the integration docs).",
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
        mesh: Any = None,
        **overrides: Any,
    ) -> None:
        RankwatchStarter.__init__(
            self, rankwatch, close_timeout_seconds=close_timeout_seconds, mesh=mesh, **overrides
        )
        self._restore_loader: Callable[[], None] = lambda: None
        self._restore_gather: Callable[[], None] = lambda: None
        self._steps_closed_by_callback = False
        self._trainer: Any = None

    def attach(self, trainer: Any) -> RankwatchCallback:
        """Tell the callback which ``Trainer`` it serves (it is otherwise found on the call
        stack when training begins); adds the callback to the Trainer if it is not there.

        With the Trainer the callback watches its DDP wrapper (the waits at DDP's own
        synchronisation points) and times its token-count all-gather. Returns ``self``.
        """
        from transformers import Trainer

        if not isinstance(trainer, Trainer):
            raise TypeError(
                f"RankwatchCallback.attach: field trainer: expected a transformers.Trainer, "
                f"got {type(trainer).__name__}"
            )
        self._trainer = trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        return self

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
        trainer = self._trainer if self._trainer is not None else _calling_trainer()
        # The DDP wrapper, when the Trainer made one: its hooks time the waits at DDP's
        # synchronisation points (buffer broadcast, gradient reduction); the callbacks'
        # model is the module inside it.
        ddp = _ddp_of(trainer, model) if trainer is not None else None
        rw.watch(ddp if ddp is not None else model, inner, mesh=self.mesh)
        # Without optimizer hooks nothing would close the step the hooks opened: on_step_end
        # (once per optimizer step) does.
        self._steps_closed_by_callback = inner is None
        if train_dataloader is not None:
            self._restore_loader = watch_loader_in_place(rw, train_dataloader)
        if trainer is not None:
            self._restore_gather = _time_gathers(rw, trainer)
        gather_timed = trainer is not None and "_get_num_items_in_batch" in vars(trainer)
        if rw.is_root:
            _warn_early_collectives(
                args, model, ddp_seen=ddp is not None, gather_timed=gather_timed
            )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Close the step when no optimizer hook does (``rw.step()`` adopts the open step)."""
        if self._steps_closed_by_callback and self.rankwatch is not None:
            with self.rankwatch.step():
                pass

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Restore the dataloader and close rankwatch (on every rank)."""
        self.close()

    def close(self) -> None:
        """Restore the dataloader and the Trainer's token count, close rankwatch; idempotent."""
        self._restore_loader()
        self._restore_loader = lambda: None
        self._restore_gather()
        self._restore_gather = lambda: None
        self._close_rankwatch()

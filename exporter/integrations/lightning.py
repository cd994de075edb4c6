"""rankwatch for PyTorch Lightning (the ``lightning`` package, 2.x): one callback.

::

    from rankwatch.exporter.integrations.lightning import RankwatchCallback

    trainer = L.Trainer(strategy="ddp", callbacks=[RankwatchCallback()])
    trainer.fit(model, datamodule=dm)

When training starts (``torch.distributed`` is initialised by then, on every rank) the
callback starts rankwatch with :func:`rankwatch.exporter.init` (keyword arguments are its
overrides; or pass ``rankwatch=`` a function returning your own ``RankWatch``) and times:

* the step: from the start of one iteration of the training loop to the start of the next
  after an optimizer step, so work after the optimizer (``on_train_batch_end`` callbacks:
  logging, checkpointing) is in the step, as with a watched loader. An iteration starts at
  the loop's SIGTERM flag broadcast (every step under DDP in Lightning 2.5 and later) or, where
  there is none, at the batch fetch. The last step ends where its optimizer step ended;
* the SIGTERM flag broadcast from rank 0, before the fetch, is a synchronisation point: the
  late rank's peers wait there (rank 0 for every receiver, the others for rank 0), outside
  every phase. It is timed as a sync wait (``forward_wait``), as ``RankWatch.sync_wait`` does;
  so are the strategy's collectives (``reduce``, ``broadcast``, ``barrier``, ``all_gather``):
  ``self.log(..., sync_dist=True)`` in ``training_step`` all-reduces inside the forward pass
  every step, where the early ranks' wait would otherwise count as their compute;
* ``input_wait``: the training loop's fetch of each batch. Lightning brackets that fetch with
  its profiler's ``train_dataloader_next`` action, on the training thread, whatever the loader
  (the loop created the loader's iterator before any callback runs, so the loader itself
  cannot be wrapped); the callback listens on the Trainer's profiler for it. ``h2d``
  (Lightning's ``batch_to_device``, after the fetch) is not timed.
* ``forward`` and ``backward``: hooks on the strategy's model (the DDP wrapper under DDP, so
  the strategy is detected), as ``RankWatch.watch`` installs them. A model Lightning does not
  wrap (one device) has ``training_step`` called directly, past every forward hook: then
  ``forward`` runs from ``on_train_batch_start`` to ``on_before_backward`` and ``backward``
  from there to ``on_after_backward``.
* ``optimizer``: from ``on_before_optimizer_step`` (Lightning calls it after the closure that
  runs forward and backward, inside ``optimizer.step(closure)``) to the end of the real
  optimizer's ``step()``; that end closes the step. The optimizer is not handed to ``watch``:
  its step hooks would run around the closure and count forward and backward as optimizer time.

Lightning skips ``optimizer.step`` while accumulating gradients, so an accumulated step is one
row. When training ends (or fails) the profiler is restored and rankwatch is closed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback

from rankwatch.exporter.integrations import (
    RankwatchStarter,
    in_sync_wait,
    undo_in_reverse,
    unwrap_optimizer,
)
from rankwatch.exporter.step_time.hooks import AttributeShadow
from rankwatch.exporter.step_time.rank_watch import RankWatch

__all__ = ["FETCH_ACTION_SUFFIX", "RankwatchCallback"]

log = logging.getLogger("rankwatch.integrations.lightning")

# Lightning's profiler action around the training loop's batch fetch:
# "[_TrainingEpochLoop].train_dataloader_next".
FETCH_ACTION_SUFFIX = ".train_dataloader_next"
# The training epoch loop's method that broadcasts rank 0's SIGTERM flag at the start of every
# iteration (Lightning 2.5 and later, under a distributed strategy).
SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"
# The strategy's collectives: ``self.log(..., sync_dist=True)`` reduces through ``reduce`` (in
# ``training_step``: every step), callbacks decide together through them (checkpointing,
# early stopping).
STRATEGY_COLLECTIVES = ("reduce", "broadcast", "barrier", "all_gather")


class RankwatchCallback(Callback, RankwatchStarter):
    """A Lightning ``Callback`` that times every training step and closes rankwatch at the end.

    Arguments as :class:`~rankwatch.exporter.integrations.RankwatchStarter`; the ``RankWatch``
    is made when each ``fit`` starts.
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
        self._step: Any = None  # the entered ``rw.step()`` context, None between steps
        # CPU clock (ns) at which the open step's last optimizer step ended; -1 while it has
        # not stepped (the next iteration's start closes a step that has).
        self._stepped_ns = -1
        self._fetch: Any = None  # the entered ``rw.phase("input_wait")``
        self._undo: list[Callable[[], None]] = []
        self._phases_from_callbacks = False

    # ---- Lightning hooks -----------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Start rankwatch; watch the model, the optimizers and the loop's batch fetch."""
        self._teardown()  # a previous fit that ended without on_train_end
        rw = self._start_rankwatch()
        model = getattr(trainer.strategy, "model", None)
        # Lightning calls a wrapper's forward (DDP, FSDP...), which the hooks time; a model it
        # does not wrap gets ``training_step`` called directly, past every forward hook: the
        # callback's own hooks time forward and backward then.
        self._phases_from_callbacks = not (
            isinstance(model, torch.nn.Module) and model is not pl_module
        )
        if not self._phases_from_callbacks:
            rw.watch(model, mesh=self.mesh)
        elif self.mesh is not None:
            rw.watch(mesh=self.mesh)
        optimizers = [unwrap_optimizer(o) for o in trainer.optimizers]
        optimizers = [o for o in optimizers if o is not None]
        for k, opt in enumerate(optimizers):
            closes = k == len(optimizers) - 1
            handle = opt.register_step_post_hook(
                lambda *_, closes=closes: self._after_optimizer_step(closes)
            )
            self._undo.append(handle.remove)
        if not optimizers:
            log.warning("rankwatch: no torch optimizer in the Trainer; steps are not closed")
        self._listen_to_fetches(trainer.profiler)
        if getattr(trainer, "world_size", 1) > 1:
            self._time_sigterm_broadcast(rw, getattr(trainer.fit_loop, "epoch_loop", None))
            for name in STRATEGY_COLLECTIVES:
                if callable(getattr(trainer.strategy, name, None)):
                    self._undo.append(in_sync_wait(rw, trainer.strategy, name))

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        """Unwrapped model: ``training_step`` (the forward) runs next."""
        self._callback_phase("forward", enter=True)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        """Unwrapped model: the forward is over, the backward starts."""
        self._callback_phase("forward", enter=False)
        self._callback_phase("backward", enter=True)

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        """Unwrapped model: the backward is over."""
        self._callback_phase("backward", enter=False)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """A ``training_step`` that returned no loss has no backward: its forward ends here."""
        self._callback_phase("forward", enter=False)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Forward and backward (the closure) are done: the optimizer's own work starts."""
        if self.rankwatch is not None and self.rankwatch.active:
            self.rankwatch.phase("optimizer").__enter__()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Restore the profiler and close rankwatch (on every rank)."""
        self.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Training failed: close rankwatch all the same (the open step has no row)."""
        self.close()

    def close(self) -> None:
        """Undo the hooks and close rankwatch; idempotent."""
        self._teardown()
        self._close_rankwatch()

    # ---- internals -----------------------------------------------------------------------

    def _teardown(self) -> None:
        self._finish_stepped()
        undo_in_reverse(self._undo)()
        self._step = self._fetch = None
        self._stepped_ns = -1

    def _time_sigterm_broadcast(self, rw: RankWatch, epoch_loop: Any) -> None:
        """Start each iteration at the epoch loop's SIGTERM flag broadcast and time it as a
        sync wait (instance attributes shadow the method; removed at the end)."""
        if not callable(getattr(epoch_loop, SIGTERM_BROADCAST, None)):
            return  # an older Lightning: the fetch starts the iteration
        self._undo.append(in_sync_wait(rw, epoch_loop, SIGTERM_BROADCAST))
        timed = getattr(epoch_loop, SIGTERM_BROADCAST)

        def start_iteration() -> Any:
            if rw.active:
                self._iteration_started(rw)
            return timed()

        self._undo.append(AttributeShadow(epoch_loop, SIGTERM_BROADCAST, start_iteration).remove)

    def _iteration_started(self, rw: RankWatch) -> None:
        """A training loop iteration starts: close the step if it ran its optimizer step (the
        work after it is in it), and open one if none is open."""
        if self._step is not None and self._stepped_ns >= 0:
            step, self._step = self._step, None
            self._stepped_ns = -1
            step.__exit__(None, None, None)
        if self._step is None:  # an optimizer step's first iteration opens it
            self._step = rw.step()
            self._step.__enter__()

    def _finish_stepped(self) -> None:
        """At the end: a step that ran its optimizer step is written, ending where that ended
        (on the GPU clock it is discarded: its end marker cannot be placed in the past)."""
        rw, step = self.rankwatch, self._step
        self._step = None
        if step is None or rw is None or not rw.active or rw.timer is None:
            return
        if self._stepped_ns >= 0 and rw.timer.gpu is None:
            rw.timer.end_step(self._stepped_ns)
        else:
            rw.timer.abort_step()

    def _listen_to_fetches(self, profiler: Any) -> None:
        """Time the loop's fetches from the profiler's ``start``/``stop`` of the fetch action
        (instance attributes shadow the profiler's methods; removed at the end)."""
        start, stop = profiler.start, profiler.stop
        shadowed = {n: vars(profiler)[n] for n in ("start", "stop") if n in vars(profiler)}

        def on_start(action_name: str) -> None:
            if action_name.endswith(FETCH_ACTION_SUFFIX):
                self._fetch_started()
            start(action_name)

        def on_stop(action_name: str) -> None:
            stop(action_name)
            if action_name.endswith(FETCH_ACTION_SUFFIX):
                self._fetch_ended()

        profiler.start, profiler.stop = on_start, on_stop

        def restore() -> None:
            for name, ours in (("start", on_start), ("stop", on_stop)):
                if vars(profiler).get(name) is not ours:
                    continue  # replaced since: leave it
                if name in shadowed:
                    setattr(profiler, name, shadowed[name])
                else:
                    delattr(profiler, name)

        self._undo.append(restore)

    def _callback_phase(self, name: str, *, enter: bool) -> None:
        rw = self.rankwatch
        if not self._phases_from_callbacks or rw is None or not rw.active:
            return
        phase = rw.phase(name)
        if enter:
            phase.__enter__()
        else:
            phase.__exit__(None, None, None)  # ignored when the phase is not open

    def _fetch_started(self) -> None:
        rw = self.rankwatch
        if rw is None or not rw.active:
            return
        self._iteration_started(rw)  # a no-op when the broadcast started the iteration
        self._fetch = rw.phase("input_wait")
        self._fetch.__enter__()

    def _fetch_ended(self) -> None:
        if self._fetch is not None:
            self._fetch.__exit__(None, None, None)
            self._fetch = None

    def _after_optimizer_step(self, closes_step: bool) -> None:
        rw = self.rankwatch
        if rw is None or not rw.active:
            return
        rw.phase("optimizer").__exit__(None, None, None)
        if not closes_step:
            return
        if self._step is not None:  # the next iteration's start closes it
            self._stepped_ns = time.perf_counter_ns()  # the timer's CPU clock
        else:  # no fetch seen (e.g. a training_step that pulls its own batches): the hooks'
            with rw.step():  # step is adopted and closed here
                pass

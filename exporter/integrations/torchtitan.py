"""rankwatch for torchtitan: a mixin for its ``Trainer``.

::

    from torchtitan.trainer import Trainer
    from rankwatch.exporter.integrations.torchtitan import RankwatchTrainerMixin

    class WatchedTrainer(RankwatchTrainerMixin, Trainer):
        pass

    trainer = WatchedTrainer(config)     # in place of config.build(), on every rank
    trainer.train()
    trainer.close()                      # closes rankwatch first, then the Trainer's parts

When the Trainer is built (``torch.distributed`` initialised, meshes built, the model
parallelised, the optimizers made) the mixin starts rankwatch (:func:`rankwatch.exporter.init`
with the class's ``rankwatch_overrides``; or set ``rankwatch_factory`` to a function returning
your own ``RankWatch``) and watches what the Trainer trains with:

* the first model part (the whole model without pipeline parallelism, this rank's first stage
  with it): forward and backward hooks, FSDP2's waits; a pipeline schedule's actions time
  every stage's forward and backward whichever part is watched;
* the optimizers container (a ``torch.optim.Optimizer`` whose ``step`` steps every optimizer):
  step hooks;
* the batches: ``batch_generator`` fetches through the watched loader, so each ``next()``
  ``train_step`` waits on is ``input_wait`` and the first fetch after an optimizer step opens
  the next training step (gradient accumulation and pipeline microbatches stay in one step);
* the mesh: torchtitan unflattens every mesh it uses from a one-dimensional ``world`` mesh,
  so a submesh's root says nothing of the layout; :func:`trainer_mesh` gives ``watch`` the
  sizes of the data-loading mesh (``pp``, ``batch``, ``cp``, ``tp``) instead, which is
  row-major over the world's ranks as torchtitan builds it.

Every collective the training thread waits in (FSDP2's, tensor parallel's, the pipeline's,
the Trainer's token-count and loss all-reduces, the gradient-norm all-reduce) is timed as a
wait by ``watch``. The Trainer's ``loss_fn`` (its ``ChunkedLossWrapper`` computes the output
projection after the model) is timed as the step's forward, and its backward as the step's
backward (:mod:`rankwatch.exporter.step_time.loss`). A checkpoint save runs after
``train_step``: it ends the training step before it starts (:meth:`RankWatch.end_step`) and
its collectives are not timed, so a save, which every rank waits through together, is never
part of a step.

``train_step`` calls :meth:`RankWatch.collect` after each step (sync mode ships rows every
``sync_step`` steps; in async mode it does nothing). ``close`` closes rankwatch (the root
publishes the summary window) before the Trainer's own ``close``. Read against torchtitan
0.3.0: ``torchtitan.trainer.Trainer`` (``model_parts``, ``optimizers``, ``parallel_dims``,
``batch_generator``, ``train_step``, ``checkpointer.save``, ``close``) and
``torchtitan.distributed.parallel_dims.ParallelDims`` (``pp``, ``dp_replicate``,
``dp_shard``, ``cp``, ``tp``, ``world_size``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

from rankwatch.exporter.integrations import undo_in_reverse
from rankwatch.exporter.step_time.loss import timed_loss
from rankwatch.exporter.step_time.rank_watch import RankWatch

__all__ = ["RankwatchTrainerMixin", "trainer_mesh"]

log = logging.getLogger("rankwatch.integrations.torchtitan")


def trainer_mesh(parallel_dims: Any) -> dict[str, int] | None:
    """The job's mesh for ``watch(mesh=)`` from torchtitan's ``ParallelDims``: the sizes of its
    data-loading mesh (``pp``, ``batch`` = ``dp_replicate`` x ``dp_shard``, ``cp``, ``tp``),
    the dimensions of size one left out; None when nothing is parallel or the sizes do not
    multiply to the world size (a layout this reading does not know)."""
    try:
        pp, cp, tp = int(parallel_dims.pp), int(parallel_dims.cp), int(parallel_dims.tp)
        batch = int(parallel_dims.dp_replicate) * int(parallel_dims.dp_shard)
        world = int(parallel_dims.world_size)
    except (AttributeError, TypeError, ValueError):
        log.warning("rankwatch: cannot read torchtitan's parallel dimensions; no mesh")
        return None
    sizes = {"pp": pp, "dp": batch, "cp": cp, "tp": tp}
    if pp * batch * cp * tp != world:
        log.warning(
            "rankwatch: torchtitan's parallel dimensions %s do not make the world size %d; "
            "ranks are compared without a mesh",
            sizes,
            world,
        )
        return None
    kept = {name: size for name, size in sizes.items() if size > 1}
    return kept if len(kept) > 1 else None


class RankwatchTrainerMixin:
    """Put before torchtitan's ``Trainer`` in a subclass's bases (module docstring).

    ``rankwatch_factory``: a function returning the ``RankWatch`` to use (called once the
    Trainer is built, on every rank); default :func:`rankwatch.exporter.init` with
    ``rankwatch_overrides``. The attribute ``rankwatch`` is the run's ``RankWatch`` (still
    there, closed, after :meth:`close`).
    """

    rankwatch_factory: ClassVar[Callable[[], RankWatch] | None] = None
    rankwatch_overrides: ClassVar[dict[str, Any]] = {}
    rankwatch_close_timeout_seconds: ClassVar[float] = 30.0
    rankwatch: RankWatch | None = None
    _rankwatch_undo: Callable[[], None]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        factory = type(self).rankwatch_factory
        if factory is not None:
            rw = factory()
        else:
            from rankwatch.exporter import init

            rw = init(**type(self).rankwatch_overrides)
        self.rankwatch = rw
        trainer: Any = self
        rw.watch(
            trainer.model_parts[0], trainer.optimizers, mesh=trainer_mesh(trainer.parallel_dims)
        )
        self._rankwatch_undo = undo_in_reverse(
            [_save_between_steps(rw, trainer.checkpointer), _loss_in_step(rw, trainer)]
        )

    def batch_generator(self, data_iterable: Iterable[Any]) -> Iterator[Any]:
        """The Trainer's batches, each fetch timed (the Trainer's own generator around the
        watched loader)."""
        rw = self.rankwatch
        watched = rw.watch(None, None, data_iterable) if rw is not None and rw.active else None
        parent: Any = super()
        batches: Iterator[Any] = parent.batch_generator(
            data_iterable if watched is None else watched
        )
        return batches

    def train_step(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's step, then :meth:`RankWatch.collect`."""
        parent: Any = super()
        out = parent.train_step(*args, **kwargs)
        if self.rankwatch is not None:
            self.rankwatch.collect()
        return out

    def close(self) -> None:
        """Close rankwatch (the summary window is published), then the Trainer."""
        rw = self.rankwatch
        if rw is not None:
            self._rankwatch_undo()
            rw.close(type(self).rankwatch_close_timeout_seconds)
        parent: Any = super()
        parent.close()


def _save_between_steps(rw: RankWatch, checkpointer: Any) -> Callable[[], None]:
    """Shadow ``checkpointer.save`` (torchtitan calls it after every ``train_step``; it saves at
    its interval) so that it ends the open training step first and runs with its collectives
    untimed; returns the undo."""
    save = getattr(checkpointer, "save", None)
    if not rw.active or not callable(save) or "save" in vars(checkpointer):
        return lambda: None

    def save_between_steps(*args: Any, **kwargs: Any) -> Any:
        rw.end_step()
        with rw.untimed_collectives():
            return save(*args, **kwargs)

    checkpointer.save = save_between_steps

    def undo() -> None:
        if vars(checkpointer).get("save") is save_between_steps:
            del checkpointer.save

    return undo


def _loss_in_step(rw: RankWatch, trainer: Any) -> Callable[[], None]:
    """Time the Trainer's loss function as the step's forward and backward (its
    ``ChunkedLossWrapper`` runs the output projection after the model: without this, compute
    read as residual); returns the undo. A pipeline schedule holds its own reference to the
    loss, timed with the schedule's actions."""
    loss_fn = getattr(trainer, "loss_fn", None)
    if rw.timer is None or not callable(loss_fn):
        return lambda: None
    timed = timed_loss(rw.timer, loss_fn)
    trainer.loss_fn = timed

    def undo() -> None:
        if getattr(trainer, "loss_fn", None) is timed:
            trainer.loss_fn = loss_fn

    return undo

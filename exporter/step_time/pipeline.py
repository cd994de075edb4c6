"""A pipeline stage's share of a step, timed as its forward and backward.

``torch.distributed.pipelining`` runs a stage's part of a step as actions of one microbatch
each, and every schedule (``ScheduleGPipe``, ``Schedule1F1B``, the interleaved and
zero-bubble ones, read in torch 2.13's ``schedules.py``) calls the same methods for them:

* ``_PipelineStageBase.forward_one_chunk``: the stage's forward of one microbatch (fetching
  the received activations, the module's forward, keeping what backward needs), and
  ``_PipelineSchedule._maybe_compute_loss``, the last stage's loss on it: **forward**;
* ``backward_one_chunk`` (the input and, in most schedules, the weight gradients; under DDP the
  last microbatch's gradient reduction too) and ``backward_weight_one_chunk`` (the weight
  gradients a zero-bubble schedule defers): **backward**.

Timing the module alone leaves the schedule's per-microbatch work around it (a millisecond or
more a microbatch on the CPU) in the residual, where it reads as untimed host work. The
receive waits between the actions are collective waits (:mod:`.collectives`). Issuing the
sends and receives is timed as a collective wait too: every schedule issues them through
``schedules._batch_p2p`` (a module function it looks up at each call: ``isend``/``irecv`` per
op, or ``batch_isend_irecv`` for a mixed batch), and on Gloo that call blocks: in the 3D
accuracy matrix's two-stage GPipe (4 microbatches, DDP over 2 replicas, alone on two cores)
untimed it left 9-10 % of every rank's step in the residual (a ``RESIDUAL_HEAVY`` warning in
a healthy job), timed about 4 %, and on a busy machine 12-17 % before. Left residual:
splitting the batch into microbatches and the schedule's own bookkeeping.

Each action is held as its phase (:meth:`StepTimer.hold`): the watched module's hooks inside
it leave the phase alone, and their waits (DDP's, a tensor-parallel layer's) land in
``forward_wait``/``backward_wait`` of it as before. Only on the training thread, never while
``torch.compile`` traces; a forward action opens the step when none is open (a training
stage, gradients on), as the module's forward hook does. The shadows are on the classes, once
per process, like the collective waits, and serve every ``RankWatch`` of the process. They are
installed by ``watch()`` when the job has imported ``torch.distributed.pipelining`` by then
(building the stage or the schedule does): call ``watch()`` after building the schedule.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from threading import get_ident
from typing import Any

import torch

from rankwatch.exporter.step_time.collectives import RegistryHandle, ShadowRegistry, timed_wait
from rankwatch.exporter.step_time.hooks import open_training_step
from rankwatch.exporter.step_time.timer import BACKWARD, FORWARD, StepTimer

__all__ = ["install_pipeline_phases", "pipeline_p2p_targets", "pipeline_phase_targets"]

_is_compiling = torch.compiler.is_compiling

# (owner, method, phase, opens a step): the schedule's actions on a stage.
_ACTIONS = (
    ("stage", "forward_one_chunk", FORWARD, True),
    ("schedule", "_maybe_compute_loss", FORWARD, False),
    ("stage", "backward_one_chunk", BACKWARD, False),
    ("stage", "backward_weight_one_chunk", BACKWARD, False),
)


def _owners() -> dict[str, Any]:
    # Only a pipelining the job imported: importing it here would cost every other job the
    # import (and, in torch 2.13, leave references to the default process group behind, as
    # DDP's first forward or torch.compile after init_process_group do).
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    schedules = sys.modules.get("torch.distributed.pipelining.schedules")
    if stage is None or schedules is None:
        return {}
    return {"stage": stage._PipelineStageBase, "schedule": schedules._PipelineSchedule}


def pipeline_phase_targets() -> list[tuple[Any, str]]:
    """``(class, method)`` of every schedule action timed as a phase; empty until the job has
    imported ``torch.distributed.pipelining`` (a method a release lacks is skipped)."""
    owners = _owners()
    return [
        (owners[o], name)
        for o, name, _, _ in _ACTIONS
        if o in owners and callable(getattr(owners[o], name, None))
    ]


def pipeline_p2p_targets() -> list[tuple[Any, str]]:
    """``(module, function)`` where every schedule issues its sends and receives, timed as a
    collective wait; empty until the job has imported ``torch.distributed.pipelining``."""
    schedules = sys.modules.get("torch.distributed.pipelining.schedules")
    if schedules is None or not callable(getattr(schedules, "_batch_p2p", None)):
        return []
    return [(schedules, "_batch_p2p")]


def _held_phase(registry: ShadowRegistry, original: Callable[..., Any]) -> Callable[..., Any]:
    name = original.__name__
    _, _, index, opens_step = next(a for a in _ACTIONS if a[1] == name)

    def timed(owner: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            return original(owner, *args, **kwargs)
        me = get_ident()
        held: list[StepTimer] = []
        for wait, thread in registry.waits:
            timer = wait.timer
            if thread != me:
                continue
            if not timer.in_step and not (
                opens_step and open_training_step(timer, _stage_training(owner))
            ):
                continue
            if timer.hold(index):
                held.append(timer)
        try:
            return original(owner, *args, **kwargs)
        finally:
            for timer in reversed(held):
                timer.release(index)

    return timed


def _stage_training(stage: Any) -> bool:
    """The stage's module is in training mode."""
    return bool(getattr(getattr(stage, "submod", None), "training", False))


_REGISTRY = ShadowRegistry(pipeline_phase_targets, _held_phase)
_P2P_REGISTRY = ShadowRegistry(pipeline_p2p_targets, timed_wait)


def install_pipeline_phases(timer: StepTimer) -> list[RegistryHandle]:
    """Time every pipeline schedule action of the calling thread (the training thread) as a
    phase of ``timer``, and its sends and receives as collective waits (module doc). Returns
    the handles (``remove()`` undoes it)."""
    api = "install_pipeline_phases"
    return [*_REGISTRY.install(timer, api), *_P2P_REGISTRY.install(timer, api)]

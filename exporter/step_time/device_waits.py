"""FSDP2's waits on the compute stream, timed on the GPU clock.

With collectives that do not block the host (NCCL), FSDP2 (``fully_shard``) makes the compute
stream wait for its collectives at three methods of each unit's parameter group
(``torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup``):

* ``wait_for_unshard`` (forward, and backward's pre-backward): ``foreach_all_gather_copy_out``
  makes the current stream ``wait_event`` the all-gather's event, then copies out on it;
* ``post_backward``: ``_wait_for_post_backward`` waits for the previous unit's
  reduce-scatter/all-reduce events, and the reduce-scatter buffer recycling waits for the
  oldest in-flight reduce-scatter's event;
* ``finalize_backward`` (the root's end-of-backward callback): waits for the last post-reduce
  events.

``unshard`` itself enqueues the all-gather on FSDP's own streams and leaves the compute stream
alone, so on the GPU clock the all-gather's wait is in ``wait_for_unshard``, not in
``unshard``. Each call here runs inside the timer's device wait (:meth:`StepTimer.device_wait`):
a pair of CUDA events on the compute stream around it, credited to ``forward_wait`` or
``backward_wait``. The host does not block in them, so the CPU clock is left alone. The copy-out
and the gradient accumulation FSDP does there are the same on every rank, so the waits stay
comparable across ranks.

``post_backward`` runs on the autograd engine's device thread; calls are timed on the thread
that installed the shadows and on any thread while a backward pass is being timed (the training
thread is blocked in it then).
"""

from __future__ import annotations

from threading import get_ident
from typing import Any

import torch

from rankwatch.exporter.step_time.hooks import AttributeShadow, fsdp_param_groups
from rankwatch.exporter.step_time.timer import BACKWARD, StepTimer

__all__ = ["FSDP_DEVICE_WAITS", "fsdp_device_waits"]

# The methods of an FSDP2 parameter group in which the compute stream waits for a collective.
FSDP_DEVICE_WAITS = ("wait_for_unshard", "post_backward", "finalize_backward")


def fsdp_device_waits(timer: StepTimer, model: torch.nn.Module) -> list[AttributeShadow]:
    """Shadow every FSDP2 unit's ``FSDP_DEVICE_WAITS`` so each call runs inside the timer's
    device wait; ``remove()`` on the results gives the methods back. Nothing on a model
    without FSDP2 units."""
    groups = fsdp_param_groups(model, FSDP_DEVICE_WAITS)
    return [_device_wait(timer, group, name) for group in groups for name in FSDP_DEVICE_WAITS]


def _device_wait(timer: StepTimer, owner: Any, name: str) -> AttributeShadow:
    original = getattr(owner, name)
    wait = timer.device_wait()
    thread = get_ident()
    is_compiling = torch.compiler.is_compiling

    def timed(*args: Any, **kwargs: Any) -> Any:
        if timer.gpu is None or is_compiling():
            return original(*args, **kwargs)
        if get_ident() != thread and not timer.phase_open(BACKWARD):
            return original(*args, **kwargs)
        with wait:
            return original(*args, **kwargs)

    return AttributeShadow(owner, name, timed)

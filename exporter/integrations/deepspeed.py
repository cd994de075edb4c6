"""rankwatch for DeepSpeed engines: the engine's own collectives timed as sync waits.

::

    from rankwatch.exporter.integrations.deepspeed import time_engine_collectives

    undo = time_engine_collectives(rw, engine)   # after deepspeed.initialize, before training

DeepSpeed synchronises the ranks outside the autograd pass, where the model hooks do not look:

* ``engine.backward`` all-reduces the gradients after ``loss.backward()`` (ZeRO stages 0 to 2,
  at the accumulation boundary): the ranks that got there early wait for the late one;
* ZeRO stages 1 and 2 all-gather the updated parameters inside ``engine.step()``, after the
  torch optimizer's step: there the early ranks wait for a rank slow in its optimizer step.

Both are run inside ``rw.sync_wait()`` (``engine.allreduce_gradients``, and the
``all_gather_dp_groups`` the ZeRO 1/2 optimizer calls), so the late rank is named from the
waits: a rank slow in its backward, whose peers wait for it inside their own ``backward``
phase, and a rank slow in its optimizer step, whose peers wait after theirs. The returned
function gives both back. ZeRO stage 3 gathers parameters in forward hooks of its own and is
not covered; with stage 0 only the gradient wait is timed (no forward wait: the seed's
definition applies).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rankwatch.exporter.integrations import in_sync_wait, undo_in_reverse

if TYPE_CHECKING:
    from rankwatch.exporter.step_time.rank_watch import RankWatch

__all__ = ["ZERO_ALL_GATHER", "time_engine_collectives"]

# The ZeRO 1/2 optimizer's module and the function it gathers the updated parameters with.
ZERO_ALL_GATHER = ("deepspeed.runtime.zero.stage_1_and_2", "all_gather_dp_groups")


def time_engine_collectives(rw: RankWatch, engine: Any) -> Callable[[], None]:
    """Time ``engine``'s gradient all-reduce and ZeRO 1/2's parameter all-gather as sync waits;
    returns the undo. Call it on the training thread, on every rank."""
    if not callable(getattr(engine, "allreduce_gradients", None)):
        raise TypeError(
            f"time_engine_collectives: field engine: expected a DeepSpeed engine (with "
            f"allreduce_gradients), got {type(engine).__name__}"
        )
    undo = [in_sync_wait(rw, engine, "allreduce_gradients")]
    module_name, function = ZERO_ALL_GATHER
    module = sys.modules.get(module_name)
    if module is not None and callable(getattr(module, function, None)):
        undo.append(in_sync_wait(rw, module, function))
    return undo_in_reverse(undo)

"""One cell of the trainer matrix on a real torchtitan job: 4 Gloo ranks, torchtitan's own
Trainer (FSDP2 x tensor parallel on its debug model) with rankwatch's mixin, a DCP checkpoint
during the run, and rank 1 slow inside the tensor-parallel region, so its TP peer waits for it
in every DTensor collective. The whole matrix (``make accuracy-trainers``) writes its section
of ``docs/accuracy.md``.
"""

from __future__ import annotations

import pytest

from bench.accuracy_trainers import CellSpec, render, run_matrix
from tests.framework_world import require_framework

require_framework("torchtitan")
pytestmark = pytest.mark.multiproc

STEPS = 24  # 2 live windows after the warm-up; a checkpoint at step 20 and at the end


def test_a_slow_tensor_parallel_rank_is_named_and_its_checkpoints_are_quiet() -> None:
    (cell,) = run_matrix([CellSpec("torchtitan_fsdp_tp", "tp", 1, STEPS)])
    table = render([cell])
    assert cell.error is None, cell.error
    assert cell.right, table
    # Every live window names rank 1, none its tensor-parallel peer (rank 0) or another rank.
    assert cell.live_windows >= 2 and cell.named_right == cell.live_windows, table
    assert cell.named_other == 0, table
    # The DCP checkpoints were written, and the only incident is the slow rank's.
    assert cell.facts["checkpoints"] == ["step-20", f"step-{STEPS}"], cell.facts
    assert all(ranks == (1,) for _, _, ranks in cell.opened), table
    # torchtitan's parameters carry its 1-D world mesh; the layout came from its parallel
    # dimensions through the mixin.
    assert cell.facts["parameter_mesh"] == [["world"], [4]], cell.facts
    assert cell.facts["watched_mesh"] == [["dp", "tp"], [2, 2]], cell.facts

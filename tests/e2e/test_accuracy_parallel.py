"""A representative subset of the 3D-parallel accuracy matrix, on one real 4-rank Gloo world.

The whole matrix (``make accuracy-parallel``) writes its section of ``docs/accuracy.md``; these
cells cover the failures it was built for: a slow rank whose tensor-parallel peer waits for it
in the DTensor collectives (the peer was named before), a slow backward under
``torch.compile(ddp_model)`` compiled after ``watch()`` (``INCOMPLETE_DATA`` before), a slow
stage-1 rank of a pipeline whose stages differ by design (every window was ``RESIDUAL_HEAVY``
before, and the schedule's work around the stage module opened ``residual_heavy`` incidents
until it was timed as the stage's), and a no-fault control of
FSDP2 with activation checkpointing whose ranks start seconds apart (the start-up skew opened a
straggler incident before; a short control here, the matrix's runs 200 windows). Every cell
runs its live windows through the real publisher hub, so a wrong incident fails it as a wrong
verdict does.
"""

from __future__ import annotations

import pytest

from bench.accuracy_parallel import NONE, SYNC_STEP, Cell, CellSpec, render, run_matrix
from rankwatch.diagnosis.vocabulary import STRAGGLER_CLASS

pytestmark = pytest.mark.multiproc

FAULT_STEPS = 8 * SYNC_STEP  # 7 live windows after the warm-up
CELLS = [
    CellSpec("tp_dp_ddp", "forward", 1, FAULT_STEPS),
    CellSpec("compile_ddp_late", "backward", 1, FAULT_STEPS),
    CellSpec("pp_dp", "forward", 2, FAULT_STEPS),
    CellSpec("fsdp_ac_nobarrier", NONE, None, 12 * SYNC_STEP),
]


@pytest.fixture(scope="module")
def cells() -> list[Cell]:
    return run_matrix(CELLS, one_world=True)


def _names_slow_rank_throughout(c: Cell, table: str) -> None:
    assert c.error is None, c.error
    assert c.live_windows >= 5, table
    assert c.summary_kind == c.expected and c.summary_culprit == c.spec.rank, table
    assert not c.summary_group, table
    # Most live windows name the slow rank, none another rank or a replica.
    assert c.named_right > c.live_windows // 2, table
    assert c.named_other == 0 and c.named_group == 0, table


def test_every_cell_is_right_and_names_the_slow_rank_throughout(cells: list[Cell]) -> None:
    table = render(cells)
    assert [c.spec for c in cells] == CELLS
    for c in cells:
        # Right: the run's verdict, and no incident on another rank (none in the control),
        # a pipeline's residual_heavy included.
        assert c.right, table
        if c.spec.rank is not None:
            _names_slow_rank_throughout(c, table)
        else:
            assert c.live_windows >= 10 and c.named_other == 0, table
    (pipeline,) = [c for c in cells if c.spec.row == "pp_dp"]
    assert all(cls == STRAGGLER_CLASS for cls, _, _ in pipeline.opened), table

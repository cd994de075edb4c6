"""A representative subset of the 3D-parallel accuracy matrix, on one real 4-rank Gloo world.

The whole matrix (``make accuracy-parallel``) writes its section of ``docs/accuracy.md``; these
cells cover the shapes it was built for: a pipeline (``torch.distributed.pipelining``, stages of
unequal cost) with a slow stage-1 rank, tensor parallel x FSDP2 with a slow rank whose
tensor-parallel peer waits for it in the DTensor collectives, and a no-fault control of FSDP2
with activation checkpointing whose ranks start seconds apart (a short one: the matrix's runs
200 windows). Each cell runs the live windows through the real publisher hub, so a wrong
incident fails it as a wrong verdict does.
"""

from __future__ import annotations

import pytest

from bench.accuracy_parallel import NONE, SYNC_STEP, CellSpec, render, run_matrix

pytestmark = pytest.mark.multiproc

CELLS = [
    CellSpec("pp_dp", "forward", 2, 40),
    CellSpec("tp_dp_fsdp", "data", 1, 40),
    CellSpec("fsdp_ac_nobarrier", NONE, None, 12 * SYNC_STEP),
]


def test_representative_cells_are_right() -> None:
    cells = run_matrix(CELLS, one_world=True)
    table = render(cells)
    assert [c.spec for c in cells] == CELLS
    for c in cells:
        assert c.error is None, c.error
        assert c.live_windows >= 5, table
        assert c.right, table
        if c.spec.rank is not None:
            # Most live windows name the slow rank, and none names another one.
            assert c.named_right > c.live_windows // 2, table
            assert c.named_other == 0, table

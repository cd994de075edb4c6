"""A representative subset of the hang accuracy matrix, on real 4-rank Gloo jobs.

The whole matrix (``make accuracy-hang``) writes its section of ``docs/accuracy.md``. Here: a
DDP job whose rank 2 sleeps forever in its forward, after a first step that compiles, an
evaluation loop and a checkpoint save each longer than the (lowered) hang budget, which must
open no hang before the fault and then a ``stuck_alive`` hang naming rank 2 in its forward; and a
DDP job whose rank 2 all-reduces a metric of another shape once, which must open a
``collective_mismatch`` naming rank 2. Each cell's world is killed (its process groups, the
stopped or stuck ranks included) whatever happens, and no process of it may be left.
"""

from __future__ import annotations

import pytest

from bench.accuracy_hang import CellSpec, render, run_cell

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(420)]

BUDGET_S = 5.0  # the pauses below last longer than this; the default is 15 s
PAUSE_S = 8.0  # the checkpoint save; the evaluation: 40 batches of 0.2 s


def test_a_rank_asleep_in_forward_is_named_after_pauses_that_are_not_hangs() -> None:
    spec = CellSpec(
        "ddp",
        "forward_sleep",
        prelude=True,
        budget_s=BUDGET_S,
        eval_batches=40,
        checkpoint_s=PAUSE_S,
    )
    cell = run_cell(spec)
    table = render([cell])
    assert cell.error is None, table + (cell.error or "")
    assert cell.left_behind == 0, table
    assert cell.hang_before_fault == 0, table  # compile, evaluation and checkpoint: no hang
    assert (cell.cls, cell.ranks, cell.phase) == ("STUCK_ALIVE", [2], "forward"), table
    assert cell.collective, table
    assert cell.incident_s is not None and cell.incident_s <= 3 * BUDGET_S, table
    assert cell.log_s is not None and cell.log_names_rank, table
    assert cell.metrics_s is not None, table


def test_a_metric_of_another_shape_is_a_collective_mismatch_naming_its_rank() -> None:
    cell = run_cell(CellSpec("ddp", "shape_mismatch"))
    table = render([cell])
    assert cell.error is None, table + (cell.error or "")
    assert cell.left_behind == 0, table
    assert cell.right, table

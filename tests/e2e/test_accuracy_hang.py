"""A representative subset of the hang accuracy matrix, on real 4-rank Gloo jobs.

The whole matrix (``make accuracy-hang``) writes its section of ``docs/accuracy.md``. Here, two
cells. One job goes through the quiet rows' pauses in its first steps (a first step that
compiles, an evaluation loop and a ``torch.distributed.checkpoint`` save, each longer than the
lowered hang budget), then rank 2 sticks in its dataset's ``__getitem__``: the pauses must open
no hang, the stuck rank a ``stuck_alive`` hang naming rank 2 in its input phase, in the incident,
the log line and on ``/metrics``. In the other, under TP x DP, rank 1 all-reduces float64
against the others' float32: Gloo aborts the rank that receives its bytes, rank 0, the root;
the store outlives it (served by the harness, as by ``torchrun``'s agent), rank 1 stands in for
it, and ``collective_mismatch`` names rank 1 alone. A killed rank (``rank_dead``) is
``test_hang_gloo.py``'s.
Each world is ended whole (its process groups, SIGKILL after a grace) whatever happens, and no
process of it may be left.
"""

from __future__ import annotations

import pytest

from bench.accuracy_hang import Cell, CellSpec, render, run_cell

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(420)]

BUDGET_S = 5.0  # the pauses below last longer than this; the default is 15 s
PAUSE_S = 8.0  # the checkpoint save; the evaluation: 40 batches of 0.2 s


@pytest.fixture(scope="module")
def stuck_after_pauses() -> Cell:
    spec = CellSpec(
        "ddp", "data_stuck", prelude=True, budget_s=BUDGET_S, eval_batches=40, checkpoint_s=PAUSE_S
    )
    return run_cell(spec)


def test_a_rank_stuck_in_its_dataset_is_named_in_the_incident_log_and_metrics(
    stuck_after_pauses: Cell,
) -> None:
    cell = stuck_after_pauses
    table = render([cell])
    assert cell.error is None, table + (cell.error or "")
    assert cell.left_behind == 0, table
    assert (cell.cls, cell.ranks, cell.phase) == ("STUCK_ALIVE", [2], "input"), table
    assert cell.waiting_ranks == [0, 1, 3] and cell.collective, table
    assert isinstance(cell.frames, list) and "__getitem__" in " ".join(cell.frames), table
    assert cell.incident_s is not None and cell.incident_s <= 3 * BUDGET_S, table
    assert cell.log_s is not None and cell.log_names_rank, table
    assert cell.metrics_s is not None and 'culprit_rank="2"' in cell.metrics_labels, table


def test_compile_evaluation_and_a_checkpoint_save_open_no_hang(stuck_after_pauses: Cell) -> None:
    cell = stuck_after_pauses
    assert cell.error is None, cell.error
    assert cell.hang_before_fault == 0, render([cell])


def test_a_dtype_mismatch_that_aborts_the_root_is_named_by_a_stand_in() -> None:
    cell = run_cell(CellSpec("tp_dp", "dtype_mismatch"))
    table = render([cell])
    assert cell.error is None, table + (cell.error or "")
    assert cell.left_behind == 0, table
    # Gloo aborted the root (SIGABRT): the verdict below came from the rank standing in.
    assert cell.exit_codes.get("0") == -6, table
    assert (cell.cls, cell.ranks) == ("COLLECTIVE_MISMATCH", [1]), table
    assert 'culprit_rank="1"' in cell.metrics_labels, table
    assert cell.right, table

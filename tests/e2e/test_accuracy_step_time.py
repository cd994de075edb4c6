"""A representative subset of the step-time accuracy matrix, on real 3-rank Gloo jobs.

The whole matrix (``make accuracy``) writes ``docs/accuracy.md``; these cells cover the failures
it was built for, one cell per shape where one is enough: a wait in forward (BatchNorm
buffers), a backward straggler, a scaler stepping an optimizer wrapper with work after the
step, gradient accumulation, a job with no slow rank, FSDP2 with a slow backward (the waits
inside its reduce-scatters), and one framework row: Lightning logging with ``sync_dist`` (an
all-reduce in every forward, the loop's per-iteration broadcast) with a slow optimizer and slow
work after the step (the two cells that were wrong before its callback timed that broadcast).
A framework row is a world of its own and costs its start-up once, so the other framework rows
(the Hugging Face Trainer logging every step, DeepSpeed ZeRO-1; each also has an integration
test of its own) and the matrix's other cells are the full run's.
"""

from __future__ import annotations

import pytest

from bench.accuracy_step_time import SLOW_RANK, render, run_matrix

pytestmark = pytest.mark.multiproc

CELLS = [
    ("batchnorm", "data"),
    ("mlp", "backward"),
    ("scaler_wrapper", "after"),
    ("no_sync", "forward"),
    ("two_forwards", "none"),
    ("fsdp", "backward"),
    ("lightning_sync_log", "optimizer"),
    ("lightning_sync_log", "after"),
]


def test_representative_cells_are_right() -> None:
    cells = run_matrix(CELLS)
    table = render(cells)
    assert [(c.row, c.col) for c in cells] == CELLS
    for c in cells:
        assert c.error is None, c.error
        assert c.right, table
        assert c.visible_definition == "sync_wait", table
        if c.col != "none":
            assert c.culprit == SLOW_RANK and c.score is not None and c.score >= 0.2, table

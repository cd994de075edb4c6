"""A representative subset of the step-time accuracy matrix, on real 3-rank Gloo jobs.

The whole matrix (``make accuracy``) writes ``docs/accuracy.md``; these cells cover each
failure it was built for: a wait in forward (BatchNorm buffers), a backward straggler, a
prefetching loader, a scaler stepping an optimizer wrapper with work after the step, gradient
accumulation, and a job with no slow rank.
"""

from __future__ import annotations

import pytest

from bench.accuracy_step_time import SLOW_RANK, render, run_matrix

pytestmark = pytest.mark.multiproc

CELLS = [
    ("batchnorm", "data"),
    ("mlp", "backward"),
    ("prefetch", "data"),
    ("scaler_wrapper", "after"),
    ("no_sync", "forward"),
    ("two_forwards", "none"),
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

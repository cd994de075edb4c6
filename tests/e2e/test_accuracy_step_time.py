"""A representative subset of the step-time accuracy matrix, on real 3-rank Gloo jobs.

The whole matrix (``make accuracy``) writes ``docs/accuracy.md``; these cells cover each
failure it was built for: a wait in forward (BatchNorm buffers), a backward straggler, a
prefetching loader, a scaler stepping an optimizer wrapper with work after the step, gradient
accumulation, a job with no slow rank, FSDP2 with slow data, forward and backward (the waits
inside its all-gathers and reduce-scatters), and the framework rows: Lightning logging with
``sync_dist`` (an all-reduce in every forward, the loop's per-iteration broadcast) with slow
data, optimizer and work after the step, and the Hugging Face Trainer logging every step (its
loss all-gather) with a slow optimizer and slow work after the step, and DeepSpeed ZeRO-1 with
a slow backward and a slow optimizer (its gradient all-reduce and parameter all-gather).
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
    ("fsdp", "data"),
    ("fsdp", "forward"),
    ("fsdp", "backward"),
    ("lightning_sync_log", "data"),
    ("lightning_sync_log", "optimizer"),
    ("lightning_sync_log", "after"),
    ("hf_trainer_logging", "optimizer"),
    ("hf_trainer_logging", "after"),
    ("deepspeed", "backward"),
    ("deepspeed", "optimizer"),
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

"""The DeepEP collector with its EP root's windows in a child process, on a real Gloo world:
``Diagnose`` starts the child on the root (``DEEPEP_DIAGNOSE_ROOT_PROCESS_MIN_EP``), its reports
reach the root's publishers, and they are the in-process root's on the same counters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from tests.e2e.test_deepep_gloo import BASE_ENV, Collect, _create, ll_window, run_world, write_ll

pytestmark = [pytest.mark.multiproc, pytest.mark.parallel_safe, pytest.mark.timeout(180)]

ROUNDS = 3


def _rounds(min_ep: str, rank: int, world: int) -> dict[str, Any]:
    from rankwatch.exporter.deepep.root_process import DeepEPRootProcess

    pub = Collect()
    env = dict(BASE_ENV, DEEPEP_DIAGNOSE_ROOT_PROCESS_MIN_EP=min_ep)
    diag = _create(
        dist.group.WORLD,
        env,
        enable_ll_diagnose=True,
        enable_normal_diagnose=False,
        publishers=[pub],
    )
    assert diag is not None
    diag.start()
    for k in range(ROUNDS):
        write_ll(diag, ll_window(world, 40 + k), rank)
        diag.diagnose_ll_sync()
    blocking = None
    if min_ep == "1":
        # DeepXTrace's synchronous call after the queued ones: the child answers in order, and
        # the window's report is in hand on the root. (The in-process root runs such a call on
        # the calling thread, possibly before its worker took the queued ones: not mixed here.)
        write_ll(diag, ll_window(world, 40 + ROUNDS), rank)
        _, blocking = diag.diagnose_sync_blocking("low_latency")
    child = isinstance(diag._root, DeepEPRootProcess)
    pid = diag._root.pid if child else None
    diag.stop(10.0)
    return {
        "child": child,
        "pid": pid,
        "blocking": None if blocking is None else blocking.window_index,
        "reports": [
            {
                "index": r.window_index,
                "ll": {p: np.asarray(x.matrix) for p, x in (r.low_latency or {}).items()},
                "verdicts": {p: x.to_dict() for p, x in (r.low_latency or {}).items()},
            }
            for r in pub.reports
        ],
        "rejected": dict(diag.rejected_windows),
    }


def _both(rank: int, world: int) -> dict[str, Any]:
    return {"child": _rounds("1", rank, world), "thread": _rounds("0", rank, world)}


def test_the_root_child_publishes_what_the_in_process_root_does(tmp_path: Path) -> None:
    results = run_world(_both, 2, tmp_path)
    root, other = results[0], results[1]
    child, thread = root["child"], root["thread"]
    assert child["child"] and child["pid"] is not None and not thread["child"]
    assert not other["child"]["child"] and other["child"]["reports"] == []
    # Every round's window, published by the root's publishers, numbered 0..ROUNDS.
    assert [r["index"] for r in child["reports"]] == list(range(ROUNDS + 1))
    assert child["blocking"] == ROUNDS
    for k, r in enumerate(child["reports"]):
        want = ll_window(2, 40 + k)
        for i, phase in enumerate(("dispatch", "combine")):
            assert np.array_equal(r["ll"][phase], want[:, i, :])
    # The same verdicts as the root on a thread of the training process.
    assert len(thread["reports"]) == ROUNDS
    assert [r["verdicts"] for r in child["reports"][:ROUNDS]] == [
        r["verdicts"] for r in thread["reports"]
    ]
    assert child["rejected"] == thread["rejected"] == {}

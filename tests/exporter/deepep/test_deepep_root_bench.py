"""The DeepEP root's training-cost benchmark keeps running between the runs that write its
figures: a real DeepEPRoot, the default publishers, a scrape, on a small group."""

from __future__ import annotations

from bench.bench_deepep_root import run


def test_deepep_root_benchmark_runs_on_a_small_group() -> None:
    rows = run(ep_sizes=(16,), engine_ep=64, rounds=1, pin=False)
    assert [r["name"].split(",")[0] for r in rows] == [
        "training time lost to one DeepEP window",
        "training time lost to one /metrics scrape",
        "training time lost to the normal-mode diagnosis alone",
    ]
    # A window, a scrape and the diagnosis each cost some CPU besides the training thread.
    assert all(r["median"] > 0 for r in rows)

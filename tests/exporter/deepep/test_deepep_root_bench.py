"""The DeepEP root's training-cost benchmark keeps running between the runs that write its
figures: a real DeepEPRoot and a real DeepEPRootProcess (its child), the default publishers, a
scrape, on a small group."""

from __future__ import annotations

from bench.bench_deepep_root import run


def test_deepep_root_benchmark_runs_on_a_small_group() -> None:
    rows = run(ep_sizes=(16,), rounds=1, pin=False)
    assert [r["name"].split(",")[0] for r in rows] == [
        "training time lost to one DeepEP window",
        "training time lost to one DeepEP window",
        "the root child's own CPU per window",
        "training time lost to one /metrics scrape",
    ]
    assert "0.02 MiB of raw int64 rows through the pipe" in rows[0]["name"]
    # A window (either root) and a scrape each cost some CPU besides the training thread.
    assert rows[0]["median"] > 0 and rows[1]["median"] > 0 and rows[3]["median"] > 0
    assert rows[2]["median"] >= 0

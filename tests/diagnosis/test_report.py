"""The report model's own behaviour: looking up a rank's identity."""

from __future__ import annotations

import pickle
from dataclasses import replace

from rankwatch.diagnosis.report import RankInfo, WindowReport


def test_rank_info_finds_each_rank_keeps_the_first_listing_and_names_unknown_ranks() -> None:
    ranks = tuple(RankInfo(r, hostname=f"node-{r // 8}", local_rank=r % 8) for r in range(64))
    ranks += (RankInfo(5, hostname="listed-twice"),)
    report = WindowReport(group="world", window_index=3, created_at_s=0.0, ranks=ranks)
    assert [report.rank_info(r).hostname for r in (0, 7, 8, 63)] == [
        "node-0",
        "node-0",
        "node-1",
        "node-7",
    ]
    assert report.rank_info(5).hostname == "node-0"  # the first listing, as before
    assert report.rank_info(64) == RankInfo(64)  # not in the report: the rank alone
    # The lookup table is not part of the report's data: equal, picklable, replaceable.
    same = WindowReport(group="world", window_index=3, created_at_s=0.0, ranks=ranks)
    assert same == report and pickle.loads(pickle.dumps(report)) == report
    moved = replace(report, ranks=(RankInfo(5, hostname="elsewhere"),))
    assert moved.rank_info(5).hostname == "elsewhere"

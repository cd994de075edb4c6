"""Who hung, on a real Gloo group: one rank stops advancing its DeepEP counters, the other goes on.

Both ranks keep taking part in the gathers (as the asynchronous collector thread of a rank stuck
in a kernel does); only the counters of the stopped rank stand still. The control stops both:
an idle group is no hang.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from rankwatch.diagnosis.deepep.normal import NormalSimulator
from rankwatch.diagnosis.vocabulary import HANG_SUSPECT
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.incidents import IncidentTracker
from rankwatch.exporter.publish.samples import engine_samples
from tests.e2e.test_deepep_gloo import BASE_ENV, Collect, _create, run_world, write_normal

pytestmark = [pytest.mark.multiproc, pytest.mark.parallel_safe, pytest.mark.timeout(180)]

ROUNDS = 5


def _stop_writing(rank: int, world: int, stopped: tuple[int, ...]) -> dict[str, Any]:
    group = dist.group.WORLD
    sim = NormalSimulator(ep_size=world, ranks_per_node=world, seed=3, slow_rank=0)
    pub = Collect()
    diag = _create(group, BASE_ENV, enable_normal_diagnose=True, publishers=[pub])
    assert diag is not None
    diag.start()
    for k in range(ROUNDS):
        window = sim.window("baseline", k)
        # From round 2 on the stopped ranks no longer run the kernels that count.
        if k < 2 or rank not in stopped:
            write_normal(diag, window, rank)
        diag.diagnose_normal_sync()
    diag.stop()
    tracker = IncidentTracker()
    events = []
    config = RankwatchConfig()
    stalled_series = []
    for report in pub.reports:
        events.append(
            [(e.action, e.incident.cls, e.incident.ranks) for e in tracker.update(report)]
        )
        stalled_series.append(
            sorted(
                (s.label_dict()["rank"], s.label_dict()["stage"])
                for s in engine_samples(report, config, "normal")
                if s.name == "rankwatch_deepep_stalled_rank"
            )
        )
    return {
        "is_root": diag.is_root,
        "reasons": [r.normal_invalid_reason for r in pub.reports],
        "hangs": [
            []
            if r.normal is None
            else [
                (i.cls, i.ranks, i.evidence["stage"])
                for i in r.normal.incidents
                if i.cls == HANG_SUSPECT
            ]
            for r in pub.reports
        ],
        "events": events,
        "stalled_series": stalled_series,
    }


def _one_rank_stops(rank: int, world: int) -> dict[str, Any]:
    return _stop_writing(rank, world, stopped=(1,))


def _every_rank_stops(rank: int, world: int) -> dict[str, Any]:
    return _stop_writing(rank, world, stopped=tuple(range(world)))


def test_a_rank_that_stops_is_named_at_once(tmp_path: Path) -> None:
    root = run_world(_one_rank_stops, 2, tmp_path)[0]
    assert root["is_root"]
    assert root["reasons"] == [None] * ROUNDS
    hang = [(HANG_SUSPECT, (1,), "notify_dispatch")]
    assert root["hangs"] == [[], [], hang, hang, hang]
    # The incident event opens on the first window that shows the stall (no 2-of-3 wait).
    assert root["events"][2] == [("open", HANG_SUSPECT, (1,))]
    assert root["events"][:2] == [[], []]
    assert (
        root["stalled_series"]
        == [[], [], [("1", "notify_dispatch")]] + [[("1", "notify_dispatch")]] * 2
    )


def test_an_idle_group_opens_nothing(tmp_path: Path) -> None:
    root = run_world(_every_rank_stops, 2, tmp_path)[0]
    assert root["reasons"] == [None, None, "empty_window", "empty_window", "empty_window"]
    assert root["hangs"] == [[]] * ROUNDS
    assert all(e == [] for e in root["events"])
    assert all(s == [] for s in root["stalled_series"])

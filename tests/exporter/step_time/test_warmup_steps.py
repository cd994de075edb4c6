"""``RANKWATCH_WARMUP_STEPS``: the first steps a process times are never shipped."""

from __future__ import annotations

import time

import pytest

from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.step_time.rank_watch import RankWatch
from tests.exporter.step_time.test_timer import single_config


class Recorder:
    def __init__(self) -> None:
        self.reports: list = []

    def publish(self, report: object) -> None:
        self.reports.append(report)

    def close(self, timeout_seconds: float) -> None:
        pass


@pytest.mark.parametrize(("warmup", "first"), [(0, 0), (3, 3), (5, 5)])
def test_the_first_steps_are_timed_but_not_shipped(warmup: int, first: int) -> None:
    rec = Recorder()
    cfg = single_config(async_mode=False, sync_step=4, warmup_steps=warmup)
    rw = RankWatch(config=cfg, publishers=[rec])
    for _ in range(12):
        with rw.step():
            with rw.phase("forward"):
                time.sleep(0.001)
            with rw.phase("backward"):
                pass
        rw.collect()
    rw.close(5.0)
    assert rw.timer is not None and rw.timer.written == 12  # every step was timed
    summary = rec.reports[-1]
    assert summary.window_kind == "summary"
    assert summary.step_time.step_range == (first, 11)


def test_the_default_warm_up_and_its_bounds() -> None:
    assert RankwatchConfig.from_env(env={}).warmup_steps == 5
    assert RankwatchConfig.from_env(env={"RANKWATCH_WARMUP_STEPS": "0"}).warmup_steps == 0
    for bad in ("-1", "1.5", "100001", "many"):
        with pytest.raises(ValueError, match="RANKWATCH_WARMUP_STEPS"):
            RankwatchConfig.from_env(env={"RANKWATCH_WARMUP_STEPS": bad})

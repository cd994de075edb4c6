"""A one-node EP group runs DeepEP's intranode kernels, which record no normal-mode counters:
its windows say so by name instead of passing for idle (or healthy)."""

from __future__ import annotations

import numpy as np

from rankwatch.diagnosis.deepep.normal import NormalSimulator, snapshot_counters
from rankwatch.diagnosis.deepep.normal.schema import counter_length
from rankwatch.exporter.deepep.snapshot import CounterWindows


def test_one_node_without_counters_is_reported_as_the_intranode_path() -> None:
    cw = CounterWindows(4, 4, normal=True, low_latency=False, started_at_s=0.0)
    zeros = np.zeros((4, counter_length(4)), dtype=np.int64)
    reasons = [cw.feed(float(t), normal=zeros).normal_invalid_reason for t in (1, 2, 3)]
    assert reasons == ["intranode_path"] * 3
    # Counters that move are diagnosed as ever; a pause after that is plain idleness.
    moved = snapshot_counters(NormalSimulator(4, 4, seed=1, slow_rank=1).window("baseline"))
    good = cw.feed(4.0, normal=moved)
    assert good.normal is not None and good.normal_invalid_reason is None
    assert cw.feed(5.0, normal=moved).normal_invalid_reason == "empty_window"


def test_two_nodes_without_counters_are_idle() -> None:
    cw = CounterWindows(4, 2, normal=True, low_latency=False, started_at_s=0.0)
    zeros = np.zeros((4, counter_length(4)), dtype=np.int64)
    assert cw.feed(1.0, normal=zeros).normal_invalid_reason == "empty_window"

"""The EP root's DeepEP windows in a real child process: the same reports as the in-process
root, its log lines and NPZ files written there, and its faults (killed, stopped) costing
windows only, each said in one line and counted as a gap; bad input named."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rankwatch.diagnosis.config import LowLatencyConfig, NormalConfig
from rankwatch.diagnosis.deepep.normal import NormalSimulator
from rankwatch.diagnosis.deepep.normal.schema import counter_length
from rankwatch.diagnosis.deepep.normal.window import snapshot_counters
from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.exporter.config import DeepEPConfig, RankwatchConfig
from rankwatch.exporter.deepep.root import DeepEPRoot, RootSpec
from rankwatch.exporter.deepep.root_child import check_snapshot_header
from rankwatch.exporter.deepep.root_process import (
    LOST_REASON,
    DeepEPRootProcess,
    runs_off_process,
)
from rankwatch.exporter.deepep.snapshot import PendingSnapshot
from tests.e2e.test_deepep_gloo import Collect

EP = 16
RANKS_PER_NODE = 8
PARTS = ("normal", "low_latency")
PHASES = ["baseline", "baseline", "baseline", "single_hca_pressure", "pre_dispatch_delay"]


def _spec(config: DeepEPConfig, instance_id: str = "", **extra: Any) -> RootSpec:
    return RootSpec(
        members=tuple(
            RankInfo(r, f"node-{r // RANKS_PER_NODE}", r % RANKS_PER_NODE) for r in range(EP)
        ),
        ranks_per_node=RANKS_PER_NODE,
        config=config,
        normal_config=NormalConfig(),
        low_latency_config=LowLatencyConfig(),
        normal=True,
        low_latency=True,
        instance_id=instance_id or uuid.uuid4().hex,
        group_name="ep",
        run="test",
        **extra,
    )


class Feed:
    """Cumulative normal and low-latency counters of a simulated EP 16 group."""

    def __init__(self, seed: int = 0) -> None:
        self.sim = NormalSimulator(EP, RANKS_PER_NODE, seed=seed, slow_rank=3)
        self.rng = np.random.default_rng(seed)
        self.normal = np.zeros((EP, counter_length(EP)), dtype=np.int64)
        self.ll = np.zeros((EP, 2 * EP), dtype=np.int64)
        self.taken = 1_000.0

    def snapshot(self, phase: str | None) -> PendingSnapshot:
        """The next snapshot; ``phase`` None adds nothing (the first one: a boundary)."""
        if phase is not None:
            self.normal += snapshot_counters(self.sim.window(phase))
            self.ll += self.rng.integers(1_000, 2_000, size=self.ll.shape)
            self.ll[:, 5] += 50_000  # peer 5 is slow to send in dispatch
        self.taken += 5.0
        rows = np.concatenate([self.normal, self.ll], axis=1)
        return PendingSnapshot(rows=torch.from_numpy(rows.copy()), taken_at_s=self.taken)


def _comparable(report: WindowReport) -> dict[str, Any]:
    out = report.to_dict()
    out.pop("created_at_s")
    out.pop("diagnosis_seconds")
    return out


def wait_for(what: str, check: Callable[[], bool], timeout_seconds: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_seconds} s")
        time.sleep(0.02)


@pytest.fixture
def child_root(tmp_path: Path) -> Iterator[tuple[DeepEPRootProcess, Collect]]:
    pub = Collect()
    root = DeepEPRootProcess(_spec(DeepEPConfig(root_stall_seconds=1.0)), [pub])
    root.start(0.0)
    wait_for("the child ready", lambda: root.ready)
    yield root, pub
    pid = root.pid
    if pid is not None:  # a test that stopped it leaves it able to end
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    root.stop(5.0)


def _feed_and_wait(root: DeepEPRootProcess, pub: Collect, feed: Feed, phase: str | None) -> None:
    before = len(pub.reports)
    root.submit(PARTS, feed.snapshot(phase))
    wait_for("the window's report", lambda: len(pub.reports) > before)


def test_the_child_publishes_the_reports_of_the_in_process_root(tmp_path: Path) -> None:
    """The same snapshots into DeepEPRoot and DeepEPRootProcess: the same reports (verdicts,
    evidence, low-latency results, window indices), published by this process's publishers."""
    here, there = Collect(), Collect()
    config = DeepEPConfig()
    instance = uuid.uuid4().hex
    local = DeepEPRoot.from_spec(_spec(config, instance), [here])
    child = DeepEPRootProcess(_spec(config, instance), [there])
    local.start(0.0)
    child.start(0.0)
    try:
        feeds = (Feed(), Feed())
        for phase in [None, *PHASES]:
            local.submit(PARTS, feeds[0].snapshot(phase))
            child.submit(PARTS, feeds[1].snapshot(phase))
        # The first window, from the all-zero start, is empty (no warm-up).
        wait_for("every window", lambda: len(there.reports) == 1 + len(PHASES))
    finally:
        local.stop(10.0)
        child.stop(10.0)
    assert len(here.reports) == 1 + len(PHASES)
    assert [_comparable(r) for r in there.reports] == [_comparable(r) for r in here.reports]
    assert there.reports[0].normal_invalid_reason == "empty_window"
    assert there.reports[4].normal is not None and there.reports[4].normal.anomalous
    assert child.latest_report is not None and child.latest_report.window_index == 5
    assert child.snapshot_bytes == EP * (counter_length(EP) + 2 * EP) * 8
    assert child.lost_snapshots == 0 and child.restarts == 0


def test_log_lines_and_npz_windows_are_written_by_the_child(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pub = Collect()
    config = DeepEPConfig(log_path=str(tmp_path), export_npz=True)
    root = DeepEPRootProcess(_spec(config, log_to_file=True, log_rank=7), [pub])
    feed = Feed()
    with caplog.at_level(logging.INFO, logger="rankwatch.exporter.deepep"):
        root.start(0.0)
        try:
            for phase in [None, "baseline", "single_hca_pressure"]:
                root.submit(PARTS, feed.snapshot(phase))
            wait_for("three windows", lambda: len(pub.reports) == 3)
        finally:
            root.stop(10.0)
    log_file = tmp_path / "deepep_diagnose_rank7.log"
    assert "InstanceID: " + root.instance_id in log_file.read_text()
    assert len(list(tmp_path.glob("*.npz"))) == 2
    # The application's logging gets the child's lines too, through this process.
    assert any(f"InstanceID: {root.instance_id}" in m for m in caplog.messages)


def test_a_killed_child_costs_its_windows_only_and_comes_back(
    child_root: tuple[DeepEPRootProcess, Collect], caplog: pytest.LogCaptureFixture
) -> None:
    root, pub = child_root
    feed = Feed()
    _feed_and_wait(root, pub, feed, None)  # window 0: empty, from the all-zero start
    _feed_and_wait(root, pub, feed, "baseline")
    first = root.pid
    assert first is not None
    with caplog.at_level(logging.WARNING, logger="rankwatch.exporter.deepep"):
        os.kill(first, signal.SIGKILL)
        wait_for("the gap's report", lambda: len(pub.reports) == 3)
        # While it is away, snapshots are taken and never wait.
        t0 = time.monotonic()
        for _ in range(3):
            root.submit(PARTS, feed.snapshot("baseline"))
        assert time.monotonic() - t0 < 1.0
        wait_for("a new child", lambda: root.restarts == 1 and root.ready)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and f"pid {first}) ended (status -9)" in lines[0], lines
    gap = pub.reports[2]
    assert gap.window_index == 2
    assert gap.normal_invalid_reason == gap.low_latency_invalid_reason == LOST_REASON
    assert root.rejected_windows[f"normal:{LOST_REASON}"] == 1
    # The new child's first snapshot is its boundary; windows resume, numbered on.
    root.submit(PARTS, feed.snapshot(None))
    _feed_and_wait(root, pub, feed, "single_hca_pressure")
    resumed = pub.reports[-1]
    assert resumed.window_index == 3 and resumed.normal is not None
    assert resumed.normal.anomalous


def test_a_stopped_child_is_killed_after_the_stall_budget_and_started_again(
    child_root: tuple[DeepEPRootProcess, Collect], caplog: pytest.LogCaptureFixture
) -> None:
    root, pub = child_root
    feed = Feed()
    _feed_and_wait(root, pub, feed, None)
    _feed_and_wait(root, pub, feed, "baseline")
    stuck = root.pid
    assert stuck is not None
    with caplog.at_level(logging.WARNING, logger="rankwatch.exporter.deepep"):
        os.kill(stuck, signal.SIGSTOP)
        t0 = time.monotonic()
        root.submit(PARTS, feed.snapshot("baseline"))
        assert time.monotonic() - t0 < 0.5
        wait_for("the gap's report", lambda: len(pub.reports) == 3)
        noticed = time.monotonic() - t0
        wait_for("a new child", lambda: root.restarts == 1 and root.ready)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "has not answered a snapshot for" in lines[0], lines
    assert 1.0 <= noticed < 5.0
    assert pub.reports[2].normal_invalid_reason == LOST_REASON
    assert root.lost_snapshots == 1
    root.submit(PARTS, feed.snapshot(None))
    _feed_and_wait(root, pub, feed, "baseline")
    assert pub.reports[-1].window_index == 3 and pub.reports[-1].normal is not None


def test_stop_is_bounded_when_the_child_is_stopped() -> None:
    pub = Collect()
    root = DeepEPRootProcess(_spec(DeepEPConfig()), [pub])  # stall budget 60 s: not noticed
    root.start(0.0)
    pid = root.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    feed = Feed()
    t0 = time.monotonic()
    for phase in [None, *["baseline"] * 20]:  # more than the pipe and the queue hold
        root.submit(PARTS, feed.snapshot(phase))
    assert time.monotonic() - t0 < 1.0  # submitting never waited
    assert root.dropped_snapshots > 0
    t0 = time.monotonic()
    root.stop(1.0)
    took = time.monotonic() - t0
    assert took < 2.5, took
    assert root._sender is not None and not root._sender.is_alive()
    assert root._relay is not None and not root._relay.is_alive()
    with pytest.raises(ProcessLookupError):
        for _ in range(100):  # killed: gone once reaped
            os.kill(pid, 0)
            time.sleep(0.02)


def test_a_child_that_cannot_start_costs_windows_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No interpreter to start the child with: one line each time it is tried, the snapshots
    are dropped, and nothing raises into the caller; stop() is bounded."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    pub = Collect()
    root = DeepEPRootProcess(_spec(DeepEPConfig()), [pub])
    feed = Feed()
    with caplog.at_level(logging.WARNING, logger="rankwatch.exporter.deepep"):
        root.start(0.0)
        root.submit(PARTS, feed.snapshot(None))
        wait_for("the second try", lambda: len(caplog.records) == 2, 10.0)
        t0 = time.monotonic()
        root.stop(2.0)
        assert time.monotonic() - t0 < 3.0
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("DeepEP root child cannot start: ") and "no-python" in lines[0]
    assert "trying again in 1 s" in lines[0]
    assert lines[1].startswith("DeepEP root child cannot start again: "), lines
    assert pub.reports == [] and root.lost_snapshots == 1 and root.pid is None


def test_process_returns_the_childs_report(
    child_root: tuple[DeepEPRootProcess, Collect],
) -> None:
    root, pub = child_root
    feed = Feed()
    empty = root.process(PARTS, feed.snapshot(None))
    assert empty is not None and empty.normal_invalid_reason == "empty_window"
    report = root.process(PARTS, feed.snapshot("single_hca_pressure"))
    assert report is not None and report.window_index == 1 and report.normal is not None
    assert pub.reports == [empty, report]


@pytest.mark.parametrize("kind", ["thread", "child"])
def test_a_blocking_call_after_queued_snapshots_is_formed_after_them(kind: str) -> None:
    """submit(), submit(), then process() at once: the blocking call's window comes after the
    queued ones (no stale_snapshot), in either root."""
    pub = Collect()
    spec = _spec(DeepEPConfig())
    root = DeepEPRoot.from_spec(spec, [pub]) if kind == "thread" else DeepEPRootProcess(spec, [pub])
    root.start(0.0)
    try:
        feed = Feed()
        for _ in range(5):
            root.submit(PARTS, feed.snapshot("baseline"))
            root.submit(PARTS, feed.snapshot("baseline"))
            report = root.process(PARTS, feed.snapshot("single_hca_pressure"))
            assert report is not None and report.normal is not None
    finally:
        root.stop(10.0)
    assert [r.window_index for r in pub.reports] == list(range(15))
    assert dict(root.rejected_windows) == {}


def test_the_default_moves_large_groups_off_the_training_process() -> None:
    config = DeepEPConfig()
    assert not runs_off_process(config, 8)  # intranode: low-latency counters only
    assert runs_off_process(config, 16)  # DeepEP's internode kernels, from 2 nodes of 8
    assert runs_off_process(config, 160)
    assert not runs_off_process(DeepEPConfig(root_process_min_ep=0), 1024)
    assert runs_off_process(DeepEPConfig(root_process_min_ep=1), 2)


@pytest.mark.parametrize("ep_size", [0, -3, True, 2.0, "16"])
def test_runs_off_process_names_a_bad_ep_size(ep_size: Any) -> None:
    with pytest.raises(ValueError, match=f"ep_size: must be a positive int, got {ep_size!r}"):
        runs_off_process(DeepEPConfig(), ep_size)


@pytest.mark.parametrize(
    ("shape", "dtype", "nbytes", "fragment"),
    [
        ([16, 150], "<i8", 19_200, "shape: expected (rows, columns) ints, got [16, 150]"),
        ((16,), "<i8", 128, "shape: expected (rows, columns) ints, got (16,)"),
        ((8, 150), "<i8", 9_600, "shape: expected (16, n >= 1) for EP 16, got (8, 150)"),
        ((16, 0), "<i8", 0, "shape: expected (16, n >= 1) for EP 16, got (16, 0)"),
        ((16, 150), "<f8", 19_200, "dtype: expected '<i8', got '<f8'"),
        ((16, 150), "<i8", 19_201, "nbytes: expected 19200 for shape (16, 150), got 19201"),
        ((16, 150), "<i8", True, "nbytes: expected 19200 for shape (16, 150), got True"),
    ],
)
def test_a_bad_snapshot_header_is_named(shape: Any, dtype: Any, nbytes: Any, fragment: str) -> None:
    with pytest.raises(ValueError) as caught:
        check_snapshot_header(16, shape, dtype, nbytes)
    assert str(caught.value) == fragment


@pytest.mark.parametrize(
    ("name", "value", "fragment"),
    [
        ("DEEPEP_DIAGNOSE_ROOT_PROCESS_MIN_EP", "-1", "-1"),
        ("DEEPEP_DIAGNOSE_ROOT_PROCESS_MIN_EP", "many", "many"),
        ("DEEPEP_DIAGNOSE_ROOT_STALL_SECONDS", "0.5", "0.5"),
        ("DEEPEP_DIAGNOSE_ROOT_STALL_SECONDS", "nan", "nan"),
    ],
)
def test_bad_root_process_settings_are_named(name: str, value: str, fragment: str) -> None:
    with pytest.raises(ValueError) as caught:
        RankwatchConfig.from_env({name: value})
    assert name in str(caught.value) and fragment in str(caught.value)


def test_the_settings_are_read_from_the_environment() -> None:
    config = RankwatchConfig.from_env(
        {"DEEPEP_DIAGNOSE_ROOT_PROCESS_MIN_EP": "0", "DEEPEP_DIAGNOSE_ROOT_STALL_SECONDS": "5"}
    ).deepep
    assert config.root_process_min_ep == 0 and config.root_stall_seconds == 5.0


@pytest.mark.parametrize(
    ("change", "error", "fragment"),
    [
        ({"members": ()}, ValueError, "members: expected a non-empty sequence of RankInfo"),
        ({"members": "ab"}, ValueError, "members: expected a non-empty sequence of RankInfo"),
        ({"members": (0, 1)}, TypeError, "members: expected RankInfo items, got 0"),
        ({"ranks_per_node": 3}, ValueError, "ranks_per_node: must be a positive divisor of "),
        ({"ranks_per_node": True}, ValueError, "the EP size 16, got True"),
        ({"group_name": ""}, ValueError, "group_name: expected a non-empty string, got ''"),
    ],
)
def test_a_bad_root_spec_is_named(change: dict[str, Any], error: type, fragment: str) -> None:
    values = {f.name: getattr(_spec(DeepEPConfig()), f.name) for f in fields(RootSpec)}
    with pytest.raises(error) as caught:
        RootSpec(**{**values, **change})
    assert fragment in str(caught.value)


def test_a_root_needs_a_spec() -> None:
    with pytest.raises(TypeError, match="spec: expected a RootSpec, got 'ep'"):
        DeepEPRootProcess("ep")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="spec: expected a RootSpec, got None"):
        DeepEPRoot.from_spec(None)  # type: ignore[arg-type]

"""rankwatch served as ``deepxtrace.diagnose`` in a two-rank Gloo world (spawned processes).

Each rank runs DeepXTrace's own call sequence against the installed module with CPU tensors in
place of CUDA ones: the low-latency sequence of DeepXTrace's README (``Diagnose(group=...)``,
the receive-wait counters handed to the kernels, ``diagnose_ll_sync`` on every rank) and the
normal-mode sequence of DeepEP pull request 720's Buffer (``BufferCalls`` of
tests/exporter/deepep/test_deepxtrace.py), writing the 15 counters by name, cumulatively, as
DeepEP's kernels do.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rankwatch.diagnosis.deepep.normal import NormalSimulator, NormalWindow, snapshot_counters
from rankwatch.diagnosis.deepep.normal.schema import counter_slots
from tests.e2e.test_deepep_gloo import Collect, assert_same_window, run_world
from tests.exporter.deepep.test_deepxtrace import HEATMAP_ROW, BufferCalls

pytestmark = [pytest.mark.multiproc, pytest.mark.parallel_safe, pytest.mark.timeout(180)]

EP = 2


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    return group


def _environment(**extra: str) -> None:
    for name in list(os.environ):
        if name.startswith("DEEPEP_DIAGNOSE_"):
            del os.environ[name]
    os.environ.update(extra)


def write_normal_by_name(stats: dict[str, torch.Tensor], window: NormalWindow, rank: int) -> None:
    """DeepEP's kernels' part: add this rank's received counts of ``window`` to each counter,
    addressed by its NORMAL_STATS_SCHEMA name."""
    from rankwatch.exporter.deepep import deepxtrace as shim

    row = snapshot_counters(window)[rank]
    slots = counter_slots(window.ep_size)
    for name, key in shim._NORMAL_STATS_FIELDS:
        s = slots[key]
        stats[name] += torch.from_numpy(row[s.offset : s.stop])


# --------------------------------------------------------------------------- scenarios


def _low_latency_sync(rank: int, world: int) -> dict[str, Any]:
    from rankwatch.exporter.deepep import install_as_deepxtrace

    log_dir = os.path.join(os.environ["RANKWATCH_TEST_OUT"], "logs")
    # Two ranks cannot push a column ratio past DeepXTrace's default 3 (the most is 2).
    _environment(
        DEEPEP_DIAGNOSE_LOG_PATH=log_dir,
        DEEPEP_DIAGNOSE_LOG_DETAILS="1",
        DEEPEP_DIAGNOSE_THRESHOLD_COL="1.5",
    )
    install_as_deepxtrace()
    from deepxtrace import diagnose as ds

    diag = ds.Diagnose(group=_world(), enable_async=False)
    dispatch, combine = diag.get_stats_ll_stats_tensor()
    results = []
    for step in range(4):
        # Every receiver waited ten times longer for rank 1's tokens: rank 1 sends slowly.
        dispatch += torch.tensor([1_000, 10_000], dtype=torch.int64) * (step + 1)
        combine += torch.tensor([2_000, 2_100], dtype=torch.int64)
        results.append(diag.diagnose_ll_sync(diagnose_step=2))
    diag.stop()
    return {"results": results, "all": diag.get_all_stats_tensor()}


def _low_latency_async(rank: int, world: int) -> None:
    from rankwatch.exporter.deepep import install_as_deepxtrace

    log_dir = os.path.join(os.environ["RANKWATCH_TEST_OUT"], "logs")
    _environment(
        DEEPEP_DIAGNOSE_LOG_PATH=log_dir,
        DEEPEP_DIAGNOSE_LOG_DETAILS="1",
        DEEPEP_DIAGNOSE_INTERVAL="0.3",
        DEEPEP_DIAGNOSE_WARMING_TIME="0",
    )
    install_as_deepxtrace()
    from deepxtrace import diagnose as ds

    # DeepXTrace's README, asynchronous mode: build, start the thread, hand the kernels the
    # counters; the results go to rank 0's log file.
    diag = ds.Diagnose(group=_world(), enable_async=True)
    diag.start_async_diagnose()
    dispatch, combine = diag.get_stats_ll_stats_tensor()
    for step in range(3):
        dispatch += torch.tensor([100, 200], dtype=torch.int64) * (rank + 1) * (step + 1)
        combine += 7
        time.sleep(0.4)
    diag.stop_async_diagnose()
    assert diag.collector is not None and diag.collector.collector_error is None


def _normal_buffer_sync(rank: int, world: int) -> dict[str, Any]:
    from rankwatch.exporter.deepep import install_as_deepxtrace

    # DeepXTrace's defaults (enabled; synchronous through Buffer's flag); logs under the test's
    # folder instead of DeepXTrace's default, the working folder.
    _environment(DEEPEP_DIAGNOSE_LOG_PATH=os.environ["RANKWATCH_TEST_OUT"])
    install_as_deepxtrace()
    buffer = BufferCalls(_world(), enable_async=False)
    sim = NormalSimulator(ep_size=world, ranks_per_node=world, seed=7, slow_rank=1)
    want = []
    results = []
    for k in range(3):
        win = sim.window("baseline", k)
        want.append(win)
        write_normal_by_name(buffer.normal_stats, win, rank)
        results.append(buffer.diagnose_normal_sync(1))
    collector = buffer.diagnose.collector
    windows = [w.normal for w in collector.recent_windows]
    buffer.destroy()
    collector.stop()
    return {"results": results, "windows": windows, "want": want}


def _normal_buffer_async(rank: int, world: int) -> dict[str, Any]:
    from rankwatch.exporter.deepep import install_as_deepxtrace

    _environment(
        DEEPEP_DIAGNOSE_INTERVAL="0.3",
        DEEPEP_DIAGNOSE_WARMING_TIME="0",
        DEEPEP_DIAGNOSE_LOG_PATH=os.environ["RANKWATCH_TEST_OUT"],
    )
    pub = Collect()
    install_as_deepxtrace(publishers=[pub])
    buffer = BufferCalls(_world(), enable_async=True)
    collector = buffer.diagnose.collector
    sim = NormalSimulator(ep_size=world, ranks_per_node=world, seed=11, slow_rank=1)
    want = [sim.window("baseline", k) for k in range(3)]
    for win in want:
        write_normal_by_name(buffer.normal_stats, win, rank)
        time.sleep(0.4)
    buffer.destroy()  # stop_async_diagnose: one final snapshot on every rank, then exit
    windows = [w.normal for w in collector.recent_windows if w.normal is not None]
    return {
        "is_root": collector.is_root,
        "windows": windows,
        "want": want,
        "reports": len(pub.reports),
        "rejected": dict(collector.rejected_windows),
        "error": collector.collector_error,
    }


# --------------------------------------------------------------------------- tests


def test_low_latency_sync_results_on_rank0_and_deepxtrace_log(tmp_path: Path) -> None:
    out = run_world(_low_latency_sync, EP, tmp_path)
    root, other = out[0]["results"], out[1]["results"]
    assert root[0] is None and root[2] is None and other[0] is None and other[2] is None
    assert other[1] == [] and other[3] == []  # DeepXTrace: results on rank 0 only
    for res in (root[1], root[3]):
        dispatch, combine = res
        assert [c[0] for c in dispatch["abnormal_cols"]] == [1]
        assert dispatch["abnormal_rows"] == [] and dispatch["abnormal_points"] == []
        assert combine == {"abnormal_cols": [], "abnormal_rows": [], "abnormal_points": []}
    # The second window holds calls 3 and 4 only (cumulative counters, diffed).
    np.testing.assert_array_equal(out[0]["all"][:, 0, :], [[7_000, 70_000], [7_000, 70_000]])
    assert out[1]["all"] is None
    text = (tmp_path / "logs" / "diagnose_rank0.log").read_text()
    assert not (tmp_path / "logs" / "diagnose_rank1.log").exists()
    rows = np.array([list(map(int, s.split())) for s in HEATMAP_ROW.findall(text)])
    # Per window: the dispatch matrix then the combine matrix, one row per rank.
    np.testing.assert_array_equal(rows[:2], [[3_000, 30_000], [3_000, 30_000]])
    np.testing.assert_array_equal(rows[2:4], [[4_000, 4_200], [4_000, 4_200]])
    np.testing.assert_array_equal(rows[4:6], [[7_000, 70_000], [7_000, 70_000]])
    summaries = [ln for ln in text.splitlines() if "Wait Recv Cost Per Token" in ln]
    assert len(summaries) == 4
    assert re.search(r"EPSize: 2, diagnose: \{'abnormal_cols': \[\[1, ", summaries[0])


def test_low_latency_async_log_holds_every_count(tmp_path: Path) -> None:
    run_world(_low_latency_async, EP, tmp_path)
    text = (tmp_path / "logs" / "diagnose_rank0.log").read_text()
    rows = np.array([list(map(int, s.split())) for s in HEATMAP_ROW.findall(text)])
    assert len(rows) >= 4 and len(rows) % 4 == 0  # per window: 2 dispatch + 2 combine rows
    blocks = rows.reshape(-1, 2, EP, EP)  # [window, phase, receiver, peer]
    # Window boundaries depend on timing; their sum is what the kernels added (6 x per call).
    np.testing.assert_array_equal(blocks[:, 0].sum(axis=0), [[600, 1_200], [1_200, 2_400]])
    np.testing.assert_array_equal(blocks[:, 1].sum(axis=0), [[21, 21], [21, 21]])
    assert text.count("Dispatch Wait Recv Cost Per Token") == len(blocks)


def test_normal_buffer_sync_windows_are_the_kernels_counts(tmp_path: Path) -> None:
    out = run_world(_normal_buffer_sync, EP, tmp_path)
    root, other = out
    assert other["results"] == [[], [], []] and other["windows"] == []
    assert [r[0]["status"] for r in root["results"]] == ["ok", "ok", "ok"]
    assert [r[0]["window_index"] for r in root["results"]] == [0, 1, 2]
    assert len(root["windows"]) == 3
    for got, want in zip(root["windows"], root["want"], strict=True):
        assert_same_window(got, want)


def test_normal_buffer_async_loses_no_count(tmp_path: Path) -> None:
    out = run_world(_normal_buffer_async, EP, tmp_path)
    root = out[0]
    assert root["is_root"] and root["error"] is None and out[1]["error"] is None
    assert root["reports"] >= 1 and out[1]["reports"] == 0
    # Window boundaries depend on timing; their sum does not (the final snapshot closes it).
    for probe in ("dispatch_final", "combine_logical_recv"):
        for field in range(3):
            got = sum(w.completion[probe][field] for w in root["windows"])
            want = sum(w.completion[probe][field] for w in root["want"])
            np.testing.assert_array_equal(got, want, err_msg=f"{probe}[{field}]")
    for probe in root["want"][0].notify:
        got = sum(w.notify[probe][1] for w in root["windows"] if probe in w.notify)
        want = sum(w.notify[probe][1] for w in root["want"])
        np.testing.assert_array_equal(got, want, err_msg=f"{probe} count")

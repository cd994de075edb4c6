"""DeepEP collector pieces that need no process group: counter block, snapshots, windows."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from rankwatch.diagnosis.deepep.normal import NormalSimulator, snapshot_counters
from rankwatch.diagnosis.deepep.normal.schema import (
    COMBINE_BUNDLE,
    DISPATCH_BUNDLE,
    counter_length,
    counter_slots,
)
from rankwatch.exporter.deepep.counters import allocate_counters, bundle_views
from rankwatch.exporter.deepep.diagnose import infer_ranks_per_node
from rankwatch.exporter.deepep.snapshot import CounterWindows, OrderedSnapshotter

EP = 4


# --------------------------------------------------------------------------- counter block


def test_bundles_are_views_into_one_allocation_in_schema_order() -> None:
    c = allocate_counters(EP, normal=True, low_latency=True)
    assert c.storage.dtype == torch.int64 and c.storage.is_contiguous()
    assert c.storage.numel() == counter_length(EP) + 2 * EP
    assert int(c.storage.abs().sum()) == 0
    slots = counter_slots(EP)
    base = c.storage.data_ptr()
    for bundle, order in (
        (c.dispatch_bundle(), DISPATCH_BUNDLE),
        (c.combine_bundle(), COMBINE_BUNDLE),
    ):
        assert bundle is not None and len(bundle) == len(order)
        for view, key in zip(bundle, order, strict=True):
            slot = slots[key]
            assert view.untyped_storage().data_ptr() == c.storage.untyped_storage().data_ptr()
            assert view.data_ptr() == base + 8 * slot.offset
            assert view.numel() == slot.length and view.dtype == torch.int64
    assert len(c.dispatch_bundle() or ()) == 10 and len(c.combine_bundle() or ()) == 5


def test_write_through_a_view_lands_in_the_block() -> None:
    c = allocate_counters(EP, normal=True, low_latency=True)
    slots = counter_slots(EP)
    dispatch = c.dispatch_bundle()
    combine = c.combine_bundle()
    assert dispatch is not None and combine is not None
    dispatch[5][2] += 7  # dispatch_final.sample from source rank 2
    combine[0].add_(11)  # cached_notify_combine.duration_ns
    assert c.storage[slots[("dispatch_final", "sample")].offset + 2] == 7
    assert c.storage[slots[("cached_notify_combine", "duration_ns")].offset] == 11
    assert c.normal is not None and c.normal[slots[("dispatch_final", "sample")].offset + 2] == 7
    assert int(c.storage.sum()) == 18
    # The low-latency vectors sit right after the normal block.
    assert c.low_latency is not None and c.low_latency.shape == (2, EP)
    c.low_latency[1][3] += 5
    assert c.storage[counter_length(EP) + EP + 3] == 5
    assert c.storage[c.low_latency_region][EP + 3] == 5


def test_disabled_parts_have_no_views() -> None:
    only_ll = allocate_counters(EP, normal=False, low_latency=True)
    assert only_ll.normal is None and only_ll.dispatch_bundle() is None
    assert only_ll.combine_bundle() is None
    assert only_ll.low_latency_region == slice(0, 2 * EP)
    only_normal = allocate_counters(EP, normal=True, low_latency=False)
    assert only_normal.low_latency is None
    assert only_normal.normal_region == slice(0, counter_length(EP))


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"ep_size": 0}, ValueError, "ep_size"),
        ({"ep_size": True}, ValueError, "ep_size"),
        ({"ep_size": "4"}, ValueError, "'4'"),
        ({"normal": "yes"}, TypeError, "normal"),
        ({"low_latency": 1}, TypeError, "low_latency"),
        ({"device": "no-such-device"}, ValueError, "device"),
    ],
)
def test_allocate_counters_rejects_bad_input(
    kwargs: dict[str, object], exc: type[Exception], words: str
) -> None:
    args: dict[str, object] = {"ep_size": EP, "normal": True, "low_latency": False}
    args.update(kwargs)
    with pytest.raises(exc, match=words):
        allocate_counters(**args)  # type: ignore[arg-type]


def test_bundle_views_rejects_bad_input() -> None:
    good = torch.zeros(counter_length(EP), dtype=torch.int64)
    with pytest.raises(TypeError, match="normal_block"):
        bundle_views([0] * counter_length(EP), EP, DISPATCH_BUNDLE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"normal_block.*ep_size=4"):
        bundle_views(good[:-1], EP, DISPATCH_BUNDLE)
    with pytest.raises(TypeError, match=r"torch\.int64"):
        bundle_views(good.float(), EP, DISPATCH_BUNDLE)
    with pytest.raises(ValueError, match="unknown schema row"):
        bundle_views(good, EP, (("dispatch_final", "latency"),))
    with pytest.raises(ValueError, match="ep_size"):
        bundle_views(good, 0, DISPATCH_BUNDLE)


# --------------------------------------------------------------------------- snapshots on CPU


def test_cpu_snapshots_are_stable_copies_without_warning() -> None:
    c = allocate_counters(EP, normal=True, low_latency=True)
    c.storage.add_(3)
    snap = OrderedSnapshotter(c.storage, producer_stream=None)
    assert snap.ordered and snap.copy_stream is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CPU has no streams: nothing is unordered
        dev = snap.device_copy(c.normal_region)
        host = snap.host_copy(c.low_latency_region)
    assert dev is not None
    c.storage.add_(1)  # the writer keeps going; the snapshots must not move
    assert torch.equal(dev, torch.full((counter_length(EP),), 3, dtype=torch.int64))
    assert torch.equal(host, torch.full((2 * EP,), 3, dtype=torch.int64))
    assert dev.data_ptr() != c.storage.data_ptr()


def test_snapshotter_rejects_bad_storage() -> None:
    with pytest.raises(TypeError, match="storage"):
        OrderedSnapshotter(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"torch\.int64"):
        OrderedSnapshotter(torch.zeros(3))
    with pytest.raises(TypeError, match="storage"):
        OrderedSnapshotter(np.zeros(3, dtype=np.int64))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- windows on the root


def _ll(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 1000, size=(EP, 2, EP), dtype=np.int64)


def test_windows_are_differences_of_cumulative_snapshots() -> None:
    sim = NormalSimulator(ep_size=EP, ranks_per_node=2, seed=3, slow_rank=1)
    cw = CounterWindows(EP, 2, normal=True, low_latency=False, started_at_s=0.0)
    for k, phase in enumerate(["baseline", "pre_dispatch_delay", "single_hca_pressure"]):
        snap = sim.advance(phase)
        win = cw.feed(float(k + 1), normal=snap.counters)
        assert win is not None and win.window_index == k and win.normal is not None
        assert sim.last_window is not None
        for p in sim.last_window.completion:
            for got, want in zip(
                win.normal.completion[p], sim.last_window.completion[p], strict=True
            ):
                np.testing.assert_array_equal(got, want)
        for p in sim.last_window.notify:
            np.testing.assert_array_equal(win.normal.notify[p][0], sim.last_window.notify[p][0])
        assert win.end_time_s == k + 1 and win.start_time_s == k


def test_counter_reset_rejects_one_window_and_the_next_is_fine() -> None:
    sim = NormalSimulator(ep_size=EP, ranks_per_node=2, seed=4, slow_rank=1)
    cw = CounterWindows(EP, 2, normal=True, low_latency=True, started_at_s=0.0)
    first = sim.advance().counters
    cw.feed(1.0, normal=first, low_latency=_ll(1))
    reset = first.copy()
    reset[3] = 0  # rank 3's counters started again from zero
    ll_reset = _ll(1) + _ll(2)
    ll_reset[3] = 0
    bad = cw.feed(2.0, normal=reset, low_latency=ll_reset)
    assert bad is not None and bad.normal is None and bad.low_latency is None
    assert bad.normal_invalid_reason == "counter_reset"
    assert bad.low_latency_invalid_reason == "counter_reset"
    assert bad.normal_invalid_detail is not None and "rank 3" in bad.normal_invalid_detail
    nxt = snapshot_counters(sim.window("baseline", 9))
    good = cw.feed(3.0, normal=reset + nxt, low_latency=ll_reset + _ll(3))
    assert good is not None and good.normal is not None and good.normal_invalid_reason is None
    np.testing.assert_array_equal(snapshot_counters(good.normal), nxt)
    assert good.low_latency is not None
    np.testing.assert_array_equal(good.low_latency["dispatch"], _ll(3)[:, 0, :])
    np.testing.assert_array_equal(good.low_latency["combine"], _ll(3)[:, 1, :])
    assert [bad.window_index, good.window_index] == [1, 2]


def test_negative_and_idle_counters_are_rejected_with_their_reason() -> None:
    cw = CounterWindows(EP, 2, normal=True, low_latency=True, started_at_s=0.0)
    zeros = np.zeros((EP, counter_length(EP)), dtype=np.int64)
    idle = cw.feed(1.0, normal=zeros, low_latency=np.zeros((EP, 2, EP), dtype=np.int64))
    assert idle is not None
    assert idle.normal_invalid_reason == "empty_window"
    assert idle.low_latency_invalid_reason == "empty_window"
    wrapped = zeros.copy()
    wrapped[0, 0] = -5
    ll = np.zeros((EP, 2, EP), dtype=np.int64)
    ll[1, 0, 2] = -1
    bad = cw.feed(2.0, normal=wrapped, low_latency=ll)
    assert bad is not None
    assert bad.normal_invalid_reason == "counter_wraparound"
    assert bad.low_latency_invalid_reason == "counter_wraparound"


def test_warmup_discards_everything_before_its_boundary() -> None:
    sim = NormalSimulator(ep_size=EP, ranks_per_node=2, seed=5, slow_rank=1)
    cw = CounterWindows(
        EP, 2, normal=True, low_latency=False, warmup_seconds=10.0, started_at_s=100.0
    )
    assert cw.feed(101.0, normal=sim.advance().counters) is None  # during warm-up
    assert cw.feed(109.9, normal=sim.advance().counters) is None
    assert cw.feed(110.0, normal=sim.advance().counters) is None  # the boundary itself
    snap = sim.advance("pre_combine_delay")
    win = cw.feed(111.0, normal=snap.counters)
    assert win is not None and win.normal is not None and win.window_index == 0
    assert sim.last_window is not None
    np.testing.assert_array_equal(snapshot_counters(win.normal), snapshot_counters(sim.last_window))
    assert (win.start_time_s, win.end_time_s) == (110.0, 111.0)


def test_no_warmup_counts_from_the_zeroed_block() -> None:
    sim = NormalSimulator(ep_size=EP, ranks_per_node=2, seed=6, slow_rank=1)
    cw = CounterWindows(EP, 2, normal=True, low_latency=False, started_at_s=5.0)
    win = cw.feed(6.0, normal=sim.advance().counters)
    assert win is not None and win.normal is not None and win.start_time_s == 5.0
    assert sim.last_window is not None
    np.testing.assert_array_equal(snapshot_counters(win.normal), snapshot_counters(sim.last_window))


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"ep_size": 0}, ValueError, "ep_size"),
        ({"ranks_per_node": 3}, ValueError, "ranks_per_node.*ep_size=4"),
        ({"ranks_per_node": 0}, ValueError, "ranks_per_node"),
        ({"warmup_seconds": -1.0}, ValueError, "warmup_seconds"),
        ({"warmup_seconds": float("nan")}, ValueError, "warmup_seconds"),
        ({"warmup_seconds": "1"}, ValueError, "warmup_seconds"),
    ],
)
def test_counter_windows_rejects_bad_construction(
    kwargs: dict[str, object], exc: type[Exception], words: str
) -> None:
    args: dict[str, object] = {"ep_size": EP, "ranks_per_node": 2}
    args.update(kwargs)
    with pytest.raises(exc, match=words):
        CounterWindows(normal=True, low_latency=True, **args)  # type: ignore[arg-type]


def test_counter_windows_rejects_bad_snapshots() -> None:
    cw = CounterWindows(EP, 2, normal=True, low_latency=False, started_at_s=0.0)
    with pytest.raises(ValueError, match="neither"):
        cw.feed(1.0)
    with pytest.raises(ValueError, match=r"normal: expected shape \(4, 42\)"):
        cw.feed(1.0, normal=np.zeros((EP, 41), dtype=np.int64))
    with pytest.raises(ValueError, match="low_latency: low-latency mode is not enabled"):
        cw.feed(1.0, low_latency=np.zeros((EP, 2, EP), dtype=np.int64))
    ll_only = CounterWindows(EP, 2, normal=False, low_latency=True, started_at_s=0.0)
    with pytest.raises(ValueError, match="normal: normal mode is not enabled"):
        ll_only.feed(1.0, normal=np.zeros((EP, counter_length(EP)), dtype=np.int64))
    with pytest.raises(ValueError, match=r"low_latency: expected shape \(4, 2, 4\)"):
        ll_only.feed(1.0, low_latency=np.zeros((EP, EP), dtype=np.int64))


# --------------------------------------------------------------------------- factory


def test_factory_needs_an_initialized_process_group() -> None:
    # A fresh interpreter: other tests of this session may have initialized torch.distributed.
    code = (
        "from rankwatch.exporter.deepep.diagnose import Diagnose\n"
        "try:\n"
        "    Diagnose.create_from_env(group=None)\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "group: torch.distributed is not initialized" in out.stdout, out.stderr


def test_ranks_per_node_is_inferred_from_contiguous_equal_host_blocks() -> None:
    assert infer_ranks_per_node(["a", "a", "b", "b"]) == 2
    assert infer_ranks_per_node(["a", "a", "a"]) == 3
    assert infer_ranks_per_node(["a", "b", "c"]) == 1
    with pytest.raises(ValueError, match="ranks_per_node: cannot infer"):
        infer_ranks_per_node(["a", "b", "a", "b"])  # interleaved hosts
    with pytest.raises(ValueError, match="ranks_per_node: cannot infer"):
        infer_ranks_per_node(["a", "a", "a", "b"])  # unequal blocks
    with pytest.raises(ValueError, match="hostnames"):
        infer_ranks_per_node([])
    with pytest.raises(ValueError, match="hostnames"):
        infer_ranks_per_node("aabb")


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_an_unusable_log_path_warns_by_variable_and_diagnosis_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """DEEPEP_DIAGNOSE_LOG_PATH that cannot hold files: one warning per output naming the
    variable, the value and what is wrong; no log file, no NPZ store, the root still runs."""
    import logging

    from rankwatch.diagnosis.config import LowLatencyConfig, NormalConfig
    from rankwatch.diagnosis.report import RankInfo
    from rankwatch.exporter.config import DeepEPConfig
    from rankwatch.exporter.deepep.root import DeepEPRoot

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    folder = str(a_file) if kind == "a file" else str(a_file / "logs")
    reason = "exists and is not a folder" if kind == "a file" else "Not a directory"
    root = DeepEPRoot(
        members=[RankInfo(r, "node-0", r) for r in range(2)],
        ranks_per_node=2,
        config=DeepEPConfig(log_path=folder, export_npz=True),
        normal_config=NormalConfig(),
        low_latency_config=LowLatencyConfig(),
        normal=True,
        low_latency=False,
        instance_id="test",
        group_name="ep",
        log_to_file=True,
    )
    with caplog.at_level(logging.WARNING, logger="rankwatch.storage"):
        root.start(0.0)
    try:
        why = f"DEEPEP_DIAGNOSE_LOG_PATH={folder!r}: ENOTDIR ({reason})"
        then = "retrying in 30 s, then at most every 600 s (counted in"
        assert caplog.messages == [
            f"rankwatch: DeepEP log lines not written: {why}; {then} "
            'rankwatch_storage_errors_total{writer="deepep_log"})',
            f"rankwatch: DeepEP NPZ windows not written: {why}; {then} "
            'rankwatch_storage_errors_total{writer="deepep_npz"})',
        ]
        assert root.log_guard is not None and root.log_guard.failing
        assert root.npz_guard is not None and root.npz_guard.failing
    finally:
        root.stop(2.0)

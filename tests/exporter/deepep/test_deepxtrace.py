"""rankwatch served as ``deepxtrace.diagnose``: DeepXTrace's own call sequences, one process.

The sequences follow DeepXTrace's README and tests (antgroup/DeepXTrace main, 87583a0:
README "Example use in DeepEP low-latency mode", src/deepxtrace/diagnose.py, tests/) and the
Buffer of DeepEP pull request 720 (see ``BufferCalls``), rewritten against a real one-rank
Gloo world with CPU tensors in place of CUDA ones. Two ranks: tests/e2e/test_deepxtrace_gloo.py.
"""

from __future__ import annotations

import datetime
import importlib
import re
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rankwatch.diagnosis.deepep.low_latency import diagnose_low_latency
from rankwatch.diagnosis.deepep.normal.schema import SCHEMA
from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.exporter.deepep import deepxtrace as shim
from rankwatch.exporter.deepep import install_as_deepxtrace, uninstall_deepxtrace
from tests.e2e.test_deepep_gloo import Collect
from tests.servers import free_port

# The names and order DeepEP's Buffer requires, copied by hand from pull request 720
# (Marsssqqq/DeepEP deep_ep/buffer.py at 4365d77, _REQUIRED_NORMAL_STATS_SCHEMA).
REQUIRED_NORMAL_STATS_SCHEMA = (
    "normal_notify_dispatch_full_kernel_duration_ns_stats",
    "normal_notify_dispatch_full_kernel_count_stats",
    "normal_cached_notify_dispatch_full_kernel_duration_ns_stats",
    "normal_cached_notify_dispatch_full_kernel_count_stats",
    "normal_cached_notify_combine_full_kernel_duration_ns_stats",
    "normal_cached_notify_combine_full_kernel_count_stats",
    "normal_dispatch_final_completion_cost_stats",
    "normal_dispatch_final_completion_sample_count_stats",
    "normal_dispatch_final_completion_token_count_stats",
    "normal_dispatch_rdma_recv_completion_cost_stats",
    "normal_dispatch_rdma_recv_completion_sample_count_stats",
    "normal_dispatch_rdma_recv_completion_token_count_stats",
    "normal_combine_logical_recv_completion_cost_stats",
    "normal_combine_logical_recv_completion_sample_count_stats",
    "normal_combine_logical_recv_completion_token_count_stats",
)

# DeepXTrace's heatmap tool reads every bracketed run of digits and spaces in the file
# (tools/deepxtrace_heatmap.py, parse_matrix_data); the same expression, rewritten.
HEATMAP_ROW = re.compile(r"\[([\d\s]+)\]")

DEEPXTRACE_VARS = (
    "DEEPEP_DIAGNOSE_ENABLE",
    "DEEPEP_DIAGNOSE_ASYNC",
    "DEEPEP_DIAGNOSE_INTERVAL",
    "DEEPEP_DIAGNOSE_WARMING_TIME",
    "DEEPEP_DIAGNOSE_WARMUP_SECONDS",
    "DEEPEP_DIAGNOSE_SYNC_STEP",
    "DEEPEP_DIAGNOSE_LOG_PATH",
    "DEEPEP_DIAGNOSE_LOG_DETAILS",
)


@pytest.fixture
def installed() -> Iterator[None]:
    uninstall_deepxtrace()
    install_as_deepxtrace()
    yield
    uninstall_deepxtrace()


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for name in DEEPXTRACE_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # DeepXTrace's default log folder is "."
    return monkeypatch


@pytest.fixture
def world() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        group = dist.group.WORLD
        assert isinstance(group, dist.ProcessGroup)
        yield group
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- installing


def test_schema_is_deepeps_and_names_every_block_row_once() -> None:
    assert shim.NORMAL_STATS_SCHEMA == REQUIRED_NORMAL_STATS_SCHEMA
    rows = [row for _, row in shim._NORMAL_STATS_FIELDS]
    assert sorted(rows) == sorted((p, f) for p, f, _ in SCHEMA) and len(set(rows)) == 15
    field_words = {"duration_ns": "duration_ns", "count": "_count", "cost": "cost"}
    field_words |= {"sample": "sample_count", "token": "token_count"}
    for name, (probe, field) in shim._NORMAL_STATS_FIELDS:
        assert name.startswith(f"normal_{probe}_") and field_words[field] in name, name


def test_every_import_form_gives_the_shim(installed: None) -> None:
    import deepxtrace.diagnose
    from deepxtrace import diagnose as ds

    assert ds is shim and deepxtrace.diagnose is shim
    assert importlib.import_module("deepxtrace.diagnose") is shim
    assert ds.Diagnose is shim.Diagnose and ds.Diagnose.diagnose_matrix is not None


def test_uninstall_removes_only_ours(installed: None) -> None:
    uninstall_deepxtrace()
    assert "deepxtrace" not in sys.modules and "deepxtrace.diagnose" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("deepxtrace.diagnose")


def _real_deepxtrace_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "site" / "deepxtrace"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "diagnose.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    return pkg


def test_a_real_deepxtrace_is_never_replaced_unless_forced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uninstall_deepxtrace()
    pkg = _real_deepxtrace_on_path(tmp_path, monkeypatch)
    try:
        with pytest.raises(RuntimeError, match=r"real DeepXTrace is installed .*force=True") as e:
            install_as_deepxtrace()
        assert str(pkg) in str(e.value)
        assert "deepxtrace" not in sys.modules  # detected without importing it
        install_as_deepxtrace(force=True)
        from deepxtrace import diagnose as ds

        assert ds is shim
    finally:
        uninstall_deepxtrace()
    real = importlib.import_module("deepxtrace.diagnose")
    assert real.REAL is True
    with pytest.raises(RuntimeError, match="real DeepXTrace"):
        install_as_deepxtrace()  # an imported real one is detected too
    for name in ("deepxtrace.diagnose", "deepxtrace"):
        sys.modules.pop(name, None)


def test_install_bad_arguments() -> None:
    with pytest.raises(TypeError, match="force: expected a bool, got 'yes'"):
        install_as_deepxtrace("yes")
    with pytest.raises(TypeError, match=r"install_as_deepxtrace: field publishers\[0\]"):
        install_as_deepxtrace(publishers=[object()])
    assert "deepxtrace" not in sys.modules


def test_normal_stats_check_names_the_bad_counter() -> None:
    good = [torch.zeros(1 if i < 6 else 4, dtype=torch.int64) for i in range(15)]
    assert list(shim.check_normal_stats_tensors(good, 4)) == list(REQUIRED_NORMAL_STATS_SCHEMA)
    with pytest.raises(ValueError, match=r"expected 15 tensors .*got 14"):
        shim.check_normal_stats_tensors(good[:14], 4)
    bad = list(good)
    bad[7] = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(
        TypeError, match="normal_dispatch_final_completion_sample_count_stats: expected dtype"
    ):
        shim.check_normal_stats_tensors(bad, 4)
    bad = list(good)
    bad[0] = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(
        ValueError, match=r"normal_notify_dispatch_full_kernel_duration_ns_stats: .* 1 values"
    ):
        shim.check_normal_stats_tensors(bad, 4)
    bad_items: list[object] = list(good)
    bad_items[14] = np.zeros(4, dtype=np.int64)
    with pytest.raises(TypeError, match=r"token_count_stats: expected a torch\.Tensor"):
        shim.check_normal_stats_tensors(bad_items, 4)
    with pytest.raises(ValueError, match="ep_size: must be a positive int, got 0"):
        shim.check_normal_stats_tensors(good, 0)
    # As Buffer holds them: by name. A schema of other names is refused, naming the names.
    by_name = dict(zip(REQUIRED_NORMAL_STATS_SCHEMA, good, strict=True))
    assert list(shim.check_normal_stats_tensors(by_name, 4)) == list(REQUIRED_NORMAL_STATS_SCHEMA)
    legacy = dict(by_name)
    legacy["normal_dispatch_wait_recv_cost_stats"] = legacy.pop(
        "normal_dispatch_final_completion_cost_stats"
    )
    with pytest.raises(
        ValueError,
        match=r"missing \['normal_dispatch_final_completion_cost_stats'\], "
        r"unknown \['normal_dispatch_wait_recv_cost_stats'\]",
    ):
        shim.check_normal_stats_tensors(legacy, 4)
    with pytest.raises(TypeError, match="tensors: expected 15 tensors or a mapping"):
        shim.check_normal_stats_tensors(torch.zeros(15, dtype=torch.int64), 4)


def test_diagnose_matrix_is_deepxtraces_static_rule(installed: None) -> None:
    from deepxtrace import diagnose as ds

    mat = np.full((8, 8), 15, dtype=np.int64)
    mat[:, 3] = 115  # README example 1: destination 3 is slow
    res = ds.Diagnose.diagnose_matrix(mat, thres_col=3.0, thres_row=3.0, thres_point=5.0)
    assert [c[0] for c in res["abnormal_cols"]] == [3]
    assert res["abnormal_rows"] == [] and res["abnormal_points"] == []


# --------------------------------------------------------------------------- DeepXTrace 0.1


def test_defaults_are_deepxtraces(installed: None, env: Any, world: dist.ProcessGroup) -> None:
    from deepxtrace import diagnose as ds

    diag = ds.Diagnose(world)  # DeepXTrace 0.1: on by default, low-latency, synchronous
    try:
        assert diag.enable_ll_diagnose and not diag.enable_normal_diagnose
        assert not diag.enable_async
        assert diag.interval == 20 and diag.sync_step == 580 and diag.warm_time == 0
        assert (diag.thres_col, diag.thres_row, diag.thres_point) == (3.0, 3.0, 5.0)
        assert diag.rank == 0 and diag.group_size == 1
        dispatch, combine = diag.get_stats_ll_stats_tensor()
        assert dispatch is not None and combine is not None
        # What upstream DeepEP asserts (csrc/legacy/buffer.hpp): int64, 1-D, contiguous, EP.
        for t in (dispatch, combine):
            assert t.dtype == torch.int64 and tuple(t.shape) == (1,) and t.is_contiguous()
        assert diag.ll_dispatch_wait_recv_cost_stats.data_ptr() == dispatch.data_ptr()
        assert diag.ll_combine_wait_recv_cost_stats.data_ptr() == combine.data_ptr()
        assert diag.get_stats_normal_stats_tensor() == (None,) * 15
        assert diag.get_instance_id() is not None
    finally:
        diag.stop()
    asynchronous = ds.Diagnose(world, enable_async=True)
    try:
        assert asynchronous.enable_async and asynchronous.warm_time == 20  # = the interval
    finally:
        asynchronous.stop()


def test_disabled_by_environment_returns_nothing(
    installed: None, env: Any, world: dist.ProcessGroup
) -> None:
    from deepxtrace import diagnose as ds

    env.setenv("DEEPEP_DIAGNOSE_ENABLE", "off")
    diag = ds.Diagnose(group=world, enable_async=False)
    assert not diag.enable_ll_diagnose and diag.collector is None
    assert diag.get_stats_ll_stats_tensor() == (None, None)
    assert diag.diagnose_ll_sync(1) is None and diag.diagnose_normal_sync(1) is None
    assert diag.get_all_stats_tensor() is None and diag.get_instance_id() is None
    assert ds.Diagnose(group=world, enable_async=True).start_async_diagnose() is None
    assert ds.Diagnose.create_from_env(world) is None
    env.setenv("DEEPEP_DIAGNOSE_ENABLE", "1")
    made = ds.Diagnose.create_from_env(world)  # pull request 17: normal mode, asynchronous
    assert made is not None and made.enable_async and made.enable_normal_diagnose
    assert len(made.get_normal_dispatch_stats_tensor()) == 10
    assert len(made.get_normal_combine_stats_tensor()) == 5
    made.start()
    made.stop()


def test_low_latency_sync_returns_results_and_writes_deepxtraces_log(
    installed: None, env: Any, world: dist.ProcessGroup, tmp_path: Path
) -> None:
    from deepxtrace import diagnose as ds

    env.setenv("DEEPEP_DIAGNOSE_LOG_DETAILS", "1")
    diag = ds.Diagnose(group=world, enable_async=False)
    dispatch, combine = diag.get_stats_ll_stats_tensor()
    results = []
    for step in range(4):
        dispatch += 1000 + step  # what low_latency_dispatch adds (cumulative)
        combine += 2000 + step
        results.append(diag.diagnose_ll_sync(diagnose_step=2))
    diag.stop()
    assert results[0] is None and results[2] is None
    for res in (results[1], results[3]):
        assert isinstance(res, list) and len(res) == 2
        for verdict in res:
            assert verdict == {"abnormal_cols": [], "abnormal_rows": [], "abnormal_points": []}
    # The counters are never zeroed: each result covers only its own two calls.
    assert int(dispatch[0]) == 4006
    np.testing.assert_array_equal(diag.get_all_stats_tensor(), [[[2005], [4005]]])
    text = (tmp_path / "diagnose_rank0.log").read_text()
    lines = text.splitlines()
    assert len(lines) == 8  # per window: dispatch summary + row, combine summary + row
    assert re.fullmatch(
        r"\[\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\] \[Diagnose\] InstanceID: "
        r"[0-9a-f-]{36} EPSize: 1, diagnose: \{'abnormal_cols': \[\], 'abnormal_rows': \[\], "
        r"'abnormal_points': \[\]\}, Dispatch Wait Recv Cost Per Token "
        r"Matrix\[src_rank, dst_rank\]",
        lines[0],
    )
    assert str(diag.get_instance_id()) in lines[0]
    rows = [list(map(int, seq.split())) for seq in HEATMAP_ROW.findall(text)]
    assert rows == [[2001], [4001], [2005], [4005]]


def test_async_start_returns_the_thread_and_stop_ends_it(
    installed: None, env: Any, world: dist.ProcessGroup
) -> None:
    from deepxtrace import diagnose as ds

    env.setenv("DEEPEP_DIAGNOSE_INTERVAL", "0.2")
    env.setenv("DEEPEP_DIAGNOSE_WARMING_TIME", "0")
    diag = ds.Diagnose(group=world, enable_async=True)
    assert diag.warm_time == 0 and diag.interval == 0.2
    thread = diag.start_async_diagnose()
    assert isinstance(thread, threading.Thread) and thread.is_alive()
    dispatch, _ = diag.get_stats_ll_stats_tensor()
    assert dispatch is not None
    dispatch += 5
    with pytest.raises(RuntimeError, match="DEEPEP_DIAGNOSE_ASYNC=0"):
        diag.diagnose_ll_sync()
    diag.stop_async_diagnose()
    assert not thread.is_alive() and diag.stop_diagnose.is_set()
    assert diag.collector is not None and diag.collector.collector_error is None


def test_constructor_bad_inputs_name_the_argument(
    installed: None, env: Any, world: dist.ProcessGroup
) -> None:
    from deepxtrace import diagnose as ds

    with pytest.raises(ValueError, match="interval: must be a finite number of seconds > 0"):
        ds.Diagnose(world, interval=0)
    with pytest.raises(TypeError, match="enable_async: expected a bool, got 'yes'"):
        ds.Diagnose(world, enable_async="yes")
    with pytest.raises(TypeError, match=r"group: expected a torch\.distributed\.ProcessGroup"):
        ds.Diagnose("ep")
    env.setenv("DEEPEP_DIAGNOSE_WARMING_TIME", "-1")
    with pytest.raises(ValueError, match="DEEPEP_DIAGNOSE_WARMING_TIME"):
        ds.Diagnose(world, enable_async=True)


# --------------------------------------------------------------------------- DeepEP PR 720


class BufferCalls:
    """The calls DeepEP's Buffer makes on DeepXTrace, in Buffer's order and form.

    Follows pull request 720 (Marsssqqq/DeepEP): deep_ep/buffer.py at 4365d77, lines 12-39
    (``_REQUIRED_NORMAL_STATS_SCHEMA``; ``_validate_deepxtrace_normal_stats_schema`` compares
    ``tuple(module.NORMAL_STATS_SCHEMA)`` with it and raises ``RuntimeError`` otherwise),
    ``Buffer._get_normal_diagnose_stats`` (the getter's length checked, then
    ``dict(zip(schema, tensors))``; the kernels take the tensors by name), and
    tests/test_deepxtrace_integration.py at 7d672b0 (``_load_deepxtrace`` through
    ``importlib.import_module``; ``diagnose_normal_sync(step)`` forwarded with its step and its
    result returned; ``destroy`` stops asynchronous diagnosis before the runtime). The
    constructor keywords are the ones the pull request's Buffer passes.
    """

    def __init__(self, group: dist.ProcessGroup, enable_async: bool) -> None:
        module = importlib.import_module("deepxtrace.diagnose")
        if tuple(getattr(module, "NORMAL_STATS_SCHEMA", None) or ()) != (
            REQUIRED_NORMAL_STATS_SCHEMA
        ):
            raise RuntimeError("Incompatible deepxtrace normal-stats schema")
        self.enable_deepxtrace_async = enable_async
        self.diagnose = module.Diagnose(
            group=group,
            enable_ll_diagnose=False,
            enable_normal_diagnose=True,
            enable_async=enable_async,
            snapshot_stream=None,  # Buffer passes get_comm_stream(); no CUDA here
        )
        tensors = self.diagnose.get_stats_normal_stats_tensor()
        if len(tensors) != len(REQUIRED_NORMAL_STATS_SCHEMA):
            raise RuntimeError("DeepXTrace normal-stats tensor count does not match its schema")
        self.normal_stats = dict(zip(REQUIRED_NORMAL_STATS_SCHEMA, tensors, strict=True))
        if enable_async:
            self.diagnose.start_async_diagnose()

    def diagnose_normal_sync(self, step: int = 0) -> Any:
        if self.enable_deepxtrace_async:
            raise RuntimeError("requires enable_deepxtrace_async=False")
        return self.diagnose.diagnose_normal_sync(step)

    def destroy(self) -> None:
        if self.enable_deepxtrace_async:
            self.diagnose.stop_async_diagnose()
        self.diagnose = None


def test_pr720_buffer_sequence_sync(installed: None, env: Any, world: dist.ProcessGroup) -> None:
    buffer = BufferCalls(world, enable_async=False)
    stats = buffer.normal_stats
    assert all(t.dtype == torch.int64 and t.is_contiguous() for t in stats.values())
    # The views share one allocation: one copy snapshots all fifteen.
    storage = {t.untyped_storage().data_ptr() for t in stats.values()}
    assert len(storage) == 1
    outs = []
    for _ in range(3):
        stats["normal_notify_dispatch_full_kernel_duration_ns_stats"] += 40_000
        stats["normal_notify_dispatch_full_kernel_count_stats"] += 1
        stats["normal_dispatch_final_completion_cost_stats"] += 9_000
        stats["normal_dispatch_final_completion_sample_count_stats"] += 3
        stats["normal_dispatch_final_completion_token_count_stats"] += 96
        outs.append(buffer.diagnose_normal_sync(17))
    assert outs == [None, None, None]  # 17 calls make a window
    for _ in range(14):
        outs.append(buffer.diagnose_normal_sync(17))
    result = outs[-1]
    assert isinstance(result, list) and len(result) == 1
    assert result[0]["status"] == "ok" and result[0]["window_index"] == 0
    final = result[0]["probes"]["dispatch_final"]
    assert final["aggregate"] == pytest.approx(3_000.0)  # 17 x 9,000 cycles over 17 x 3 samples
    assert buffer.diagnose.collector.latest_report is not None
    buffer.destroy()


def test_blocking_sync_bad_inputs(installed: None, env: Any, world: dist.ProcessGroup) -> None:
    from deepxtrace import diagnose as ds

    diag = ds.Diagnose(group=world, enable_async=False)
    assert diag.collector is not None
    with pytest.raises(ValueError, match="part: must be 'normal' or 'low_latency', got 'll'"):
        diag.collector.diagnose_sync_blocking("ll")
    with pytest.raises(TypeError, match=r"diagnose_step: expected an int, got 1\.5"):
        diag.diagnose_ll_sync(1.5)
    with pytest.raises(ValueError, match="diagnose_step: must be >= 0, got -2"):
        diag.diagnose_ll_sync(-2)
    assert diag.diagnose_normal_sync(1) is None  # normal mode is off on this instance
    diag.stop()


def test_deepxtrace_log_in_an_unwritable_folder_warns_and_writes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with caplog.at_level("WARNING"):
        log = shim.DeepXTraceLog(str(blocker), 0, ep_size=2, instance_id=uuid.uuid4(), details=True)
    assert caplog.messages == []  # the file is opened at the first line
    mat = np.array([[1, 9], [1, 9]], dtype=np.int64)
    report = WindowReport(
        group="ep",
        window_index=0,
        created_at_s=0.0,
        ranks=(RankInfo(0, "h", 0), RankInfo(1, "h", 1)),
        low_latency={p: diagnose_low_latency(mat, p) for p in ("dispatch", "combine")},
    )
    with caplog.at_level("WARNING"):
        log.publish(report)  # no file, no error: said once
        log.publish(report)
    (line,) = caplog.messages
    assert f"DEEPEP_DIAGNOSE_LOG_PATH={str(blocker)!r}" in line and "ENOTDIR" in line
    log.close(1.0)
    assert len(log.lines(report)) == 6  # summary + 2 rows per phase
    assert blocker.read_text() == ""


def test_installed_config_and_publishers_reach_the_collector(
    env: Any, world: dist.ProcessGroup
) -> None:
    from rankwatch.exporter.config import RankwatchConfig

    keep = Collect()
    env.setenv("DEEPEP_DIAGNOSE_SYNC_STEP", "2")
    uninstall_deepxtrace()
    install_as_deepxtrace(publishers=[keep], config=RankwatchConfig(run_id="run-7"))
    try:
        from deepxtrace import diagnose as ds

        diag = ds.Diagnose(world)
        assert diag.interval == 20 and diag.sync_step == 2  # DEEPEP_DIAGNOSE_*: DeepXTrace's
        dispatch, _ = diag.get_stats_ll_stats_tensor()
        dispatch += 3
        assert diag.diagnose_ll_sync() is None
        assert diag.diagnose_ll_sync() is not None
        diag.stop()
    finally:
        uninstall_deepxtrace()
    assert [r.run for r in keep.reports] == ["run-7"]  # the rest: the installed config's
    with pytest.raises(TypeError, match="config: expected a RankwatchConfig"):
        install_as_deepxtrace(config={"run_id": "x"})
    assert "deepxtrace" not in sys.modules

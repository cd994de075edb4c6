"""DeepEP collector on real Gloo process groups across spawned processes.

Every rank plays DeepEP: it writes its column of the simulator's per-window matrices into its own
counter block through the bundle views (cumulatively), and the root must rebuild exactly the
simulator's windows. Worlds are small (2 to 4 ranks) because the machine has two cores.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rankwatch.diagnosis.deepep.artifact import load_window_artifact
from rankwatch.diagnosis.deepep.log_lines import parse_log_line
from rankwatch.diagnosis.deepep.normal import NormalSimulator, NormalWindow, snapshot_counters
from rankwatch.diagnosis.deepep.normal.schema import COMBINE_BUNDLE, DISPATCH_BUNDLE, counter_slots
from rankwatch.diagnosis.report import WindowReport
from tests.rank_processes import rank_process
from tests.servers import free_port, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.parallel_safe, pytest.mark.timeout(180)]

BASE_ENV = {
    "DEEPEP_DIAGNOSE_ENABLE": "1",
    "DEEPEP_DIAGNOSE_ASYNC": "0",
    "DEEPEP_DIAGNOSE_SYNC_STEP": "1",
    "DEEPEP_DIAGNOSE_INTERVAL": "0.2",
    "DEEPEP_DIAGNOSE_WARMUP_SECONDS": "0",
}


# --------------------------------------------------------------------------- harness


def _entry(fn: Callable[[int, int], Any], rank: int, world: int, port: int, out: str) -> None:
    result: dict[str, Any]
    os.environ["RANKWATCH_TEST_OUT"] = out
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        result = {"ok": fn(rank, world)}
    except BaseException:
        result = {"error": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_world(fn: Callable[[int, int], Any], world: int, tmp_path: Path) -> list[Any]:
    """Run ``fn(rank, world)`` in ``world`` spawned Gloo ranks; return each rank's result."""
    port = free_port()
    procs = [
        rank_process(_entry, (fn, r, world, port, str(tmp_path)), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 150
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} did not finish in time"
    results = []
    errors = []
    for r in range(world):
        path = tmp_path / f"rank{r}.pkl"
        assert path.exists(), f"rank {r} exited with code {procs[r].exitcode} and no result"
        res = pickle.loads(path.read_bytes())
        if "error" in res:
            errors.append(f"--- rank {r} ---\n{res['error']}")
        results.append(res.get("ok"))
    assert not errors, "\n".join(errors)
    return results


class Broken:
    """A publisher that always fails: the others must still get every report."""

    def publish(self, report: WindowReport) -> None:
        raise RuntimeError("publisher down")

    def close(self, timeout_seconds: float) -> None:
        pass


class Collect:
    """A real publisher that keeps every report it is handed."""

    def __init__(self) -> None:
        self.reports: list[WindowReport] = []

    def publish(self, report: WindowReport) -> None:
        self.reports.append(report)

    def close(self, timeout_seconds: float) -> None:
        pass


def write_normal(diag: Any, window: NormalWindow, rank: int) -> None:
    """DeepEP's part: add this rank's received counts of ``window`` through the bundle views."""
    row = snapshot_counters(window)[rank]
    slots = counter_slots(window.ep_size)
    for views, order in (
        (diag.get_normal_dispatch_stats_tensor(), DISPATCH_BUNDLE),
        (diag.get_normal_combine_stats_tensor(), COMBINE_BUNDLE),
    ):
        for view, key in zip(views, order, strict=True):
            s = slots[key]
            view += torch.from_numpy(row[s.offset : s.stop])


def ll_window(ep: int, seed: int) -> np.ndarray:
    """One low-latency window: ``[receiver, phase, peer]`` wait cycles (identical on every rank)."""
    return np.random.default_rng(seed).integers(1_000, 50_000, size=(ep, 2, ep), dtype=np.int64)


def write_ll(diag: Any, mats: np.ndarray, rank: int) -> None:
    dispatch, combine = diag.get_stats_ll_stats_tensor()
    dispatch += torch.from_numpy(mats[rank, 0])
    combine += torch.from_numpy(mats[rank, 1])


def window_arrays(w: NormalWindow) -> dict[str, np.ndarray]:
    out = {}
    for p, (d, c) in w.notify.items():
        out[f"{p}.duration"] = d
        out[f"{p}.count"] = c
    for p, mats in w.completion.items():
        for f, m in zip(("cost", "samples", "tokens"), mats, strict=True):
            out[f"{p}.{f}"] = m
    return out


def assert_same_window(got: NormalWindow, want: NormalWindow) -> None:
    a, b = window_arrays(got), window_arrays(want)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _create(group: Any, env: dict[str, str], **kw: Any) -> Any:
    from rankwatch.exporter.deepep.diagnose import Diagnose

    return Diagnose.create_from_env(group=group, env=env, **kw)


def _summary(reports: list[WindowReport]) -> list[dict[str, Any]]:
    return [
        {
            "index": r.window_index,
            "group": r.group,
            "ranks": [(i.rank, i.hostname, i.local_rank) for i in r.ranks],
            "normal": None if r.normal is None else r.normal.window_index,
            "reason": r.normal_invalid_reason,
            "ll": None if r.low_latency is None else sorted(r.low_latency),
            "ll_matrix": None
            if r.low_latency is None
            else {p: np.asarray(x.matrix) for p, x in r.low_latency.items()},
            "seconds": dict(r.diagnosis_seconds),
        }
        for r in reports
    ]


# --------------------------------------------------------------------------- scenarios


def _sync_windows_reset_and_warmup(rank: int, world: int) -> dict[str, Any]:
    """Synchronous mode: exact windows, a counter reset on rank 2, then a warm-up boundary."""
    group = dist.group.WORLD
    sim = NormalSimulator(ep_size=world, ranks_per_node=2, seed=7, slow_rank=1)
    pub = Collect()
    env = dict(BASE_ENV, DEEPEP_DIAGNOSE_SYNC_STEP="3")
    diag = _create(
        group, env, enable_ll_diagnose=True, enable_normal_diagnose=True, publishers=[pub]
    )
    assert diag is not None and not diag.enable_async
    diag.start()
    phases = ["baseline", "baseline", "baseline", "pre_dispatch_delay", "baseline"]
    want = []
    ll_want = []
    for k, phase in enumerate(phases):
        win = sim.window(phase, k)
        want.append(win)
        write_normal(diag, win, rank)
        ll = ll_window(world, 100 + k)
        ll_want.append(ll)
        write_ll(diag, ll, rank)
        if k == 2 and rank == 2:
            # A restarted writer: rank 2's cumulative counters start again from zero.
            diag.counters.storage.zero_()
        for _ in range(3):  # sync_step = 3: the third call of each round collects
            diag.diagnose_normal_sync()
            diag.diagnose_ll_sync()
    diag.stop()
    first = {
        "is_root": diag.is_root,
        "windows": list(diag.recent_windows),
        "reports": _summary(pub.reports),
        "latest": None if diag.latest_report is None else diag.latest_report.window_index,
        "rejected": dict(diag.rejected_windows),
        "want": want,
        "ll_want": ll_want,
    }

    # Warm-up: everything written before the first snapshot after warm-up is discarded.
    # Also: log lines with details and NPZ windows under the log path.
    log_dir = os.path.join(os.environ["RANKWATCH_TEST_OUT"], "logs")
    warm_env = dict(
        BASE_ENV,
        DEEPEP_DIAGNOSE_WARMUP_SECONDS="0.8",
        DEEPEP_DIAGNOSE_LOG_PATH=log_dir,
        DEEPEP_DIAGNOSE_LOG_DETAILS="1",
        DEEPEP_DIAGNOSE_EXPORT_NPZ="1",
    )
    pub2 = Collect()
    diag2 = _create(group, warm_env, enable_normal_diagnose=True, publishers=[Broken(), pub2])
    diag2.start()
    t0 = time.time()
    sim2 = NormalSimulator(ep_size=world, ranks_per_node=2, seed=11, slow_rank=1)
    wins = [sim2.window("baseline", k) for k in range(4)]
    write_normal(diag2, wins[0], rank)  # A: during warm-up
    diag2.diagnose_normal_sync()
    time.sleep(max(0.0, 1.0 - (time.time() - t0)))
    write_normal(diag2, wins[1], rank)  # B: before the boundary snapshot
    diag2.diagnose_normal_sync()  # first snapshot after warm-up: the boundary
    write_normal(diag2, wins[2], rank)  # C
    diag2.diagnose_normal_sync()
    write_normal(diag2, wins[3], rank)  # D
    diag2.diagnose_normal_sync()
    diag2.stop()
    first["warm_windows"] = list(diag2.recent_windows)
    first["warm_want"] = wins
    first["warm_reports"] = _summary(pub2.reports)
    first["instance_id"] = diag2.instance_id
    first["log_dir"] = log_dir
    return first


def test_sync_windows_match_simulator_reset_and_warmup(tmp_path: Path) -> None:
    results = run_world(_sync_windows_reset_and_warmup, 4, tmp_path)
    root = results[0]
    assert root["is_root"] and not any(r["is_root"] for r in results[1:])
    assert all(r["windows"] == [] and r["reports"] == [] for r in results[1:])
    assert all(r["latest"] is None for r in results[1:])

    # Normal and low-latency parts are collected by separate sync calls: two reports per round.
    windows = root["windows"]
    normal = [w for w in windows if w.normal is not None or w.normal_invalid_reason]
    ll = [w for w in windows if w.low_latency is not None or w.low_latency_invalid_reason]
    assert len(normal) == 5 and len(ll) == 5
    for k in (0, 1, 3, 4):
        assert_same_window(normal[k].normal, root["want"][k])
        assert normal[k].normal_invalid_reason is None
    assert normal[2].normal is None and normal[2].normal_invalid_reason == "counter_reset"
    for k in (0, 1, 3, 4):
        for i, phase in enumerate(("dispatch", "combine")):
            np.testing.assert_array_equal(ll[k].low_latency[phase], root["ll_want"][k][:, i, :])
    assert ll[2].low_latency is None and ll[2].low_latency_invalid_reason == "counter_reset"
    assert root["rejected"] == {"normal:counter_reset": 1, "low_latency:counter_reset": 1}

    reports = root["reports"]
    assert [r["index"] for r in reports] == list(range(10))
    assert root["latest"] == 9
    host = socket.gethostname().lower()
    for r in reports:
        assert r["group"] == "ep"
        assert r["ranks"] == [(g, host, g) for g in range(4)]
    normal_reports = [r for r in reports if r["normal"] is not None or r["reason"]]
    assert [r["reason"] for r in normal_reports] == [None, None, "counter_reset", None, None]
    assert all("normal" in r["seconds"] for r in normal_reports if r["reason"] is None)
    ll_reports = [r for r in reports if r["ll"] is not None]
    assert len(ll_reports) == 4
    for r, k in zip(ll_reports, (0, 1, 3, 4), strict=True):
        np.testing.assert_array_equal(r["ll_matrix"]["dispatch"], root["ll_want"][k][:, 0, :])
        assert "low_latency" in r["seconds"]

    # Warm-up: A and B are gone, the windows are exactly C and D.
    warm = root["warm_windows"]
    assert [w.window_index for w in warm] == [0, 1]
    assert_same_window(warm[0].normal, root["warm_want"][2])
    assert_same_window(warm[1].normal, root["warm_want"][3])
    assert [r["reason"] for r in root["warm_reports"]] == [None, None]

    # The root's log file and NPZ windows; the other ranks write neither.
    log_dir = Path(root["log_dir"])
    assert sorted(p.name for p in log_dir.glob("*.log")) == ["deepep_diagnose_rank0.log"]
    text = (log_dir / "deepep_diagnose_rank0.log").read_text()
    assert "publisher down" in text  # the broken publisher is logged, the others still served
    lines = [parse_log_line(x) for x in text.splitlines() if "[Diagnose]" in x]
    assert {(x.window_index, x.record) for x in lines} == {
        (w, r) for w in (0, 1) for r in ("summary", "detail", "values")
    }
    assert {x.instance_id for x in lines} == {root["instance_id"]}
    assert sum(x.record == "detail" for x in lines) == 12  # six probes, two windows
    npz = sorted(log_dir.glob("*.npz"))
    assert len(npz) == 2
    for path, want in zip(npz, root["warm_want"][2:], strict=True):
        window, diagnosis, _ = load_window_artifact(path)
        assert_same_window(window, want)
        assert diagnosis is not None


def _sum_windows(windows: list[Any]) -> dict[str, np.ndarray]:
    total: dict[str, np.ndarray] = {}
    for w in windows:
        if w.normal is None:
            continue
        for k, v in window_arrays(w.normal).items():
            total[k] = total.get(k, 0) + v
    return total


def _async_run(
    rank: int, group: Any, env: dict[str, str], sim_seed: int, group_name: str = "ep"
) -> dict[str, Any]:
    """Asynchronous collection: writes after warm-up, a final snapshot at stop."""
    ep = dist.get_world_size(group)
    me = dist.get_rank(group)
    pub = Collect()
    diag = _create(
        group,
        env,
        enable_ll_diagnose=True,
        enable_normal_diagnose=True,
        publishers=[pub],
        group_name=group_name,
    )
    assert diag is not None and diag.enable_async
    try:
        diag.diagnose_normal_sync()
        raise AssertionError("diagnose_normal_sync ran in async mode")
    except RuntimeError as exc:
        assert "DEEPEP_DIAGNOSE_ASYNC=0" in str(exc)
    sim = NormalSimulator(ep_size=ep, ranks_per_node=ep, seed=sim_seed, slow_rank=0)
    wins = [sim.window("baseline", k) for k in range(3)]
    lls = [ll_window(ep, sim_seed + k) for k in range(3)]
    dist.barrier(group)
    diag.start()
    write_normal(diag, wins[0], me)  # during warm-up: discarded
    write_ll(diag, lls[0], me)
    _wait_for_boundary(diag, group)
    write_normal(diag, wins[1], me)
    write_ll(diag, lls[1], me)
    time.sleep(0.5)
    write_normal(diag, wins[2], me)
    write_ll(diag, lls[2], me)
    # Nothing written before the first member's stop is lost: every member takes a final
    # snapshot at the collective that carries that stop. What a member writes after it is not
    # collected, so every member finishes writing first, as training ends on every rank
    # together. Without this barrier the root's last write was lost once in a fresh clone's
    # run: rank 1 stopped while rank 0 had not yet written its last window.
    dist.barrier(group)
    diag.stop()
    collector = diag._collector
    return {
        "global_rank": rank,
        "is_root": diag.is_root,
        "root_global": diag.root_global_rank,
        "collector_alive": collector is not None and collector.is_alive(),
        "collector_error": diag.collector_error,
        "cpu_group_released": diag._cpu_group is None,
        "windows": list(diag.recent_windows),
        "reports": _summary(pub.reports),
        "rejected": dict(diag.rejected_windows),
        "want": _sum_windows_of(wins[1:]),
        "ll_want": lls[1] + lls[2],
    }


def _wait_for_boundary(diag: Any, group: Any, timeout_seconds: float = 60.0) -> None:
    """Return on every member once the root holds the boundary snapshot of both parts.

    The boundary is the first snapshot after warm-up, taken whenever the collector threads get
    to it. Writing on a clock instead (warm-up plus 0.5 s) races it on a loaded host: a
    boundary later than the next write would discard that write with the warm-up.
    """
    if diag.is_root:
        windows = diag._root._windows
        wait_until(
            lambda: all(windows._has_boundary.values()),
            timeout_seconds,
            interval=0.01,
            what="the root's warm-up boundary snapshot",
        )
    dist.barrier(group)


def _sum_windows_of(wins: list[NormalWindow]) -> dict[str, np.ndarray]:
    total: dict[str, np.ndarray] = {}
    for w in wins:
        for k, v in window_arrays(w).items():
            total[k] = total.get(k, 0) + v
    return total


def _check_async(
    res: dict[str, Any], ranks: list[int], group_name: str, single_window: bool = False
) -> None:
    assert res["is_root"] and res["root_global"] == ranks[0]
    if single_window:
        # No tick after the warm-up boundary: the only window is stop()'s final snapshot.
        assert [w.window_index for w in res["windows"]] == [0]
    assert not res["collector_alive"] and res["collector_error"] is None
    assert res["cpu_group_released"]
    windows = res["windows"]
    assert windows, "no window was formed"
    got = _sum_windows(windows)
    assert got.keys() == res["want"].keys()
    for k in got:
        np.testing.assert_array_equal(got[k], res["want"][k], err_msg=k)
    ll_total = sum(
        np.stack([w.low_latency["dispatch"], w.low_latency["combine"]], axis=1)
        for w in windows
        if w.low_latency is not None
    )
    np.testing.assert_array_equal(ll_total, res["ll_want"])
    # Idle intervals are the only rejections an undisturbed run may have.
    assert set(res["rejected"]) <= {"normal:empty_window", "low_latency:empty_window"}
    host = socket.gethostname().lower()
    for r in res["reports"]:
        assert r["group"] == group_name
        assert [x[0] for x in r["ranks"]] == ranks
        assert all(x[1] == host for x in r["ranks"])
    assert [r["index"] for r in res["reports"]] == [w.window_index for w in windows]


def _async_world(rank: int, world: int) -> dict[str, Any]:
    env = dict(BASE_ENV, DEEPEP_DIAGNOSE_ASYNC="1", DEEPEP_DIAGNOSE_WARMUP_SECONDS="0.4")
    return _async_run(rank, dist.group.WORLD, env, sim_seed=21)


def test_async_collection_over_private_gloo_group(tmp_path: Path) -> None:
    results = run_world(_async_world, 2, tmp_path)
    _check_async(results[0], [0, 1], "ep")
    other = results[1]
    assert not other["is_root"] and other["windows"] == [] and other["reports"] == []
    # Every member's thread took part and left after the same final collective.
    assert not other["collector_alive"] and other["collector_error"] is None
    assert other["cpu_group_released"]


def _subgroups(rank: int, world: int) -> dict[str, Any]:
    # Two disjoint, non-contiguous EP groups: every rank creates both (new_group is collective),
    # then each rank runs DeepEP diagnosis only in its own.
    even = dist.new_group([0, 2])
    odd = dist.new_group([1, 3])
    mine, ranks, name = (even, [0, 2], "ep-even") if rank % 2 == 0 else (odd, [1, 3], "ep-odd")
    me = dist.get_rank(mine)
    out: dict[str, Any] = {"ranks": ranks, "name": name}

    # Synchronous: exact windows through the EP group itself, gathered to its global root.
    pub = Collect()
    diag = _create(mine, BASE_ENV, enable_normal_diagnose=True, publishers=[pub])
    diag.start()
    sim = NormalSimulator(ep_size=2, ranks_per_node=2, seed=5 + rank % 2, slow_rank=1)
    want = []
    for k in range(3):
        win = sim.window("baseline" if k != 1 else "pre_dispatch_delay", k)
        want.append(win)
        write_normal(diag, win, me)
        diag.diagnose_normal_sync()
    diag.stop()
    out["sync"] = {
        "is_root": diag.is_root,
        "root_global": diag.root_global_rank,
        "windows": list(diag.recent_windows),
        "reports": _summary(pub.reports),
        "want": want,
    }
    env = dict(
        BASE_ENV,
        DEEPEP_DIAGNOSE_ASYNC="1",
        DEEPEP_DIAGNOSE_WARMUP_SECONDS="0.3",
        DEEPEP_DIAGNOSE_INTERVAL="60",
    )
    out["async"] = _async_run(rank, mine, env, sim_seed=40 + rank % 2, group_name=name)
    return out


def test_non_contiguous_subgroups_gather_to_their_global_root(tmp_path: Path) -> None:
    results = run_world(_subgroups, 4, tmp_path)
    for root_rank, other_rank in ((0, 2), (1, 3)):
        root, other = results[root_rank], results[other_rank]
        sync = root["sync"]
        assert sync["is_root"] and sync["root_global"] == root_rank
        assert not other["sync"]["is_root"] and other["sync"]["windows"] == []
        assert [w.window_index for w in sync["windows"]] == [0, 1, 2]
        for got, want in zip(sync["windows"], sync["want"], strict=True):
            assert_same_window(got.normal, want)
        for r in sync["reports"]:
            assert [x[0] for x in r["ranks"]] == root["ranks"]
        _check_async(root["async"], root["ranks"], root["name"], single_window=True)
        assert not other["async"]["is_root"] and other["async"]["reports"] == []


def _expect_error(fn: Callable[[], Any], kind: type[BaseException]) -> str:
    try:
        fn()
    except kind as exc:
        return str(exc)
    except BaseException as exc:
        raise AssertionError(f"expected {kind.__name__}, got {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"expected {kind.__name__}, nothing was raised")


def _bad_settings(rank: int, world: int) -> dict[str, Any]:
    """Every failing call below is collective and must fail on every rank, with a clear text."""
    group = dist.group.WORLD
    out: dict[str, Any] = {}

    def create(env: dict[str, str], **kw: Any) -> Any:
        kw.setdefault("enable_normal_diagnose", True)
        return _create(group, env, **kw)

    # Mixed settings across the group.
    env = dict(BASE_ENV, DEEPEP_DIAGNOSE_ASYNC="0" if rank == 1 else "1")
    out["mixed_async"] = _expect_error(lambda: create(env), ValueError)
    env = dict(BASE_ENV, DEEPEP_DIAGNOSE_ENABLE="0" if rank == 2 else "1")
    out["mixed_enable"] = _expect_error(lambda: create(env), ValueError)
    env = dict(BASE_ENV, DEEPEP_DIAGNOSE_SYNC_STEP=str(10 + rank))
    out["mixed_step"] = _expect_error(lambda: create(env), ValueError)
    out["mixed_mode"] = _expect_error(
        lambda: create(BASE_ENV, enable_ll_diagnose=rank == 0), ValueError
    )
    out["mixed_rpn"] = _expect_error(
        lambda: create(BASE_ENV, ranks_per_node=1 if rank == 0 else 3), ValueError
    )
    # A bad value on one rank: that rank names it, the others name that rank.
    env = dict(BASE_ENV, DEEPEP_DIAGNOSE_INTERVAL="soon" if rank == 0 else "0.2")
    out["bad_interval"] = _expect_error(lambda: create(env), ValueError)
    env = dict(BASE_ENV, DEEPEP_DIAGNOSE_SYNC_STEP="0")
    out["bad_step"] = _expect_error(lambda: create(env), ValueError)
    env = dict(BASE_ENV, DEEPEP_DIAGNOSE_ENABLE="maybe")
    out["bad_enable"] = _expect_error(lambda: create(env), ValueError)
    env = dict(BASE_ENV, DEEPEP_DIAGNOSE_THRESHOLD_COL="-1")
    out["bad_threshold"] = _expect_error(lambda: create(env), ValueError)
    # Bad arguments, on one rank or on all.
    out["bad_rpn"] = _expect_error(
        lambda: create(BASE_ENV, ranks_per_node=2 if rank == 1 else None), ValueError
    )
    out["bad_flag"] = _expect_error(
        lambda: create(BASE_ENV, enable_normal_diagnose="yes"), TypeError
    )
    out["bad_stream"] = _expect_error(lambda: create(BASE_ENV, snapshot_stream="comm"), TypeError)
    out["cpu_stream"] = _expect_error(
        lambda: create(BASE_ENV, snapshot_stream=torch.Stream(device="cpu")), ValueError
    )
    out["bad_publisher"] = _expect_error(lambda: create(BASE_ENV, publishers=[object()]), TypeError)
    out["bad_timeout"] = _expect_error(
        lambda: create(BASE_ENV, gather_timeout_seconds=0), ValueError
    )
    # Bad groups fail locally, before any collective.
    out["bad_group"] = _expect_error(
        lambda: _create("world", BASE_ENV, enable_normal_diagnose=True), TypeError
    )
    pair = dist.new_group([0, 1])
    if rank == 2:
        out["non_member"] = _expect_error(
            lambda: _create(pair, BASE_ENV, enable_normal_diagnose=True), ValueError
        )

    # Disabled (by default, explicitly, or with nothing to diagnose) is None on every rank,
    # and mixed values of the other settings do not matter then.
    out["default_off"] = create({})
    out["off"] = create(
        dict(BASE_ENV, DEEPEP_DIAGNOSE_ENABLE="0", DEEPEP_DIAGNOSE_ASYNC=str(rank % 2))
    )
    out["nothing"] = create(BASE_ENV, enable_normal_diagnose=False)

    # Calls on a valid instance.
    diag = create(BASE_ENV)
    out["before_start"] = _expect_error(diag.diagnose_normal_sync, RuntimeError)
    diag.start()
    out["neg_step"] = _expect_error(lambda: diag.diagnose_normal_sync(-1), ValueError)
    out["str_step"] = _expect_error(lambda: diag.diagnose_normal_sync("5"), TypeError)
    out["async_start"] = _expect_error(diag.start_async_diagnose, RuntimeError)
    out["bad_stop"] = _expect_error(lambda: diag.stop(timeout_seconds=-1), ValueError)
    out["ll_off"] = diag.get_stats_ll_stats_tensor()
    out["ll_sync_off"] = diag.diagnose_ll_sync()
    diag.stop()
    diag.stop()  # idempotent
    out["restart"] = _expect_error(diag.start, RuntimeError)
    return out


def test_bad_settings_and_arguments_fail_on_every_rank(tmp_path: Path) -> None:
    results = run_world(_bad_settings, 3, tmp_path)
    for rank, out in enumerate(results):
        assert "DEEPEP_DIAGNOSE_ASYNC differs" in out["mixed_async"]
        assert "True on global ranks [0, 2]" in out["mixed_async"]
        assert "False on global ranks [1]" in out["mixed_async"]
        assert "DEEPEP_DIAGNOSE_ENABLE differs" in out["mixed_enable"]
        assert "DEEPEP_DIAGNOSE_SYNC_STEP differs" in out["mixed_step"]
        assert "enable_ll_diagnose differs" in out["mixed_mode"]
        assert "ranks_per_node differs" in out["mixed_rpn"]
        assert "DEEPEP_DIAGNOSE_INTERVAL" in out["bad_interval"]
        assert "'soon'" in out["bad_interval"]
        if rank != 0:
            assert "global rank 0" in out["bad_interval"]
        assert "DEEPEP_DIAGNOSE_SYNC_STEP" in out["bad_step"] and "0" in out["bad_step"]
        assert "DEEPEP_DIAGNOSE_ENABLE" in out["bad_enable"] and "'maybe'" in out["bad_enable"]
        assert "DEEPEP_DIAGNOSE_THRESHOLD_COL" in out["bad_threshold"]
        assert "ranks_per_node" in out["bad_rpn"] and "EP size 3" in out["bad_rpn"]
        if rank != 1:
            assert "global rank 1" in out["bad_rpn"]
        assert "enable_normal_diagnose" in out["bad_flag"] and "'yes'" in out["bad_flag"]
        assert "snapshot_stream" in out["bad_stream"] and "'comm'" in out["bad_stream"]
        assert "snapshot_stream" in out["cpu_stream"] and "CUDA" in out["cpu_stream"]
        assert "publishers[0]" in out["bad_publisher"]
        assert "gather_timeout_seconds" in out["bad_timeout"]
        assert "group" in out["bad_group"] and "'world'" in out["bad_group"]
        assert out["default_off"] is None and out["off"] is None and out["nothing"] is None
        assert "start()" in out["before_start"]
        assert "diagnose_step" in out["neg_step"] and "-1" in out["neg_step"]
        assert "diagnose_step" in out["str_step"]
        assert "DEEPEP_DIAGNOSE_ASYNC=1" in out["async_start"]
        assert "timeout_seconds" in out["bad_stop"]
        assert out["ll_off"] == (None, None) and out["ll_sync_off"] is None
        assert "stopped" in out["restart"]
    assert (
        "not a member" in results[2]["non_member"] and "global rank 2" in results[2]["non_member"]
    )


def _explicit_config(rank: int, world: int) -> dict[str, Any]:
    """``create_from_env(config=...)``: every setting comes from the one object passed in."""
    from rankwatch import exporter
    from rankwatch.diagnosis.config import DiagnosisConfig, LowLatencyConfig, NormalConfig
    from rankwatch.exporter.config import DeepEPConfig, RankwatchConfig
    from rankwatch.exporter.deepep.diagnose import Diagnose

    group = dist.group.WORLD
    out: dict[str, Any] = {}
    config = RankwatchConfig.from_env(
        {},
        run_id="explicit-run",
        node_name_env="RW_TEST_NODE",
        deepep=DeepEPConfig(enable=True, async_mode=False, sync_step=2),
        diagnosis=DiagnosisConfig(
            normal=NormalConfig(notify_ratio=0.4, axis_slowdown=1.6),
            low_latency=LowLatencyConfig(thres_col=4.5),
        ),
    )
    # The environment disagrees on every setting, one of them invalid: none of it is read. It
    # still holds the node name, in the variable the object names.
    env = {
        "DEEPEP_DIAGNOSE_ENABLE": "0",
        "DEEPEP_DIAGNOSE_SYNC_STEP": "9",
        "DEEPEP_DIAGNOSE_NOTIFY_RATIO": "0.9",
        "DEEPEP_DIAGNOSE_THRESHOLD_COL": "-1",
        "RANKWATCH_NODE_NAME_ENV": "NOT_THIS_ONE",
        "RANKWATCH_RUN_ID": "env-run",
        "RW_TEST_NODE": f"Node-{rank}",
    }
    pub = Collect()
    diag = _create(group, env, config=config, enable_normal_diagnose=True, publishers=[pub])
    out["deepep"] = diag.config
    out["normal_config"] = diag.normal_config
    out["low_latency_config"] = diag.low_latency_config
    out["sync_step"] = diag.sync_step
    out["async"] = diag.enable_async
    out["layout"] = (diag.ranks_per_node, [(i.rank, i.hostname, i.local_rank) for i in diag.ranks])
    diag.start()
    sim = NormalSimulator(ep_size=world, ranks_per_node=world, seed=3, slow_rank=1)
    write_normal(diag, sim.window("baseline", 0), dist.get_rank(group))
    for _ in range(2):  # sync_step = 2 from the object (the environment says 9)
        diag.diagnose_normal_sync()
    diag.stop()
    out["runs"] = [r.run for r in pub.reports]

    # Bad config arguments fail on every rank: the rank that passed one names the argument, the
    # others name that rank.
    def create(config: Any) -> Any:
        return _create(group, BASE_ENV, config=config, enable_normal_diagnose=True)

    out["bad_type"] = _expect_error(lambda: create({"deepep": config.deepep}), TypeError)
    out["bad_on_one"] = _expect_error(
        lambda: create(config if rank == 0 else config.deepep),
        ValueError if rank == 0 else TypeError,
    )
    # Objects that disagree across the group are refused like environments that do.
    other = RankwatchConfig.from_env({}, deepep=DeepEPConfig(enable=True, sync_step=2 + rank))
    out["mixed"] = _expect_error(lambda: create(other), ValueError)

    # The use: the RankWatch that init() returned shares its one object with DeepEP.
    rw = exporter.init(
        metrics_enabled=False,
        otlp_enabled=False,
        deepep=DeepEPConfig(enable=True, async_mode=False, sync_step=5),
    )
    try:
        shared = Diagnose.create_from_env(group, config=rw.config)
        assert shared is not None
        out["shared"] = shared.config is rw.config.deepep and shared.sync_step == 5
        out["shared_thresholds"] = shared.normal_config is rw.config.diagnosis.normal
        shared.stop()
    finally:
        rw.close(10.0)
    return out


def test_explicit_config_is_the_only_source_of_settings(tmp_path: Path) -> None:
    from rankwatch.diagnosis.config import LowLatencyConfig, NormalConfig
    from rankwatch.exporter.config import DeepEPConfig

    results = run_world(_explicit_config, 2, tmp_path)
    for rank, out in enumerate(results):
        assert out["deepep"] == DeepEPConfig(enable=True, async_mode=False, sync_step=2)
        assert out["normal_config"] == NormalConfig(notify_ratio=0.4, axis_slowdown=1.6)
        assert out["low_latency_config"] == LowLatencyConfig(thres_col=4.5)
        assert out["sync_step"] == 2 and out["async"] is False
        # Hostnames from the variable the object names: one rank per node, local rank 0 each.
        assert out["layout"] == (1, [(0, "node-0", 0), (1, "node-1", 0)])
        assert out["runs"] == (["explicit-run"] if rank == 0 else [])
        assert "config: expected a RankwatchConfig" in out["bad_type"]
        assert "dict" in out["bad_type"]
        if rank == 0:
            assert "global rank 1" in out["bad_on_one"]
            assert "config: expected a RankwatchConfig" in out["bad_on_one"]
        else:
            assert "config: expected a RankwatchConfig" in out["bad_on_one"]
            assert "DeepEPConfig" in out["bad_on_one"]
        assert "DEEPEP_DIAGNOSE_SYNC_STEP differs" in out["mixed"]
        assert "2 on global ranks [0]" in out["mixed"] and "3 on global ranks [1]" in out["mixed"]
        assert out["shared"] is True and out["shared_thresholds"] is True

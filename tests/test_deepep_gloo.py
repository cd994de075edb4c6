"""DeepEP collector on real Gloo process groups across spawned processes.

Every rank plays DeepEP: it writes its column of the simulator's per-window matrices into its own
counter block through the bundle views (cumulatively), and the root must rebuild exactly the
simulator's windows. Worlds are small (2 to 4 ranks) because the machine has two cores.
"""

from __future__ import annotations

import datetime
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
import torch.multiprocessing as mp
from rankwatch.diagnosis.normal import NormalSimulator, NormalWindow, snapshot_counters
from rankwatch.diagnosis.normal.schema import COMBINE_BUNDLE, DISPATCH_BUNDLE, counter_slots
from rankwatch.diagnosis.window_report import WindowReport

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

BASE_ENV = {
    "DEEPEP_DIAGNOSE_ENABLE": "1",
    "DEEPEP_DIAGNOSE_ASYNC": "0",
    "DEEPEP_DIAGNOSE_SYNC_STEP": "1",
    "DEEPEP_DIAGNOSE_INTERVAL": "0.2",
    "DEEPEP_DIAGNOSE_WARMUP_SECONDS": "0",
}


# --------------------------------------------------------------------------- harness


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[[int, int], Any], rank: int, world: int, port: int, out: str) -> None:
    result: dict[str, Any]
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
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, str(tmp_path)), daemon=True)
        for r in range(world)
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
    from rankwatch.exporter.deepep import Diagnose

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
    warm_env = dict(BASE_ENV, DEEPEP_DIAGNOSE_WARMUP_SECONDS="0.8")
    pub2 = Collect()
    diag2 = _create(group, warm_env, enable_normal_diagnose=True, publishers=[pub2])
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

"""Ranks that die, freeze or restart under real Gloo worlds of spawned processes.

The faults come from outside, as they do in production: the parent test sends ``SIGKILL`` (a
rank killed mid-window, no goodbye), ``SIGSTOP``/``SIGCONT`` (a rank that stops sending for a
while: a debugger, swap, a frozen node, then comes back), and kills the root to restart the job
under a new world. Each rank writes what it saw to a JSON file; the parent asserts:

* windows name the missing ranks, and diagnosis covers a rank again once it is back;
* the surviving training threads never waited (their slowest step stays far below the fault's
  length) and never saw an exception;
* shutdown keeps its bound.

What a restart can and cannot do is written in ``docs/reliability.md``: the job's c10d store
lives on the root's process, so a root that dies takes the group with it; rankwatch's part is
that the other ranks keep training until the launcher restarts the job, and that the new root
serves ``/metrics`` on the same port at once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from tests.rank_processes import rank_process
from tests.servers import free_port

pytestmark = pytest.mark.multiproc

JOIN_TIMEOUT_S = 120.0


# ---- inside the spawned ranks ----------------------------------------------------------------


class Recorder:
    """A publisher that keeps every report as a dict."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []

    def publish(self, report: Any) -> None:
        d = report.to_dict()
        d["wall"] = time.time()
        self.reports.append(d)

    def close(self, timeout_seconds: float) -> None:
        pass


def _config(**overrides: Any) -> Any:
    from rankwatch.diagnosis.config import DiagnosisConfig, StepTimeConfig
    from rankwatch.exporter.config import RankwatchConfig

    diag = DiagnosisConfig(step_time=StepTimeConfig(live_window_steps=40))
    return RankwatchConfig.from_env(env={}, diagnosis=diag, **overrides)


def _mark(out: str, rank: int, what: str) -> None:
    Path(out, f"{what}.{rank}").write_text(str(time.time()))


def _train_steps(rw: Any, seconds: float, on_step: Callable[[int], None] | None = None) -> dict:
    """Explicit phases around local work (no collective in the training loop, so survivors keep
    going whatever happens to a peer). Returns step counts and timings."""
    import torch

    a = torch.randn(96, 96)
    start = time.monotonic()
    slowest, steps, stamps = 0.0, 0, []
    while time.monotonic() - start < seconds:
        t0 = time.monotonic()
        with rw.step():
            with rw.phase("input_wait"):
                time.sleep(0.003)
            with rw.phase("forward"):
                b = a @ a
            with rw.phase("backward"):
                (b @ a).sum()
                time.sleep(0.002)
        rw.collect()
        if on_step is not None:
            on_step(steps)
        took = time.monotonic() - t0
        slowest = max(slowest, took)
        steps += 1
        stamps.append(time.time())
    return {"steps": steps, "slowest_step_s": slowest, "last_step_at": stamps[-1] if stamps else 0}


def _entry(scenario: str, rank: int, world: int, port: int, out: str, extra: dict) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result: dict[str, Any] = {"rank": rank}
    Path(out, f"pid.{rank}").write_text(str(os.getpid()))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        torch.manual_seed(rank)  # the same weights and batches on every run
        SCENARIOS[scenario](rank, world, out, extra, result)
        if extra.get("destroy", True):
            dist.destroy_process_group()
    except BaseException:
        result["error"] = traceback.format_exc()
    Path(out, f"{rank}.json").write_text(json.dumps(result))


def scenario_kill_and_freeze(
    rank: int, world: int, out: str, extra: dict, result: dict[str, Any]
) -> None:
    """World 4, async windows every 0.25 s: the parent SIGKILLs rank 3, then freezes rank 2
    for 3 s with SIGSTOP and lets it go with SIGCONT."""
    import torch.distributed as dist

    from rankwatch.exporter.step_time.rank_watch import RankWatch

    rec = Recorder()
    rw = RankWatch(
        config=_config(interval_seconds=0.25, gather_timeout_seconds=1.0), publishers=[rec]
    )
    dist.barrier()
    _mark(out, rank, "running")
    result.update(_train_steps(rw, extra["run_s"]))
    t0 = time.monotonic()
    rw.close(5.0)
    result.update(close_s=time.monotonic() - t0, reports=rec.reports)


def scenario_deepep(rank: int, world: int, out: str, extra: dict, result: dict[str, Any]) -> None:
    """World 3, DeepEP async collection every 0.3 s over its own Gloo group: rank 2 is frozen
    for 1.5 s (shorter than the gather timeout), later killed."""
    import torch
    import torch.distributed as dist

    from rankwatch.diagnosis.deepep.normal.schema import (
        COMBINE_BUNDLE,
        DISPATCH_BUNDLE,
        counter_slots,
    )
    from rankwatch.diagnosis.deepep.normal.simulator import NormalSimulator
    from rankwatch.diagnosis.deepep.normal.window import snapshot_counters
    from rankwatch.exporter.deepep.diagnose import Diagnose

    rec = Recorder()
    env = {
        "DEEPEP_DIAGNOSE_ENABLE": "1",
        "DEEPEP_DIAGNOSE_ASYNC": "1",
        "DEEPEP_DIAGNOSE_INTERVAL": "0.3",
    }
    diag = Diagnose.create_from_env(
        dist.group.WORLD, env=env, publishers=[rec], ranks_per_node=3, gather_timeout_seconds=4.0
    )
    assert diag is not None
    sim = NormalSimulator(world, 3, seed=5, slow_rank=1)
    slots = counter_slots(world)
    views = [
        (v, slots[key])
        for bundle, order in (
            (diag.get_normal_dispatch_stats_tensor(), DISPATCH_BUNDLE),
            (diag.get_normal_combine_stats_tensor(), COMBINE_BUNDLE),
        )
        for v, key in zip(bundle, order, strict=True)
    ]
    rows = [snapshot_counters(sim.window("baseline", k))[rank] for k in range(8)]

    def write(step: int) -> None:
        # DeepEP's kernels: add this rank's received counts for one dispatch/combine.
        row = rows[step % len(rows)]
        for view, s in views:
            view += torch.from_numpy(row[s.offset : s.stop] // 50)

    diag.start()
    dist.barrier()
    _mark(out, rank, "running")

    class Plain:
        def step(self) -> Any:
            return _Nothing()

        def phase(self, name: str) -> Any:
            return _Nothing()

        def collect(self) -> None:
            pass

    result.update(_train_steps(Plain(), extra["run_s"], on_step=write))
    t0 = time.monotonic()
    diag.stop(timeout_seconds=3.0)
    result.update(
        stop_s=time.monotonic() - t0,
        reports=[
            {k: r[k] for k in ("window_index", "normal_invalid_reason", "wall")}
            | {"normal": r["normal"] is not None}
            for r in rec.reports
        ],
        collector_error=diag.collector_error,
        rejected=dict(diag.rejected_windows),
        dropped=diag.dropped_snapshots,
    )


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def scenario_root_restart(
    rank: int, world: int, out: str, extra: dict, result: dict[str, Any]
) -> None:
    """World 2 with /metrics on the root. ``phase`` 1: the parent SIGKILLs the root; rank 1
    trains on, then closes. ``phase`` 2 (a new world, same metrics port): the RankWatch is
    closed and created again halfway, as after an in-job restart of the monitoring."""
    import torch.distributed as dist

    from rankwatch.exporter.publish.hub import PublisherHub
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    def start() -> Any:
        cfg = _config(
            interval_seconds=0.25,
            gather_timeout_seconds=1.0,
            metrics_port=extra["metrics_port"],
            run_id=f"restart-{extra['phase']}",
        )
        pubs = [PublisherHub(cfg, otlp=False)] if rank == 0 else []
        return RankWatch(config=cfg, publishers=pubs)

    rw = start()
    dist.barrier()
    _mark(out, rank, "running")
    if extra["phase"] == 1:
        result.update(_train_steps(rw, extra["run_s"]))
    else:
        first = _train_steps(rw, extra["run_s"] / 2)
        rw.close(5.0)
        _mark(out, rank, "closed")
        rw = start()
        second = _train_steps(rw, extra["run_s"] / 2)
        result.update(steps=first["steps"] + second["steps"])
        result["slowest_step_s"] = max(first["slowest_step_s"], second["slowest_step_s"])
    t0 = time.monotonic()
    rw.close(5.0)
    result["close_s"] = time.monotonic() - t0


class _Lines(logging.Handler):
    """Keeps the aggregator's log lines (the root process's ``rankwatch.aggregator`` logger)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def scenario_aggregator(
    rank: int, world: int, out: str, extra: dict, result: dict[str, Any]
) -> None:
    """World 3, async windows every 0.25 s, an aggregator that may stand still for 2 s: the
    parent kills the root's aggregator, then stops the next one for good, then stops the third
    for 1 s only (a slow receiver). Rank 0 keeps its aggregator's pid in ``agg.pid``."""
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    lines = _Lines()
    logging.getLogger("rankwatch.aggregator").addHandler(lines)
    rec = Recorder()
    rw = RankWatch(
        config=_config(
            interval_seconds=0.25, gather_timeout_seconds=1.0, aggregator_stall_seconds=2.0
        ),
        publishers=[rec],
    )
    pid_file = Path(out, "agg.pid")

    def on_step(_: int) -> None:
        agg = rw._aggregator
        known = pid_file.read_text() if pid_file.exists() else ""
        if agg is not None and agg.pid is not None and agg.address() and known != str(agg.pid):
            pid_file.write_text(str(agg.pid))

    _mark(out, rank, "running")
    result.update(_train_steps(rw, extra["run_s"], on_step if rank == 0 else None))
    t0 = time.monotonic()
    rw.close(5.0)
    agg = rw._aggregator
    result.update(
        close_s=time.monotonic() - t0,
        reports=rec.reports,
        lines=lines.lines,
        restarts=None if agg is None else agg.restarts,
    )


def scenario_leaders(rank: int, world: int, out: str, extra: dict, result: dict[str, Any]) -> None:
    """World 8 as two nodes of 4 (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), node leaders on: ranks
    1-3 ship through rank 0, ranks 5-7 through rank 4 (no collective here: the point is whose
    rows arrive). The parent SIGKILLs rank 4, the second node's leader."""
    from rankwatch.exporter.step_time.rank_watch import RankWatch
    from rankwatch.exporter.step_time.shipping import UNIX

    os.environ.update(LOCAL_RANK=str(rank % 4), LOCAL_WORLD_SIZE="4")
    lines = _Lines()
    logging.getLogger("rankwatch.exporter.step_time.node_relay").addHandler(lines)
    rec = Recorder()
    rw = RankWatch(
        config=_config(interval_seconds=0.25, gather_timeout_seconds=1.0, node_leaders="on"),
        publishers=[rec],
    )
    collector = rw._collector
    assert collector is not None
    _mark(out, rank, "running")
    routes: list[str] = []

    def on_step(step: int) -> None:
        peer = collector.connection.peer
        kind = "" if peer is None else ("leader" if peer[1] == UNIX else "aggregator")
        if kind and (not routes or routes[-1] != kind):
            routes.append(kind)

    result.update(_train_steps(rw, extra["run_s"], on_step))
    rw.close(5.0)
    relay = collector.relay
    result.update(
        reports=rec.reports,
        lines=lines.lines,
        routes=routes,
        relayed=None if relay is None else relay.forwarded,
    )


SCENARIOS: dict[str, Callable[[int, int, str, dict, dict[str, Any]], None]] = {
    "aggregator": scenario_aggregator,
    "leaders": scenario_leaders,
    "kill_and_freeze": scenario_kill_and_freeze,
    "deepep": scenario_deepep,
    "root_restart": scenario_root_restart,
}


# ---- the parent ------------------------------------------------------------------------------


class World:
    """Spawned ranks plus the handles the parent uses to hurt them."""

    def __init__(self, scenario: str, world: int, out: Path, extra: dict[str, Any]) -> None:
        port = free_port()
        self.out = out
        self.procs = [
            rank_process(_entry, (scenario, r, world, port, str(out), extra)) for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def wait_running(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all((self.out / f"running.{r}").exists() for r in range(len(self.procs))):
                return
            dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None]
            if dead:
                break
            time.sleep(0.05)
        self.kill_all()
        pytest.fail(f"ranks did not start training: {self.collect()}")

    def signal(self, rank: int, sig: int) -> float:
        os.kill(self.procs[rank].pid, sig)
        return time.time()

    def join(self) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(self.procs) if p.is_alive()]
        self.kill_all()
        assert not hung, f"ranks {hung} hung: {self.collect()}"
        return self.collect()

    def kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.join(5)

    def collect(self) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        for r, p in enumerate(self.procs):
            f = self.out / f"{r}.json"
            out[r] = json.loads(f.read_text()) if f.exists() else {}
            out[r]["exitcode"] = p.exitcode
        return out


def _ok(res: dict[str, Any]) -> None:
    assert "error" not in res, res.get("error")
    assert res["exitcode"] == 0, res


def test_killed_and_frozen_ranks_are_named_missing_and_the_frozen_one_comes_back(
    tmp_path: Path,
) -> None:
    run_s, freeze_s = 9.0, 3.0
    w = World("kill_and_freeze", 4, tmp_path, {"run_s": run_s})
    w.wait_running()
    time.sleep(1.5)
    killed_at = w.signal(3, signal.SIGKILL)  # mid-window: windows come every 0.25 s
    time.sleep(1.0)
    stopped_at = w.signal(2, signal.SIGSTOP)
    time.sleep(freeze_s)
    resumed_at = w.signal(2, signal.SIGCONT)
    res = w.join()

    for r in (0, 1, 2):
        _ok(res[r])
    assert res[3]["exitcode"] == -signal.SIGKILL
    live = [r for r in res[0]["reports"] if r["window_kind"] == "live"]
    summary = [r for r in res[0]["reports"] if r["window_kind"] == "summary"]

    def when(r: dict[str, Any]) -> float:
        return float(r["wall"])

    dead = [r for r in live if 3 in r["missing_ranks"]]
    frozen = [r for r in live if 2 in r["missing_ranks"] and stopped_at < when(r) < resumed_at]
    back = [r for r in live if when(r) > resumed_at + 1.0 and r["missing_ranks"] == [3]]
    print(
        f"{len(live)} live windows; killed rank 3 missing from {len(dead)}, frozen rank 2 "
        f"missing from {len(frozen)} during its {freeze_s:.0f} s stop, {len(back)} windows with "
        f"it back; first window naming rank 3 {when(dead[0]) - killed_at:.2f} s after the kill; "
        f"survivors' slowest steps {[round(res[r]['slowest_step_s'], 3) for r in (0, 1)]} s, "
        f"close {[round(res[r]['close_s'], 2) for r in (0, 1, 2)]} s"
    )
    # The kill shows within the gather timeout (1 s) plus a window interval or two.
    assert dead and when(dead[0]) - killed_at < 3.0
    assert all(3 in r["missing_ranks"] for r in live if when(r) > killed_at + 3.0)
    # The frozen rank is named missing while frozen, and diagnosed again once it is back.
    assert len(frozen) >= 2, [(when(r) - stopped_at, r["missing_ranks"]) for r in live]
    assert back, [(when(r) - resumed_at, r["missing_ranks"]) for r in live]
    assert 2 in back[-1]["step_time"]["ranks"]
    assert back[-1]["step_time"]["missing_ranks"] == [3]
    assert len(summary) == 1 and summary[0]["missing_ranks"] == [3]
    # The survivors' training threads never waited for any of it.
    for r in (0, 1):
        assert res[r]["slowest_step_s"] < 0.5, res[r]["slowest_step_s"]
        assert res[r]["last_step_at"] > resumed_at  # they trained through the whole fault
    for r in (0, 1, 2):
        assert res[r]["close_s"] < 5.5, res[r]["close_s"]


def test_deepep_collection_survives_a_frozen_rank_and_stops_cleanly_after_a_death(
    tmp_path: Path,
) -> None:
    w = World("deepep", 3, tmp_path, {"run_s": 7.0})
    w.wait_running()
    time.sleep(1.5)
    stopped_at = w.signal(2, signal.SIGSTOP)
    time.sleep(1.5)  # shorter than the 4 s gather timeout: the gather just waits
    resumed_at = w.signal(2, signal.SIGCONT)
    time.sleep(1.5)
    killed_at = w.signal(2, signal.SIGKILL)
    res = w.join()

    for r in (0, 1):
        _ok(res[r])
    assert res[2]["exitcode"] == -signal.SIGKILL
    reports = res[0]["reports"]
    after_resume = [r for r in reports if resumed_at < r["wall"] < killed_at]
    print(
        f"{len(reports)} DeepEP windows ({len(after_resume)} between the freeze and the kill), "
        f"rejected {res[0]['rejected']}, dropped snapshots {res[0]['dropped']}; collector error "
        f"root: {res[0]['collector_error']!r}; survivors' slowest steps "
        f"{[round(res[r]['slowest_step_s'], 3) for r in (0, 1)]} s, stop "
        f"{[round(res[r]['stop_s'], 2) for r in (0, 1)]} s"
    )
    # Collection resumed after the freeze: windows kept coming, all diagnosed. The one
    # exception is an idle window: a gather that waited out the freeze can be followed at once
    # by the next snapshot, with no counts in between; it is rejected as empty, by name.
    assert len(after_resume) >= 2
    assert all(
        (r["normal"] and r["normal_invalid_reason"] is None)
        or (not r["normal"] and r["normal_invalid_reason"] == "empty_window")
        for r in reports
    ), [r["normal_invalid_reason"] for r in reports]
    assert sum(not r["normal"] for r in reports) <= 2
    assert set(res[0]["rejected"]) <= {"normal:empty_window"}, res[0]["rejected"]
    assert [r["window_index"] for r in reports] == list(range(len(reports)))
    # The death ended collection on both survivors with the error recorded, not raised.
    for r in (0, 1):
        assert res[r]["collector_error"], res[r]
        assert res[r]["slowest_step_s"] < 0.5, res[r]["slowest_step_s"]
        assert res[r]["stop_s"] <= 3.0 + 0.5, res[r]["stop_s"]
    assert stopped_at < resumed_at < killed_at


def _scrape(port: int) -> dict[str, float] | None:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except OSError:
        return None
    body = data.split(b"\r\n\r\n", 1)[-1].decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for sample in fam.samples:
            if sample.name in ("rankwatch_window_index", "rankwatch_exporter_start_time_seconds"):
                out[sample.name] = sample.value
                out["run"] = sample.labels.get("run", "")  # type: ignore[assignment]
    return out


def test_root_killed_then_the_job_restarts_on_the_same_metrics_port(tmp_path: Path) -> None:
    metrics_port = free_port()
    # Phase 1: the root dies; rank 1 keeps training and closes within its bound.
    (tmp_path / "one").mkdir()
    extra1 = {"run_s": 6.0, "phase": 1, "metrics_port": metrics_port, "destroy": False}
    w1 = World("root_restart", 2, tmp_path / "one", extra1)
    w1.wait_running()
    deadline = time.monotonic() + 20
    first = None
    while time.monotonic() < deadline:
        first = _scrape(metrics_port)
        if first and first.get("rankwatch_window_index", -1) >= 2:
            break
        time.sleep(0.2)
    assert first and first["rankwatch_window_index"] >= 2, first
    killed_at = w1.signal(0, signal.SIGKILL)
    res1 = w1.join()
    assert res1[0]["exitcode"] == -signal.SIGKILL
    _ok(res1[1])

    # Phase 2: the launcher restarts the job: a new world, the same metrics port at once.
    (tmp_path / "two").mkdir()
    w2 = World(
        "root_restart",
        2,
        tmp_path / "two",
        {"run_s": 6.0, "phase": 2, "metrics_port": metrics_port},
    )
    w2.wait_running()
    seen: list[dict[str, float]] = []
    while any(p.is_alive() for p in w2.procs):
        got = _scrape(metrics_port)
        if got:
            seen.append(got)
        time.sleep(0.1)
    res2 = w2.join()
    for r in (0, 1):
        _ok(res2[r])

    starts = sorted({s["rankwatch_exporter_start_time_seconds"] for s in seen})
    print(
        f"rank 1 after the root's death: {res1[1]['steps']} steps, last "
        f"{res1[1]['last_step_at'] - killed_at:.2f} s after the kill, slowest "
        f"{res1[1]['slowest_step_s'] * 1e3:.0f} ms, close {res1[1]['close_s']:.2f} s; restarted "
        f"job: {len(seen)} scrapes, exporter start times {len(starts)}, closes "
        f"{[round(res2[r]['close_s'], 2) for r in (0, 1)]} s"
    )
    # Rank 1 trained on through the root's death: its thread never waited, close is bounded.
    assert res1[1]["last_step_at"] > killed_at + 3.0
    assert res1[1]["slowest_step_s"] < 0.5
    assert res1[1]["close_s"] < 5.5
    # The new job served /metrics on the same port; the in-job re-creation shows as a second
    # exporter start (a counter reset Prometheus understands) with windows counted afresh.
    assert seen and all(s["run"] == "restart-2" for s in seen)
    assert len(starts) == 2 and starts[0] > first["rankwatch_exporter_start_time_seconds"]
    later = [
        s["rankwatch_window_index"]
        for s in seen
        if s["rankwatch_exporter_start_time_seconds"] == starts[1] and "rankwatch_window_index" in s
    ]
    assert later and min(later) <= 2
    for r in (0, 1):
        assert res2[r]["slowest_step_s"] < 0.5 and res2[r]["close_s"] < 5.5


def _aggregator_pid(out: Path, other_than: int = 0, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        f = out / "agg.pid"
        if f.exists() and (text := f.read_text()) and int(text) != other_than:
            return int(text)
        time.sleep(0.05)
    raise AssertionError(f"no aggregator pid other than {other_than} within {timeout} s")


def test_the_aggregator_killed_stuck_or_slow_costs_windows_only(tmp_path: Path) -> None:
    """The root's aggregator SIGKILLed, then SIGSTOPped for good, then for 1 s: training goes
    on, each fault is one clear line, the windows stop and resume, the run ends with its
    summary."""
    w = World("aggregator", 3, tmp_path, {"run_s": 14.0})
    w.wait_running()
    first = _aggregator_pid(tmp_path)
    time.sleep(1.5)
    killed_at = time.time()
    os.kill(first, signal.SIGKILL)
    second = _aggregator_pid(tmp_path, other_than=first)
    time.sleep(1.0)
    stuck_at = time.time()
    os.kill(second, signal.SIGSTOP)  # killed by the root after 2 s without a beat
    third = _aggregator_pid(tmp_path, other_than=second)
    back_at = time.time()
    time.sleep(1.0)
    os.kill(third, signal.SIGSTOP)
    slow_at = time.time()
    time.sleep(1.0)  # under the 2 s the root allows: a slow receiver, not a stuck one
    os.kill(third, signal.SIGCONT)
    res = w.join()
    for r in range(3):
        _ok(res[r])
    root = res[0]
    live = [r for r in root["reports"] if r["window_kind"] == "live"]
    walls = [float(r["wall"]) for r in live]
    gaps = [(round(a - killed_at, 1), round(b - a, 1)) for a, b in pairwise(walls) if b - a > 0.75]
    print(
        f"{len(live)} live windows; gaps over 0.75 s at {gaps} s after the kill; "
        f"lines {root['lines']}; slowest steps "
        f"{[round(res[r]['slowest_step_s'], 3) for r in range(3)]} s"
    )
    assert root["restarts"] == 2, root["restarts"]
    # One line when each ended, one when each was back, one for the stuck one.
    ended = [line for line in root["lines"] if "ended" in line]
    stuck = [line for line in root["lines"] if "has not moved" in line]
    back = [line for line in root["lines"] if "is back (pid" in line]
    assert len(ended) == 2 and len(stuck) == 1 and len(back) == 2, root["lines"]
    # The windows stop while it is gone and resume once it is back, after each fault.
    assert any(killed_at < t < stuck_at for t in walls), walls
    assert any(t > back_at for t in walls)
    assert any(t > slow_at + 1.5 for t in walls)
    # Training never waited for any of it.
    for r in range(3):
        assert res[r]["slowest_step_s"] < 0.5, res[r]["slowest_step_s"]
        assert res[r]["close_s"] < 5.5, res[r]["close_s"]
    # The slow receiver lost nothing: its windows continue the step ranges without a gap,
    # and the run ends on its summary with every rank.
    summary = [r for r in root["reports"] if r["window_kind"] == "summary"]
    assert len(summary) == 1 and summary[0]["missing_ranks"] == []


def test_node_leaders_relay_their_nodes_and_a_lost_leaders_ranks_ship_directly(
    tmp_path: Path,
) -> None:
    """Two nodes of four ranks: the followers ship through their node's leader (one
    connection per node to the aggregator) and every rank's rows reach the windows; when the
    second node's leader is killed its ranks ship directly, with one line each, and stay in
    the windows."""
    w = World("leaders", 8, tmp_path, {"run_s": 9.0})
    w.wait_running()
    time.sleep(3.0)
    killed_at = w.signal(4, signal.SIGKILL)
    res = w.join()
    for r in (0, 1, 2, 3, 5, 6, 7):
        _ok(res[r])
    assert res[4]["exitcode"] == -signal.SIGKILL
    # Followers went through their leader first; the lost leader's went direct after.
    for r in (1, 2, 3):
        assert res[r]["routes"] == ["leader"], (r, res[r]["routes"])
    for r in (5, 6, 7):
        assert res[r]["routes"] == ["leader", "aggregator"], (r, res[r]["routes"])
        assert len(res[r]["lines"]) == 1 and "leader (rank 4)" in res[r]["lines"][0]
    assert res[0]["relayed"] > 0
    live = [r for r in res[0]["reports"] if r["window_kind"] == "live"]
    before = [r for r in live if float(r["wall"]) < killed_at and r["step_time"]]
    after = [r for r in live if float(r["wall"]) > killed_at + 3.0 and r["step_time"]]
    assert before and after
    for window in before:
        assert window["missing_ranks"] == [] and window["step_time"]["ranks"] == list(range(8))
    for window in after:  # the followers of the lost leader are back; only it is missing
        assert window["missing_ranks"] == [4], window["missing_ranks"]
        means = window["step_time"]["rank_means"]
        assert all(means[str(r)]["step"] is not None for r in (0, 1, 2, 3, 5, 6, 7)), means

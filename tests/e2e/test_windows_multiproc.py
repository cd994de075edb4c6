"""Cross-rank windows on real Gloo worlds of spawned processes.

Each test spawns a small world (2 to 4 ranks) that trains a tiny MLP; every rank writes what it
saw (its rows, the reports its root published, how long things took) to a JSON file, and the
parent asserts. Stragglers are sleeps of 40 ms, large against the few milliseconds a step of
the tiny model takes, so the verdicts hold on a loaded two-core machine.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.rank_processes import rank_process
from tests.servers import free_port

pytestmark = pytest.mark.multiproc

SLEEP_S = 0.04  # the injected straggler delay
JOIN_TIMEOUT_S = 150.0

# ---- helpers run inside the spawned ranks ----------------------------------------------------


class Recorder:
    """A publisher that keeps every report as a dict (what the parent asserts on)."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []

    def publish(self, report: Any) -> None:
        d = report.to_dict()
        d["monotonic"] = time.monotonic()
        self.reports.append(d)

    def close(self, timeout_seconds: float) -> None:
        pass


def _config(**overrides: Any) -> Any:
    from rankwatch.diagnosis.config import DiagnosisConfig, StepTimeConfig
    from rankwatch.exporter.config import RankwatchConfig

    live = overrides.pop("live_window_steps", 100)
    overrides.setdefault("warmup_steps", 0)  # the scenarios count steps from the first one
    diag = DiagnosisConfig(step_time=StepTimeConfig(live_window_steps=live))
    return RankwatchConfig.from_env(env={}, diagnosis=diag, **overrides)


def _mlp() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


class _Knobs:
    """Per-process switches the straggler scenario flips as the steps go by."""

    step = 0
    slow_forward = False
    slow_h2d = False


class SlowForward:
    """Forward pre hook on the inner model: sleeps while ``_Knobs.slow_forward`` is on."""

    def __call__(self, module: Any, args: Any) -> None:
        if _Knobs.slow_forward:
            time.sleep(SLEEP_S)


class Batch:
    """(x, y) whose move to the device sleeps while ``_Knobs.slow_h2d`` is on."""

    def __init__(self, x: Any, y: Any) -> None:
        self.x, self.y = x, y

    def to(self, device: Any, non_blocking: bool = False) -> Batch:
        if _Knobs.slow_h2d:
            time.sleep(SLEEP_S)
        return Batch(self.x.to(device), self.y.to(device))


class Loader:
    """``n`` batches; ``delay(i)`` seconds of sleep before batch ``i`` (the input pipeline)."""

    def __init__(self, n: int, delay: Callable[[int], float]) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        import torch

        gen = torch.Generator().manual_seed(1)
        for i in range(self.n):
            _Knobs.step = i
            d = self.delay(i)
            if d:
                time.sleep(d)
            yield Batch(torch.randn(16, 32, generator=gen), torch.randn(16, 1, generator=gen))


def _train(rw: Any, model: Any, opt: Any, loader: Any) -> None:
    import torch

    for batch in loader:
        loss = torch.nn.functional.mse_loss(model(batch.x), batch.y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        rw.collect()


def _rows(rw: Any) -> list[list[float | None]]:
    timer = rw.timer
    rows = timer.ring[: timer.written].tolist()
    return [[None if isinstance(v, float) and math.isnan(v) else v for v in r] for r in rows]


def _entry(rank: int, world: int, port: int, scenario: str, out: str) -> None:
    os.environ["LOCAL_RANK"] = str(100 + rank)
    # As on Kubernetes (downward API spec.nodeName): each rank on a node of its own.
    os.environ["NODE_NAME"] = f"Node-{rank}"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result: dict[str, Any] = {"rank": rank, "out": out}
    try:
        import torch

        torch.set_num_threads(1)
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        SCENARIOS[scenario](rank, world, result)
        dist.destroy_process_group()
    except BaseException:
        result["error"] = traceback.format_exc()
    Path(out, f"{rank}.json").write_text(json.dumps(result))


# ---- scenarios (one per spawned world) -----------------------------------------------------

PHASE_STEPS = 20  # steps per scenario phase; also sync_step and the live window
BULK_STEPS = 1300  # more than two messages' worth of rows


def scenario_kinds(rank: int, world: int, result: dict[str, Any]) -> None:
    """DDP, watch(), sync mode: warm-up, then an input, a compute and an H2D straggler."""
    import torch

    from rankwatch.exporter.step_time.rank_watch import RankWatch

    phases = ["warmup", "input", "compute", "h2d"]
    culprit = {"input": 1, "compute": 2, "h2d": 1}

    def phase_of(i: int) -> str:
        return phases[min(i // PHASE_STEPS, len(phases) - 1)]

    def delay(i: int) -> float:
        p = phase_of(i)
        _Knobs.slow_forward = p == "compute" and rank == culprit[p]
        _Knobs.slow_h2d = p == "h2d" and rank == culprit[p]
        return SLEEP_S if p == "input" and rank == culprit[p] else 0.0

    inner = _mlp()
    inner.register_forward_pre_hook(SlowForward())
    model = torch.nn.parallel.DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rec = Recorder()
    cfg = _config(
        async_mode=False,
        sync_step=PHASE_STEPS,
        live_window_steps=PHASE_STEPS,
        gather_timeout_seconds=20.0,
    )
    rw = RankWatch(config=cfg, publishers=[rec])
    loader = rw.watch(model, opt, Loader(PHASE_STEPS * len(phases), delay))
    _train(rw, model, opt, loader)
    # The last round's window is built on the background thread: give it a moment.
    deadline = time.monotonic() + 20
    while rw.is_root and len(rec.reports) < len(phases) and time.monotonic() < deadline:
        time.sleep(0.05)
    rw.close(10.0)
    result.update(reports=rec.reports, strategy=rw.strategy, rows=_rows(rw))


def scenario_equivalence(rank: int, world: int, result: dict[str, Any]) -> None:
    """Explicit API vs watch() on the same DDP model; then FSDP detection."""
    import torch

    from rankwatch.exporter.step_time.rank_watch import RankWatch

    # Bad groups fail before any collective call, naming the field and the value.
    errors = []
    for bad in ([0, world + 3], [0, 0], [], ["0"], [-1]):
        try:
            RankWatch(group=bad, config=_config())
            errors.append(None)
        except (TypeError, ValueError) as exc:
            errors.append([type(exc).__name__, str(exc)])
    result["bad_groups"] = errors

    n = 8
    inner = _mlp()
    inner.register_forward_pre_hook(SlowForward())
    model = torch.nn.parallel.DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _Knobs.slow_forward = True  # every rank: forward >= SLEEP_S on both APIs
    _Knobs.slow_h2d = True
    cfg = _config(async_mode=False, sync_step=4, gather_timeout_seconds=20.0)

    rec = Recorder()
    rw = RankWatch(config=cfg, publishers=[rec])
    it = iter(Loader(n, lambda i: 0.0))
    for _ in range(n):
        with rw.step():
            with rw.phase("input_wait"):
                batch = next(it)
            with rw.phase("h2d"):
                batch = batch.to(torch.device("cpu"))
            with rw.phase("forward"):
                loss = torch.nn.functional.mse_loss(model(batch.x), batch.y)
            with rw.phase("backward"):
                loss.backward()
            with rw.phase("optimizer"):
                opt.step()
            opt.zero_grad()
        rw.collect()
    result["explicit_rows"] = _rows(rw)
    result["explicit_strategy"] = rw.strategy
    rw.close(10.0)
    result["explicit_reports"] = rec.reports

    rec = Recorder()
    rw = RankWatch(config=cfg, publishers=[rec])
    _train(rw, model, opt, rw.watch(model, opt, Loader(n, lambda i: 0.0)))
    result["watch_rows"] = _rows(rw)
    result["watch_strategy"] = rw.strategy
    rw.close(10.0)
    result["watch_reports"] = rec.reports

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _Knobs.slow_forward = _Knobs.slow_h2d = False
    sharded = _mlp()
    fully_shard(sharded, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.SGD(sharded.parameters(), lr=0.01)
    rec = Recorder()
    rw = RankWatch(config=cfg, publishers=[rec])
    _train(rw, sharded, opt, rw.watch(sharded, opt, Loader(n, lambda i: 0.0)))
    result["fsdp_strategy"] = rw.strategy
    result["fsdp_rows"] = _rows(rw)
    rw.close(10.0)
    result["fsdp_reports"] = rec.reports
    group = sharded._get_fsdp_state()._fsdp_param_group
    result["fsdp_collectives_restored"] = not {"unshard", "post_backward"} & set(vars(group))

    # One shipment of more rows than a message holds: it travels as several chunks.
    rec = Recorder()
    rw = RankWatch(config=_config(async_mode=False, sync_step=10_000), publishers=[rec])
    for _ in range(BULK_STEPS):
        with rw.step(), rw.phase("forward"):
            pass
        rw.collect()
    rw.close(10.0)
    result["bulk_reports"] = rec.reports


def scenario_world4(rank: int, world: int, result: dict[str, Any]) -> None:
    """Part 1: subgroup [1, 3] (non-contiguous) with DDP over it and an input straggler on 3.
    Part 2: the whole world, async, explicit API, rank 2 killed and rank 3 stalled mid-run."""
    import torch
    import torch.distributed as dist

    from rankwatch.exporter.step_time.rank_watch import RankWatch

    # ---- part 1
    train_pg = dist.new_group([1, 3], backend="gloo")
    rec = Recorder()
    cfg = _config(interval_seconds=0.3, gather_timeout_seconds=5.0)
    rw = RankWatch(group=[1, 3], config=cfg, publishers=[rec])
    result["sub_active"] = rw.active
    if rank in (1, 3):
        model = torch.nn.parallel.DistributedDataParallel(_mlp(), process_group=train_pg)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = rw.watch(model, opt, Loader(40, lambda i: SLEEP_S if rank == 3 else 0.0))
        _train(rw, model, opt, loader)
    rw.close(10.0)
    result["sub_reports"] = rec.reports
    result["sub_latest"] = None if rw.latest_report is None else rw.latest_report.to_dict()
    if rank in (1, 3):
        # The same subgroup given as a process-group handle: only its members construct it.
        rw = RankWatch(group=train_pg, config=cfg)
        for _ in range(5):
            with rw.step(), rw.phase("forward"):
                pass
        rw.close(10.0)
        latest = rw.latest_report
        result["handle_ranks"] = None if latest is None else [i.rank for i in latest.ranks]

    # ---- part 2
    rec = Recorder()
    cfg = _config(interval_seconds=0.25, gather_timeout_seconds=1.5)
    rw = RankWatch(config=cfg, publishers=[rec])
    # Creating a lazily connected group waits for nobody, and ranks 1 and 3 come from part 1's
    # training: line the ranks up, as a job's own collectives would, so that the 9 s runs
    # overlap (else the root closes, waits out its final deadline and leaves, seconds before
    # ranks 1 and 3 ship their final rows).
    dist.barrier()
    run_s, kill_at, stall_at, stall_s = 9.0, 15, 40, 4.0
    start = time.monotonic()
    i = 0
    slow_step_s = 0.0
    while time.monotonic() - start < run_s:
        if rank == 2 and i == kill_at:
            os._exit(3)  # dies mid-run without a word
        t0 = time.monotonic()
        with rw.step():
            with rw.phase("input_wait"):
                time.sleep(0.004)
            with rw.phase("forward"):
                time.sleep(0.004)
                if rank == 3 and i == stall_at:
                    time.sleep(stall_s)  # the training thread hangs, then recovers
            with rw.phase("backward"):
                time.sleep(0.004)
        rw.collect()
        if rank != 3 or i != stall_at:
            slow_step_s = max(slow_step_s, time.monotonic() - t0)
        i += 1
    t0 = time.monotonic()
    rw.close(4.0)
    result.update(
        steps=i,
        close_s=time.monotonic() - t0,
        slowest_step_s=slow_step_s,
        reports=rec.reports,
        started=start,
    )


def scenario_ship_and_exit(rank: int, world: int, result: dict[str, Any]) -> None:
    """Ranks 1 and 2 close (their final rows shipped) and leave the process at once, before
    the root reads them; the root trains on, then closes."""
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    rec = Recorder()
    rw = RankWatch(config=_config(interval_seconds=0.25), publishers=[rec])
    for _ in range(30 if rank else 60):
        with rw.step(), rw.phase("forward"):
            time.sleep(0.02 if rank == 2 else 0.01)
    if rank:
        rw.close(5.0)
        # Gone before the root has polled: its next receive from this rank cannot be posted.
        Path(result["out"], f"{rank}.json").write_text(json.dumps(result))
        os._exit(0)
    time.sleep(1.5)
    rw.close(5.0)
    result["reports"] = rec.reports


SCENARIOS: dict[str, Callable[[int, int, dict[str, Any]], None]] = {
    "ship_and_exit": scenario_ship_and_exit,
    "kinds": scenario_kinds,
    "equivalence": scenario_equivalence,
    "world4": scenario_world4,
}


# ---- parent side ---------------------------------------------------------------------------


def run_world(scenario: str, world: int, tmp_path: Path) -> dict[int, dict[str, Any]]:
    port = free_port()
    procs = [rank_process(_entry, (r, world, port, scenario, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not hung, f"ranks {hung} hung in scenario {scenario}"
    out: dict[int, dict[str, Any]] = {}
    for r, p in enumerate(procs):
        f = tmp_path / f"{r}.json"
        out[r] = json.loads(f.read_text()) if f.exists() else {"exitcode": p.exitcode}
        out[r]["exitcode"] = p.exitcode
    return out


def _ok(res: dict[str, Any]) -> None:
    assert "error" not in res, res.get("error")
    assert res["exitcode"] == 0, res


def test_straggler_kinds_named_with_culprit_under_ddp_watch_sync(tmp_path: Path) -> None:
    res = run_world("kinds", 3, tmp_path)
    for r in range(3):
        _ok(res[r])
        assert res[r]["strategy"] == "ddp"
    assert res[1]["reports"] == [] and res[2]["reports"] == []  # only the root publishes
    live = [r for r in res[0]["reports"] if r["window_kind"] == "live"]
    summary = [r for r in res[0]["reports"] if r["window_kind"] == "summary"]
    assert len(summary) == 1
    by_range = {tuple(r["step_time"]["step_range"]): r for r in live}
    expected = {
        (20, 39): ("INPUT_STRAGGLER", 1),
        (40, 59): ("COMPUTE_STRAGGLER", 2),
        (60, 79): ("H2D_STRAGGLER", 1),
    }
    for step_range, (kind, culprit) in expected.items():
        assert step_range in by_range, sorted(by_range)
        st = by_range[step_range]["step_time"]
        assert st["strategy"] == "ddp" and st["clock"] == "cpu"
        top = st["findings"][0]
        assert (top["kind"], top["culprit_rank"]) == (kind, culprit), st
        assert by_range[step_range]["missing_ranks"] == []
    assert [i["rank"] for i in live[0]["ranks"]] == [0, 1, 2]
    assert [i["local_rank"] for i in live[0]["ranks"]] == [100, 101, 102]
    # the node name each rank read, shipped to the root with its identity, lower case
    assert [i["hostname"] for i in live[0]["ranks"]] == ["node-0", "node-1", "node-2"]


def test_watch_gives_the_explicit_rows_and_detects_ddp_and_fsdp(tmp_path: Path) -> None:
    res = run_world("equivalence", 2, tmp_path)
    for r in range(2):
        _ok(res[r])
        kinds = [e[0] for e in res[r]["bad_groups"]]
        assert kinds == ["ValueError", "ValueError", "ValueError", "TypeError", "ValueError"]
        assert all("field group" in e[1] for e in res[r]["bad_groups"])
        ex, wa = res[r]["explicit_rows"], res[r]["watch_rows"]
        assert [row[0] for row in ex] == [row[0] for row in wa] == list(range(8))
        # Same signals measured: all six CPU signals, no GPU signal; the hooks also time the
        # DDP sync waits (explicit phases cannot), the trailing columns.
        for a, b in zip(ex, wa, strict=True):
            assert [v is None for v in a[:13]] == [v is None for v in b[:13]]
            assert all(v is not None for v in a[1:7]) and all(v is None for v in a[7:])
            assert b[13] is not None and b[14] is not None and b[15] is None
            for row in (a, b):
                assert row[3] >= SLEEP_S * 1e3  # forward holds the injected sleep
                assert row[2] >= SLEEP_S * 1e3  # so does h2d
                assert row[6] >= row[2] + row[3]  # step covers the phases inside it
        assert res[r]["explicit_strategy"] is None  # nothing watched, nothing detected
        assert res[r]["watch_strategy"] == "ddp"
        assert res[r]["fsdp_strategy"] == "fsdp"
        # FSDP2 on Gloo: the all-gather and reduce-scatter waits timed in every step, and the
        # parameter group's methods given back at close.
        assert all(row[13] is not None and row[14] is not None for row in res[r]["fsdp_rows"])
        assert res[r]["fsdp_collectives_restored"]
    for key, strategy in (("explicit", "ddp"), ("watch", "ddp"), ("fsdp", "fsdp")):
        summaries = [r for r in res[0][f"{key}_reports"] if r["window_kind"] == "summary"]
        assert len(summaries) == 1, key
        st = summaries[0]["step_time"]
        assert st["strategy"] == strategy and st["step_range"] == [0, 7], (key, st)
    from rankwatch.exporter.aggregator.wire import MAX_ROWS_PER_FRAME

    assert BULK_STEPS > 2 * MAX_ROWS_PER_FRAME
    (bulk,) = res[0]["bulk_reports"]  # no round before close: only the summary
    assert bulk["window_kind"] == "summary" and bulk["missing_ranks"] == []
    assert bulk["step_time"]["step_range"] == [0, BULK_STEPS - 1]
    assert bulk["step_time"]["steps"] == BULK_STEPS


def test_rows_shipped_just_before_a_rank_exits_are_kept(tmp_path: Path) -> None:
    res = run_world("ship_and_exit", 3, tmp_path)
    for r in range(3):
        _ok(res[r])
    (summary,) = [r for r in res[0]["reports"] if r["window_kind"] == "summary"]
    # Both ranks that left shipped everything first: none is missing, their steps are counted.
    assert summary["missing_ranks"] == [], summary["missing_ranks"]
    st = summary["step_time"]
    assert [i["rank"] for i in summary["ranks"]] == [0, 1, 2]
    assert st["steps"] >= 30, st["steps"]


def test_subgroup_global_ranks_and_dead_and_stalled_ranks(tmp_path: Path) -> None:
    res = run_world("world4", 4, tmp_path)
    for r in (0, 1, 3):
        _ok(res[r])
    assert res[2]["exitcode"] == 3  # killed itself mid-run

    # ---- part 1: subgroup [1, 3]
    assert res[1]["sub_active"] and res[3]["sub_active"]
    assert not res[0]["sub_active"]
    assert res[0]["sub_reports"] == [] and res[3]["sub_reports"] == []
    latest = res[1]["sub_latest"]
    assert latest is not None and latest["window_kind"] == "summary"
    assert [i["rank"] for i in latest["ranks"]] == [1, 3]
    assert [i["local_rank"] for i in latest["ranks"]] == [101, 103]
    st = latest["step_time"]
    assert st["ranks"] == [1, 3] and st["strategy"] == "ddp"
    top = st["findings"][0]
    assert (top["kind"], top["culprit_rank"]) == ("INPUT_STRAGGLER", 3), st
    assert res[1]["handle_ranks"] == [1, 3]
    assert res[3]["handle_ranks"] is None  # not the root

    # ---- part 2: rank 2 dies, rank 3 stalls for 4 s then recovers
    reports = res[0]["reports"]
    live = [r for r in reports if r["window_kind"] == "live"]
    summary = [r for r in reports if r["window_kind"] == "summary"]
    dead = [r for r in live if 2 in r["missing_ranks"]]
    assert dead, [r["missing_ranks"] for r in live]
    stalled = [r for r in live if 3 in r["missing_ranks"]]
    assert stalled, [r["missing_ranks"] for r in live]
    # Windows go on after the death: later ones still diagnose the ranks that remain...
    first_dead = dead[0]
    after = [r for r in dead if r["window_index"] > first_dead["window_index"]]
    assert (
        after
        and after[-1]["step_time"]["step_range"][1]
        > (first_dead["step_time"]["step_range"] or [0, -1])[1]
    )
    # ...and rank 3 is back in the windows once it runs again.
    back = [
        r
        for r in live
        if r["window_index"] > stalled[-1]["window_index"] and r["missing_ranks"] == [2]
    ]
    assert back, [r["missing_ranks"] for r in live]
    assert back[-1]["step_time"]["missing_ranks"] == [2]
    assert len(summary) == 1 and summary[0]["missing_ranks"] == [2]
    # The training threads never waited for any of it, and shutdown was bounded.
    for r in (0, 1, 3):
        assert res[r]["slowest_step_s"] < 1.0, res[r]["slowest_step_s"]
        assert res[r]["close_s"] < 4.5, res[r]["close_s"]

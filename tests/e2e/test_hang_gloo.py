"""The hang watcher on real 3-rank Gloo worlds (DDP): the ``hang`` incident, its log line and
``/metrics`` for a rank stuck in its dataset, an extra ``all_reduce`` on one rank, a rank
killed with SIGKILL, and a quiet run with a declared long phase. Every world is killed whole
in every outcome (:func:`tests.hang_world.run_hang_world`); budgets are small (3 s) so the
suite stays short: the default budget's latency is the hang matrix's business."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.hang_world import HangRoot, run_hang_world

pytestmark = pytest.mark.multiproc

WORLD = 3
CULPRIT = 2
HANG_STEP = 6
BUDGET_S = 3.0
WAIT_S = 90.0


def _opened(events: list[dict[str, Any]]) -> bool:
    return any(e["action"] == "open" and e["cls"] == "hang" for e in events)


def _mismatch_opened(events: list[dict[str, Any]]) -> bool:
    return (
        any(e["action"] == "open" and e["cause"] == "collective_mismatch" for e in events)
        or sum(e["action"] == "open" for e in events if e["cls"] == "hang") >= 2
    )


def _train(rank: int, out: str, plan: str, done: Any = _opened) -> dict[str, Any]:
    """DDP on 3 ranks with a stop flag broadcast from rank 0 after every step (the pattern the
    integration docs give); ``plan`` says what goes wrong:

    * ``journey``: rank 2 stuck in its dataset for 2.5 budgets at step 6 (then it goes on),
      rank 1 in a declared 2-budget checkpoint phase at step 14 (its own budget 10 budgets),
      rank 2 calling one ``all_reduce`` the others never call at step 22;
    * ``kill``: rank 2 kills itself (SIGKILL) at step 6; the others' collectives fail and the
      script keeps the process alive, as a launcher's grace period would;
    * ``uneven``: the job ends at step 8; ranks 1 and 2 close rankwatch and stay alive (a slow
      exit), rank 0 works on outside any collective for 3 budgets (its final checkpoint: no
      hang), then calls one ``all_reduce`` the others never will (a batch more than they had).
    """
    import torch
    import torch.distributed as dist

    from rankwatch.exporter import init

    dist.init_process_group("gloo")
    root = HangRoot(rank, out, done)
    rw = init(
        on_incident=root.on_incident,
        metrics_port=root.port,
        metrics_enabled=rank == 0,
        interval_seconds=0.5,
        hang_budget_seconds=BUDGET_S,
        hang_poll_seconds=0.25,
        artifact_dir=str(Path(out, "artifacts")),
    )
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    flag = torch.zeros(1)

    class Data(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 10_000

        def __getitem__(self, i: int) -> Any:
            if rank == CULPRIT and i == HANG_STEP * 4:
                root.hang_at = time.monotonic()
                if plan == "journey":
                    time.sleep(2.5 * BUDGET_S)  # stuck in its dataset, alive
            return torch.randn(8), torch.randn(1)

    loader = torch.utils.data.DataLoader(Data(), batch_size=4)
    try:
        for step, (x, y) in enumerate(rw.watch(model, opt, loader)):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if plan == "journey" and rank == 1 and step == 14:
                with rw.phase("checkpoint", budget_seconds=10 * BUDGET_S):
                    time.sleep(2 * BUDGET_S)
            if plan == "journey" and rank == CULPRIT and step == 22:
                dist.all_reduce(torch.ones(1))  # a collective the others never call
            if plan == "kill" and rank == CULPRIT and step == HANG_STEP:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.broadcast(flag, 0)
            if plan == "uneven" and step == 8:
                break
        if plan == "uneven" and rank != 0:
            rw.close()
        elif plan == "uneven":
            time.sleep(3 * BUDGET_S)  # the final checkpoint, the others gone: no hang
            root.hang_at = time.monotonic()
            dist.all_reduce(torch.ones(1))  # one batch more than the others had
    except RuntimeError:
        pass  # a peer died: Gloo's error is the script's, the process stays up
    time.sleep(600)  # the parent kills the world
    return {}


def scenario_journey(rank: int, world: int, out: str) -> dict[str, Any]:
    return _train(rank, out, "journey", _mismatch_opened)


def scenario_kill(rank: int, world: int, out: str) -> dict[str, Any]:
    return _train(rank, out, "kill")


def scenario_uneven(rank: int, world: int, out: str) -> dict[str, Any]:
    return _train(rank, out, "uneven")


def test_ranks_that_closed_are_no_hang_until_a_rank_waits_for_them(tmp_path: Path) -> None:
    res = run_hang_world("tests.e2e.test_hang_gloo:scenario_uneven", WORLD, tmp_path, WAIT_S)
    opened = [e for e in res["events"] if e["action"] == "open" and e["cls"] == "hang"]
    # Nothing while rank 0 worked on alone; one hang once it waited in a call for them.
    assert len(opened) == 1, res["events"]
    inc = opened[0]
    assert inc["at"] >= res["hang_at"], (inc["at"], res["hang_at"])
    assert inc["cause"] == "stuck_alive" and inc["ranks"] == [1, 2], inc
    ev = inc["evidence"]
    assert ev["phase"] == "left" and "left the job" in ev["detail"], ev
    assert ev["collective"]["op"] == "all_reduce" and ev["waiting_ranks"] == [0], ev
    assert "stack unavailable: the rank left (closed rankwatch)" in str(ev["frames"]), ev


def test_stuck_then_moving_on_then_a_quiet_long_phase_then_an_extra_all_reduce(
    tmp_path: Path,
) -> None:
    res = run_hang_world("tests.e2e.test_hang_gloo:scenario_journey", WORLD, tmp_path, WAIT_S)
    hangs = [e for e in res["events"] if e["cls"] == "hang"]
    actions = [(e["action"], e["cause"]) for e in hangs]
    # Stuck, then moved on (closed at once), the declared checkpoint quiet, then the mismatch.
    assert actions == [
        ("open", "stuck_alive"),
        ("close", "stuck_alive"),
        ("open", "collective_mismatch"),
    ], hangs
    stuck, closed, mismatch = hangs
    assert stuck["ranks"] == [CULPRIT] and stuck["probe"] == "input", stuck
    assert stuck["severity"] == "critical"
    ev = stuck["evidence"]
    assert ev["hang_class"] == "STUCK_ALIVE"
    assert ev["phase"] == "input" and ev["phase_seconds"] >= BUDGET_S * 0.9, ev
    # Raised once no rank finished a step for the budget, every rank without progress for a
    # third of it at least.
    assert ev["detected_after_seconds"] >= BUDGET_S, ev
    assert ev["stalled_seconds"] >= BUDGET_S / 3, ev
    assert sorted(ev["waiting_ranks"]) == [0, 1], ev
    assert any("__getitem__" in f for f in ev["frames"]), ev
    assert isinstance(ev["waiting_frames"], list) and ev["waiting_frames"], ev
    # One WARNING line per opening, naming rank, host, pid, phase, seconds, the collective and
    # the top frame.
    lines = [
        m
        for level, m in res["lines"]
        if level == "WARNING" and " HANG " in m and "rankwatch.incident.open" in m
    ]
    assert len(lines) == 2, res["lines"]
    for part in (f"rank {CULPRIT} (host", "pid", "phase input for", "of group 0", "__getitem__"):
        assert part in lines[0], lines[0]
    assert "all_reduce" in lines[1] and "broadcast" in lines[1], lines[1]
    # The others wait in DDP's gradient all-reduce, issued by its reducer in C++: the group
    # and its sequence number are known, the op is not seen from Python.
    assert stuck["evidence"]["collective"]["group"] == "0", stuck["evidence"]
    assert stuck["evidence"]["collective"]["seq"] > HANG_STEP, stuck["evidence"]
    assert closed["reason"], closed
    ev = mismatch["evidence"]
    assert mismatch["ranks"] == [CULPRIT], ev
    assert ev["hang_class"] == "COLLECTIVE_MISMATCH"
    mine, theirs = ev["culprit_collective"], ev["collective"]
    assert mine["op"] == "all_reduce" and theirs["op"] == "broadcast", ev
    assert mine["group"] == theirs["group"] and mine["seq"] == theirs["seq"], ev
    assert "test_hang_gloo.py" in ev["culprit_collective_detail"]["site"], ev
    assert "test_hang_gloo.py" in ev["collective_detail"]["site"], ev
    assert sorted(ev["waiting_ranks"]) == [0, 1], ev
    assert 'hang_class="collective_mismatch"' in res["metrics"], res["metrics"][-2000:]
    assert "rankwatch_hang_collective_seq{" in res["metrics"]
    # Every stuck rank keeps its hang record on disk (the job may be killed next); read back
    # offline, the files give the same verdict.
    from rankwatch.diagnosis.hang.artifact import classify_files, load_hang_file

    files = [load_hang_file(p) for p in sorted((tmp_path / "artifacts").glob("hang-rank*.json"))]
    assert sorted(f.rank for f in files) == [0, 1, 2], files
    offline = classify_files(files)
    assert offline is not None and offline.hang_class == "COLLECTIVE_MISMATCH", offline
    assert offline.ranks == (CULPRIT,)


def test_a_killed_rank_is_named_dead(tmp_path: Path) -> None:
    res = run_hang_world("tests.e2e.test_hang_gloo:scenario_kill", WORLD, tmp_path, WAIT_S)
    opened = [e for e in res["events"] if e["action"] == "open" and e["cls"] == "hang"]
    assert len(opened) == 1, res["events"]
    inc = opened[0]
    assert inc["cause"] == "rank_dead" and inc["ranks"] == [CULPRIT], inc
    assert "gone" in str(inc["evidence"]["frames"]), inc["evidence"]
    assert 'hang_class="rank_dead"' in res["metrics"]

"""The hang watcher on real 3-rank Gloo worlds (DDP): the ``hang`` incident, its log line and
``/metrics`` for a rank stuck in its dataset, an extra ``all_reduce`` on one rank, a rank
killed with SIGKILL, and a quiet run with a declared long phase. Every world is killed whole
in every outcome (:func:`tests.hang_world.run_hang_world`); budgets are small (3 s) so the
suite stays short: the default budget's latency is the hang matrix's business."""

from __future__ import annotations

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


def _train(rank: int, out: str, hang: str, done: Any = _opened, steps: int = 400) -> dict[str, Any]:
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
    )
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    class Data(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 10_000

        def __getitem__(self, i: int) -> Any:
            if hang == "dataset" and rank == CULPRIT and i >= HANG_STEP * 4:
                root.hang_at = time.monotonic()
                while True:
                    time.sleep(1.0)  # stuck in its dataset, alive
            return torch.randn(8), torch.randn(1)

    loader = torch.utils.data.DataLoader(Data(), batch_size=4)
    for step, (x, y) in enumerate(rw.watch(model, opt, loader)):
        if hang == "extra" and rank == CULPRIT and step == HANG_STEP:
            dist.all_reduce(torch.ones(3))  # a collective the others never call
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step >= steps:
            break
    time.sleep(600)  # the parent kills the world
    return {}


def scenario_dataset(rank: int, world: int, out: str) -> dict[str, Any]:
    return _train(rank, out, "dataset")


def scenario_extra(rank: int, world: int, out: str) -> dict[str, Any]:
    return _train(rank, out, "extra")


def test_rank_stuck_in_its_dataset(tmp_path: Path) -> None:
    res = run_hang_world("tests.e2e.test_hang_gloo:scenario_dataset", WORLD, tmp_path, WAIT_S)
    opened = [e for e in res["events"] if e["action"] == "open" and e["cls"] == "hang"]
    assert len(opened) == 1, res["events"]
    inc = opened[0]
    ev = inc["evidence"]
    assert inc["severity"] == "critical"
    assert inc["cause"] == "stuck_alive", ev
    assert inc["ranks"] == [CULPRIT], ev
    assert inc["probe"] == "input", ev
    assert ev["hang_class"] == "STUCK_ALIVE"
    assert ev["phase_seconds"] >= BUDGET_S * 0.9
    assert ev["collective"] is not None and ev["collective"]["seq"] > 0, ev
    assert sorted(ev["waiting_ranks"]) == [0, 1], ev
    assert isinstance(ev["frames"], list) and any("__getitem__" in f for f in ev["frames"]), ev
    assert isinstance(ev["waiting_frames"], list) and ev["waiting_frames"], ev
    assert ev["stalled_seconds"] >= BUDGET_S
    lines = [m for level, m in res["lines"] if level == "WARNING" and "HANG" in m]
    assert len(lines) == 1, res["lines"]
    line = lines[0]
    for part in (f"rank {CULPRIT}", "pid", "phase input", "__getitem__", "#"):
        assert part in line, line
    print(line)
    metrics = res["metrics"]
    assert "rankwatch_hang_active{" in metrics, metrics[-3000:]
    assert 'hang_class="stuck_alive"' in metrics

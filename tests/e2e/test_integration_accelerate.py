"""A plain Accelerate loop on a real run: two Gloo ranks on the CPU.

``accelerator.prepare`` wraps the model in DDP, the optimizer in ``AcceleratedOptimizer`` and the
loader in ``DataLoaderShard``; the loop iterates what ``rw.watch`` returns and calls
``accelerator.backward``. Rank 1's ``collate_fn`` sleeps: the root must name it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.framework_world import (
    BATCH,
    SLOW_RANK,
    STEPS,
    Recorder,
    assert_input_straggler,
    pairs_loader,
    require_framework,
    run_world,
)

require_framework("accelerate")
pytestmark = pytest.mark.multiproc


def scenario_accelerate(rank: int, world: int, out: str) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator

    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.integrations import unwrap_optimizer
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    accelerator = Accelerator(cpu=True)  # initialises Gloo from torchrun's environment
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = pairs_loader(rank, STEPS * BATCH * world)
    model, opt, loader = accelerator.prepare(model, opt, loader)

    recorder = Recorder()
    config = RankwatchConfig.from_env(interval_seconds=1.0, gather_timeout_seconds=20.0)
    rw = RankWatch(config=config, publishers=[recorder])
    # AcceleratedOptimizer's step calls the real optimizer's: its hooks time the update.
    for x, y in rw.watch(model, unwrap_optimizer(opt), loader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    rows = rw.timer.ring[: rw.timer.written].tolist() if rw.timer is not None else []
    rw.close(5.0)
    accelerator.wait_for_everyone()
    return {
        "reports": recorder.reports,
        "rows": len(rows),
        "row_signals": [r[1:6] for r in rows],
        "strategy": rw.strategy,
    }


def test_plain_accelerate_loop_names_the_slow_collate_rank_as_input_straggler(
    tmp_path: Path,
) -> None:
    res = run_world(f"{__name__}:scenario_accelerate", 2, tmp_path)
    assert res[1]["reports"] == []
    for r in res.values():
        assert r["strategy"] == "ddp"  # read from the DDP wrapper Accelerate made
        assert r["rows"] == STEPS
        # Every phase is timed, h2d included (the wrapper moves the batch: a no-op on the CPU).
        assert all(v == v for row in r["row_signals"] for v in row)
    assert_input_straggler(res[0]["reports"], SLOW_RANK)

"""A DeepSpeed loop on a real run: two Gloo ranks on the CPU, ZeRO stage 1.

``engine.backward`` reduces the gradients after the autograd pass, where the backward hooks
no longer look, so the loop times forward and backward explicitly (the recipe the integration
docs give), hands the optimizer inside DeepSpeed's ZeRO optimizer to ``watch`` and times the
engine's collectives as sync waits (``time_engine_collectives``). Rank 1's
``collate_fn`` sleeps: the root must name it.
"""

from __future__ import annotations

import os
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

require_framework("deepspeed")
pytestmark = pytest.mark.multiproc


def scenario_deepspeed(rank: int, world: int, out: str) -> dict[str, Any]:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.runtime.zero.stage_1_and_2 as zero
    import torch

    from rankwatch.diagnosis.step_time.table import column
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.integrations import unwrap_optimizer
    from rankwatch.exporter.integrations.deepspeed import time_engine_collectives
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        config={
            "train_micro_batch_size_per_gpu": BATCH,
            "zero_optimization": {"stage": 1},
            "zero_allow_untested_optimizer": True,
        },
    )
    loader = pairs_loader(rank, STEPS * BATCH)
    recorder = Recorder()
    config = RankwatchConfig.from_env(interval_seconds=1.0, gather_timeout_seconds=20.0)
    rw = RankWatch(strategy="ddp", config=config, publishers=[recorder])
    with pytest.raises(TypeError, match="field engine: expected a DeepSpeed engine"):
        time_engine_collectives(rw, model)
    all_gather = zero.all_gather_dp_groups
    undo = time_engine_collectives(rw, engine)  # the gradient all-reduce, ZeRO's all-gather
    inner = unwrap_optimizer(optimizer)
    for x, y in rw.watch(None, inner, loader):
        with rw.phase("forward"):
            loss = torch.nn.functional.mse_loss(engine(x), y)
        with rw.phase("backward"):
            engine.backward(loss)  # the autograd pass, then the gradient reduction
        engine.step()  # steps the torch optimizer inside: its hooks close the step
    rows = rw.timer.ring[: rw.timer.written].tolist() if rw.timer is not None else []
    undo()
    rw.close(5.0)
    torch.distributed.barrier()
    return {
        "reports": recorder.reports,
        "rows": len(rows),
        "row_signals": [r[1:6] for r in rows],
        "waits_ms": [
            (r[column("cpu", "forward_wait")], r[column("cpu", "backward_wait")]) for r in rows
        ],
        "restored": zero.all_gather_dp_groups is all_gather
        and "allreduce_gradients" not in vars(engine),
        "optimizer_types": [type(optimizer).__name__, type(inner).__name__],
    }


def test_deepspeed_loop_names_the_slow_collate_rank_as_input_straggler(tmp_path: Path) -> None:
    res = run_world(f"{__name__}:scenario_deepspeed", 2, tmp_path)
    assert res[1]["reports"] == []
    for r in res.values():
        assert r["optimizer_types"] == ["DeepSpeedZeroOptimizer", "SGD"]
        assert r["rows"] == STEPS
        for wait, h2d, fwd, bwd, opt in r["row_signals"]:  # no h2d: watch() had no model
            assert h2d != h2d and wait == wait and fwd == fwd and bwd == bwd and opt == opt
        # The engine's all-gather (after the optimizer) and all-reduce (in backward) are the
        # sync waits of every step; both given back at the end.
        assert all(fw == fw and bw == bw for fw, bw in r["waits_ms"]), r["waits_ms"]
        assert r["restored"]
    assert_input_straggler(res[0]["reports"], SLOW_RANK)

"""The Lightning callback on a real run: DDP over two Gloo ranks on the CPU.

A tiny LightningModule trains under ``lightning.Trainer(strategy="ddp")``; rank 1's
``collate_fn`` sleeps, so rank 1 is the input straggler and the root's windows must say so.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest

from bench.accuracy_frameworks import lightning_regressor
from tests.framework_world import (
    BATCH,
    SLEEP_S,
    SLOW_RANK,
    STEPS,
    Recorder,
    assert_input_straggler,
    pairs_loader,
    require_framework,
    run_world,
)

require_framework("lightning")
pytestmark = pytest.mark.multiproc


def scenario_lightning(rank: int, world: int, out: str) -> dict[str, Any]:
    """Fit with DDP and the callback; the root records every window report."""
    import lightning.pytorch as lp

    from rankwatch.diagnosis.step_time.table import column
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.integrations.lightning import (
        SIGTERM_BROADCAST,
        STRATEGY_COLLECTIVES,
        RankwatchCallback,
    )
    from rankwatch.exporter.publish.recorder import RunRecorder
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    loader = pairs_loader(rank, STEPS * BATCH * world)  # Lightning shards it per rank
    recorder = Recorder()
    config = RankwatchConfig.from_env(interval_seconds=1.0, gather_timeout_seconds=20.0)
    # The run's own recorder (as init() adds one): the root prints its verdict at fit end.
    run_recorder = RunRecorder(config, run={"run_id": config.run_id})
    callback = RankwatchCallback(
        lambda: RankWatch(config=config, publishers=[recorder, run_recorder])
    )
    trainer = lp.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        max_steps=STEPS,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    profiler = trainer.profiler
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        trainer.fit(lightning_regressor(), train_dataloaders=loader)
    rw = callback.rankwatch
    assert rw is not None and rw.timer is not None
    rows = rw.timer.ring[: rw.timer.written].tolist()
    return {
        "reports": recorder.reports,
        "rows": len(rows),
        "row_signals": [r[1:6] for r in rows],
        "forward_wait_ms": [r[column("cpu", "forward_wait")] for r in rows],
        "broadcast_restored": SIGTERM_BROADCAST not in vars(trainer.fit_loop.epoch_loop),
        "collectives_restored": not set(STRATEGY_COLLECTIVES) & set(vars(trainer.strategy)),
        "closed": not rw.active,
        "is_root": rw.is_root,
        "strategy": rw.strategy,
        "profiler_restored": not {"start", "stop"} & set(vars(profiler)),
        "run_id": config.run_id,
        "end_block": err.getvalue().partition("rankwatch: run ")[2],
    }


def test_lightning_callback_names_the_slow_collate_rank_as_input_straggler(
    tmp_path: Path,
) -> None:
    res = run_world(f"{__name__}:scenario_lightning", 2, tmp_path)
    root, other = res[0], res[1]
    assert root["is_root"] and not other["is_root"]
    assert other["reports"] == []
    for r in (root, other):
        assert r["closed"] and r["profiler_restored"]
        assert r["strategy"] == "ddp"
        assert r["rows"] == STEPS, r["rows"]
        # input_wait, forward, backward, optimizer timed in every step; h2d never.
        for wait, h2d, fwd, bwd, opt in r["row_signals"]:
            assert h2d != h2d and wait == wait and fwd == fwd and bwd == bwd and opt == opt
        # The loop's SIGTERM flag broadcast, before every fetch, is timed as a sync wait.
        assert all(v == v for v in r["forward_wait_ms"]), r["forward_wait_ms"]
        assert r["broadcast_restored"] and r["collectives_restored"]
    slow = sorted(row[0] for row in res[SLOW_RANK]["row_signals"])[STEPS // 2]
    assert slow >= SLEEP_S * 1000 * 0.9, slow
    assert_input_straggler(root["reports"], SLOW_RANK)
    # The fit ends with the run's verdict, on the root only, under torchrun's run id.
    assert other["end_block"] == "" and root["run_id"] == other["run_id"] != ""
    block = root["end_block"]
    assert block.startswith(f"{root['run_id']} ended\n"), block
    assert f"  Verdict: rank {SLOW_RANK} is an input-pipeline straggler" in block, block

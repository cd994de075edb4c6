"""The Hugging Face ``Trainer`` callback on a real run: two Gloo ranks on the CPU.

A tiny BERT built from a config (no download) trains under ``Trainer`` with DDP; rank 1's data
collator sleeps, so rank 1 is the input straggler: the root's incident callback and its summary
window must say so.
"""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path
from typing import Any

import pytest

from bench.accuracy_frameworks import tiny_bert
from rankwatch.diagnosis.step_time.table import column
from tests.framework_world import (
    SLEEP_S,
    SLOW_RANK,
    STEPS,
    require_framework,
    run_world,
)

require_framework("transformers")
pytestmark = pytest.mark.multiproc


class TokenDataset:
    """``n`` random token sequences with labels (map-style, as the Trainer expects)."""

    def __init__(self, n: int, length: int = 12) -> None:
        import torch

        gen = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, 64, (n, length), generator=gen)
        self.labels = torch.randint(0, 2, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class SlowCollator:
    """Stacks the examples; sleeps first on the slow rank (its input pipeline is slow)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls = 0

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        self.calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


def training_args(out_dir: str, steps: int, ddp_backend: str | None = "gloo", **extra: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=4,
        use_cpu=True,
        ddp_backend=ddp_backend,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **extra,
    )


def scenario_trainer_defaults(rank: int, world: int, out: str) -> dict[str, Any]:
    """The Trainer's default arguments: it all-gathers the token count after fetching the
    batches and DDP broadcasts the model's buffers, both before the forward pass, so the
    ranks wait for the late one there (timed as sync waits by the callback)."""
    return train_with_callback(rank, world, out)


def scenario_trainer_no_early_sync(rank: int, world: int, out: str) -> dict[str, Any]:
    """Both synchronisations before the forward pass off: the wait is in backward."""
    return train_with_callback(
        rank, world, out, average_tokens_across_devices=False, ddp_broadcast_buffers=False
    )


def train_with_callback(rank: int, world: int, out: str, **extra: Any) -> dict[str, Any]:
    """Train under ``Trainer`` with the callback as a user writes it: ``init()`` with overrides
    and an ``on_incident`` function (the root records the incident events)."""
    import torch.distributed as dist
    import transformers.trainer
    from transformers import Trainer

    from rankwatch.exporter.integrations.transformers import RankwatchCallback

    args = training_args(out, STEPS, **extra)
    loss_gather = transformers.trainer.nested_gather
    events: list[dict[str, Any]] = []

    def on_incident(event: Any) -> None:
        inc = event.incident
        events.append({"action": event.action, "cls": inc.cls, "ranks": list(inc.ranks)})
        events[-1]["cause"] = inc.cause

    callback = RankwatchCallback(
        on_incident=on_incident, interval_seconds=1.0, gather_timeout_seconds=20.0
    )
    collator = SlowCollator(SLEEP_S if rank == SLOW_RANK else 0.0)
    trainer = Trainer(
        model=tiny_bert(),
        args=args,
        train_dataset=TokenDataset(STEPS * 4 * world),
        data_collator=collator,
        callbacks=[callback],
    )
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # the root's end-of-run block, printed at train end
        trainer.train()
    rw = callback.rankwatch
    assert rw is not None
    rows = rw.timer.ring[: rw.timer.written].tolist() if rw.timer is not None else []
    fww = [r[column("cpu", "forward_wait")] for r in rows]
    loader = trainer.callback_handler.train_dataloader
    dist.barrier()
    summary = rw.latest_report  # the root's last report: the summary window at close
    return {
        "events": events,
        "summary": summary.to_dict() if summary is not None else None,
        "rows": len(rows),
        "input_wait_ms": [r[1] for r in rows],
        "forward_wait_ms": fww,
        "gather_restored": "_get_num_items_in_batch" not in vars(trainer)
        and transformers.trainer.nested_gather is loss_gather,
        "collator_calls": collator.calls,
        "loader_module_after": type(loader).__module__,
        "closed": not rw.active,
        "is_root": rw.is_root,
        "strategy": rw.strategy,
        "run_id": rw.config.run_id,
        "end_block": err.getvalue().partition("rankwatch: run ")[2],
    }


@pytest.mark.parametrize(
    "scenario", ["scenario_trainer_defaults", "scenario_trainer_no_early_sync"]
)
def test_trainer_callback_names_the_slow_collator_rank_as_input_straggler(
    tmp_path: Path, scenario: str
) -> None:
    res = run_world(f"{__name__}:{scenario}", 2, tmp_path)
    root, other = res[0], res[1]
    assert root["is_root"] and not other["is_root"]
    assert other["events"] == [] and other["summary"] is None  # only the root diagnoses
    assert root["closed"] and other["closed"]  # closed at train end
    # Every optimizer step is a row, on both ranks, timed from the loader the Trainer holds.
    for r in (root, other):
        assert r["rows"] == STEPS, r["rows"]
        assert r["collator_calls"] >= STEPS
        assert all(v == v for v in r["input_wait_ms"])  # input_wait timed in every step (no NaN)
        # The DDP wrapper is watched: its sync waits are timed in every step.
        assert all(v == v for v in r["forward_wait_ms"]), r["forward_wait_ms"]
        assert r["gather_restored"]  # the Trainer gets its token count and loss gathers back
        # The loader gets its own class back at train end.
        assert r["loader_module_after"] == "accelerate.data_loader", r["loader_module_after"]
    slow_wait = sorted(res[SLOW_RANK]["input_wait_ms"])[STEPS // 2]
    assert slow_wait >= SLEEP_S * 1000 * 0.9, slow_wait
    # Live windows named it (an incident opens after 2 of 3 windows agree), and so does the
    # summary window published at train end.
    opened = [e for e in root["events"] if e["action"] == "open"]
    assert {
        "action": "open",
        "cls": "step_time_straggler",
        "ranks": [SLOW_RANK],
        "cause": "input_straggler",
    } in opened, root["events"]
    # The run ends with the verdict, on the root only, naming the same rank.
    assert other["end_block"] == ""
    block = root["end_block"]
    # the run is named after torchrun's run id, the same on both ranks
    assert root["run_id"] == other["run_id"] and root["run_id"].startswith("world-")
    assert block.startswith(f"{root['run_id']} ended\n"), block
    assert f"  Verdict: rank {SLOW_RANK} is an input-pipeline straggler" in block, block
    assert "  Incidents: " in block and "  Summary: not written" in block, block
    assert root["summary"]["window_kind"] == "summary"
    st = root["summary"]["step_time"]
    assert st["strategy"] == "ddp"
    assert st["visible_definition"] == "sync_wait", st["visible_definition"]
    assert (st["findings"][0]["kind"], st["findings"][0]["culprit_rank"]) == (
        "INPUT_STRAGGLER",
        SLOW_RANK,
    )


def test_attach_adds_the_callback_once_and_refuses_what_is_not_a_trainer(tmp_path: Path) -> None:
    from transformers import Trainer

    from rankwatch.exporter.integrations.transformers import RankwatchCallback

    callback = RankwatchCallback()
    with pytest.raises(TypeError, match=r"field trainer: expected a transformers\.Trainer"):
        callback.attach(tiny_bert())
    trainer = Trainer(
        model=tiny_bert(),
        args=training_args(str(tmp_path), 1, ddp_backend=None),
        train_dataset=TokenDataset(4),
        data_collator=SlowCollator(0.0),
    )
    assert callback.attach(trainer) is callback
    assert callback.attach(trainer) is callback
    assert [c for c in trainer.callback_handler.callbacks if c is callback] == [callback]


def test_early_collectives_warning_names_only_the_waits_that_are_not_timed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from types import SimpleNamespace

    from rankwatch.exporter.integrations.transformers import _warn_early_collectives

    args = SimpleNamespace(
        world_size=2, average_tokens_across_devices=True, ddp_broadcast_buffers=None
    )
    model = tiny_bert()  # has buffers (position ids)
    with caplog.at_level("WARNING", logger="rankwatch.integrations.transformers"):
        _warn_early_collectives(args, model, ddp_seen=True, gather_timed=True)
        assert caplog.records == []  # the callback reached the Trainer: both waits timed
        _warn_early_collectives(args, model, ddp_seen=False, gather_timed=False)
    (record,) = caplog.records
    assert "average_tokens_across_devices" in record.getMessage()
    assert "ddp_broadcast_buffers" in record.getMessage()
    assert "attach(trainer)" in record.getMessage()

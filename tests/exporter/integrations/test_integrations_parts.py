"""The integrations' parts in one process: optimizer unwrapping, the in-place loader, the
incident callback of the publishing hub."""

from __future__ import annotations

import logging
import math
import threading
import time
import types
from typing import Any

import pytest
import torch

from rankwatch.diagnosis.step_time.mesh import MeshLayout
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.integrations import in_sync_wait, unwrap_optimizer, watch_loader_in_place
from rankwatch.exporter.publish.hub import PublisherHub
from rankwatch.exporter.step_time.rank_watch import RankWatch

AFTER_S = 0.02  # work after each batch, in the Lightning step test


def _config(**overrides: Any) -> RankwatchConfig:
    return RankwatchConfig.from_env(env={}, metrics_enabled=False, otlp_enabled=False, **overrides)


def test_unwrap_optimizer_reaches_the_torch_optimizer_inside_accelerate_and_lightning() -> None:
    from accelerate import Accelerator
    from lightning.pytorch.core.optimizer import LightningOptimizer

    sgd = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    assert unwrap_optimizer(sgd) is sgd
    wrapped = Accelerator(cpu=True).prepare(sgd)  # one process: no process group
    assert type(wrapped).__name__ == "AcceleratedOptimizer"
    assert unwrap_optimizer(wrapped) is sgd
    assert unwrap_optimizer(LightningOptimizer(sgd)) is sgd
    assert unwrap_optimizer(None) is None
    assert unwrap_optimizer(object()) is None


def test_loader_in_place_times_each_fetch_and_gives_the_class_back() -> None:
    from accelerate.data_loader import DataLoaderShard

    loader = DataLoaderShard(list(range(12)), batch_size=3)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rw = RankWatch(config=_config())
    rw.watch(model, opt)
    restore = watch_loader_in_place(rw, loader)
    # Still a DataLoader to isinstance (Accelerate's own disguise) and a DataLoaderShard.
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert isinstance(loader, DataLoaderShard) and type(loader) is not DataLoaderShard
    assert len(loader) == 4
    batches = 0
    for batch in loader:  # iterated as the framework does: the object itself
        model(batch.float().unsqueeze(1)).sum().backward()
        opt.step()
        batches += 1
    assert batches == 4
    timer = rw.timer
    assert timer is not None and timer.written == 4
    assert all(not math.isnan(v) for v in timer.ring[:4, 1])  # input_wait in every row
    assert all(math.isnan(v) for v in timer.ring[:4, 2])  # no h2d: the loader moves batches
    restore()
    assert type(loader) is DataLoaderShard
    assert next(iter(loader)).tolist() == [0, 1, 2]
    assert timer.written == 4  # no longer timed
    rw.close(1.0)


def test_loader_in_place_leaves_an_inactive_rankwatch_alone() -> None:
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    rw = RankWatch(config=_config(enabled=False))
    restore = watch_loader_in_place(rw, loader)
    assert type(loader) is torch.utils.data.DataLoader
    restore()


class _Collectives:
    """Stands in for a framework object whose method is a collective (it waits)."""

    def reduce(self, seconds: float) -> str:
        time.sleep(seconds)
        return "reduced"

    def nested(self, seconds: float) -> str:
        return self.reduce(seconds)  # one collective calling another


def _forward_wait_ms(rw: RankWatch) -> float:
    from rankwatch.diagnosis.step_time.table import column

    assert rw.timer is not None
    return float(rw.timer.ring[rw.timer.written - 1][column("cpu", "forward_wait")])


def test_in_sync_wait_times_a_method_and_a_module_function_then_gives_them_back() -> None:
    rw = RankWatch(config=_config())
    obj = _Collectives()
    module = types.ModuleType("framework")
    module.gather = lambda seconds: time.sleep(seconds) or "gathered"  # type: ignore[attr-defined]
    original_gather = module.gather  # type: ignore[attr-defined]
    undo_method = in_sync_wait(rw, obj, "reduce")
    undo_nested = in_sync_wait(rw, obj, "nested")
    undo_function = in_sync_wait(rw, module, "gather")
    with rw.step():
        assert obj.reduce(0.02) == "reduced"
        assert module.gather(0.01) == "gathered"  # type: ignore[attr-defined]
    assert _forward_wait_ms(rw) >= 30.0
    with rw.step():
        assert obj.nested(0.02) == "reduced"  # the inner call runs inside the outer block
    assert 20.0 <= _forward_wait_ms(rw) < 40.0
    with rw.step():  # a call from another thread is not this training loop's wait
        worker = threading.Thread(target=obj.reduce, args=(0.02,))
        worker.start()
        worker.join()
        obj.reduce(0.0)
    assert _forward_wait_ms(rw) < 10.0
    undo_method()
    undo_nested()
    undo_function()
    assert "reduce" not in vars(obj) and "nested" not in vars(obj)
    assert module.gather is original_gather  # type: ignore[attr-defined]
    # A later replacement is left alone by the undo.
    undo = in_sync_wait(rw, obj, "reduce")
    obj.reduce = lambda seconds: "theirs"  # type: ignore[method-assign]
    undo()
    assert obj.reduce(0.0) == "theirs"
    rw.close(2.0)


def test_in_sync_wait_on_a_disabled_rankwatch_calls_through() -> None:
    rw = RankWatch(config=_config(enabled=False))
    obj = _Collectives()
    undo = in_sync_wait(rw, obj, "reduce")
    assert obj.reduce(0.0) == "reduced"
    undo()
    assert "reduce" not in vars(obj)


def test_hub_calls_on_incident_with_each_event_and_survives_its_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from rankwatch.exporter.publish.incidents import IncidentEvent
    from tests.publish_reports import step_window

    with pytest.raises(TypeError, match="on_incident"):
        PublisherHub(_config(), metrics=False, otlp=False, on_incident="stop")  # type: ignore[arg-type]
    seen: list[IncidentEvent] = []

    def on_incident(event: IncidentEvent) -> None:
        seen.append(event)
        raise RuntimeError("the script's own bug")

    hub = PublisherHub(_config(), metrics=False, otlp=False, on_incident=on_incident)
    with caplog.at_level(logging.ERROR, logger="rankwatch.publishing"):
        # Two windows with rank 2 as input straggler open it; three clean ones close it.
        for i, culprit in enumerate([2, 2, None, None, None]):
            hub.publish(step_window(i, culprit=culprit))
        assert hub.flush(10.0)
    hub.close(2.0)
    assert [(e.action, e.incident.cls, e.incident.ranks) for e in seen] == [
        ("open", "step_time_straggler", (2,)),
        ("close", "step_time_straggler", (2,)),
    ]
    assert seen[0].window_index == 1 and seen[1].window_index == 4
    assert caplog.text.count("on_incident failed") == 2  # logged, and publishing went on


def test_the_core_never_imports_a_framework() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pkgutil, importlib, rankwatch.exporter as e\n"
        "for m in pkgutil.iter_modules(e.__path__):\n"
        "    if m.name != 'integrations':\n"
        "        importlib.import_module('rankwatch.exporter.' + m.name)\n"
        "import rankwatch.exporter.integrations\n"
        "print(sorted(n for n in ('transformers', 'accelerate', 'lightning', 'deepspeed')"
        " if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


def test_lightning_callback_makes_one_row_per_optimizer_step_when_accumulating(
    tmp_path: Any,
) -> None:
    import lightning.pytorch as lp

    from bench.accuracy_frameworks import lightning_regressor
    from rankwatch.exporter.integrations.lightning import RankwatchCallback
    from tests.framework_world import pairs_loader

    class AfterBatch(lp.Callback):  # type: ignore[misc]
        """Work after each batch (logging, checkpointing): in its step, not between steps."""

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            time.sleep(AFTER_S)

    callback = RankwatchCallback(lambda: RankWatch(config=_config()), mesh={"dp": 1})
    trainer = lp.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=5,
        accumulate_grad_batches=2,
        callbacks=[callback, AfterBatch()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(lightning_regressor(), train_dataloaders=pairs_loader(0, 8 * 10))
    rw = callback.rankwatch
    assert rw is not None and rw.timer is not None and not rw.active
    assert rw._aggregator is not None and rw._aggregator.mesh == MeshLayout(("dp",), (1,), (0,))
    rows = rw.timer.ring[: rw.timer.written]
    assert len(rows) == 5  # ten batches, five optimizer steps
    assert not any(math.isnan(v) for v in rows[:, [1, 3, 4, 5]].ravel())
    assert all(math.isnan(v) for v in rows[:, 2])  # h2d is not timed
    # A step runs to the next iteration's start: both batches' after-work is in it. The last
    # step ends where its optimizer step ended (only its first batch's after-work is in it).
    step_ms = rows[:, 6]
    assert all(v >= 2 * AFTER_S * 1e3 for v in step_ms[:-1]), step_ms
    assert AFTER_S * 1e3 <= step_ms[-1] < 2 * AFTER_S * 1e3, step_ms


def test_trainer_callback_makes_one_row_per_optimizer_step_when_accumulating(
    tmp_path: Any,
) -> None:
    from transformers import Trainer

    from bench.accuracy_frameworks import tiny_bert
    from rankwatch.exporter.integrations.transformers import RankwatchCallback
    from tests.e2e.test_integration_transformers import SlowCollator, TokenDataset, training_args

    callback = RankwatchCallback(lambda: RankWatch(config=_config()), mesh={"pp": 1})
    trainer = Trainer(
        model=tiny_bert(),
        args=training_args(str(tmp_path), 5, None, gradient_accumulation_steps=2),
        train_dataset=TokenDataset(4 * 10),
        data_collator=SlowCollator(0.0),
        callbacks=[callback],
    )
    trainer.train()
    rw = callback.rankwatch
    assert rw is not None and rw.timer is not None and not rw.active
    assert rw._aggregator is not None and rw._aggregator.mesh == MeshLayout(("pp",), (1,), (0,))
    rows = rw.timer.ring[: rw.timer.written]
    assert len(rows) == 5  # ten micro-batches, five optimizer steps
    assert not any(math.isnan(v) for v in rows[:, [1, 3, 4, 5]].ravel())
    assert type(trainer.callback_handler.train_dataloader).__module__ == "accelerate.data_loader"


@pytest.mark.parametrize("framework", ["lightning", "transformers"])
def test_callback_bad_arguments_are_refused_with_the_field_named(framework: str) -> None:
    import importlib

    module = importlib.import_module(f"rankwatch.exporter.integrations.{framework}")
    callback = module.RankwatchCallback
    with pytest.raises(TypeError, match=r"RankwatchCallback: field rankwatch: .*'not callable'"):
        callback("not callable")
    with pytest.raises(ValueError, match=r"overrides \['metrics_port'\] apply to init\(\) only"):
        callback(lambda: RankWatch(config=_config()), metrics_port=9500)
    for bad in ("pp=2", 4, ["pp", 2], object()):
        with pytest.raises(TypeError, match="RankwatchCallback: field mesh: expected a DeviceMesh"):
            callback(mesh=bad)
    # What fits: nothing, sizes, a layout (a DeviceMesh is checked against the group later).
    for good in (None, {"dp": 2}, MeshLayout(("dp",), (1,), (0,))):
        assert callback(mesh=good).mesh is good

"""torchtitan's mixin in one process: the mesh read from its parallel dimensions, the steps a
Trainer-shaped loop writes (a batch fetched through ``batch_generator``, ``train_step``, then
``checkpointer.save`` between steps), and ``RankWatch.end_step``.

The base class here has the attributes and methods of ``torchtitan.trainer.Trainer`` that the
mixin uses, with the same call order as its ``train()``; the real Trainer runs in
tests/e2e/test_accuracy_trainers.py (4 ranks).
"""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rankwatch.diagnosis.step_time.table import column
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.integrations.torchtitan import RankwatchTrainerMixin, trainer_mesh
from rankwatch.exporter.step_time.rank_watch import RankWatch

SAVE_S = 0.05  # the checkpoint save's time, every SAVE_EVERY steps
SAVE_EVERY = 3
STEPS = 9


def _dims(**sizes: int) -> Any:
    dims = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, **sizes}
    world = 1
    for v in dims.values():
        world *= v
    return types.SimpleNamespace(world_size=sizes.pop("world", world), **dims)


@pytest.mark.parametrize(
    ("sizes", "want"),
    [
        ({"dp_shard": 2, "tp": 2}, {"dp": 2, "tp": 2}),
        ({"pp": 2, "dp_shard": 2}, {"pp": 2, "dp": 2}),
        ({"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 2}, {"pp": 2, "dp": 4, "tp": 2}),
        ({"dp_shard": 4}, None),  # one dimension says nothing the ranks do not
        ({}, None),
    ],
)
def test_trainer_mesh_is_the_data_loading_layout(
    sizes: dict[str, int], want: dict[str, int] | None
) -> None:
    assert trainer_mesh(_dims(**sizes)) == want


def test_trainer_mesh_refuses_sizes_that_are_not_the_world(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert trainer_mesh(_dims(dp_shard=2, tp=2, world=8)) is None
    assert "do not make the world size 8" in caplog.text
    assert trainer_mesh(object()) is None
    assert "cannot read torchtitan's parallel dimensions" in caplog.text


class _Checkpointer:
    def __init__(self) -> None:
        self.saved: list[int] = []

    def save(self, curr_step: int, last_step: bool = False) -> None:
        if curr_step % SAVE_EVERY == 0:
            time.sleep(SAVE_S)
            self.saved.append(curr_step)


class _TrainerShape:
    """What the mixin uses of torchtitan's Trainer, in the order its ``train()`` calls it."""

    def __init__(self, config: Any) -> None:
        torch.manual_seed(0)
        self.model_parts = [torch.nn.Linear(4, 1)]
        self.optimizers = torch.optim.SGD(self.model_parts[0].parameters(), lr=0.1)
        self.parallel_dims = _dims()
        self.checkpointer = _Checkpointer()
        self.closed = False

    def batch_generator(self, data_iterable: Any) -> Iterator[Any]:
        yield from data_iterable

    def train_step(self, data_iterator: Iterator[Any]) -> None:
        x = next(data_iterator)
        self.model_parts[0](x).sum().backward()
        self.optimizers.step()
        self.optimizers.zero_grad()

    def train(self) -> None:
        batches = self.batch_generator(torch.randn(4) for _ in range(STEPS + 1))
        for step in range(1, STEPS + 1):
            self.train_step(batches)
            self.checkpointer.save(step)

    def close(self) -> None:
        self.closed = True


def _watched(**overrides: Any) -> Any:
    config = RankwatchConfig.from_env(
        env={}, metrics_enabled=False, otlp_enabled=False, end_summary=False, **overrides
    )

    class Watched(RankwatchTrainerMixin, _TrainerShape):
        rankwatch_factory = staticmethod(lambda: RankWatch(config=config))

    return Watched(config=None)


def test_every_step_is_timed_and_no_checkpoint_save_is_in_a_step() -> None:
    trainer = _watched()
    rw = trainer.rankwatch
    trainer.train()
    timer = rw.timer
    rows = timer.ring[: timer.written]
    trainer.close()
    assert trainer.closed and not rw.active
    assert trainer.checkpointer.saved == [3, 6, 9]
    assert len(rows) == STEPS
    steps_ms = rows[:, column("cpu", "step")]  # fetch to the optimizer step's end
    # A save sleeps SAVE_S; it is in no step.
    assert float(steps_ms.max()) < SAVE_S * 1e3 / 2, steps_ms.tolist()
    # The Trainer's save is its own again.
    assert "save" not in vars(trainer.checkpointer)


def test_a_disabled_rankwatch_leaves_the_trainer_alone() -> None:
    trainer = _watched(enabled=False)
    trainer.train()
    trainer.close()
    assert trainer.closed
    assert trainer.checkpointer.saved == [3, 6, 9]
    assert "save" not in vars(trainer.checkpointer)


def test_end_step_without_an_open_step_does_nothing() -> None:
    rw = RankWatch(config=RankwatchConfig.from_env(env={}, end_summary=False))
    rw.end_step()
    assert rw.timer is not None and rw.timer.written == 0
    rw.close(1.0)
    RankWatch(config=RankwatchConfig.from_env(env={}, enabled=False)).end_step()

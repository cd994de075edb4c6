"""``watch()`` on the shapes real training loops have, in one process (no torch.distributed).

Each test is one numbered failure of the step-time issue: a batch type lost, a compiled model,
work after the optimizer, an optimizer wrapper, an optimizer that never steps, a loader on a
prefetch thread, and the rank flag of collectives that do not block the host.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import UserDict
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch

from rankwatch.diagnosis.step_time import SIGNALS
from rankwatch.diagnosis.step_time.table import BASE_WIDTH, EXTRA_COLUMNS
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.step_time.hooks import OPTIMIZER_SILENT_BATCHES, move_to_device
from rankwatch.exporter.step_time.rank_watch import RankWatch

CPU = {s: 1 + i for i, s in enumerate(SIGNALS)}
AFTER_S = 0.03


def config() -> RankwatchConfig:
    return RankwatchConfig.from_env(env={}, async_mode=False, sync_step=10**6)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(n)]


def rows_of(rw: RankWatch) -> np.ndarray:
    assert rw.timer is not None
    rows, _, lost = rw.timer.read(0)
    assert lost == 0
    return rows


def train(model: Any, opt: Any, loader: Any, after_s: float = 0.0) -> None:
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if after_s:
            time.sleep(after_s)  # logging, checkpointing: after the optimizer


class Encoding(UserDict):  # type: ignore[type-arg]
    """A tokenizer-style batch: a Mapping with its own ``to``."""

    def to(self, device: Any, non_blocking: bool = False) -> Encoding:
        return Encoding({k: v.to(device) for k, v in self.data.items()})


class Frozen(Mapping):  # type: ignore[type-arg]
    """A Mapping subclass without ``to``, built from a dict."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._d = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


def test_a_mapping_batch_keeps_its_type() -> None:
    cpu = torch.device("cpu")
    enc = move_to_device(Encoding({"ids": torch.zeros(2)}), cpu)
    assert type(enc) is Encoding and torch.equal(enc["ids"], torch.zeros(2))
    frozen = move_to_device(Frozen({"ids": torch.ones(2)}), cpu)
    assert type(frozen) is Frozen and torch.equal(frozen["ids"], torch.ones(2))
    assert type(move_to_device({"a": torch.ones(1)}, cpu)) is dict


def test_work_after_the_optimizer_lands_in_the_step() -> None:
    rw = RankWatch(config=config())
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train(model, opt, rw.watch(model, opt, batches(4)), after_s=AFTER_S)
    rows = rows_of(rw)
    rw.close(2.0)
    # A step runs from one fetch to the next: every step holds its post-optimizer sleep.
    assert rows[:, 0].tolist() == [0, 1, 2, 3]
    assert (rows[:, CPU["step"]] >= AFTER_S * 1e3).all(), rows[:, CPU["step"]]
    phases = np.nansum(rows[:, [CPU[s] for s in ("h2d", "forward", "backward", "optimizer")]], 1)
    assert (rows[:, CPU["step"]] - phases >= AFTER_S * 1e3).all()  # in the residual


def test_a_skipped_batch_stays_in_the_next_step() -> None:
    rw = RankWatch(config=config())
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(rw.watch(model, opt, batches(4))):
        if i == 1:
            continue  # a batch the loop skips: no training work, no step of its own
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    rows = rows_of(rw)
    rw.close(2.0)
    assert len(rows) == 3
    assert not np.isnan(rows[:, [CPU["forward"], CPU["backward"]]]).any()


class Wrapper:
    """A framework's optimizer wrapper (the torch optimizer in ``.optimizer``)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()


def test_an_optimizer_wrapper_is_accepted_and_its_steps_timed() -> None:
    rw = RankWatch(config=config())
    model = mlp()
    wrapper = Wrapper(torch.optim.SGD(model.parameters(), lr=0.01))
    rw.watch(model, Wrapper(wrapper))  # type: ignore[arg-type]  (a wrapper of a wrapper)
    for x, y in batches(3):
        torch.nn.functional.mse_loss(model(x), y).backward()
        wrapper.step()
        wrapper.zero_grad()
    rows = rows_of(rw)
    rw.close(2.0)
    assert rows[:, 0].tolist() == [0, 1, 2]  # without a loader the optimizer closes steps
    assert not np.isnan(rows[:, CPU["optimizer"]]).any()
    with pytest.raises(TypeError, match="field optimizer"):
        RankWatch(config=config()).watch(mlp(), object())  # type: ignore[arg-type]


def test_an_optimizer_that_never_steps_is_named_once(caplog: pytest.LogCaptureFixture) -> None:
    rw = RankWatch(config=config())
    model = mlp()
    watched = torch.optim.SGD(model.parameters(), lr=0.01)
    other = torch.optim.SGD(model.parameters(), lr=0.01)  # the one the loop steps
    n = OPTIMIZER_SILENT_BATCHES + 5
    with caplog.at_level(logging.WARNING, logger="rankwatch"):
        train(model, other, rw.watch(model, watched, batches(n)))
    # The threshold is configurable (RANKWATCH_OPTIMIZER_SILENT_BATCHES).
    quick = RankWatch(
        config=RankwatchConfig.from_env(env={"RANKWATCH_OPTIMIZER_SILENT_BATCHES": "3"})
    )
    quick_model = mlp()
    quick_opt = torch.optim.SGD(quick_model.parameters(), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="rankwatch"):
        train(quick_model, other, quick.watch(quick_model, quick_opt, batches(4)))
    quick.close(2.0)
    rows = rows_of(rw)
    rw.close(2.0)
    said = [r for r in caplog.records if "has not stepped" in r.getMessage()]
    assert len(said) == 2 and "3 batches" in said[1].getMessage()
    assert len(rows) == n  # steps still close, at each fetch


def test_a_loader_on_a_prefetch_thread_is_not_timed(caplog: pytest.LogCaptureFixture) -> None:
    rw = RankWatch(config=config())
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = rw.watch(model, opt, batches(5))
    q: queue.Queue[Any] = queue.Queue(maxsize=2)

    def produce() -> None:
        for b in loader:
            time.sleep(0.02)  # the producer's fetch: not what training waits for
            q.put(b)
        q.put(None)

    with caplog.at_level(logging.WARNING, logger="rankwatch"):
        t = threading.Thread(target=produce)
        t.start()
        train(model, opt, iter(q.get, None))
        t.join()
    rows = rows_of(rw)
    rw.close(2.0)
    assert len([r for r in caplog.records if "another thread" in r.getMessage()]) == 1
    assert len(rows) == 5
    assert np.isnan(rows[:, CPU["input_wait"]]).all()  # no producer-thread numbers
    assert not np.isnan(rows[:, CPU["forward"]]).any()


@pytest.mark.slow  # torch.compile traces and compiles: seconds, not in `make test-fast`
@pytest.mark.parametrize("order", ["compile_then_watch", "watch_then_compile"])
def test_compile_fullgraph_before_and_after_watch(order: str) -> None:
    torch._dynamo.reset()
    rw = RankWatch(config=config())
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if order == "compile_then_watch":
        compiled = torch.compile(model, fullgraph=True)
        loader = rw.watch(compiled, opt, batches(3))
    else:
        loader = rw.watch(model, opt, batches(3))
        compiled = torch.compile(model, fullgraph=True)
    train(compiled, opt, loader)
    rows = rows_of(rw)
    rw.close(2.0)
    assert rows[:, 0].tolist() == [0, 1, 2]
    if order == "compile_then_watch":  # hooks on the compiled wrapper run outside the graph
        assert not np.isnan(rows[:, CPU["forward"]]).any()


@pytest.mark.slow  # torch.compile traces: seconds, not in `make test-fast`
def test_a_model_compiled_after_watch_is_named_once(caplog: pytest.LogCaptureFixture) -> None:
    torch._dynamo.reset()
    rw = RankWatch(config=config())
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = rw.watch(model, opt, batches(OPTIMIZER_SILENT_BATCHES + 2))
    compiled = torch.compile(model, backend="eager")  # the hooks now run inside the graph
    with caplog.at_level(logging.WARNING, logger="rankwatch"):
        train(compiled, opt, loader)
    rows = rows_of(rw)
    rw.close(2.0)
    assert np.isnan(rows[:, CPU["forward"]]).all()  # what the warning is about
    said = [r for r in caplog.records if "compiled after watch()" in r.getMessage()]
    assert len(said) == 1, caplog.text
    # Watched where the loop calls it, nothing is said.
    caplog.clear()
    rw = RankWatch(config=config())
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model, backend="eager")
    with caplog.at_level(logging.WARNING, logger="rankwatch"):
        train(compiled, opt, rw.watch(compiled, opt, batches(OPTIMIZER_SILENT_BATCHES + 2)))
    rw.close(2.0)
    assert "compiled after watch()" not in caplog.text


def test_a_rank_on_an_accelerator_flags_its_rows() -> None:
    # CUDA does not run here: the flag is what watch() sets for a model off the CPU.
    for flagged in (False, True):
        rw = RankWatch(config=config())
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = rw.watch(model, opt, batches(2))
        assert rw.timer is not None and rw.timer.async_collectives is False  # on the CPU
        rw.timer.async_collectives = flagged
        train(model, opt, loader)
        flags = rows_of(rw)[:, BASE_WIDTH + EXTRA_COLUMNS.index("async_collectives")]
        rw.close(2.0)
        assert (flags == 1.0).all() if flagged else np.isnan(flags).all()

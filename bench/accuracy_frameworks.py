"""The accuracy matrix's framework rows: the Hugging Face ``Trainer`` and Lightning with
rankwatch's callbacks, and a plain Accelerate loop around ``RankWatch.watch()``, as users run
them.

A framework initialises ``torch.distributed`` itself, from the environment ``torchrun`` sets,
so these cells run in worlds of their own (:func:`worker`): every rank is a spawned process
with that environment, and runs the row's cells one after the other, each a new ``Trainer``
and a new ``RankWatch`` (the callback starts it when training starts and closes it at the end).
The fault is injected where the column says, as in the plain rows:

* ``data``: the collate function sleeps;
* ``forward``: a forward pre hook on the model inside the framework's DDP wrapper sleeps;
* ``backward``: the first gradient of the pass (the last layer's weight) sleeps once it is
  accumulated, so the rest of backward waits behind it;
* ``optimizer``: the optimizer's ``step`` sleeps after its update (a subclass, so the sleep is
  inside ``step`` whoever calls it: the Trainer's wrapper, or Lightning's closure);
* ``after``: the framework's end-of-step callback sleeps (``on_step_end``,
  ``on_train_batch_end``; the Accelerate loop sleeps after ``zero_grad``): logging or
  checkpointing after the step.

Every rank's model also sleeps ``base_s`` in its forward (a stand-in for compute).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The frameworks each row needs (module to import).
BATCH = 4


@dataclass(frozen=True)
class Fault:
    """One cell's run on this rank: the world, the steps, and the fault's place and size."""

    world: int
    col: str  # where the slow rank is slow (the matrix's column)
    slow: bool  # this rank is the slow one
    steps: int
    slow_s: float
    base_s: float  # every rank's forward sleep

    def delay_s(self, place: str) -> float:
        """The sleep this rank adds at ``place`` (a column name): 0 unless it is the fault's."""
        return self.slow_s if self.slow and self.col == place else 0.0


def torchrun_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The environment ``torchrun`` gives a rank of a one-node job, offline, and no exporters
    (every rank its own ``/metrics`` port would collide between worlds: the cells and the
    framework tests read the timers' rows and the root's reports)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        # torchrun's run id (a UUID of its own on a single node without --rdzv-id): job-wide
        "TORCHELASTIC_RUN_ID": f"world-{port}",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RANKWATCH_METRICS_ENABLE": "0",
        "RANKWATCH_OTLP_ENABLE": "0",
    }


def sleeper(seconds: float) -> Any:
    """A hook (any arguments) that sleeps ``seconds`` (0: returns at once)."""

    def hook(*args: Any) -> None:
        if seconds:
            time.sleep(seconds)

    return hook


def _slow_down(net: Any, f: Fault) -> None:
    """A Sequential's forward sleeps (every rank's base, plus the fault's), and its last
    layer's weight gradient, the first of the backward pass, sleeps once accumulated."""
    net.register_forward_pre_hook(sleeper(f.base_s + f.delay_s("forward")))
    net[-1].weight.register_post_accumulate_grad_hook(sleeper(f.delay_s("backward")))


def _slow_sgd(params: Any, slow_s: float) -> Any:
    """SGD whose ``step`` sleeps ``slow_s`` after its update (0: plain SGD)."""
    import torch

    class SlowSGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            loss = super().step(closure)
            time.sleep(slow_s)
            return loss

    return SlowSGD(params, lr=0.01) if slow_s > 0 else torch.optim.SGD(params, lr=0.01)


class _SlowCollate:
    """Stacks the examples (dicts or pairs); sleeps first when ``delay_s`` is set."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __call__(self, examples: list[Any]) -> Any:
        import torch

        if self.delay_s:
            time.sleep(self.delay_s)
        if isinstance(examples[0], dict):
            return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}
        xs, ys = zip(*examples, strict=True)
        return torch.stack(xs), torch.stack(ys)


def _pairs_loader(batches: int, delay_s: float) -> Any:
    """A DataLoader of ``batches`` batches of random (x[32], y[1]) pairs (the framework's
    sampler shards it across ranks); its collate function sleeps ``delay_s``."""
    import torch

    gen = torch.Generator().manual_seed(1)
    n = batches * BATCH
    xs, ys = torch.randn(n, 32, generator=gen), torch.randn(n, 1, generator=gen)
    data: Any = list(zip(xs, ys, strict=True))
    return torch.utils.data.DataLoader(data, batch_size=BATCH, collate_fn=_SlowCollate(delay_s))


def tiny_bert() -> Any:
    """A two-class BERT built from a config (no download), small enough that a step takes a few
    milliseconds on one core."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=2,  # type: ignore[call-arg]  # a PretrainedConfig keyword
    )
    return BertForSequenceClassification(config)


def lightning_regressor(
    optimizer: Callable[[Any], Any] | None = None, *, sync_log: bool = False
) -> Any:
    """A LightningModule around a small MLP (``.net``: Linear, ReLU, Linear); SGD unless
    ``optimizer`` (parameters -> optimizer) says otherwise. With ``sync_log`` its
    ``training_step`` logs the loss averaged over the ranks (an all-reduce every step)."""
    import lightning.pytorch as lp
    import torch

    class Regressor(lp.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
            )

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            if sync_log:
                self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self) -> Any:
            if optimizer is not None:
                return optimizer(self.parameters())
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Regressor()


def _rankwatch_factory() -> Any:
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    # Nothing ships during the run (a window's work would be one rank's noise); the rows are
    # read from the timer at the end, as the plain rows' are.
    cfg = RankwatchConfig.from_env(async_mode=False, sync_step=10**6, gather_timeout_seconds=30.0)
    return lambda: RankWatch(config=cfg)


def _rows_of(rw: Any) -> list[list[float | None]]:
    timer = rw.timer
    assert timer is not None
    return [[None if math.isnan(v) else v for v in r] for r in timer.ring[: timer.written].tolist()]


def _hf_cell(f: Fault, accumulate: int = 1, logging_steps: int = 0) -> Any:
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from rankwatch.exporter.integrations.transformers import RankwatchCallback

    model = tiny_bert()
    model.register_forward_pre_hook(sleeper(f.base_s + f.delay_s("forward")))
    model.classifier.weight.register_post_accumulate_grad_hook(sleeper(f.delay_s("backward")))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (f.steps * accumulate * BATCH * f.world, 12), generator=gen)
    labels = torch.randint(0, 2, (len(ids),), generator=gen)
    dataset = [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels, strict=True)]

    class AfterStep(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            time.sleep(f.delay_s("after"))

    callbacks: list[Any] = [RankwatchCallback(_rankwatch_factory()), AfterStep()]
    with tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(
            output_dir=out_dir,
            max_steps=f.steps,
            gradient_accumulation_steps=accumulate,
            per_device_train_batch_size=BATCH,
            use_cpu=True,
            ddp_backend="gloo",
            report_to=[],
            save_strategy="no",
            # Logging gathers the loss from every rank at each logging step.
            logging_strategy="steps" if logging_steps else "no",
            logging_steps=max(1, logging_steps),
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=dataset,
            data_collator=_SlowCollate(f.delay_s("data")),
            callbacks=callbacks,
            optimizers=(_slow_sgd(model.parameters(), f.delay_s("optimizer")), None),
        )
        trainer.train()
    return _rows_of(callbacks[0].rankwatch)


def _lightning_cell(f: Fault, accumulate: int = 1, sync_log: bool = False) -> Any:
    import lightning.pytorch as lp

    from rankwatch.exporter.integrations.lightning import RankwatchCallback

    class AfterStep(lp.Callback):
        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            time.sleep(f.delay_s("after"))

    module = lightning_regressor(
        optimizer=lambda params: _slow_sgd(params, f.delay_s("optimizer")), sync_log=sync_log
    )
    _slow_down(module.net, f)
    loader = _pairs_loader(f.steps * accumulate * f.world, f.delay_s("data"))
    callbacks: list[Any] = [RankwatchCallback(_rankwatch_factory()), AfterStep()]
    trainer = lp.Trainer(
        accelerator="cpu",
        devices=f.world,
        strategy="ddp",
        max_steps=f.steps,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, train_dataloaders=loader)
    return _rows_of(callbacks[0].rankwatch)


def _accelerate_cell(f: Fault) -> Any:
    import torch
    from accelerate import Accelerator

    from rankwatch.exporter.integrations import unwrap_optimizer

    accelerator = Accelerator(cpu=True)  # Gloo from torchrun's environment (once per process)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    _slow_down(net, f)
    opt = _slow_sgd(net.parameters(), f.delay_s("optimizer"))
    loader = _pairs_loader(f.steps * f.world, f.delay_s("data"))
    model, opt, loader = accelerator.prepare(net, opt, loader)
    rw = _rankwatch_factory()()
    # AcceleratedOptimizer's step calls the real optimizer's: its hooks time the update.
    for x, y in rw.watch(model, unwrap_optimizer(opt), loader):
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        time.sleep(f.delay_s("after"))
    rows = _rows_of(rw)
    rw.close(10.0)
    accelerator.free_memory()
    return rows


def _deepspeed_cell(f: Fault) -> Any:
    """The loop the integration docs give for DeepSpeed: forward and backward timed by
    ``phase()`` (``engine.backward`` reduces the gradients after the autograd pass), the
    torch optimizer inside the ZeRO optimizer handed to ``watch``, the engine's collectives
    timed as sync waits."""
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch

    from rankwatch.exporter.integrations import unwrap_optimizer
    from rankwatch.exporter.integrations.deepspeed import time_engine_collectives

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    _slow_down(net, f)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=net,
        optimizer=_slow_sgd(net.parameters(), f.delay_s("optimizer")),
        config={
            "train_micro_batch_size_per_gpu": BATCH,
            "zero_optimization": {"stage": 1},
            "zero_allow_untested_optimizer": True,
        },
    )
    rw = _rankwatch_factory()()
    undo = time_engine_collectives(rw, engine)
    loader = _pairs_loader(f.steps, f.delay_s("data"))  # not sharded: every rank's own
    for x, y in rw.watch(None, unwrap_optimizer(optimizer), loader):
        with rw.phase("forward"):
            loss = torch.nn.functional.mse_loss(engine(x), y)
        with rw.phase("backward"):
            engine.backward(loss)
        engine.step()
        time.sleep(f.delay_s("after"))
    rows = _rows_of(rw)
    undo()
    rw.close(10.0)
    return rows


# Row -> (its cell on one rank, the cell's options).
_ROWS: dict[str, tuple[Callable[..., list[list[float | None]]], dict[str, Any]]] = {
    "hf_trainer": (_hf_cell, {}),
    "hf_trainer_accum": (_hf_cell, {"accumulate": 2}),
    "hf_trainer_logging": (_hf_cell, {"logging_steps": 1}),
    "lightning": (_lightning_cell, {}),
    "lightning_accum": (_lightning_cell, {"accumulate": 2}),
    "lightning_sync_log": (_lightning_cell, {"sync_log": True}),
    "accelerate": (_accelerate_cell, {}),
    "deepspeed": (_deepspeed_cell, {}),
}
FRAMEWORK_ROWS = frozenset(_ROWS)


def run_cell(
    row: str,
    col: str,
    *,
    world: int,
    slow: bool,
    steps: int,
    slow_s: float,
    base_s: float,
) -> list[list[float | None]]:
    """One cell of a framework row on this rank (``slow``: the rank the column slows): the
    rows its timer wrote. (Lightning takes ``WORLD_SIZE`` out of the environment when a fit
    ends, so the world is passed.)"""
    cell, options = _ROWS[row]
    return cell(Fault(world, col, slow, steps, slow_s, base_s), **options)

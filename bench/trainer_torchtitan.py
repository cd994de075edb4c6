"""A torchtitan job on the CPU: its Llama 3 debug model, its ``Trainer`` with rankwatch's mixin,
its checkpointing, as a user runs it, with the two changes a CPU run needs.

torchtitan 0.3.0 picks its device once, when ``torchtitan.tools.utils`` is imported:
``device_type = torch._utils._get_available_device_type() or "cuda"`` (no accelerator: CUDA),
and ``device_module`` is ``torch.cuda``. Without a GPU the Trainer then fails at
``device_module.set_device`` (a CPU build of torch has no CUDA), and the process group would
be NCCL (``Backend.default_device_backend_map["cuda"]``). :func:`use_cpu` sets both to the
CPU before anything else of torchtitan is imported (every module copies them at import): the
process group becomes Gloo (the map's entry for ``"cpu"``), the mesh a CPU mesh, and the memory
monitor reads a stand-in device module that reports no memory. The other change is the data:
the debug config reads a tokenizer and a C4 sample from the repository's ``tests/assets``,
which the package does not ship; :class:`SyntheticTokens` yields seeded random tokens, with a
tokenizer that is never called (:class:`NoTokenizer`). Everything else is torchtitan's: its
``Trainer``, ``parallelize_llama`` (FSDP2 with tensor parallel over DTensor, or its pipeline
schedule), its optimizer container, loss, and DCP checkpointer.

``import triton`` is unconditional in torchtitan 0.3.0 (``distributed.minimal_async_ep``,
imported by every decoder model), so the ``triton`` package must be installed on the CPU too.
"""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MODEL_SEQ_LEN = 32  # tokens per sample (the debug config's 2048 is minutes a step on a CPU)
MODEL_BATCH = 2  # samples per rank per step (with pp, microbatches of one)
LAYERS = 2  # of the debug model's six (each rank's step stays tens of milliseconds)


class _CpuProperties:
    total_memory = 1 << 40  # a stand-in: the memory monitor divides by it
    name = "cpu"


def use_cpu() -> None:
    """Make torchtitan run on the CPU (module docstring): before any other torchtitan import."""
    import torch
    import torch.distributed as dist
    import torchtitan.tools.utils as tt_utils

    if not hasattr(dist, "set_timeout"):  # torch 2.13 has it under a private name
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]
    tt_utils.device_type = "cpu"
    tt_utils.device_module = types.SimpleNamespace(  # what the Trainer calls on its module
        set_device=lambda *_: None,
        device_count=lambda: 1,
        current_device=lambda: 0,
        synchronize=torch.cpu.synchronize,
        get_device_name=lambda *_: "cpu",
        get_device_properties=lambda *_: _CpuProperties(),
        reset_peak_memory_stats=lambda *_: None,
        empty_cache=lambda: None,
        memory_stats=lambda *_: {},
    )


@dataclass
class Faults:
    """Where this rank sleeps per step (seconds; 0: nowhere)."""

    data_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    tp_s: float = 0.0  # inside the tensor-parallel region: between its collectives


def _classes() -> tuple[Any, Any]:
    """The tokenizer and loader classes (defined once torchtitan is importable)."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    from dataclasses import dataclass as config_dataclass

    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class NoTokenizer(BaseTokenizer):
        """The tokenizer slot of the config: the synthetic loader makes token ids itself."""

        @config_dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 2048

        def __init__(self, config: Any, **_: Any) -> None:
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError

        def get_vocab_size(self) -> int:
            return int(self.vocab_size)

    class SyntheticTokens(BaseDataLoader):
        """Seeded random token batches (``{"input": ids, "positions": ...}``, labels), one
        stream per data-parallel rank; each fetch sleeps ``delay_s`` first. Its state (batches
        served) is checkpointed."""

        @config_dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 2048
            delay_s: float = 0.0

        def __init__(
            self,
            config: Any,
            *,
            dp_world_size: int,
            dp_rank: int,
            seq_len: int,
            local_batch_size: int,
            **_: Any,
        ) -> None:
            self.config = config
            self.dp_rank, self.seq_len, self.batch = dp_rank, seq_len, local_batch_size
            self.served = 0

        def __iter__(self) -> Iterator[tuple[dict[str, Any], Any]]:
            gen = torch.Generator().manual_seed(1000 + self.dp_rank)
            while True:
                if self.config.delay_s:
                    time.sleep(self.config.delay_s)
                ids = torch.randint(
                    0, self.config.vocab_size, (self.batch, self.seq_len + 1), generator=gen
                )
                self.served += 1
                # one document per sample: FlexAttention's document mask is causal
                positions = torch.arange(self.seq_len).expand(self.batch, -1)
                yield {"input": ids[:, :-1], "positions": positions}, ids[:, 1:]

        def state_dict(self) -> dict[str, Any]:
            return {"served": self.served}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.served = int(state_dict.get("served", 0))

    _CLASSES = (NoTokenizer, SyntheticTokens)
    return _CLASSES


_CLASSES: tuple[Any, Any] | None = None


def debug_config(
    mesh: dict[str, int], steps: int, data_delay_s: float, checkpoint_dir: str, every: int
) -> Any:
    """torchtitan's ``llama3_debugmodel`` config, smaller (``LAYERS`` layers, ``MODEL_SEQ_LEN``
    tokens, ``MODEL_BATCH`` samples), on ``mesh`` (``dp_shard``, ``tp``, ``pp`` sizes), the
    synthetic data, a DCP checkpoint every ``every`` steps into ``checkpoint_dir`` (0: none)."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    no_tokenizer, synthetic = _classes()
    cfg = llama3_debugmodel()
    spec = model_registry("debugmodel")
    # Attention through torch's scaled_dot_product_attention (causal): FlexAttention has no
    # backward on the CPU, varlen attention calls the CUDA flash kernel.
    for _, _, parent, name in list(spec.model.traverse(FlexAttention.Config)):
        setattr(parent, name, ScaledDotProductAttention.Config())
    spec.model.layers = spec.model.layers[:LAYERS]
    cfg.model_spec = spec
    cfg.tokenizer = no_tokenizer.Config()
    cfg.dataloader = synthetic.Config(delay_s=data_delay_s)
    cfg.training.seq_len = MODEL_SEQ_LEN
    cfg.training.local_batch_size = MODEL_BATCH
    cfg.training.steps = steps
    cfg.training.disable_cuda_graphs = True
    cfg.parallelism.data_parallel_shard_degree = mesh.get("dp_shard", 1)
    cfg.parallelism.tensor_parallel_degree = mesh.get("tp", 1)
    cfg.parallelism.pipeline_parallel_degree = mesh.get("pp", 1)
    cfg.parallelism.pipeline_parallel_schedule = "1F1B"
    # DTensor for the model-parallel dimensions (the classic FSDP2 + TP composition); the
    # default spmd_types backend asks fully_shard for parameters on the full SPMD mesh, which
    # torch 2.13's FSDP2 refuses for the debug model's plain norm weights.
    cfg.parallelism.spmd_backend = "partial_dtensor"
    cfg.validator.enable = False
    cfg.metrics.log_freq = 10
    cfg.checkpoint.enable = every > 0
    cfg.checkpoint.interval = max(1, every)
    cfg.checkpoint.keep_latest_k = 2
    cfg.checkpoint.last_save_model_only = True
    cfg.dump_folder = checkpoint_dir
    cfg.comm.init_timeout_seconds = 300
    cfg.comm.train_timeout_seconds = 300
    return cfg


def sum_only_reductions(model_parts: list[Any]) -> None:
    """FSDP2 reduces with plain sums (then scales): torchtitan turns FSDP's gradient division
    off (``set_gradient_divide_factor(1.0)``: it normalises by the global token count itself),
    and FSDP2 then reduce-scatters with ``ReduceOp.PREMUL_SUM(1.0)``, which Gloo refuses
    ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). ``set_force_sum_reduction_for_comms`` is
    FSDP2's own switch to sum-only collectives; the gradients are the same."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def split_microbatch_step(schedule: Any) -> None:
    """Let torch 2.13's pipeline schedule take microbatches split by the caller: torchtitan
    0.3.0 calls ``schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=, loss_kwargs=,
    return_outputs=)``, an API of a newer torch; 2.13's ``step`` would pass them to the model
    as keyword arguments. Its ``_step_microbatches`` takes exactly those lists, after the same
    per-step reset ``step`` does (``has_backward``, ``clear_runtime_states``)."""
    step = schedule.step

    def step_microbatches(
        *args: Any,
        arg_mbs: Any = None,
        kwarg_mbs: Any = None,
        target_mbs: Any = None,
        losses: Any = None,
        return_outputs: bool = True,
        loss_kwargs: Any = None,
        **kwargs: Any,
    ) -> Any:
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return step(
                *args,
                losses=losses,
                return_outputs=return_outputs,
                loss_kwargs=loss_kwargs,
                **kwargs,
            )
        schedule._stage.has_backward = schedule._has_backward
        schedule._stage.clear_runtime_states()
        schedule._step_microbatches(
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
        )
        return None

    schedule.step = step_microbatches


def _sleep_hook(seconds: float) -> Any:
    def hook(*_: Any) -> None:
        time.sleep(seconds)

    return hook


def _install_faults(part: Any, faults: Faults, calls_per_step: int) -> None:
    """This rank's sleeps on its model part (the forward pre hook, a gradient hook on the last
    block's output, each block's feed-forward), split over the part's calls per step."""
    per = 1.0 / calls_per_step
    if faults.forward_s:
        part.register_forward_pre_hook(_sleep_hook(faults.forward_s * per))
    blocks = list(part.layers.values()) if part.layers is not None else []
    if faults.backward_s and blocks:
        delay = faults.backward_s * per

        def grad_sleep(_module: Any, _inputs: Any, output: Any) -> None:
            if getattr(output, "requires_grad", False):
                output.register_hook(_sleep_hook(delay))

        blocks[-1].register_forward_hook(grad_sleep)
    if faults.tp_s and blocks:
        for block in blocks:
            block.feed_forward.register_forward_pre_hook(
                _sleep_hook(faults.tp_s * per / len(blocks))
            )


def run(
    mesh: dict[str, int],
    steps: int,
    faults: Faults,
    checkpoint_dir: str,
    checkpoint_every: int,
    rankwatch_factory: Any,
) -> Any:
    """Train ``steps`` steps of the debug model with rankwatch on this rank; the closed
    Trainer (its ``rankwatch`` is closed too). ``use_cpu()`` must have run first."""
    from torchtitan.trainer import Trainer

    from rankwatch.exporter.integrations.torchtitan import RankwatchTrainerMixin

    class WatchedTrainer(RankwatchTrainerMixin, Trainer):
        pass

    WatchedTrainer.rankwatch_factory = staticmethod(rankwatch_factory)
    cfg = debug_config(mesh, steps, faults.data_s, checkpoint_dir, checkpoint_every)
    trainer = WatchedTrainer(cfg)
    sum_only_reductions(trainer.model_parts)
    if getattr(trainer, "pp_schedule", None) is not None:
        split_microbatch_step(trainer.pp_schedule)
    calls = trainer.num_pipeline_parallel_microbatches * trainer.gradient_accumulation_steps
    for part in trainer.model_parts:
        _install_faults(part, faults, calls)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer

"""An Accelerate N-D parallel job: ``ParallelismConfig(dp_shard_size=2, tp_size=2)`` (FSDP2 over
transformers' tensor parallel plan) on a tiny Llama built from a config, in a plain Accelerate
loop around ``RankWatch.watch()``; for a host with 4 CUDA GPUs (``make gpu-check``).

It cannot run on a CPU: Accelerate 1.16 selects FSDP (which a dp_shard ``ParallelismConfig``
requires) only for a multi-accelerator job, and refuses the config on ``MULTI_CPU`` (see
``NOT_RUN`` in :mod:`bench.accuracy_trainers`).

The model: ``LlamaConfig`` (2 layers, hidden 64) saved by rank 0 to a temporary folder and
loaded back with ``from_pretrained(..., tp_plan="auto", device_mesh=mesh["tp"])``, which is how
transformers applies its tensor parallel plan (nothing is downloaded: ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

SEQ_LEN = 64
BATCH = 4
VOCAB = 512


def _tiny_llama_folder(folder: str) -> str:
    """Rank 0 saves a seeded tiny Llama into ``folder``; every rank waits for it."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    if dist.get_rank() == 0 and not os.path.exists(os.path.join(folder, "config.json")):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=SEQ_LEN,
        )
        LlamaForCausalLM(config).save_pretrained(folder)
    dist.barrier()
    return folder


def run(
    folder: str,
    steps: int,
    data_delay_s: float,
    forward_hook: Callable[..., Any] | None,
    rankwatch_factory: Callable[[], Any],
) -> Any:
    """Train ``steps`` steps with rankwatch on this rank (torchrun's environment, one CUDA
    device per rank); ``forward_hook``: a forward pre hook put on the first decoder layer (the
    fault), ``data_delay_s``: the loader's sleep per batch. Returns the closed ``RankWatch``."""
    import torch
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import LlamaForCausalLM

    from rankwatch.exporter.integrations import unwrap_optimizer

    accelerator = Accelerator(
        parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2),
        fsdp_plugin=FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        ),
    )
    mesh = accelerator.torch_device_mesh
    model = LlamaForCausalLM.from_pretrained(
        _tiny_llama_folder(folder), tp_plan="auto", device_mesh=mesh["tp"]
    )
    if forward_hook is not None:
        model.model.layers[0].register_forward_pre_hook(forward_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    # The tensor-parallel peers see the same batch: one stream per data-parallel index.
    seed = 1 + accelerator.process_index // 2

    def batches() -> Iterator[Any]:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            if data_delay_s:
                time.sleep(data_delay_s)
            yield torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=gen)

    rw = rankwatch_factory()
    for ids in rw.watch(model, unwrap_optimizer(optimizer), batches(), mesh=mesh):
        ids = ids.to(accelerator.device)
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
        rw.collect()
    rw.close(30.0)
    accelerator.free_memory()
    return rw

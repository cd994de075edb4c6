"""The accuracy matrix's trainer rows: real torchtitan jobs (its Trainer, its debug model, its
FSDP2 + tensor parallel on a device mesh, its DCP checkpoints) with rankwatch added as a
torchtitan user adds it, one slow rank per cell.

Every cell is a real run of 4 Gloo ranks (``torchrun``'s environment; torchtitan initialises
``torch.distributed`` itself): each rank builds a ``Trainer`` subclass with
:class:`~rankwatch.exporter.integrations.torchtitan.RankwatchTrainerMixin` (made on the CPU as
:mod:`bench.trainer_torchtitan` says), trains, checkpoints every ``CHECKPOINT_EVERY`` steps and
closes. The ``RankWatch`` is the 3D matrix's (:func:`bench.accuracy_parallel.
recording_rankwatch`: sync mode, a live window every 10 steps, the real publisher hub and its
incidents), and a cell is right by the same rule (:class:`bench.accuracy_parallel.Cell`).

Accelerate's ``ParallelismConfig`` row does not run here: Accelerate 1.16 builds FSDP2 (and so
accepts a dp_shard x tp ``ParallelismConfig``) only for a multi-accelerator job; see
:data:`NOT_RUN` and ``make gpu-check``.

``python -m bench.accuracy_trainers`` (``make accuracy-trainers``) writes its section of
``docs/accuracy.md``; :func:`run_matrix` runs any subset (the test suite runs one cell).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.accuracy_parallel import (
    DOC,
    NO_STRAGGLER,
    NONE,
    Cell,
    CellSpec,
    cell_of,
    cells_table,
    commit_id,
    names_of,
    recording_rankwatch,
    run_timed,
    say_cell,
    write_section,
)

WORLD = 4
SLOW_S = 0.3  # the slow rank's extra sleep per step (about half a step on a loaded 2-core host)
STEPS = 60  # steps of a cell with a slow rank (5 of warm-up, then 5 live windows of 10)
CONTROL_STEPS = 150  # the control's steps (14 live windows)
CHECKPOINT_EVERY = 20  # a DCP checkpoint of model and optimizer every this many steps
JOIN_TIMEOUT_S = 1800.0
SECTION = "trainers"
OWNER = "accuracy-trainers"

PLACES: dict[str, str] = {
    "data": "data loading (the loader sleeps before yielding the batch)",
    "forward": "forward (a forward pre-hook of the model sleeps, before its first all-gather)",
    "backward": "backward (a gradient hook on the last block's output sleeps)",
    "tp": "inside the tensor-parallel region (each block's feed-forward sleeps between the "
    "attention's and the feed-forward's tensor-parallel collectives): its TP peer waits there",
}


@dataclass(frozen=True)
class Row:
    """A trainer job: its mesh (torchtitan's parallel degrees) and the rank the faults are on."""

    description: str
    mesh: dict[str, int]
    slow_rank: int
    places: tuple[str, ...]


ROWS: dict[str, Row] = {
    "torchtitan_fsdp_tp": Row(
        "torchtitan 0.3.0, Llama 3 debug model (2 layers), data_parallel_shard_degree 2 x "
        "tensor_parallel_degree 2 (FSDP2 over DTensor tensor parallel, its parallelize_llama)",
        {"dp_shard": 2, "tp": 2},
        1,
        ("data", "forward", "backward", "tp"),
    ),
    "torchtitan_pp_dp": Row(
        "torchtitan 0.3.0, the same model, pipeline_parallel_degree 2 x "
        "data_parallel_shard_degree 2 (its pipeline_llm: one stage per rank, Schedule1F1B, "
        "2 microbatches; FSDP2 within each stage); the slow rank is on stage 1",
        {"pp": 2, "dp_shard": 2},
        2,
        ("data", "forward", "backward"),
    ),
}

# Rows a trainer's users run that cannot run on this machine, and exactly why.
NOT_RUN: dict[str, str] = {
    "accelerate_fsdp_tp": (
        "Accelerate 1.16 `ParallelismConfig(dp_shard_size=2, tp_size=2)` with an FSDP2 "
        "plugin: without an accelerator the state is `MULTI_CPU`, and Accelerate switches a "
        "job to FSDP only from a multi-accelerator type (`AcceleratorState.__init__`, the "
        "`MULTI_GPU`... branch), so `ParallelismConfig._validate_accelerator` refuses it "
        "(`ValueError: ParallelismConfig is only compatible DistributedType.FSDP (version 2) "
        "or DistributedType.Multi{Device} or DistributedType.DEEPSPEED, but got "
        "DistributedType.MULTI_CPU`); without `cpu=True` the CPU job is one process "
        "(`total_size (4) does not match num_processes (1)`). Prepared for a CUDA host: "
        "`make gpu-check` runs the job (bench/trainer_accelerate.py)."
    ),
}


def cells_of(row: str) -> list[CellSpec]:
    """Every cell of ``row``: each place on its slow rank, then the no-fault control."""
    rank = ROWS[row].slow_rank
    return [CellSpec(row, p, rank, STEPS) for p in ROWS[row].places] + [
        CellSpec(row, NONE, None, CONTROL_STEPS)
    ]


def expected(spec: CellSpec) -> str:
    """The right verdict: FSDP2 jobs are never attributed to compute (the step-time policy)."""
    if spec.place == NONE:
        return NO_STRAGGLER
    return "INPUT_STRAGGLER" if spec.place == "data" else "STRAGGLER"


# ---- inside the spawned ranks ----------------------------------------------------------------


def _run_cell(rank: int, spec: CellSpec, scratch: str) -> dict[str, Any]:
    from bench import trainer_torchtitan

    slow = spec.rank == rank
    faults = trainer_torchtitan.Faults(
        **({f"{spec.place}_s": SLOW_S} if slow and spec.place in PLACES else {})
    )
    rw, recorded = None, None

    def factory() -> Any:
        nonlocal rw, recorded
        rw, recorded = recording_rankwatch(f"accuracy-{spec.row}")
        return rw

    folder = tempfile.mkdtemp(prefix=f"{spec.place}-", dir=scratch)
    trainer = trainer_torchtitan.run(
        ROWS[spec.row].mesh, spec.steps, faults, folder, CHECKPOINT_EVERY, factory
    )
    assert recorded is not None
    out = recorded()
    if out:
        # What the mesh reading saw: the watched layout, and the root mesh a DTensor
        # parameter carries (torchtitan's 1-D world mesh, which says nothing of the layout).
        from torch.distributed.tensor import DTensor

        mesh = rw._aggregator.mesh if rw is not None and rw._aggregator is not None else None
        out["watched_mesh"] = None if mesh is None else [list(mesh.dim_names), list(mesh.shape)]
        param = next(p for p in trainer.model_parts[0].parameters() if isinstance(p, DTensor))
        root = param.device_mesh._get_root_mesh()
        out["parameter_mesh"] = [list(root.mesh_dim_names or ()), list(root.mesh.shape)]
        out["checkpoints"] = sorted(os.listdir(os.path.join(folder, "checkpoint")))
    return out


def _worker(rank: int, port: int, specs: list[CellSpec], out: str) -> None:
    """A rank of one world (torchrun's environment), running ``specs`` one after the other."""
    import json

    from bench.accuracy_frameworks import torchrun_env

    os.environ.update(torchrun_env(rank, WORLD, port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("rankwatch.incidents").setLevel(logging.ERROR)
    logging.getLogger("torchtitan").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    result: dict[str, Any] = {}
    try:
        import torch

        from bench import trainer_torchtitan

        torch.set_num_threads(1)
        trainer_torchtitan.use_cpu()
        with tempfile.TemporaryDirectory() as scratch:
            for spec in specs:
                run_timed(result, spec, lambda spec=spec: _run_cell(rank, spec, scratch))
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        result["error"] = traceback.format_exc()
    Path(out, f"{rank}.json").write_text(json.dumps(result))


# ---- in the parent ---------------------------------------------------------------------------


def run_matrix(specs: list[CellSpec]) -> list[Cell]:
    """Run ``specs`` in spawned Gloo worlds, one per row; their outcomes, in the order given."""
    from bench.accuracy_step_time import spawn_world

    results: dict[str, Cell] = {}
    for row in dict.fromkeys(s.row for s in specs):
        world_specs = [s for s in specs if s.row == row]
        per_rank = spawn_world(_worker, WORLD, world_specs, JOIN_TIMEOUT_S)
        for spec in world_specs:
            cell = results[spec.key] = cell_of(spec, per_rank, expected(spec))
            say_cell(spec.key, cell)
    return [results[s.key] for s in specs]


def render(cells: list[Cell], commit: str | None = None) -> str:
    """The trainer rows as a Markdown section."""
    right = sum(c.right for c in cells)
    lines = [
        "## Trainer matrix (torchtitan; Accelerate's ParallelismConfig)",
        "",
        "Generated by `make accuracy-trainers` (`python -m bench.accuracy_trainers`) on commit "
        f"`{commit or commit_id()}`; do not edit by hand.",
        "",
        f"Every cell is a real run of {WORLD} Gloo processes under `torchrun`'s environment: "
        "torchtitan's own `Trainer` (a subclass with rankwatch's `RankwatchTrainerMixin`, "
        "nothing else changed) trains its Llama 3 debug model on the CPU, saving a DCP "
        f"checkpoint (model and optimizer) every {CHECKPOINT_EVERY} steps in every cell. "
        "rankwatch runs in sync mode with a live window every 10 steps (as in the 3D matrix), "
        "publishing to the real publisher hub; the slow rank sleeps "
        f"{SLOW_S * 1e3:.0f} ms more per step where the column says. Fault cells run {STEPS} "
        f"steps, the control {CONTROL_STEPS}. The compute is the model's own (no stand-in "
        "sleep). A cell is right as in the 3D matrix: the run's verdict is the expected kind "
        "and names the slow rank, and no incident opened on another rank (none at all in the "
        f"control). Right: {right} of {len(cells)}.",
        "",
        "Rows:",
        "",
    ]
    for name in dict.fromkeys(c.spec.row for c in cells):
        row = ROWS[name]
        lines.append(f"- `{name}`: {row.description}; slow rank: {row.slow_rank}")
    lines += ["", "Where the slow rank is slow:", ""]
    lines += [f"- `{k}`: {v}" for k, v in PLACES.items()]
    lines += [f"- `{NONE}`: no slow rank (the control)"]
    lines += cells_table(cells)
    lines += ["", "Not run on this machine, and why:", ""]
    lines += [f"- `{name}`: {why}" for name, why in NOT_RUN.items()]
    lines += ["", NOTES]
    return "\n".join(lines) + "\n"


NOTES = """### Reading the trainer matrix

- **What a CPU run of torchtitan needs** (read in torchtitan 0.3.0's source; the job is
  `bench/trainer_torchtitan.py`). torchtitan picks its device at import,
  `_get_available_device_type() or "cuda"`, so without a GPU it would call `torch.cuda` and
  ask for NCCL: setting `torchtitan.tools.utils.device_type = "cpu"` (and a device module
  that reports no memory) before importing the rest gives Gloo and a CPU mesh. FlexAttention
  has no backward on the CPU and varlen attention calls the CUDA flash kernel, so the blocks'
  inner attention is torchtitan's `ScaledDotProductAttention` (causal). torchtitan turns
  FSDP's gradient division off and FSDP2 then reduce-scatters with `PREMUL_SUM(1.0)`, which
  Gloo refuses: `set_force_sum_reduction_for_comms(True)`. torch 2.13 names
  `dist.set_timeout` `_set_pg_timeout` (torchtitan calls it after the first step), and its
  pipeline schedule's `step` takes no pre-split microbatches: torchtitan 0.3.0 calls
  `schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=, ...)`, which torch 2.13 passes to the
  model as keyword arguments (`ValueError: Expecting 2 arg_mbs but got 1` on the first step,
  on GPUs too); the job hands those lists to the schedule's own `_step_microbatches`, after
  the reset `step` does. `import
  triton` is unconditional (the `triton` package is installed on the CPU too). The data is
  synthetic (the debug config's tokenizer and C4 sample live in torchtitan's repository, not
  its package). None of these touch rankwatch.
- **What rankwatch needed.** torchtitan builds every mesh by unflattening a 1-D `world` mesh,
  so the mesh of a DTensor parameter (and any submesh's root) is that 1-D mesh, and
  `watch()` would find no layout: the mixin passes `trainer_mesh(parallel_dims)`, the sizes of
  its data-loading mesh (`pp`, `dp` = replicate x shard, `cp`, `tp`). Checkpoint saves run
  between steps: the mixin ends the training step before torchtitan's `checkpointer.save`
  (`RankWatch.end_step()`) and the save's collectives are not timed, so a save is never in a
  step. The Trainer's own collectives (the token count and loss all-reduces, the gradient
  norm) are timed as waits like any other. torchtitan's loss (`ChunkedLossWrapper`) runs the
  output projection and the cross-entropy after the model returns (the model skips its
  `lm_head`): the mixin times the Trainer's `loss_fn` as forward and its backward as backward
  (`rankwatch.exporter.step_time.loss`). The first run of this matrix, without it, was 1 of 5
  right: every fault cell's verdict named rank 1 with the expected kind in every live window,
  but three of them and the control opened `residual_heavy` incidents on all four ranks, and
  every one of the control's 15 windows was `RESIDUAL_HEAVY`.
- **Controls and load.** Neither control opened an incident over its 15 live windows, with a
  checkpoint every 20 steps; one window of each named a rank `STRAGGLER` (scores 0.11 and
  0.13, on a machine at load 17 to 26 shared with other jobs: 4 ranks on 2 cores, real
  compute), which no incident followed (the previous run of the TP control: 4 such windows,
  scores up to 0.14, no incident). The checkpoint saves (steps 20, 40, ...) are in no step.
- **Limits.** 4 ranks, two sizes per dimension, a two-layer debug model on a CPU
  shared with other jobs (real compute, so the machine's load is in every step). Accelerate's
  N-D parallelism did not run (above); nothing here ran on GPUs."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=str(DOC), help="Markdown file whose section is written ('-': print)"
    )
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows")
    parser.add_argument("--places", default=",".join([*PLACES, NONE]), help="comma-separated")
    args = parser.parse_args(argv)
    rows = names_of(parser, "--rows", args.rows, ROWS, "row")
    places = names_of(parser, "--places", args.places, [*PLACES, NONE], "place")
    specs = [s for r in rows for s in cells_of(r) if s.place in places]
    start = time.monotonic()
    cells = run_matrix(specs)
    text = render(cells)
    if args.out == "-":
        print(text)
    else:
        write_section(SECTION, text, Path(args.out), owner=OWNER)
    right = sum(c.right for c in cells)
    print(f"{right}/{len(cells)} cells right in {time.monotonic() - start:.0f} s")
    return 0 if right == len(cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())

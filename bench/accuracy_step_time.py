"""The step-time accuracy matrix: real Gloo jobs, one slow rank, the verdict per cell.

Rows are model and loop shapes real jobs have; columns say where one rank (``SLOW_RANK``) is
slow, by a sleep of ``SLOW_S`` per step; every rank also sleeps ``BASE_S`` inside its forward so a
step is not all Python overhead. Every cell is a real run: ``WORLD`` spawned processes under
``torch.distributed`` (Gloo) train with ``RankWatch.watch()``, and the diagnosis runs on the
rows their timers wrote (the last ``WINDOW`` steps of ``STEPS``).

``python -m bench.accuracy_step_time`` (``make accuracy``) runs the whole matrix and writes
``docs/accuracy.md``; :func:`run_matrix` runs any subset (the test suite runs a few cells).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.accuracy_frameworks import FRAMEWORK_ROWS, run_cell, sleeper, torchrun_env
from bench.accuracy_parallel import generated_tail, names_of
from rankwatch.exporter.cli.ports import free_port
from tests.rank_processes import rank_process

WORLD = 3
SLOW_RANK = 1
SLOW_S = 0.03  # the injected slowdown per step on the slow rank
BASE_S = 0.012  # every rank's forward sleeps this long (a stand-in for compute)
STEPS = 40
WINDOW = 32  # steps diagnosed: the last ones (warm-up excluded); >= 20 allows critical
JOIN_TIMEOUT_S = 900.0

ROWS: dict[str, str] = {
    "mlp": "plain MLP under DDP",
    "batchnorm": "BatchNorm MLP, DDP default broadcast_buffers=True",
    "no_broadcast": "BatchNorm MLP, broadcast_buffers=False",
    "no_sync": "gradient accumulation: 2 micro-batches, the first under no_sync()",
    "two_forwards": "two forwards per step, one backward",
    "compile": "DDP(torch.compile(model, fullgraph=True))",
    "prefetch": "loader consumed by a prefetch thread (training reads a queue)",
    "scaler_wrapper": "GradScaler stepping a framework-style optimizer wrapper",
    "fsdp": "FSDP2 (fully_shard) instead of DDP",
    "hf_trainer": "Hugging Face Trainer (tiny BERT, DDP, default arguments) with its callback",
    "hf_trainer_accum": "the same Trainer, gradient_accumulation_steps=2",
    "hf_trainer_logging": "the same Trainer, logging every step (the loss gathered from all ranks)",
    "lightning": 'Lightning Trainer(strategy="ddp") with its callback',
    "lightning_accum": "the same Lightning Trainer, accumulate_grad_batches=2",
    "lightning_sync_log": "the same, training_step logs its loss with sync_dist=True",
    "accelerate": "plain Accelerate loop (prepare: DDP, AcceleratedOptimizer) around watch()",
    "deepspeed": "DeepSpeed ZeRO-1 loop, forward and backward timed by phase() (the docs' recipe)",
}
COLUMNS: dict[str, str] = {
    "data": "data loading",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer step",
    "after": "after the step (logging, checkpointing)",
    "none": "no slow rank",
}
NO_STRAGGLER = "no straggler"
STRATEGIES = {"fsdp": "fsdp"}  # the strategy a row's diagnosis runs under (else DDP)


def expected(row: str, col: str) -> str:
    """The right verdict of a cell (``NO_STRAGGLER``: any kind that names no straggler)."""
    if col == "none":
        return NO_STRAGGLER
    if col == "data":
        # A prefetch thread's fetch is not what training waits for, and the queue wait of the
        # training thread is user code rankwatch cannot see: the culprit is named, the cause
        # (input) cannot be measured.
        return "STRAGGLER" if row == "prefetch" else "INPUT_STRAGGLER"
    if col in ("forward", "backward"):
        # Under FSDP compute is never attributed (the seed's policy): the culprit is named.
        return "STRAGGLER" if STRATEGIES.get(row) == "fsdp" else "COMPUTE_STRAGGLER"
    return "STRAGGLER"  # optimizer / after the step: no attribution component covers them


@dataclass(frozen=True)
class Cell:
    """One cell's verdict."""

    row: str
    col: str
    kind: str
    culprit: int | None
    score: float | None
    visible_definition: str
    expected: str
    error: str | None = None

    @property
    def right(self) -> bool:
        if self.error is not None:
            return False
        if self.expected == NO_STRAGGLER:
            return "STRAGGLER" not in self.kind
        return self.kind == self.expected and self.culprit == SLOW_RANK


# ---- inside the spawned ranks ----------------------------------------------------------------


class _OptimizerWrapper:
    """A framework-style optimizer wrapper: the torch optimizer is in ``.optimizer``."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> Any:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self, closure: Any = None) -> Any:
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def _run_cell(rank: int, row: str, col: str) -> list[list[float | None]]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from rankwatch.diagnosis.config import DiagnosisConfig, StepTimeConfig
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    slow = rank == SLOW_RANK
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(32, 64)]
    if row in ("batchnorm", "no_broadcast"):
        layers.append(torch.nn.BatchNorm1d(64))
    last = torch.nn.Linear(64, 1)
    layers += [torch.nn.ReLU(), last]
    net = torch.nn.Sequential(*layers)
    inner: Any = torch.compile(net, fullgraph=True) if row == "compile" else net
    inner.register_forward_pre_hook(sleeper(BASE_S))
    model: Any
    if row == "fsdp":
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(inner)
    else:
        # (the default broadcasts buffers before every forward; passing it at all warns)
        model = DDP(inner, broadcast_buffers=False) if row == "no_broadcast" else DDP(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watched_opt: Any = _OptimizerWrapper(opt) if row == "scaler_wrapper" else opt
    scaler = torch.amp.GradScaler("cpu") if row == "scaler_wrapper" else None

    def batches() -> Any:
        gen = torch.Generator().manual_seed(1 + rank)
        for _ in range(STEPS):
            if slow and col == "data":
                time.sleep(SLOW_S)
            yield torch.randn(16, 32, generator=gen), torch.randn(16, 1, generator=gen)

    diag = DiagnosisConfig(step_time=StepTimeConfig(live_window_steps=STEPS))
    cfg = RankwatchConfig.from_env(
        env={}, diagnosis=diag, async_mode=False, sync_step=10**6, gather_timeout_seconds=30.0
    )
    rw = RankWatch(config=cfg)
    loader = rw.watch(model, watched_opt, batches())
    if slow and col == "forward":
        inner.register_forward_pre_hook(sleeper(SLOW_S))
    if slow and col == "backward" and row == "fsdp":
        # FSDP hands a sharded parameter its gradient inside the unit's reduce-scatter call,
        # after the collective: a hook there is not backward compute. The last layer's
        # backward is (the hook runs once its input gradients are computed).
        last.register_full_backward_hook(sleeper(SLOW_S))
    elif slow and col == "backward":
        # The first gradient of the pass (last layer): the rest of backward waits behind it.
        last.weight.register_post_accumulate_grad_hook(sleeper(SLOW_S))
    if slow and col == "optimizer":
        opt.register_step_pre_hook(sleeper(SLOW_S))

    def mse(out: Any, y: Any) -> Any:
        return torch.nn.functional.mse_loss(out, y)

    source: Any = loader
    if row == "prefetch":
        q: queue.Queue[Any] = queue.Queue(maxsize=2)

        def produce() -> None:
            for b in loader:
                q.put(b)
            q.put(None)

        threading.Thread(target=produce, daemon=True).start()
        source = iter(q.get, None)
    for x, y in source:
        if row == "no_sync":
            with model.no_sync():
                mse(model(x[:8]), y[:8]).backward()
            mse(model(x[8:]), y[8:]).backward()
        elif row == "two_forwards":
            (mse(model(x[:8]), y[:8]) + mse(model(x[8:]), y[8:])).backward()
        elif scaler is not None:
            scaler.scale(mse(model(x), y)).backward()
        else:
            mse(model(x), y).backward()
        if scaler is not None:
            scaler.step(watched_opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        if slow and col == "after":
            time.sleep(SLOW_S)
    timer = rw.timer
    assert timer is not None
    rows = timer.ring[: timer.written].tolist()
    rw.close(10.0)
    return [[None if math.isnan(v) else v for v in r] for r in rows]


def _worker(rank: int, port: int, cells: list[tuple[str, str]], out: str) -> None:
    """A rank of one matrix world, running ``cells`` one after the other. Plain rows join the
    Gloo group here; a framework row (one per world) gets the environment ``torchrun`` would
    set, and the framework joins it."""
    framework = any(row in FRAMEWORK_ROWS for row, _ in cells)
    if framework:
        os.environ.update(torchrun_env(rank, WORLD, port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result: dict[str, Any] = {}
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if not framework:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
            )
        for row, col in cells:
            if dist.is_initialized():  # a framework joins in its first cell
                dist.barrier()
            try:
                result[f"{row}/{col}"] = (
                    run_cell(
                        row,
                        col,
                        world=WORLD,
                        slow=rank == SLOW_RANK,
                        steps=STEPS,
                        slow_s=SLOW_S,
                        base_s=BASE_S,
                    )
                    if framework
                    else _run_cell(rank, row, col)
                )
            except Exception:
                result[f"{row}/{col}"] = {"error": traceback.format_exc()}
                raise
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        result["error"] = traceback.format_exc()
    Path(out, f"{rank}.json").write_text(json.dumps(result))


# ---- in the parent ---------------------------------------------------------------------------


def _group_leader(worker: Any, *args: Any) -> None:
    """A rank (:mod:`tests.rank_processes`): the leader of a process group of its own (its
    children, e.g. compile workers, join it, so one ``killpg`` ends them all), killed by the
    kernel if the parent dies first (no rank outlives a killed harness), then
    ``worker(*args)``."""
    os.setpgid(0, 0)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass  # not Linux: the parent's kill still ends the rank
    worker(*args)


def kill_world(procs: list[Any], grace_s: float = 0.0) -> None:
    """End every rank of ``procs`` and all their children: SIGTERM to each rank's process
    group first when ``grace_s`` > 0 (with SIGCONT, so a stopped rank handles it), then, after
    up to ``grace_s``, SIGCONT and SIGKILL to each group (a stopped process dies of SIGKILL
    too), and reap them."""

    def signal_groups(*signums: int) -> None:
        for p in started:
            for signum in signums:
                try:
                    os.killpg(p.pid, signum)
                except (ProcessLookupError, PermissionError):
                    # not (yet) a group leader, or gone: the rank alone
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signum)

    started = [p for p in procs if p.pid is not None]
    if grace_s > 0:
        signal_groups(signal.SIGTERM, signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        for p in started:
            p.join(max(0.0, deadline - time.monotonic()))
    signal_groups(signal.SIGCONT, signal.SIGKILL)
    for p in started:
        p.join(5.0)


@contextlib.contextmanager
def started_world(
    worker: Any, world: int, work: Any, *, agent_store: bool = False
) -> Iterator[tuple[list[Any], str]]:
    """Start ``world`` processes running ``worker(rank, port, work, out)``, each the leader of
    its own process group; yield them and ``out`` (a temporary folder), and on leaving kill
    whatever is left of every group, in every outcome. With ``agent_store`` this process serves
    the job's c10d store on ``port``, as ``torchrun``'s agent does (the workers then set
    ``TORCHELASTIC_USE_AGENT_STORE=True``: rank 0 connects to it instead of serving it)."""
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        store = None
        if agent_store:
            import torch.distributed as dist

            store = dist.TCPStore(
                "127.0.0.1", port, world, is_master=True, wait_for_workers=False, multi_tenant=True
            )
        procs = [rank_process(_group_leader, (worker, r, port, work, out)) for r in range(world)]
        try:
            for p in procs:
                p.start()
            yield procs, out
        finally:
            kill_world(procs)
            del store


def read_results(out: str, world: int) -> list[dict[str, Any]]:
    """What each rank wrote to ``out/<rank>.json`` (``{"error": "died"}`` for none)."""
    results = []
    for r in range(world):
        path = Path(out, f"{r}.json")
        results.append(json.loads(path.read_text()) if path.exists() else {"error": "died"})
    return results


def spawn_world(
    worker: Any, world: int, work: Any, timeout_s: float = JOIN_TIMEOUT_S
) -> list[dict[str, Any]]:
    """Spawn ``world`` processes running ``worker(rank, port, work, out)`` (each writes
    ``out/<rank>.json``), wait up to ``timeout_s`` for them (then kill every process group
    left), and return what each wrote (``{"error": "died"}`` for a rank that wrote nothing)."""
    with started_world(worker, world, work) as (procs, out):
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        kill_world(procs)
        return read_results(out, world)


def _run_world(cells: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Spawn ``WORLD`` ranks running ``cells`` (:func:`_worker`); what each wrote."""
    return spawn_world(_worker, WORLD, cells)


def run_matrix(cells: list[tuple[str, str]]) -> list[Cell]:
    """Run ``cells`` (``(row, col)`` pairs) in spawned Gloo worlds (the plain rows in one, each
    framework row in one of its own); their verdicts, in the order given."""
    import numpy as np

    from rankwatch.diagnosis.step_time import diagnose_arrays

    results: dict[str, list[Any]] = {}  # cell key -> each rank's rows (or error)

    def gather(keys: list[str], ranks: list[dict[str, Any]]) -> None:
        err = next((res.get("error") for res in ranks if res.get("error")), None)
        for key in keys:
            results[key] = [res.get(key, {"error": err}) for res in ranks]

    plain = [(r, c) for r, c in cells if r not in FRAMEWORK_ROWS]
    worlds = [plain] if plain else []
    for fw_row in dict.fromkeys(r for r, _ in cells if r in FRAMEWORK_ROWS):
        worlds.append([(r, c) for r, c in cells if r == fw_row])
    for world_cells in worlds:
        gather([f"{r}/{c}" for r, c in world_cells], _run_world(world_cells))
    cells_out: list[Cell] = []
    for row, col in cells:
        key = f"{row}/{col}"
        want = expected(row, col)
        per_rank = results[key]
        bad = [p for p in per_rank if not isinstance(p, list)]
        if bad:
            errors = [p.get("error") for p in bad if isinstance(p, dict) and p.get("error")]
            err = errors[0] if errors else None
            cells_out.append(Cell(row, col, "ERROR", None, None, "-", want, str(err or bad[0])))
            continue
        arrays = {
            r: np.array(
                [[math.nan if v is None else v for v in line] for line in rows], dtype=np.float64
            )
            for r, rows in enumerate(per_rank)
            if isinstance(rows, list)
        }
        report = diagnose_arrays(arrays, strategy=STRATEGIES.get(row, "ddp"), window=WINDOW)
        top = report.findings[0]
        ev = report.straggler
        cells_out.append(
            Cell(
                row,
                col,
                top.kind,
                top.culprit_rank,
                ev.score if ev is not None else None,
                report.visible_definition,
                want,
            )
        )
    return cells_out


def render(cells: list[Cell]) -> str:
    """The accuracy matrix as Markdown."""
    right = sum(c.right for c in cells)
    lines = [
        "# Step-time accuracy matrix",
        "",
        "Generated by `make accuracy` (`python -m bench.accuracy_step_time`); do not edit by hand.",
        "",
        f"Every cell is a real run: {WORLD} processes under `torch.distributed` (Gloo, CPU) "
        f"train a small MLP with `RankWatch.watch()` (the framework rows: a tiny BERT under "
        f"the Hugging Face `Trainer` and an MLP under Lightning, each with rankwatch's callback, "
        f"an MLP in a plain Accelerate loop and in a DeepSpeed loop; the processes started as "
        f"`torchrun` starts them) for {STEPS} steps; rank {SLOW_RANK} is "
        f"slowed by {SLOW_S * 1e3:.0f} ms per step where the column says (a sleep), every rank "
        f"sleeps {BASE_S * 1e3:.0f} ms in its forward, and the diagnosis runs on the rows of "
        f"the last {WINDOW} steps. A cell shows the verdict, the culprit rank, the straggler "
        "score and the visible definition used, then the expected verdict (the culprit "
        f"must be rank {SLOW_RANK} for a straggler kind). Right: {right} of {len(cells)}.",
        "",
        "Rows:",
        "",
    ]
    lines += [f"- `{k}`: {v}" for k, v in ROWS.items()]
    lines += ["", "Columns (where the slow rank is slow):", ""]
    lines += [f"- `{k}`: {v}" for k, v in COLUMNS.items()]
    lines += ["", "| row | slow in | verdict | culprit | score | visible | expected | right |"]
    lines += ["|---|---|---|---|---|---|---|---|"]
    for c in cells:
        score = "-" if c.score is None else f"{c.score:.2f}"
        culprit = "-" if c.culprit is None else str(c.culprit)
        ok = "yes" if c.right else "**no**"
        lines.append(
            f"| {c.row} | {c.col} | {c.kind} | {culprit} | {score} | {c.visible_definition} "
            f"| {c.expected} | {ok} |"
        )
    errors = [c for c in cells if c.error]
    if errors:
        lines += ["", "Errors:", ""]
        for c in errors:
            tail = (c.error or "").strip().splitlines()[-1:]
            lines.append(f"- {c.row}/{c.col}: {' '.join(tail)}")
    lines += ["", NOTES]
    return "\n".join(lines) + "\n"


NOTES = """## Reading the matrix

- **Why these verdicts.** The visible value compared across ranks is the wait at the
  synchronisation points (`sync_wait`: DDP's pre-forward work, where the buffer broadcast
  waits, plus the trailing wait of backward), so the rank that arrived last waited least,
  wherever the job synchronises. Attribution compares the culprit with the victim: input
  wait, H2D, and compute (the module's forward plus the local backward, without the waits).
- **Slow optimizer, slow work after the step** are `STRAGGLER` (sync or unattributed): the
  culprit is right, but no attribution component covers the optimizer or work outside the
  timed phases. With a watched loader a step runs from one fetch to the next, so that work is
  in the culprit's residual.
- **Prefetch thread, slow data loading** is `STRAGGLER`, by design: the producer thread's
  fetch is not what training waits for (rankwatch does not time it, and warns once), and the
  training thread's wait on the queue is the user's code, which no hook sees. The culprit is
  still named from the sync waits; the input cause is unknowable without timing the queue
  read (wrap the consumer side with `watch()` or time it with `rw.phase("input_wait")`).
- **FSDP** (FSDP2, `fully_shard`) names the culprit from the waits too: `watch()` times each
  unit's all-gather and reduce-scatter (they block the host on Gloo). Under the seed's
  `forward + backward` a slow forward or backward was missed (both cells wrong before): the
  slow rank's extra compute and its peers' wait for it land in the same sum. Compute is never
  attributed under FSDP (the seed), so those cells are `STRAGGLER`. The backward fault is a
  full backward hook on the last layer here: FSDP hands a sharded parameter its gradient
  inside the reduce-scatter call, so a post-accumulate-grad hook there is not backward
  compute. On accelerators this is not run (see `docs/reliability.md`).
- **Framework rows** run the framework's own training loop with rankwatch's callback (the
  Accelerate and DeepSpeed rows: the loops `docs/integration.md` gives); the fault is
  injected the same way (the optimizer's `step` is a subclass that sleeps after its
  update; work after the step is the framework's end-of-batch callback). Lightning (2.5 and
  later) broadcasts a SIGTERM flag from rank 0 at the start of every iteration: rank 0 waits
  there for the late rank, outside every phase. The callback times it as a sync wait and
  starts the step there; before it did, a slow optimizer named rank 0 and slow work after the
  step named nobody (the step closed at the optimizer and the work fell between steps).
- **No slow rank** accepts any verdict that names no straggler (`BALANCED`,
  `COMPUTE_BOUND`, `RESIDUAL_HEAVY`...): which bottleneck a tiny model on a loaded machine
  shows is not what this matrix checks. These cells are exposed to the machine: 3 ranks on a
  shared 2-core machine contend for the CPU, and a rank starved of it is a real straggler for
  as long as it lasts. With a 6 ms forward, `no_sync`/`none` showed such a contention
  straggler (score 0.16 to 0.18) in 2 of 3 full runs; with the 12 ms forward used now, a few
  milliseconds of contention stay under the 0.10 threshold.
- **Never ran here:** the GPU clock (CUDA events) and NCCL; on those jobs the sync waits are
  timed on the compute stream and the sync-wait definition applies on the GPU clock, checked
  only against a CUDA double so far (see `docs/diagnosis-step-time.md`, and `make gpu-check`
  for the device check).
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/accuracy.md", help="Markdown file to write")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows")
    parser.add_argument("--cols", default=",".join(COLUMNS), help="comma-separated columns")
    args = parser.parse_args(argv)
    rows = names_of(parser, "--rows", args.rows, ROWS, "row")
    cols = names_of(parser, "--cols", args.cols, COLUMNS, "column")
    start = time.monotonic()
    cells = run_matrix([(r, c) for r in rows for c in cols])
    out = Path(args.out)
    # The 3D-parallel matrix's sections below this one are another runner's: kept.
    tail = generated_tail(out.read_text()) if out.exists() else ""
    out.write_text(render(cells) + ("\n" + tail if tail else ""))
    right = sum(c.right for c in cells)
    print(f"{right}/{len(cells)} cells right in {time.monotonic() - start:.0f} s -> {args.out}")
    return 0 if right == len(cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())

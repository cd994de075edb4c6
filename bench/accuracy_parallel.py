"""The 3D-parallel accuracy matrix: real 4-rank Gloo jobs on a device mesh, one slow rank, the
verdicts of the live windows, the run's verdict and the incidents opened.

Rows are parallel shapes real jobs have (tensor parallel over a ``DeviceMesh`` with FSDP2 or
DDP over the data-parallel dimension, a ``torch.distributed.pipelining`` schedule with DDP over
the replicas of each stage, FSDP2 with activation checkpointing and ranks that start seconds
apart, ``torch.compile`` of a DDP model); columns say where one rank is slow (a sleep of
``SLOW_S`` per step in data loading, forward, backward or the optimizer step) and which rank,
one per mesh dimension where the dimensions differ, plus a column with no slow rank.

Every cell is a real run: ``WORLD`` spawned processes join a Gloo group, build the mesh with
``init_device_mesh("cpu", ...)``, and each holds one ``RankWatch`` over the world in sync mode,
its hooks installed by ``watch()`` as a user installs them and ``collect()`` called once per
step, so the collector builds a live window every ``SYNC_STEP`` steps (over the last
``LIVE_WINDOW_STEPS``) and the summary window at ``close()``. The root hands every window to a
:class:`~rankwatch.exporter.publish.hub.PublisherHub` (its incident tracker opens and closes
incidents; ``on_incident`` records them) and to a recorder of the verdicts. Every rank's step
is mostly sleep standing in for compute (``COMPUTE_S``), so runs are short.

``python -m bench.accuracy_parallel`` (``make accuracy-parallel``; ``make accuracy`` runs it
after the single-dimension matrix) writes its section of ``docs/accuracy.md``;
:func:`run_matrix` runs any subset (the test suite runs a few cells).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.accuracy_frameworks import sleeper

WORLD = 4
COMPUTE_S = 0.024  # every rank's forward sleeps this long per step (a stand-in for compute)
SLOW_S = 0.03  # the injected slowdown per step on the slow rank (half a step or more)
STEPS = 150  # steps of a cell with a slow rank
SYNC_STEP = 10  # a live window every this many steps
LIVE_WINDOW_STEPS = 10  # steps of each live window: windows do not overlap (as by default)
CONTROL_WINDOWS = 200  # live windows of a full-length no-fault cell
MICROBATCHES = 4  # per pipeline step
STAGE1_COST = 1.5  # the second pipeline stage's compute, relative to the first one's
STAGGER_S = 1.5  # fsdp_ac_nobarrier: rank r enters its loop r * STAGGER_S late
BATCH = 16
JOIN_TIMEOUT_S = 1800.0

PLACES: dict[str, str] = {
    "data": "data loading (the loader sleeps before yielding the batch)",
    "forward": "forward (a forward pre-hook sleeps)",
    "backward": "backward (the last layer's backward sleeps)",
    "optimizer": "optimizer step (a step pre-hook sleeps)",
}
NONE = "none"
NO_STRAGGLER = "no straggler"


@dataclass(frozen=True)
class Row:
    """A parallel shape: its mesh (dimension name -> size, outermost first), the ranks a fault
    is put on (a label saying where each sits in the mesh -> rank), and the strategy whose
    expectations apply (``"fsdp"``: compute is never attributed, as in the plain matrix)."""

    description: str
    mesh: tuple[tuple[str, int], ...]
    fault_ranks: dict[str, int]
    strategy: str


ROWS: dict[str, Row] = {
    "tp_dp_fsdp": Row(
        'mesh ("dp", "tp") = (2, 2): a tensor-parallel MLP (ColwiseParallel, RowwiseParallel) '
        "with FSDP2 (fully_shard) over dp",
        (("dp", 2), ("tp", 2)),
        {"dp0 tp1": 1},
        "fsdp",
    ),
    "tp_dp_ddp": Row(
        "the same tensor-parallel MLP, DDP over the dp group (process_group=)",
        (("dp", 2), ("tp", 2)),
        {"dp0 tp1": 1},
        "ddp",
    ),
    "pp_dp": Row(
        f'mesh ("pp", "dp") = (2, 2): a two-stage pipeline (PipelineStage, ScheduleGPipe, '
        f"{MICROBATCHES} microbatches), DDP (static_graph=True) over the replicas of each stage; "
        f"stage 1 computes "
        f"{STAGE1_COST:g}x stage 0",
        (("pp", 2), ("dp", 2)),
        {"stage 0": 1, "stage 1": 2},
        "ddp",
    ),
    "fsdp_tp": Row(
        "FSDP2 + TP as in tp_dp_fsdp, the fault on the other tensor-parallel group's first "
        "rank (dp1 tp0)",
        (("dp", 2), ("tp", 2)),
        {"dp1 tp0": 2},
        "fsdp",
    ),
    "fsdp_ac_nobarrier": Row(
        f'mesh ("dp",) = (4,): FSDP2 over activation-checkpointed blocks (checkpoint_wrapper); '
        f"rank r enters its loop {STAGGER_S:g} * r s late, no barrier",
        (("dp", 4),),
        {"dp": 1},
        "fsdp",
    ),
    "compile_ddp": Row(
        "torch.compile(DDP(model)) (default backend, the sleeps an operator inside the graph), "
        "the compiled wrapper watched, as the integration guide says; 1D",
        (("dp", 4),),
        {"dp": 1},
        "ddp",
    ),
    "compile_ddp_late": Row(
        "the same, but watch() gets the DDP model and training calls torch.compile of it (its "
        "hooks then run inside the compiled call)",
        (("dp", 4),),
        {"dp": 1},
        "ddp",
    ),
    "compile_blocks_ddp": Row(
        "each block torch.compile'd (the sleep inside the first), DDP around them, the DDP "
        "model watched",
        (("dp", 4),),
        {"dp": 1},
        "ddp",
    ),
}


@dataclass(frozen=True)
class CellSpec:
    """One cell: a row, where the fault is (``NONE``: nowhere), on which rank, how long."""

    row: str
    place: str
    rank: int | None
    steps: int

    @property
    def key(self) -> str:
        where = self.place if self.rank is None else f"{self.place}@{self.rank}"
        return f"{self.row}/{where}/{self.steps}"


def cells_of(row: str, *, control_windows: int = CONTROL_WINDOWS) -> list[CellSpec]:
    """Every cell of ``row``: each place on each fault rank, then the no-fault control, long
    enough for ``control_windows`` live windows."""
    out = [
        CellSpec(row, place, rank, STEPS)
        for rank in ROWS[row].fault_ranks.values()
        for place in PLACES
    ]
    out.append(CellSpec(row, NONE, None, control_windows * SYNC_STEP + 2 * SYNC_STEP))
    return out


def expected(spec: CellSpec) -> str:
    """The right verdict of a cell (``NO_STRAGGLER``: any kind that names no straggler)."""
    if spec.place == NONE:
        return NO_STRAGGLER
    if spec.place == "data":
        return "INPUT_STRAGGLER"
    if spec.place in ("forward", "backward"):
        # Under FSDP compute is never attributed (the step-time policy): the culprit is named.
        return "STRAGGLER" if ROWS[spec.row].strategy == "fsdp" else "COMPUTE_STRAGGLER"
    return "STRAGGLER"  # the optimizer: no attribution component covers it


# ---- inside the spawned ranks ----------------------------------------------------------------


@dataclass
class Job:
    """One rank's part of a cell: what ``watch()`` gets and one training step."""

    model: Any  # the module handed to watch()
    optimizer: Any
    train_step: Callable[[Any, Any], None]
    forward_module: Any  # its forward pre-hooks sleep (compute, and the forward fault), or None
    backward_fault: Callable[[float], None]  # installs a sleep in backward
    mesh: Any
    forward_sleeps: int = 1  # forward calls per step (microbatches)


def _mlp(widths: tuple[int, ...]) -> Any:
    import torch

    layers: list[Any] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _mse(out: Any, y: Any) -> Any:
    import torch

    return torch.nn.functional.mse_loss(out, y)


def _plain_step(model: Any, opt: Any) -> Callable[[Any, Any], None]:
    def train_step(x: Any, y: Any) -> None:
        _mse(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return train_step


def _full_backward_sleep(module: Any) -> Callable[[float], None]:
    """The module's backward sleeps (once its input gradients are computed). Under FSDP a
    sharded parameter gets its gradient inside the reduce-scatter call, so a gradient hook
    there would not be backward compute."""
    return lambda s: module.register_full_backward_hook(sleeper(s))


def _grad_sleep(param: Any) -> Callable[[float], None]:
    """The first gradient of the pass sleeps once accumulated: the rest of backward waits."""
    return lambda s: param.register_post_accumulate_grad_hook(sleeper(s))


def _tp_job(row: str, mesh: Any) -> Job:
    import torch
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    net = _mlp((32, 64, 32))
    parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    model: Any
    if row == "tp_dp_ddp":
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
        from torch.nn.parallel import DistributedDataParallel as DDP

        # DDP takes local tensors: DTensor parameters are turned into local ones around it
        # (torch's TP + DDP composition).
        _pre_dp_module_transform(net)
        model = DDP(net, process_group=mesh["dp"].get_group())
    else:
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(net, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return Job(model, opt, _plain_step(model, opt), net, _full_backward_sleep(net[2]), mesh)


def _pp_job(mesh: Any) -> Job:
    import torch
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.nn.parallel import DistributedDataParallel as DDP

    stage_index = mesh.get_local_rank("pp")
    torch.manual_seed(stage_index)
    net = _mlp((32, 64, 64)) if stage_index == 0 else _mlp((64, 64, 32))
    # static_graph: torch 2.13's DDP rebuilds its buckets after the first step and, with the
    # schedule's several backward passes per step, fails an internal assertion without it.
    model = DDP(net, process_group=mesh["dp"].get_group(), static_graph=True)
    stage = PipelineStage(model, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=_mse)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step(x: Any, y: Any) -> None:
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        opt.step()
        opt.zero_grad()

    return Job(
        model,
        opt,
        train_step,
        net,
        _full_backward_sleep(net[-1]),
        mesh,
        forward_sleeps=MICROBATCHES,
    )


def _fsdp_ac_job(mesh: Any) -> Job:
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()) for _ in range(3)]
    head = torch.nn.Linear(32, 32)
    net = torch.nn.Sequential(*(checkpoint_wrapper(b) for b in blocks), head)
    for block in net:
        fully_shard(block, mesh=mesh)
    model: Any = fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return Job(model, opt, _plain_step(model, opt), net, _full_backward_sleep(head), mesh)


_SLEEP_OP: Any = None


def _sleep_op() -> Any:
    """``sleep(x, seconds)``: returns ``x`` after sleeping, as an operator of its own, so a
    compiled graph calls it in place (a plain ``time.sleep`` in a hook breaks the graph, and
    the compiled module would then run its hooks eagerly: not the job this row stands for)."""
    global _SLEEP_OP
    if _SLEEP_OP is None:
        import torch

        # (the schema is spelled out: this module's annotations are strings)
        @torch.library.custom_op(
            "rankwatch_bench::sleep", mutates_args=(), schema="(Tensor x, float seconds) -> Tensor"
        )
        def sleep(x: torch.Tensor, seconds: float) -> torch.Tensor:
            time.sleep(seconds)
            return x.clone()

        @sleep.register_fake
        def _(x: torch.Tensor, seconds: float) -> torch.Tensor:
            return torch.empty_like(x)

        _SLEEP_OP = sleep
    return _SLEEP_OP


def _compile_ddp_job(row: str, mesh: Any, forward_s: float) -> Job:
    """``compile_ddp``: the compiled DDP model trains and is watched; ``compile_ddp_late``:
    the DDP model is watched and its compiled wrapper trains; ``compile_blocks_ddp``: each
    block is compiled and DDP wraps them (the DDP model trains and is watched)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    op = _sleep_op()

    class Sleep(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return op(x, forward_s)

    torch.manual_seed(0)
    mlp = _mlp((32, 64, 32))
    last = mlp[-1]
    if row == "compile_blocks_ddp":
        blocks: list[Any] = [torch.compile(torch.nn.Sequential(Sleep(), mlp[0], mlp[1])), mlp[2]]
        blocks[-1] = torch.compile(blocks[-1])
        net = torch.nn.Sequential(*blocks)
    else:
        net = torch.nn.Sequential(Sleep(), *mlp)
    ddp = DDP(net)
    # Compute (and a slow forward) sleep inside the graph: nothing for a hook to do.
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    if row == "compile_blocks_ddp":
        return Job(ddp, opt, _plain_step(ddp, opt), None, _grad_sleep(last.weight), mesh)
    compiled = torch.compile(ddp)
    watched = compiled if row == "compile_ddp" else ddp
    return Job(watched, opt, _plain_step(compiled, opt), None, _grad_sleep(last.weight), mesh)


def _build_job(row: str, forward_s: float) -> Job:
    """The row's job on this rank; ``forward_s``: this rank's forward sleep per step (compute
    and a slow forward), for a job whose sleep is not a hook (``forward_module`` None)."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = ROWS[row].mesh
    mesh = init_device_mesh(
        "cpu", tuple(size for _, size in dims), mesh_dim_names=tuple(name for name, _ in dims)
    )
    if row in ("tp_dp_fsdp", "tp_dp_ddp", "fsdp_tp"):
        return _tp_job(row, mesh)
    if row == "pp_dp":
        return _pp_job(mesh)
    if row == "fsdp_ac_nobarrier":
        return _fsdp_ac_job(mesh)
    return _compile_ddp_job(row, mesh, forward_s)


def _data_seed(row: str, rank: int, mesh: Any) -> int:
    """Ranks that must see the same batch share a seed: the members of a tensor-parallel
    group (same dp index), and the pipeline's stages (one dp index: one micro-batch stream)."""
    names = mesh.mesh_dim_names or ()
    return 1 + (mesh.get_local_rank("dp") if "dp" in names else rank)


class VerdictRecorder:
    """A publisher keeping each window's verdict (kind, straggler findings) as plain data."""

    def __init__(self) -> None:
        self.windows: list[dict[str, Any]] = []

    def publish(self, report: Any) -> None:
        st = report.step_time
        top = st.findings[0] if st is not None and st.findings else None
        self.windows.append(
            {
                "window": report.window_kind,
                "kind": "NO_STEP_TIME" if st is None else st.kind,
                "culprit": None if top is None else top.culprit_rank,
                # kind, culprit, the ranks named, the pipeline replica named when only the
                # replica can be told
                "stragglers": []
                if st is None
                else [
                    [f.kind, f.culprit_rank, list(f.ranks), list(f.slow_group_ranks)]
                    for f in st.findings
                    if f.is_straggler
                ],
                "group": [] if top is None else list(top.slow_group_ranks),
                "score": None if st is None or st.straggler is None else st.straggler.score,
                "visible": None if st is None else st.visible_definition,
                "missing": list(report.missing_ranks),
                # the run's means per rank (ms): what a wrong verdict is read from
                "means": None
                if st is None or report.window_kind != "summary"
                else {str(r): m for r, m in st.rank_means.items()},
            }
        )

    def close(self, timeout_seconds: float) -> None:
        return None


def recording_rankwatch(run_id: str) -> tuple[Any, Callable[[], dict[str, Any]]]:
    """A ``RankWatch`` over the world as the cells hold it (sync mode, a live window every
    ``SYNC_STEP`` steps over the last ``LIVE_WINDOW_STEPS``, nothing exported), publishing to
    the real publisher hub and a :class:`VerdictRecorder`; and the function returning what the
    root recorded (windows and incident events; empty on the other ranks) once it is closed."""
    from rankwatch.diagnosis.config import DiagnosisConfig, StepTimeConfig
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.publish.hub import PublisherHub
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    diag = DiagnosisConfig(step_time=StepTimeConfig(live_window_steps=LIVE_WINDOW_STEPS))
    cfg = RankwatchConfig.from_env(
        env={},
        run_id=run_id,
        diagnosis=diag,
        async_mode=False,
        sync_step=SYNC_STEP,
        gather_timeout_seconds=60.0,
        metrics_enabled=False,
        otlp_enabled=False,
        end_summary=False,
        shutdown_timeout_seconds=60.0,
    )
    incidents: list[dict[str, Any]] = []

    def on_incident(event: Any) -> None:
        inc = event.incident
        incidents.append(
            {
                "action": event.action,
                "cls": inc.cls,
                "cause": inc.cause,
                "ranks": list(inc.ranks),
                "severity": inc.severity,
                "window": event.window_index,
            }
        )

    recorder = VerdictRecorder()
    hub = PublisherHub(cfg, metrics=False, otlp=False, on_incident=on_incident)
    rw = RankWatch(config=cfg, publishers=[hub, recorder])

    def recorded() -> dict[str, Any]:
        return {"windows": recorder.windows, "incidents": incidents} if rw.is_root else {}

    return rw, recorded


def _run_cell(rank: int, spec: CellSpec) -> dict[str, Any]:
    import torch

    slow_s = SLOW_S if spec.rank == rank else 0.0
    row = ROWS[spec.row]
    # Stage 1 of the pipeline computes more by design (ranks of the outermost "pp" half).
    stage1 = row.mesh[0][0] == "pp" and rank >= WORLD // 2
    compute_s = COMPUTE_S * (STAGE1_COST if stage1 else 1.0)
    fault_forward_s = slow_s if spec.place == "forward" else 0.0
    job = _build_job(spec.row, compute_s + fault_forward_s)
    seed = _data_seed(spec.row, rank, job.mesh)

    def batches() -> Iterator[tuple[Any, Any]]:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(spec.steps):
            if spec.place == "data":
                time.sleep(slow_s)
            yield torch.randn(BATCH, 32, generator=gen), torch.randn(BATCH, 32, generator=gen)

    rw, recorded = recording_rankwatch(f"accuracy-{spec.row}")
    loader = rw.watch(job.model, job.optimizer, batches(), mesh=job.mesh)
    if job.forward_module is not None:
        # Compute first, then the fault: both before the forward's own work (per microbatch
        # in a pipeline, so a step's total is the same).
        per_call = 1.0 / job.forward_sleeps
        job.forward_module.register_forward_pre_hook(sleeper(compute_s * per_call))
        if fault_forward_s:
            job.forward_module.register_forward_pre_hook(sleeper(fault_forward_s * per_call))
    if spec.place == "backward" and slow_s:
        job.backward_fault(slow_s / job.forward_sleeps)
    if spec.place == "optimizer" and slow_s:
        job.optimizer.register_step_pre_hook(sleeper(slow_s))
    if spec.row == "fsdp_ac_nobarrier":
        time.sleep(STAGGER_S * rank)  # ranks start apart; the first all-gather lines them up
    for x, y in loader:
        job.train_step(x, y)
        rw.collect()
    rw.close(60.0)
    return recorded()


def run_timed(result: dict[str, Any], spec: CellSpec, run: Callable[[], dict[str, Any]]) -> None:
    """``result[spec.key]``: what ``run()`` returned and its seconds; on an exception its
    traceback, and the exception raised again (the world's later cells would not line up)."""
    start = time.monotonic()
    try:
        result[spec.key] = run()
        result[spec.key]["seconds"] = time.monotonic() - start
    except Exception:
        result[spec.key] = {"error": traceback.format_exc()}
        raise


def _worker(rank: int, port: int, specs: list[CellSpec], out: str) -> None:
    """A rank of one world, running ``specs`` one after the other."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The incident lines are recorded through on_incident; on stderr they drown the table.
    logging.getLogger("rankwatch.incidents").setLevel(logging.ERROR)
    # FSDP2 warns on every run that a Sequential returns a view; nothing here changes it.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    result: dict[str, Any] = {}
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
        )
        for spec in specs:
            dist.barrier()
            run_timed(result, spec, lambda spec=spec: _run_cell(rank, spec))
        dist.destroy_process_group()
    except BaseException:
        result["error"] = traceback.format_exc()
    Path(out, f"{rank}.json").write_text(json.dumps(result))


# ---- in the parent ---------------------------------------------------------------------------


def _run_world(specs: list[CellSpec]) -> list[dict[str, Any]]:
    """Spawn ``WORLD`` ranks running ``specs`` (:func:`_worker`); what each wrote."""
    from bench.accuracy_step_time import spawn_world

    return spawn_world(_worker, WORLD, specs, JOIN_TIMEOUT_S)


@dataclass(frozen=True)
class Cell:
    """One cell's outcome. A window *names* a rank with a straggler finding whose culprit it
    is, or a pipeline replica (a group) when the finding says only the replica can be told."""

    spec: CellSpec
    summary_kind: str
    summary_culprit: int | None
    summary_group: tuple[int, ...]  # the replica the run's verdict names instead of a rank
    live_windows: int
    named_right: int  # live windows naming the slow rank
    named_group: int  # live windows naming a pipeline replica that holds the slow rank
    named_other: int  # live windows naming another rank, or a replica without the slow rank
    opened: tuple[tuple[str, str, tuple[int, ...]], ...]  # (class, cause, ranks) per opening
    seconds: float
    expected: str
    error: str | None = None
    live_kinds: dict[str, int] = field(default_factory=dict)
    # the highest straggler score of a live window naming another rank (None: none did)
    other_score: float | None = None
    summary_means: dict[str, Any] | None = None  # rank -> the run's means (ms)
    facts: dict[str, Any] = field(default_factory=dict)  # anything else the root returned

    @property
    def wrong_incidents(self) -> int:
        """Incidents opened on anything but the slow rank alone (every one, in a control)."""
        return sum(1 for _, _, ranks in self.opened if ranks != (self.spec.rank,))

    @property
    def right(self) -> bool:
        if self.error is not None or self.wrong_incidents:
            return False
        if self.expected == NO_STRAGGLER:
            return "STRAGGLER" not in self.summary_kind
        return (
            self.summary_kind == self.expected
            and self.summary_culprit == self.spec.rank
            and not self.summary_group
        )


def cell_of(spec: CellSpec, per_rank: list[dict[str, Any]], want: str | None = None) -> Cell:
    """A cell's outcome from what its ranks returned (the root's windows and incidents);
    ``want``: its expected verdict (default :func:`expected`)."""
    want = want or expected(spec)
    root = per_rank[0].get(spec.key)
    errors = [
        res.get(spec.key, {}).get("error") or res.get("error")
        for res in per_rank
        if "error" in res.get(spec.key, {}) or res.get("error")
    ]
    if errors or not isinstance(root, dict) or "windows" not in root:
        err = next((e for e in errors if e), "no result")
        return Cell(spec, "ERROR", None, (), 0, 0, 0, 0, (), 0.0, want, str(err))
    live = [w for w in root["windows"] if w["window"] == "live"]
    summary = next((w for w in root["windows"] if w["window"] == "summary"), None)
    right = group = other = 0
    other_scores: list[float] = []
    kinds: dict[str, int] = {}
    for w in live:
        kinds[w["kind"]] = kinds.get(w["kind"], 0) + 1
        ranks_named: set[int] = set()
        groups_named: list[set[int]] = []
        for _, culprit, ranks, replica in w["stragglers"]:
            if replica:
                groups_named.append(set(replica))
            elif culprit is not None:
                ranks_named.add(culprit)
            else:
                ranks_named.update(ranks)
        right += spec.rank in ranks_named
        group += any(spec.rank in g for g in groups_named)
        wrong = bool(ranks_named - {spec.rank}) or any(spec.rank not in g for g in groups_named)
        other += wrong
        if wrong and w["score"] is not None:
            other_scores.append(w["score"])
    opened = tuple(
        (i["cls"], i["cause"], tuple(i["ranks"]))
        for i in root["incidents"]
        if i["action"] == "open"
    )
    return Cell(
        spec,
        "NO_SUMMARY" if summary is None else summary["kind"],
        None if summary is None else summary["culprit"],
        () if summary is None else tuple(summary["group"]),
        len(live),
        right,
        group,
        other,
        opened,
        float(root.get("seconds", 0.0)),
        want,
        live_kinds=kinds,
        other_score=max(other_scores, default=None),
        summary_means=None if summary is None else summary["means"],
        facts={k: v for k, v in root.items() if k not in ("windows", "incidents", "seconds")},
    )


def run_matrix(specs: list[CellSpec], *, one_world: bool = False) -> list[Cell]:
    """Run ``specs`` in spawned Gloo worlds, one world per row (a row that breaks its world
    loses only its own cells), or all in one world (``one_world``: a few cells, one start-up);
    their outcomes, in the order given."""
    worlds = (
        [specs]
        if one_world
        else [[s for s in specs if s.row == row] for row in dict.fromkeys(s.row for s in specs)]
    )
    results: dict[str, Cell] = {}
    for world_specs in worlds:
        per_rank = _run_world(world_specs)
        for spec in world_specs:
            cell = results[spec.key] = cell_of(spec, per_rank)
            say_cell(spec.key, cell)
    return [results[s.key] for s in specs]


# ---- the report ----------------------------------------------------------------------------

DOC = Path("docs/accuracy.md")
CURRENT = "current"
BEFORE = "before"
TITLES = {
    CURRENT: "## 3D-parallel matrix",
    BEFORE: "## 3D-parallel matrix, before the 3D-parallel work",
}


# The generators whose sections follow the single-dimension matrix in docs/accuracy.md.
SECTION_OWNERS = (
    "accuracy-parallel",
    "accuracy-trainers",
    "accuracy-hang",
    "accuracy-fault-unit",
)


def _marks(section: str, owner: str = "accuracy-parallel") -> tuple[str, str]:
    source = f"bench/{owner.replace('-', '_')}.py"
    return (
        f"<!-- {owner} {section}: begin (generated by {source}) -->",
        f"<!-- {owner} {section}: end -->",
    )


def generated_tail(doc: str) -> str:
    """The part of ``doc`` this module and the hang matrix write (from the first such section
    on; empty without one): the single-dimension matrix rewrites the file above it and keeps
    this."""
    found = [at for owner in SECTION_OWNERS if (at := doc.find(f"<!-- {owner} ")) >= 0]
    return doc[min(found) :] if found else ""


def say_cell(key: str, cell: Cell) -> None:
    """One finished cell's progress line on stderr (a matrix run takes many minutes)."""
    print(
        f"{key}: {cell.summary_kind} {cell.summary_culprit} "
        f"{'right' if cell.right else 'WRONG'} ({cell.seconds:.0f} s)",
        file=sys.stderr,
        flush=True,
    )


def write_section(
    section: str, text: str, path: Path = DOC, owner: str = "accuracy-parallel"
) -> None:
    """Put ``text`` into ``path`` as ``owner``'s ``section`` (between its markers): in place
    of the old one, else (this module's current matrix) before the other generated sections,
    else at the end."""
    begin, end = _marks(section, owner)
    doc = path.read_text() if path.exists() else ""
    block = f"{begin}\n\n{text}\n{end}\n"
    if begin in doc and end in doc:
        start, stop = doc.index(begin), doc.index(end) + len(end) + 1
        doc = doc[:start] + block + doc[stop:]
    elif owner == "accuracy-parallel" and section == CURRENT and generated_tail(doc):
        at = len(doc) - len(generated_tail(doc))
        doc = doc[:at] + block + "\n" + doc[at:]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block
    path.write_text(doc)


def commit_id() -> str:
    """HEAD's short commit id (``unknown`` outside a git checkout)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cells_table(cells: list[Cell]) -> list[str]:
    """The cells as Markdown lines: the table, each cell's live-window verdicts, the errors."""
    lines = [
        "",
        "| row | slow in | slow rank | run verdict | culprit | live windows | named slow rank "
        "| named its replica | named another | incidents opened | expected | right |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        counts = Counter((cause, ranks) for _, cause, ranks in c.opened)
        opened = "; ".join(
            f"{cause} {list(ranks)}" + (f" x{n}" if n > 1 else "")
            for (cause, ranks), n in counts.items()
        )
        culprit = "-" if c.summary_culprit is None else str(c.summary_culprit)
        if c.summary_group:
            culprit = f"replica {list(c.summary_group)}"
        slow = "-" if c.spec.rank is None else str(c.spec.rank)
        lines.append(
            f"| {c.spec.row} | {c.spec.place} | {slow} | {c.summary_kind} | {culprit} "
            f"| {c.live_windows} | {c.named_right} | {c.named_group} | {c.named_other} "
            f"| {opened or 'none'} "
            f"| {c.expected} | {'yes' if c.right else '**no**'} |"
        )
    lines += ["", "The live windows' verdicts, per cell:", ""]
    for c in cells:
        kinds = ", ".join(
            f"{k} {n}" for k, n in sorted(c.live_kinds.items(), key=lambda kv: -kv[1])
        )
        where = c.spec.place if c.spec.rank is None else f"{c.spec.place} on rank {c.spec.rank}"
        if c.other_score is not None:
            kinds += f" (highest score naming another rank: {c.other_score:.2f})"
        lines.append(f"- {c.spec.row}, {where}: {kinds or '-'}")
    errors = [c for c in cells if c.error]
    if errors:
        lines += ["", "Errors:", ""]
        for c in errors:
            tail = (c.error or "").strip().splitlines()[-1:]
            lines.append(f"- {c.spec.row}/{c.spec.place}: {' '.join(tail)}")
    return lines


def render(cells: list[Cell], section: str = CURRENT, commit: str | None = None) -> str:
    """The matrix as a Markdown section; ``commit``: the one the cells ran on (default HEAD)."""
    right = sum(c.right for c in cells)
    lines = [
        TITLES[section],
        "",
        "Generated by `make accuracy-parallel` (`python -m bench.accuracy_parallel`) on commit "
        f"`{commit or commit_id()}`; do not edit by hand.",
        "",
    ]
    if section == BEFORE:
        lines += [NOTES_BEFORE, ""]
    lines += [
        f"Every cell is a real run: {WORLD} processes under `torch.distributed` (Gloo, CPU) build "
        'a device mesh (`init_device_mesh("cpu", ...)`), each holds one `RankWatch` over the '
        "world with `watch()` installed as a user installs it, in sync mode with a live window "
        f"every {SYNC_STEP} steps (over the last {LIVE_WINDOW_STEPS}); the root publishes to the "
        "real publisher hub (its incident tracker, `on_incident` records the openings). Every "
        f"rank's forward sleeps {COMPUTE_S * 1e3:.0f} ms per step (per pipeline stage: split "
        f"over the {MICROBATCHES} microbatches, x{STAGE1_COST:g} on stage 1); the slow rank "
        f"sleeps {SLOW_S * 1e3:.0f} ms more per step where the column says. Cells with a slow "
        f"rank run {STEPS} steps; a control runs until it has had about its number of windows. "
        "Every rank passes the mesh to `watch(..., mesh=)`. A cell is right when the run's "
        "verdict (the summary window) is the expected kind and names the slow rank (not only "
        "its pipeline replica), and no incident opened on any other rank (none at all in a "
        "control); the live windows are counted by what their straggler findings name: the "
        "slow rank, the pipeline replica holding it (when only the replica can be told), or "
        f"another rank. Right: {right} of {len(cells)}.",
        "",
        "Rows:",
        "",
    ]
    for name in dict.fromkeys(c.spec.row for c in cells):
        row = ROWS[name]
        where = ", ".join(f"rank {r} ({label})" for label, r in row.fault_ranks.items())
        lines.append(f"- `{name}`: {row.description}; slow rank: {where}")
    lines += ["", "Where the slow rank is slow:", ""]
    lines += [f"- `{k}`: {v}" for k, v in PLACES.items()]
    lines += [f"- `{NONE}`: no slow rank (the control)"]
    lines += cells_table(cells)
    if section == CURRENT:
        lines += ["", NOTES]
    return "\n".join(lines) + "\n"


NOTES_BEFORE = """This section ran on the commit above, before the 3D-parallel work (collectives
of every mesh dimension timed as waits, diagnosis per mesh dimension, robust windows); it is
kept as it was, for comparison. The section above is the current code."""

NOTES = """### Reading the 3D-parallel matrix

- **How the jobs are built** (torch 2.13, read in its source). Tensor parallel:
  `torch.distributed.tensor.parallel.parallelize_module` with `ColwiseParallel` then
  `RowwiseParallel` over `mesh["tp"]`. DDP over a module with DTensor parameters fails in
  DDP's constructor (`c10d.broadcast_` has no DTensor sharding strategy), so `tp_dp_ddp` uses
  torch's own TP + DDP composition, `torch.distributed.tensor.parallel.ddp.
  _pre_dp_module_transform` (local tensors for DDP, DTensors rebuilt around each forward),
  then `DDP(process_group=mesh["dp"].get_group())`. The pipeline: `PipelineStage` over the
  DDP-wrapped stage module and `ScheduleGPipe`; `torch.distributed.pipelining.stage`
  (`_PipelineStageBase.forward_maybe_with_nosync`, `backward_maybe_with_nosync`) runs every
  microbatch's forward and backward but the last under `no_sync()` and calls the reducer's
  `prepare_for_backward` itself before the last one. Without `static_graph=True` DDP's bucket
  rebuild after the first step fails an internal assertion (4 against 8 parameters) in a
  pipelining job without rankwatch too. The compiled rows run the sleep as an operator of its
  own (`torch.library.custom_op`), so the compiled graph holds it and no hook of ours runs
  inside; `compile_ddp_late` watches the DDP model and trains `torch.compile` of it.
- **Faults.** A sleep of the slow rank, once per step: in the loader before yielding, in a
  forward pre-hook of the module (split over the microbatches in the pipeline; in the compiled
  rows, the operator sleeps longer), in the full backward hook of the last layer (FSDP2 and
  the TP model: a gradient hook under FSDP2 runs inside the reduce-scatter call; DDP rows: the
  last layer's weight's post-accumulate-grad hook), in an optimizer step pre-hook.
- **Before and after.** The section below ran before the 3D-parallel work: 4 of 39 right.
  Each tensor-parallel row named the slow rank's TP peer (rank 0 for slow rank 1) in most live
  windows and opened `residual_heavy` incidents in its control (the DTensor collectives were
  not waits); every pipeline cell was `RESIDUAL_HEAVY` with an incident over all four ranks;
  staggered FSDP2 starts opened a straggler incident on the last rank to start (rank 3, the
  first all-gather's wait) and the run's verdict missed the slow rank; compiled DDP watched as
  the compiled wrapper missed a slow backward. Now every fault cell names the slow rank, with
  the expected kind, in its run verdict and in every live window, and no window names a TP or
  pipeline peer or a pipeline replica.
- **The last two wrong rows, fixed.** The previous full run (086b0a1: 35 of 44) had two.
  `pp_dp` opened `residual_heavy` incidents in 4 of 8 fault cells and in its control: only the
  stage's module was timed, and each microbatch's work around it in the schedule (fetching the
  received activations, keeping what backward needs, the loss on stage 1: about 2 ms a
  microbatch here) was residual, 12 to 14 % of the step. The schedule's actions
  (`forward_one_chunk` and the loss, `backward_one_chunk`) are now the stage's forward and
  backward. Issuing each microbatch's sends and receives between the actions was left residual
  then, and on Gloo that call blocks: the control's residual stayed near the 0.10 line (9 to
  10 % alone, a `residual_heavy` incident again in the run before this one); it is timed as a
  collective wait now (`schedules._batch_p2p`), about 4 % of the step is left residual,
  `COMPUTE_BOUND`, no incident. `compile_ddp_late` was
  `INCOMPLETE_DATA` in every window (the hooks of a DDP model compiled after `watch()` run
  inside the graph and time nothing); DDP's own `_pre_forward`/`_post_forward`, which run
  eagerly around the compiled module, now time its forward when the hooks could not, and the
  row gives eager DDP's verdicts.
- **Controls.** About 200 live windows each (200 goal), counted in the table with the
  incidents they opened; the goal is none. The staggered FSDP2 start is in the warm-up steps,
  which are not shipped. Runs of these controls on a machine shared
  with other jobs (load 4 to 7) opened up to one straggler incident per TP control (window
  scores 0.14 and 0.17): 4 ranks contend for 2 cores, a rank starved for a few windows is a
  real straggler for that long, and a 10-step window is a tenth of the default's, so such
  bursts weigh more. The windows do not overlap (as with the defaults, 100 steps every 100):
  with windows of 10 steps every 5, one burst fell into two windows and two of three windows
  open an incident (3 to 5 incidents per TP control in the first run).
- **Limits.** CPU and Gloo only, 4 ranks, two sizes per dimension at most; the TP model is
  two layers, the pipeline two stages of an MLP. Never run on GPUs or NCCL (see
  `docs/reliability.md`)."""


def save_run(cells: list[Cell], path: Path) -> None:
    """The cells of a run and the commit it ran on, as JSON (:func:`load_run` reads it)."""
    data = {
        "commit": commit_id(),
        "cells": [{**c.__dict__, "spec": c.spec.__dict__} for c in cells],
    }
    path.write_text(json.dumps(data, indent=1))


def load_run(path: Path) -> tuple[list[Cell], str]:
    """The cells and commit :func:`save_run` wrote (to render a run again, e.g. with new
    notes, without running it again)."""
    data = json.loads(path.read_text())
    cells = []
    for item in data["cells"]:
        fields = dict(item)
        fields["spec"] = CellSpec(**item["spec"])
        fields["summary_group"] = tuple(item["summary_group"])
        fields["opened"] = tuple((c, k, tuple(r)) for c, k, r in item["opened"])
        cells.append(Cell(**fields))
    return cells, str(data["commit"])


def names_of(
    parser: argparse.ArgumentParser, option: str, value: str, allowed: Any, what: str
) -> list[str]:
    """A comma-separated option (``--rows``) as a list, each name checked against
    ``allowed`` (an unknown one is a usage error naming the option, the name and ``what``)."""
    names = [n for n in value.split(",") if n]
    for n in names:
        if n not in allowed:
            parser.error(f"{option}: unknown {what} {n!r} (one of {', '.join(allowed)})")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=str(DOC), help="Markdown file whose section is written ('-': print)"
    )
    parser.add_argument(
        "--section",
        default=CURRENT,
        choices=(CURRENT, BEFORE),
        help="which section of the file to write",
    )
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows")
    parser.add_argument("--places", default=",".join([*PLACES, NONE]), help="comma-separated")
    parser.add_argument(
        "--control-windows", type=int, default=CONTROL_WINDOWS, help="live windows per control"
    )
    parser.add_argument("--json", default="", help="also write the cells as JSON here")
    parser.add_argument(
        "--from-json", default="", help="render the run saved here (--json) instead of running"
    )
    args = parser.parse_args(argv)
    rows = names_of(parser, "--rows", args.rows, ROWS, "row")
    places = names_of(parser, "--places", args.places, [*PLACES, NONE], "place")
    if args.control_windows < 1:
        parser.error(f"--control-windows: must be >= 1, got {args.control_windows}")
    specs = [
        s
        for r in rows
        for s in cells_of(r, control_windows=args.control_windows)
        if s.place in places
    ]
    start = time.monotonic()
    commit = None
    if args.from_json:
        cells, commit = load_run(Path(args.from_json))
    else:
        cells = run_matrix(specs)
    text = render(cells, args.section, commit)
    if args.out == "-":
        print(text)
    else:
        write_section(args.section, text, Path(args.out))
    if args.json:
        save_run(cells, Path(args.json))
    right = sum(c.right for c in cells)
    print(f"{right}/{len(cells)} cells right in {time.monotonic() - start:.0f} s")
    return 0 if right == len(cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())

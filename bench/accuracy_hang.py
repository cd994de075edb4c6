"""The hang accuracy matrix: real 4-rank Gloo jobs that hang, and what rankwatch says of them.

Rows are parallel shapes (DDP, FSDP2, tensor parallel x FSDP2, pipeline x DDP: the jobs of
:mod:`bench.accuracy_parallel`, built by its code); columns are ways a job hangs (a rank stuck
in its dataset, asleep or spinning in its forward, an extra or mismatched collective, a rank
killed or stopped, every rank blocked on a shared resource). Every cell is a real run:
``WORLD`` spawned processes join a Gloo group, start rankwatch as a user does
(``rankwatch.exporter.init`` with an ``on_incident`` callback, ``/metrics`` on, the hang budget
left at its default) and ``watch()`` the model, optimizer and loader; after ``FAULT_STEP``
steps the fault starts. The parent watches what a person would see: the incident (the root's
``on_incident``), the WARNING log line (a handler on the ``rankwatch`` loggers of the root) and
the root's ``/metrics`` (``rankwatch_hang_active``), each with its latency from the fault. Then
it ends the job as a launcher does: SIGTERM to every rank (the hang records are written then),
a grace, SIGCONT and SIGKILL to every rank's process group; and checks that no process is left.

Quiet rows: each shape trains with no fault through a first step that compiles
(``torch.compile`` on CPU), an evaluation loop and a checkpoint save of ``CHECKPOINT_S``
(``torch.distributed.checkpoint.save`` to a slow storage writer), long enough for
``QUIET_WINDOWS`` live windows; every incident opened, of any class, is counted: a quiet row is
right with none.

``--mechanics`` runs the fault cells without rankwatch: does each fault hang the job, or does
Gloo raise, and does the harness end everything.

``python -m bench.accuracy_hang`` (``make accuracy-hang``) writes the "hang" section of
``docs/accuracy.md``; :func:`run_cell` runs one cell (the test suite runs a few).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
import urllib.request
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from bench.accuracy_frameworks import sleeper
from bench.accuracy_parallel import Job, _mlp, _plain_step, write_section
from bench.accuracy_step_time import kill_world, read_results, started_world
from rankwatch.exporter.cli.ports import free_port

WORLD = 4
COMPUTE_S = 0.01  # every rank's forward sleeps this long per step (a stand-in for compute)
# The quiet rows compute longer: the harness's own per-step work between the optimizer and the
# next fetch (its metric all-reduce, its progress file; about 2 ms) was about 10 % of a 22 ms
# step, on the RESIDUAL_HEAVY line (measured: each window's residual share 0.08 to 0.12), and
# a control must not be a harness on a threshold.
QUIET_COMPUTE_S = 0.04
FAULT_STEP = 60  # the step whose start holds the fault (earlier steps train normally)
BATCH = 16
START_TIMEOUT_S = 300.0  # spawn, imports, process group, job built and FAULT_STEP steps
CELL_TIMEOUT_S = 60.0  # after the fault: four times the default budget
TERM_GRACE_S = 8.0  # SIGTERM -> SIGKILL: time to write the hang records
MECHANICS_HANG_S = 15.0  # mechanics: no step anywhere for this long after the fault = hung
QUIET_WINDOWS = 200
QUIET_INTERVAL_S = 0.5  # a live window every half second over the last QUIET_WINDOW_STEPS steps
QUIET_WINDOW_STEPS = 10
QUIET_OUTLIER_FRACTION = 0.1  # one outlier step of the 10 (module doc, quiet rows)
CHECKPOINT_S = 60.0  # the quiet rows' checkpoint save lasts this long (slow storage)
EVAL_BATCHES = 100
EVAL_BATCH_S = 0.2  # each evaluation batch's forward sleeps this long: a 20 s evaluation
QUIET_EVAL_STEP = 150  # the step after which the quiet rows evaluate
QUIET_CHECKPOINT_STEP = 300  # ... and save a checkpoint
QUIET_TIMEOUT_S = 900.0
BUDGET_S = 15.0  # the default hang budget (RANKWATCH_HANG_BUDGET_SECONDS), the Done-when bound
# A verdict bound by the budget is due when no rank has finished a step for it, which is before
# the fault (the step ended, then the fault began); the root looks at that moment, and the
# ranks' records it reads are at most one poll old: "in time" allows that one poll
# (RANKWATCH_HANG_POLL_SECONDS, default 0.5 s) and nothing more.
IN_TIME_S = BUDGET_S + 0.5

STUCK_ALIVE = "STUCK_ALIVE"
COLLECTIVE_MISMATCH = "COLLECTIVE_MISMATCH"
STALLED_IN_COLLECTIVE = "STALLED_IN_COLLECTIVE"
RANK_DEAD = "RANK_DEAD"
ALL_STALLED = "ALL_STALLED"
QUIET = "quiet"


@dataclass(frozen=True)
class Shape:
    """A parallel shape: its mesh (dimension -> size, outermost first), the rank a fault is put
    on (not the root, rank 0, which classifies: see the notes) and where that rank sits."""

    description: str
    mesh: tuple[tuple[str, int], ...]
    culprit: int
    where: str


SHAPES: dict[str, Shape] = {
    "ddp": Shape("an MLP under DDP over the world", (("dp", 4),), 2, "dp rank 2"),
    "fsdp": Shape(
        "FSDP2 (fully_shard) over activation-checkpointed blocks, 1D mesh of 4",
        (("dp", 4),),
        2,
        "dp rank 2",
    ),
    "tp_dp": Shape(
        'mesh ("dp", "tp") = (2, 2): a tensor-parallel MLP (ColwiseParallel, RowwiseParallel) '
        "with FSDP2 over dp",
        (("dp", 2), ("tp", 2)),
        1,
        "dp0 tp1: the root's tensor-parallel peer",
    ),
    "pp_dp": Shape(
        'mesh ("pp", "dp") = (2, 2): a two-stage pipeline (ScheduleGPipe, 4 microbatches), '
        "DDP over each stage's replicas",
        (("pp", 2), ("dp", 2)),
        2,
        "stage 1, dp 0",
    ),
}


@dataclass(frozen=True)
class Scenario:
    """A way a job hangs, and the verdict it should get, decided before any run: the class,
    whether the culprit is named (``ALL_STALLED``: no one), the culprit's phase (None: not
    judged) and whether the incident must name a collective. ``on_root``: the fault is put on
    rank 0, the root, instead of the shape's culprit."""

    description: str
    cls: str
    names_culprit: bool
    phase: str | None
    collective: bool
    why: str
    on_root: bool = False


SCENARIOS: dict[str, Scenario] = {
    "data_stuck": Scenario(
        "the culprit's dataset `__getitem__` sleeps forever (loader in the training thread)",
        STUCK_ALIVE,
        True,
        "input",
        True,
        "the others run on into the step's first collective and wait there; the culprit "
        "never enters it and sits in its input phase",
    ),
    "forward_sleep": Scenario(
        "a forward pre-hook of the culprit sleeps forever",
        STUCK_ALIVE,
        True,
        "forward",
        True,
        "the same, the culprit sitting in forward; its frames show the sleep",
    ),
    "busy_gil": Scenario(
        "a forward pre-hook of the culprit spins in a Python loop forever (it holds the "
        "interpreter lock except at the interpreter's switch interval)",
        STUCK_ALIVE,
        True,
        "forward",
        True,
        "alive and busy, never entering the collective: stuck, not dead; the background "
        "thread still gets the lock every switch interval, so the frames are readable",
    ),
    "extra_allreduce": Scenario(
        "every rank all-reduces a per-step metric (2 floats, on a group of its own); the "
        "culprit calls that `all_reduce` twice once: its extra call pairs with the others' "
        "call, and its own then waits alone while they go on into the next step",
        COLLECTIVE_MISMATCH,
        True,
        None,
        True,
        "the culprit is one sequence number ahead on the metric group, in a collective no "
        "other rank will call; the others wait in the next step's collective",
    ),
    "shape_mismatch": Scenario(
        "the same metric, 3 elements instead of 2 on the culprit once",
        COLLECTIVE_MISMATCH,
        True,
        None,
        True,
        "same group, same sequence number, another shape; the culprit is the one rank of four "
        "that differs",
    ),
    "dtype_mismatch": Scenario(
        "the same metric, float64 on the culprit once (float32 on the others)",
        COLLECTIVE_MISMATCH,
        True,
        None,
        True,
        "same group, same sequence number, another dtype",
    ),
    "sigkill": Scenario(
        "the culprit SIGKILLs itself at the start of a forward",
        RANK_DEAD,
        True,
        None,
        False,
        "the process is gone: its sockets are closed by the kernel",
    ),
    "sigstop": Scenario(
        "the culprit SIGSTOPs itself at the start of a forward",
        STUCK_ALIVE,
        True,
        None,
        True,
        "a stopped process is not dead (its sockets stay open, `ps` lists it, SIGCONT resumes "
        "it); it never enters the collective the others wait in. Nothing of it runs after the "
        "stop, its watcher included, so its phase and frames cannot be read: the incident must "
        "say so (the phase is not judged: see below)",
    ),
    "root_sigkill": Scenario(
        "rank 0, the root that classifies, SIGKILLs itself at the start of a forward",
        RANK_DEAD,
        True,
        None,
        False,
        "the root's process is gone; the store outlives it (the launcher serves it), so the "
        "lowest rank left stands in for it and names it",
        on_root=True,
    ),
    "all_stalled": Scenario(
        "every rank's dataset `__getitem__` opens a FIFO nobody writes (a storage outage seen "
        "by all ranks)",
        ALL_STALLED,
        False,
        None,
        False,
        "no rank in a collective and none progressing: no culprit to name",
    ),
}


@dataclass(frozen=True)
class CellSpec:
    """One cell: a shape and a scenario (``QUIET``: no fault, the long quiet run)."""

    shape: str
    scenario: str
    mechanics: bool = False  # without rankwatch: does the fault hang the job at all
    # A fault cell that first goes through the quiet rows' pauses (a compiling first step, an
    # evaluation, a checkpoint save) in its first FAULT_STEP steps.
    prelude: bool = False
    budget_s: float | None = None  # RANKWATCH_HANG_BUDGET_SECONDS (None: the default)
    quiet_windows: int = QUIET_WINDOWS  # the quiet run stops after this many live windows
    eval_batches: int = EVAL_BATCHES
    checkpoint_s: float = CHECKPOINT_S

    @property
    def key(self) -> str:
        return f"{self.shape}/{self.scenario}" + ("/mechanics" if self.mechanics else "")


# ---- inside the spawned ranks ----------------------------------------------------------------


class _State:
    """What the fault hooks of one rank read: the step the loop is in."""

    step = 0


def _ddp_job(mesh: Any) -> Job:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = _mlp((32, 64, 32))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return Job(model, opt, _plain_step(model, opt), net, lambda s: None, mesh)


def _build(shape: str) -> Job:
    from bench.accuracy_parallel import _build_job

    if shape == "ddp":
        from torch.distributed.device_mesh import init_device_mesh

        return _ddp_job(init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",)))
    row = {"fsdp": "fsdp_ac_nobarrier", "tp_dp": "tp_dp_fsdp", "pp_dp": "pp_dp"}[shape]
    return _build_job(row, 0.0)


def _mark_fault(out: str, rank: int) -> None:
    """Write when this rank's fault starts (the latency is counted from the last one)."""
    # Written whole, then renamed: the harness polls for it and must never read half of it.
    tmp = Path(out, f".fault-{rank}.json.tmp")
    tmp.write_text(json.dumps({"t": time.time(), "step": _State.step}))
    tmp.replace(Path(out, f"fault-{rank}.json"))


def _forever(out: str, rank: int) -> None:
    _mark_fault(out, rank)
    while True:
        time.sleep(3600)


class _Dataset:
    """Batch ``i`` is seeded by ``seed`` and ``i``; at ``stall_at`` it calls ``stall``."""

    def __init__(self, seed: int, stall_at: int, stall: Callable[[], None]) -> None:
        self.seed, self.stall_at, self.stall = seed, stall_at, stall

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        import torch

        if i == self.stall_at:
            self.stall()
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return torch.randn(BATCH, 32, generator=gen), torch.randn(BATCH, 32, generator=gen)


def _fifo_reader(path: str, out: str, rank: int) -> Callable[[], None]:
    def stall() -> None:
        _mark_fault(out, rank)
        with open(path, "rb") as f:  # blocks until a writer opens it: never
            f.read()

    return stall


def _forward_fault(scenario: str, out: str, rank: int) -> Callable[..., None]:
    """A forward pre-hook that starts ``scenario`` on the step ``FAULT_STEP``."""

    def hook(*args: Any) -> None:
        if _State.step != FAULT_STEP:
            return
        if scenario == "forward_sleep":
            _forever(out, rank)
        elif scenario == "busy_gil":
            _mark_fault(out, rank)
            n = 0
            while True:
                n += 1
        elif scenario in ("sigkill", "sigstop", "root_sigkill"):
            _mark_fault(out, rank)
            os.kill(os.getpid(), signal.SIGSTOP if scenario == "sigstop" else signal.SIGKILL)

    return hook


def _metrics(scenario: str, step: int, culprit: bool, out: str, rank: int) -> list[Any]:
    """The per-step metric every rank all-reduces, [loss, stop] (the last one is the metric);
    on the culprit at the fault step: mismatched, or all-reduced twice."""
    import torch

    if not culprit or step != FAULT_STEP:
        return [torch.zeros(2)]
    if scenario == "shape_mismatch":
        _mark_fault(out, rank)
        return [torch.zeros(3)]
    if scenario == "dtype_mismatch":
        _mark_fault(out, rank)
        return [torch.zeros(2, dtype=torch.float64)]
    if scenario == "extra_allreduce":
        _mark_fault(out, rank)
        return [torch.zeros(2), torch.zeros(2)]
    return [torch.zeros(2)]


class _LogFile(logging.Handler):
    """WARNING lines of the rankwatch loggers, as JSON lines with their wall time."""

    def __init__(self, path: Path, rank: int) -> None:
        super().__init__(logging.WARNING)
        self.path = path
        self.rank = rank

    def emit(self, record: logging.LogRecord) -> None:
        line = {
            "t": time.time(),
            "rank": self.rank,
            "logger": record.name,
            "message": record.getMessage(),
        }
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def _incident_writer(path: Path) -> Callable[[Any], None]:
    def on_incident(event: Any) -> None:
        inc = event.incident
        line = {
            "t": time.time(),
            "action": event.action,
            "cls": inc.cls,
            "cause": inc.cause,
            "ranks": list(inc.ranks),
            "severity": inc.severity,
            "probe": getattr(inc, "probe", ""),
            "evidence": getattr(inc, "evidence", None),
        }
        with path.open("a") as f:
            f.write(json.dumps(line, default=str) + "\n")

    return on_incident


class _WindowCounter:
    """A publisher counting the live windows the root built."""

    def __init__(self) -> None:
        self.live = 0

    def publish(self, report: Any) -> None:
        self.live += report.window_kind == "live"

    def close(self, timeout_seconds: float) -> None:
        return None


def _slow_writer(path: str, seconds: float) -> Any:
    """A checkpoint writer to a folder on a slow storage: writing takes ``seconds``."""
    from torch.distributed.checkpoint import FileSystemWriter

    class SlowWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            time.sleep(seconds)
            return super().write_data(plan, planner)

    return SlowWriter(path)


def _evaluate(job: Any, shape: str, rank: int, batches: int) -> None:
    """An evaluation loop: forward passes without gradients (the pipeline: each stage's own
    module on local input, no schedule), then the mean loss all-reduced."""
    import torch
    import torch.distributed as dist

    model = job.model
    model.eval()
    total = torch.zeros(1)
    gen = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for _ in range(batches):
            time.sleep(EVAL_BATCH_S)
            width = 64 if shape == "pp_dp" and rank >= WORLD // 2 else 32
            out = model(torch.randn(BATCH, width, generator=gen))
            total += out.float().pow(2).mean()
    model.train()
    dist.all_reduce(total)


def _rank(rank: int, port: int, spec: CellSpec, out: str) -> None:
    """One rank of a cell: train, put the fault in at ``FAULT_STEP`` (or run the quiet
    schedule), never return on a hang (the parent ends the job)."""
    stderr = open(Path(out, f"{rank}.stderr"), "w")  # noqa: SIM115 - lives as long as the rank
    os.dup2(stderr.fileno(), 2)
    faulthandler.enable(stderr)
    os.environ.update(
        OMP_NUM_THREADS="1",
        LOCAL_RANK=str(rank),
        # torchrun's layout: its agent (here the harness) serves the store, not rank 0.
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHINDUCTOR_COMPILE_THREADS="1",  # compile in the rank (no worker pool)
        RANKWATCH_ARTIFACT_DIR=str(Path(out, "artifacts")),
    )
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    result: dict[str, Any] = {}
    try:
        result = _train(rank, port, spec, out)
    except BaseException:
        result["error"] = traceback.format_exc()
        Path(out, f"{rank}.json").write_text(json.dumps(result))
        if spec.scenario != QUIET and not spec.mechanics:
            # A collective that raised (a peer's socket closed, a size Gloo refused): the
            # rank stays up, as a rank blocked by a launcher's grace would, so rankwatch's
            # root can still speak; the parent ends it.
            while True:
                time.sleep(3600)
        return
    Path(out, f"{rank}.json").write_text(json.dumps(result))


def _train(rank: int, port: int, spec: CellSpec, out: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    # The logged metric has a group of its own (a call on the world group would pair with
    # DDP's or FSDP's own collectives there, and Gloo aborts on the size difference).
    metric_group = dist.new_group(backend="gloo")
    scenario = spec.scenario
    culprit = rank == culprit_of(spec)
    quiet = scenario == QUIET
    job = _build(spec.shape)
    names = job.mesh.mesh_dim_names or ()
    seed = 1 + (job.mesh.get_local_rank("dp") if "dp" in names else rank)

    stall: Callable[[], None] = lambda: None  # noqa: E731
    if scenario == "data_stuck" and culprit:
        stall = lambda: _forever(out, rank)  # noqa: E731
    elif scenario == "all_stalled":
        stall = _fifo_reader(str(Path(out, "shared.fifo")), out, rank)
    loader: Any = torch.utils.data.DataLoader(
        cast(Any, _Dataset(seed, FAULT_STEP if not quiet else -1, stall)),
        batch_size=None,
        num_workers=0,
    )
    pauses = quiet or spec.prelude
    eval_step = QUIET_EVAL_STEP if quiet else FAULT_STEP // 3
    checkpoint_step = QUIET_CHECKPOINT_STEP if quiet else 2 * FAULT_STEP // 3
    if spec.budget_s is not None:
        os.environ["RANKWATCH_HANG_BUDGET_SECONDS"] = str(spec.budget_s)
    rw: Any = None
    counter = _WindowCounter()
    if not spec.mechanics:
        from rankwatch.exporter.config import RankwatchConfig
        from rankwatch.exporter.publish.hub import default_publishers
        from rankwatch.exporter.step_time.rank_watch import RankWatch

        overrides: dict[str, Any] = {}
        if quiet:
            overrides.update(interval_seconds=QUIET_INTERVAL_S)
            os.environ["RANKWATCH_LIVE_WINDOW_STEPS"] = str(QUIET_WINDOW_STEPS)
            # A tenth of the default window: the evaluation's or the checkpoint's one long step
            # may be left out of it as one of five is out of a default 100-step window (at the
            # default 5 % none of ten may be, and that step's pause read as residual).
            os.environ["RANKWATCH_OUTLIER_STEPS_MAX_FRACTION"] = str(QUIET_OUTLIER_FRACTION)
        # Every rank's: a rank standing in for a root that is gone logs the incident.
        logging.getLogger("rankwatch").addHandler(_LogFile(Path(out, "log.jsonl"), rank))
        # What init(on_incident=...) builds, plus a counter of the root's live windows.
        config = RankwatchConfig.from_env(
            metrics_port=int(Path(out, "metrics_port").read_text()),
            otlp_enabled=False,
            end_summary=False,
            run_id=f"hang-{spec.shape}-{scenario}",
            **overrides,
        )
        publishers = default_publishers(
            config, rank, on_incident=_incident_writer(Path(out, "incidents.jsonl"))
        )
        rw = RankWatch(None, None, config, [*publishers, counter])
        loader = rw.watch(job.model, job.optimizer, loader, mesh=job.mesh)
    if job.forward_module is not None:
        per_call = 1.0 / job.forward_sleeps
        compute_s = QUIET_COMPUTE_S if quiet else COMPUTE_S
        job.forward_module.register_forward_pre_hook(sleeper(compute_s * per_call))
        if culprit and scenario in (
            "forward_sleep",
            "busy_gil",
            "sigkill",
            "sigstop",
            "root_sigkill",
        ):
            job.forward_module.register_forward_pre_hook(_forward_fault(scenario, out, rank))
    if pauses:  # the first step compiles (inductor, C++ on CPU)
        prep = torch.compile(lambda t: torch.tanh(t) * 0.5 + t * torch.sigmoid(t))
        job.forward_module.register_forward_pre_hook(lambda m, args: (prep(args[0]),))
    progress = Path(out, f"progress-{rank}")
    started = time.monotonic()
    checkpoint_s = 0.0
    for i, (x, y) in enumerate(loader):
        _State.step = i
        job.train_step(x, y)
        calls = _metrics(scenario, i, culprit, out, rank)
        metric = calls[-1]
        if quiet and rank == 0 and counter.live >= spec.quiet_windows + 5:
            metric[1] = 1.0  # enough windows: every rank stops after this step
        for tensor in calls:
            # a collective outside the model, timed as the docs say
            with rw.sync_wait() if rw is not None else contextlib.nullcontext():
                dist.all_reduce(tensor, group=metric_group)
        progress.write_text(f"{i} {time.time()}")
        if pauses and i == eval_step:
            _evaluate(job, spec.shape, rank, spec.eval_batches)
        if pauses and i == checkpoint_step:
            import torch.distributed.checkpoint as dcp

            t0 = time.monotonic()
            state = {f"stage{rank // 2}" if spec.shape == "pp_dp" else "model": job.model}
            dcp.save(
                {k: v.state_dict() for k, v in state.items()},
                storage_writer=_slow_writer(str(Path(out, "ckpt")), spec.checkpoint_s),
            )
            checkpoint_s = time.monotonic() - t0
        if metric[1] > 0 or (not quiet and i > FAULT_STEP + 10_000):
            break
    result: dict[str, Any] = {
        "steps": _State.step + 1,
        "seconds": time.monotonic() - started,
        "checkpoint_seconds": checkpoint_s,
        "live_windows": counter.live,
    }
    if rw is not None:
        rw.close(30.0)
    dist.destroy_process_group()
    return result


# ---- in the parent ---------------------------------------------------------------------------


@dataclass
class Cell:
    """One cell's outcome: the first hang incident's fields beside the expected ones."""

    spec: CellSpec
    expected_cls: str
    expected_ranks: list[int]
    expected_phase: str | None
    cls: str = "-"  # observed hang class (upper case), "-" when none opened
    ranks: list[int] = field(default_factory=list)
    phase: str = ""
    phase_seconds: float | None = None
    collective: Any = None
    culprit_collective: Any = None
    frames: Any = None
    waiting_ranks: list[int] = field(default_factory=list)
    stalled_s: float | None = None  # the incident's stalled_seconds (no progress for so long)
    incident_s: float | None = None  # fault -> incident opened
    log_s: float | None = None  # fault -> a WARNING line naming the hang
    log_names_rank: bool = False
    log_line: str = ""
    metrics_s: float | None = None  # fault -> rankwatch_hang_active 1 on /metrics
    metrics_labels: str = ""
    closed: bool = False
    other_incidents: list[str] = field(default_factory=list)  # opened, not of class hang
    hang_opened: int = 0  # hang incidents opened (after the fault)
    hang_before_fault: int = 0  # hang incidents opened before the fault: false hangs
    hang_records: int = 0  # hang-rank*.json written after SIGTERM
    offline: str = ""  # the verdict of those files read back (`rankwatch replay`), "-": none
    left_behind: int = 0  # processes of the job alive after the harness ended it
    outcome: str = ""  # mechanics: "hung", "progressed", ...
    alive_ranks: list[int] = field(default_factory=list)  # mechanics: alive when it was judged
    exit_codes: dict[str, int] = field(default_factory=dict)  # rank -> exit code, if it exited
    rank_errors: dict[str, str] = field(default_factory=dict)  # rank -> last line
    seconds: float = 0.0
    quiet_windows: int = 0
    quiet_checkpoint_s: float = 0.0
    error: str | None = None

    @property
    def in_time(self) -> bool:
        """The incident, its log line and its gauge all came within ``IN_TIME_S`` of the
        fault."""
        times = (self.incident_s, self.log_s, self.metrics_s)
        return all(t is not None and t <= IN_TIME_S for t in times)

    @property
    def right(self) -> bool:
        if self.error is not None or self.left_behind:
            return False
        if self.spec.scenario == QUIET:
            # A control: any incident it opens (a step-time one too) is a false page.
            return (
                self.hang_opened == 0
                and not self.other_incidents
                and self.quiet_windows >= self.spec.quiet_windows
            )
        if self.spec.mechanics:
            return self.outcome == "hung"
        return self.verdict_right

    @property
    def verdict_right(self) -> bool:
        """A fault cell's verdict: the class, ranks, phase and collective expected, in the
        incident, the log line (naming the rank) and on /metrics, no hang before the fault."""
        return (
            self.error is None
            and self.hang_before_fault == 0
            and self.cls == self.expected_cls
            and self.ranks == self.expected_ranks
            and (self.expected_phase is None or self.phase == self.expected_phase)
            and (not SCENARIOS[self.spec.scenario].collective or bool(self.collective))
            and self.incident_s is not None
            and self.log_s is not None
            and self.log_names_rank
            and self.metrics_s is not None
        )


def expected_of(spec: CellSpec) -> tuple[str, list[int], str | None]:
    if spec.scenario == QUIET:
        return "none", [], None
    sc = SCENARIOS[spec.scenario]
    return sc.cls, [culprit_of(spec)] if sc.names_culprit else [], sc.phase


def culprit_of(spec: CellSpec) -> int:
    """The rank the cell's fault is put on: the shape's culprit, or the root (``on_root``)."""
    sc = SCENARIOS.get(spec.scenario)
    return 0 if sc is not None and sc.on_root else SHAPES[spec.shape].culprit


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


_HANG_ACTIVE = re.compile(r"^rankwatch_hang_active\{([^}]*)\}\s+([0-9.eE+-]+)", re.M)


def _scrape(base_port: int, root_alive: bool) -> str | None:
    """The labels of a ``rankwatch_hang_active`` series at 1 on the root's /metrics (port base
    + local rank), or once the root's process is gone on the other ranks' (a stand-in's). Not
    theirs while the root lives: a stopped rank's server would hold each look for its timeout."""
    ports = [base_port] if root_alive else range(base_port + 1, base_port + WORLD)
    for port in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            continue
        for labels, value in _HANG_ACTIVE.findall(text):
            if float(value) >= 1:
                return labels
    return None


def _group_members(pgids: set[int]) -> list[int]:
    """Processes (not zombies) whose process group is one of ``pgids``."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) in pgids and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


def _fault_time(out: str) -> float | None:
    times = [json.loads(p.read_text())["t"] for p in Path(out).glob("fault-*.json")]
    return max(times) if times else None


def _progress(out: str) -> float:
    """The wall time of the last step any rank finished (0: none yet)."""
    last = 0.0
    for p in Path(out).glob("progress-*"):
        with contextlib.suppress(ValueError, IndexError, OSError):
            last = max(last, float(p.read_text().split()[1]))
    return last


def run_cell(spec: CellSpec, keep: Path | None = None) -> Cell:
    """Run one cell in a world of its own, end the world, and say what happened; with
    ``keep``, its files (hang records, log lines, incidents, the ranks' stderr) are copied to
    ``keep/<shape>-<scenario>``."""
    want_cls, want_ranks, want_phase = expected_of(spec)
    cell = Cell(spec, want_cls, want_ranks, want_phase)
    start = time.monotonic()
    metrics_port = free_port()
    pgids: set[int] = set()
    with started_world(_rank, WORLD, spec, agent_store=True) as (procs, out):
        Path(out, "metrics_port").write_text(str(metrics_port))
        os.mkfifo(Path(out, "shared.fifo"))
        pgids = {p.pid for p in procs if p.pid is not None}
        try:
            if spec.scenario == QUIET:
                _watch_quiet(cell, procs, out)
            else:
                _watch_fault(cell, procs, out, metrics_port)
        except Exception:
            cell.error = traceback.format_exc()
        finally:
            # What the ranks raised before the harness ended them (ending one rank makes its
            # peers' collectives raise too: those errors are the harness's, not the fault's).
            for r, res in enumerate(read_results(out, WORLD)):
                if res.get("error") and res["error"] != "died":
                    cell.rank_errors[str(r)] = res["error"].strip().splitlines()[-1][:160]
                elif procs[r].exitcode is not None:
                    cell.rank_errors[str(r)] = _stderr_error(Path(out, f"{r}.stderr"))
                if procs[r].exitcode is not None:
                    cell.exit_codes[str(r)] = procs[r].exitcode
                if r == 0 and spec.scenario == QUIET:
                    cell.quiet_windows = int(res.get("live_windows", 0))
                    cell.quiet_checkpoint_s = float(res.get("checkpoint_seconds", 0.0))
            grace = TERM_GRACE_S if spec.scenario != QUIET else 0.0
            kill_world(procs, grace)
            cell.hang_records = len(list(Path(out, "artifacts").glob("**/hang-rank*.json")))
            cell.offline = offline_verdict(Path(out, "artifacts"))
            _read_incidents(cell, out)
            if keep is not None:
                shutil.copytree(
                    out,
                    keep / f"{spec.shape}-{spec.scenario}",
                    ignore=shutil.ignore_patterns("shared.fifo", "ckpt"),
                    dirs_exist_ok=True,
                )
    time.sleep(0.5)
    cell.left_behind = len(_group_members(pgids))
    cell.seconds = time.monotonic() - start
    return cell


def offline_verdict(folder: Path) -> str:
    """What ``rankwatch replay``/``diagnose`` says of the hang record files a job left in
    ``folder`` (the ranks' own records, classified offline): ``"CLASS [ranks]"``, or ``-``
    when they make no verdict (fewer than two ranks' files, none suspect)."""
    from rankwatch.diagnosis.hang.artifact import classify_files, load_hang_file

    files = []
    for path in sorted(folder.glob("**/hang-rank*.json")):
        with contextlib.suppress(Exception):  # a file cut short by the kill: left out
            files.append(load_hang_file(path))
    verdict = classify_files(files) if files else None
    return "-" if verdict is None else f"{verdict.hang_class} {list(verdict.ranks)}"


def _stderr_error(path: Path) -> str:
    """The line of a rank's stderr that says why it ended (a C++ abort writes no JSON)."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    for pattern in (r"what\(\)", r"error|terminate|abort|fatal"):
        said = [ln for ln in lines if re.search(pattern, ln, re.I)]
        if said:
            return said[-1].strip()[:200]
    return (lines or ["(nothing on stderr)"])[-1].strip()[:200]


def _wait_for_fault(procs: list[Any], out: str) -> float:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        t = _fault_time(out)
        if t is not None:
            # every faulting rank has written its mark (all_stalled: every rank)
            time.sleep(1.0)
            return _fault_time(out) or t
        if not procs[0].is_alive() and _fault_time(out) is None:  # not its own fault
            raise RuntimeError("rank 0 exited before the fault")
        time.sleep(0.2)
    raise RuntimeError(f"no fault within {START_TIMEOUT_S:.0f} s of the start")


def _watch_fault(cell: Cell, procs: list[Any], out: str, metrics_port: int) -> None:
    """Poll what a person would see until the incident, its log line and its gauge are all
    there, or ``CELL_TIMEOUT_S`` after the fault."""
    fault_t = _wait_for_fault(procs, out)
    deadline = fault_t + (MECHANICS_HANG_S + 10 if cell.spec.mechanics else CELL_TIMEOUT_S)
    culprits = cell.expected_ranks
    while time.time() < deadline:
        if cell.spec.mechanics:
            last = _progress(out)
            if not all(p.is_alive() for p in procs):
                time.sleep(2.0)  # let the others raise (or not) and write why
                cell.outcome = "ranks exited"
                break
            if time.time() - max(last, fault_t) >= MECHANICS_HANG_S:
                cell.outcome = "hung"
                break
            time.sleep(0.5)
            continue
        now = time.time()
        if cell.metrics_s is None:
            labels = _scrape(metrics_port, procs[0].is_alive())
            if labels is not None:
                cell.metrics_s, cell.metrics_labels = now - fault_t, labels
        if cell.log_s is None:
            for line in _lines(Path(out, "log.jsonl")):
                msg = str(line.get("message", ""))
                if line["t"] >= fault_t and _is_hang_line(msg):
                    cell.log_s, cell.log_line = line["t"] - fault_t, msg[:600]
                    cell.log_names_rank = all(
                        re.search(rf"\brank[s]?\W{{0,3}}(\[[^\]]*\b)?{r}\b", msg) for r in culprits
                    )
                    break
        opened = [i for i in _lines(Path(out, "incidents.jsonl")) if i["cls"] == "hang"]
        if opened and cell.metrics_s is not None and cell.log_s is not None:
            break
        time.sleep(0.25)
    if cell.spec.mechanics and not cell.outcome:
        cell.outcome = "progressed" if _progress(out) > fault_t else "not hung long enough"
    if cell.spec.mechanics:
        cell.alive_ranks = [r for r, p in enumerate(procs) if p.is_alive()]


def _is_hang_line(msg: str) -> bool:
    """A log line opening a hang: the incident's JSON line (its class ``hang``, opened) or the
    hang watcher's own text line."""
    try:
        doc = json.loads(msg)
    except ValueError:
        return bool(re.search(r"\bhang\b", msg)) and "over:" not in msg
    if not isinstance(doc, dict):
        return False
    classes = [v for k, v in doc.items() if k.endswith("class")]
    return "hang" in classes and "close" not in str(doc.get("event", ""))


def _read_incidents(cell: Cell, out: str) -> None:
    fault_t = _fault_time(out)
    first = None
    for inc in _lines(Path(out, "incidents.jsonl")):
        if inc["action"] == "close" and inc["cls"] == "hang":
            cell.closed = True
        if inc["action"] != "open":
            continue
        if inc["cls"] != "hang":
            cell.other_incidents.append(f"{inc['cls']}/{inc['cause']} {inc['ranks']}")
            continue
        if fault_t is not None and inc["t"] < fault_t:
            cell.hang_before_fault += 1
            ev = inc.get("evidence") or {}
            cell.other_incidents.append(
                f"hang/{inc['cause']} {inc['ranks']} {inc.get('probe') or ''} "
                f"{fault_t - inc['t']:.0f} s before the fault, stalled "
                f"{float(ev.get('stalled_seconds') or 0):.0f} s"
            )
            continue
        cell.hang_opened += 1
        if first is None:
            first = inc
    if first is None:
        return
    ev = first.get("evidence") or {}
    cell.cls = str(ev.get("hang_class") or first["cause"]).upper()
    cell.ranks = sorted(first["ranks"])
    cell.phase = str(first.get("probe") or ev.get("phase") or "")
    cell.phase_seconds = ev.get("phase_seconds")
    cell.collective = ev.get("collective")
    cell.culprit_collective = ev.get("culprit_collective")
    cell.frames = ev.get("frames")
    cell.waiting_ranks = list(ev.get("waiting_ranks") or [])
    stalled = ev.get("stalled_seconds")
    cell.stalled_s = None if stalled is None else float(stalled)
    if fault_t is not None:
        cell.incident_s = first["t"] - fault_t


def _watch_quiet(cell: Cell, procs: list[Any], out: str) -> None:
    deadline = time.monotonic() + QUIET_TIMEOUT_S
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        time.sleep(1.0)
    if any(p.is_alive() for p in procs):
        cell.error = f"the quiet run did not end within {QUIET_TIMEOUT_S:.0f} s"


def cells_of(shapes: list[str], scenarios: list[str], mechanics: bool = False) -> list[CellSpec]:
    return [CellSpec(sh, sc, mechanics) for sh in shapes for sc in scenarios]


def run_matrix(
    specs: list[CellSpec],
    log: Callable[[str], None] | None = None,
    json_path: str = "",
    keep: Path | None = None,
) -> list[Cell]:
    """Run ``specs``, one world each, in order; with ``json_path``, the cells so far are saved
    there after each one (a long run stopped half way keeps what it measured)."""
    cells = []
    machine = _machine()
    for spec in specs:
        cell = run_cell(spec, keep)
        cells.append(cell)
        if log is not None:
            log(_one_line(cell))
        if json_path:
            save_run(cells, Path(json_path), machine)
    return cells


def load_runs(paths: list[str]) -> tuple[list[Cell], str, str]:
    """The cells :func:`save_run` wrote to ``paths``, a later file's cell replacing an earlier
    one of the same key (a cell run again), with the first file's commit and machine."""
    by_key: dict[str, Cell] = {}
    commit = machine = ""
    for i, path in enumerate(paths):
        data = json.loads(Path(path).read_text())
        if i == 0:
            commit, machine = str(data["commit"]), str(data.get("machine", ""))
        for c in data["cells"]:
            cell = Cell(**{**c, "spec": CellSpec(**c["spec"])})
            by_key[cell.spec.key] = cell
    return list(by_key.values()), commit, machine


def save_run(cells: list[Cell], path: Path, machine: str) -> None:
    """The cells, the commit and the machine, as JSON (``--from-json`` renders it)."""
    data = {"commit": _commit(), "machine": machine, "cells": [asdict(c) for c in cells]}
    path.write_text(json.dumps(data, indent=1, default=str))


def _one_line(c: Cell) -> str:
    if c.spec.mechanics:
        return (
            f"{c.spec.key}: {c.outcome} errors={c.rank_errors} left={c.left_behind} "
            f"({c.seconds:.0f} s) {c.error or ''}"
        )
    if c.spec.scenario == QUIET:
        return (
            f"{c.spec.key}: hang opened {c.hang_opened}, other {c.other_incidents}, windows "
            f"{c.quiet_windows}, checkpoint {c.quiet_checkpoint_s:.0f} s, left {c.left_behind} "
            f"{'right' if c.right else 'WRONG'} ({c.seconds:.0f} s) {c.error or ''}"
        )
    return (
        f"{c.spec.key}: {c.cls} {c.ranks} {c.phase} incident {_s(c.incident_s)} log "
        f"{_s(c.log_s)} metrics {_s(c.metrics_s)} left {c.left_behind} "
        f"{'right' if c.right else 'WRONG'} ({c.seconds:.0f} s) {c.error or ''}"
    )


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} s"


# ---- the report ----------------------------------------------------------------------------

DOC = Path("docs/accuracy.md")
SECTION = "matrix"
OWNER = "accuracy-hang"


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _machine() -> str:
    """Where the matrix runs: cores and the load when it starts (the machine is often shared)."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f", on {os.cpu_count()} cores (load average {load:.1f} at the start)"


def _coll(c: Any) -> str:
    if not isinstance(c, dict):
        return "-"
    return f"{c.get('group')}/{c.get('op')}#{c.get('seq')}"


def _frame(frames: Any) -> str:
    if isinstance(frames, list):
        return str(frames[0]) if frames else "-"
    return "-" if frames is None else str(frames)


def _others(c: Cell) -> str:
    """Incidents a cell opened besides its hang: other classes, and hangs before the fault."""
    before = [i for i in c.other_incidents if i.startswith("hang/")]
    counts = Counter(i.split(" ")[0] for i in c.other_incidents if not i.startswith("hang/"))
    rest = [f"{k} x{n}" if n > 1 else k for k, n in counts.items()]
    return "; ".join([*before, *rest]) or "-"


def _rank_errors(c: Cell) -> dict[str, str]:
    """What each rank that failed said (a rank that ended cleanly is left out; a rank killed
    by a signal without a word is said to be)."""
    out = {}
    for r, text in c.rank_errors.items():
        code = c.exit_codes.get(r)
        if code == 0:
            continue
        if code is not None and code < 0 and text == "(nothing on stderr)":
            text = f"killed by signal {-code}"
        out[r] = text
    return out


def _first_hang(c: Cell) -> str:
    if not c.hang_opened:
        return "-"
    stalled = "" if c.stalled_s is None else f", no progress for {c.stalled_s:.0f} s"
    return f"{c.cls} {c.ranks} in `{c.phase or '-'}`{stalled}: {_cellv(_frame(c.frames))[:80]}"


def _cellv(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(cells: list[Cell], commit: str | None = None, machine: str = "") -> str:
    fault = [c for c in cells if c.spec.scenario != QUIET and not c.spec.mechanics]
    # Shape by shape, scenarios in their order, however the runs were split.
    order = {name: i for i, name in enumerate(SCENARIOS)}
    shapes = list(SHAPES)
    fault.sort(key=lambda c: (shapes.index(c.spec.shape), order.get(c.spec.scenario, 99)))
    quiet = [c for c in cells if c.spec.scenario == QUIET]
    mech = [c for c in cells if c.spec.mechanics]
    lines = [
        "## Hang matrix",
        "",
        f"Generated by `make accuracy-hang` (`python -m bench.accuracy_hang`) on commit "
        f"`{commit or _commit()}`{machine}; do not edit by hand.",
        "",
        EXPLAIN,
        "",
        "Shapes (the rank a fault is put on):",
        "",
    ]
    for name, sh in SHAPES.items():
        lines.append(f"- `{name}`: {sh.description}; culprit rank {sh.culprit} ({sh.where})")
    lines += ["", "Scenarios, and the verdict decided for each before any run:", ""]
    for name, sc in SCENARIOS.items():
        culprit = "rank 0" if sc.on_root else "the culprit" if sc.names_culprit else "no rank"
        phase = f", phase `{sc.phase}`" if sc.phase else ""
        lines.append(
            f"- `{name}`: {sc.description}. Expected `{sc.cls}` naming {culprit}{phase}: {sc.why}."
        )
    if fault:
        right = sum(c.right for c in fault)
        in_time = sum(c.in_time for c in fault)
        lines += [
            "",
            f"### Fault cells: {right} of {len(fault)} right; {in_time} of {len(fault)} with "
            f"the incident, the log line and the gauge within {IN_TIME_S:g} s of the fault",
            "",
            "| shape | scenario | expected | observed | ranks (expected) | phase (expected) "
            "| collective | culprit's collective | incident after | log line after "
            "| /metrics after | top frame | other incidents | hang records "
            f"| offline verdict | left | right | <= {IN_TIME_S:g} s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in fault:
            phase = c.phase or "-"
            if c.phase_seconds is not None:
                phase += f" {float(c.phase_seconds):.0f} s"
            log = _s(c.log_s) + ("" if c.log_s is None or c.log_names_rank else " (no rank)")
            lines.append(
                f"| {c.spec.shape} | {c.spec.scenario} | {c.expected_cls} | {c.cls} "
                f"| {c.ranks} ({c.expected_ranks}) | {phase} ({c.expected_phase or 'any'}) "
                f"| {_cellv(_coll(c.collective))} | {_cellv(_coll(c.culprit_collective))} "
                f"| {_s(c.incident_s)} | {log} | {_s(c.metrics_s)} "
                f"| {_cellv(_frame(c.frames))[:80]} | {_others(c)} "
                f"| {c.hang_records} | {c.offline or '-'} | {c.left_behind} "
                f"| {'yes' if c.right else '**no**'} "
                f"| {'yes' if c.in_time else '**no**'} |"
            )
    if quiet:
        lines += [
            "",
            f"### Quiet rows: {sum(c.right for c in quiet)} of {len(quiet)} right",
            "",
            "| shape | live windows | checkpoint save | hang incidents | the first hang "
            "| other incidents | left | right |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in quiet:
            lines.append(
                f"| {c.spec.shape} | {c.quiet_windows} | {c.quiet_checkpoint_s:.0f} s "
                f"| {c.hang_opened} | {_first_hang(c)} | {_others(c)} "
                f"| {c.left_behind} | {'yes' if c.right else '**no**'} |"
            )
    ran = {c.spec.key for c in cells}
    missing = [
        f"{sh}/{sc}" for sh in SHAPES for sc in [*SCENARIOS, QUIET] if f"{sh}/{sc}" not in ran
    ]
    if fault and missing:
        lines += ["", f"Not run in this run: {', '.join(f'`{m}`' for m in missing)}."]
    errors = [c for c in cells if c.error or _rank_errors(c)]
    if errors:
        lines += ["", "Errors seen by ranks (a collective that raised, a harness error):", ""]
        for c in errors:
            text = (c.error or "").strip().splitlines()[-1:] + [
                f"rank {r}: {e}" for r, e in _rank_errors(c).items()
            ]
            lines.append(f"- {c.spec.key}: {_cellv('; '.join(text))}")
    if mech:
        lines += [
            "",
            "### Fault mechanics without rankwatch",
            "",
            "| shape | scenario | what the job did | ranks alive then | errors raised in ranks "
            "| left |",
            "|---|---|---|---|---|---|",
        ]
        for c in mech:
            errs = (
                "; ".join(
                    f"rank {r}"
                    + (f" (exit {c.exit_codes[r]})" if r in c.exit_codes else "")
                    + f": {e}"
                    for r, e in c.rank_errors.items()
                )
                or "none"
            )
            lines.append(
                f"| {c.spec.shape} | {c.spec.scenario} | {c.outcome} | {c.alive_ranks} "
                f"| {_cellv(errs)} | {c.left_behind} |"
            )
    lines += ["", NOTES]
    return "\n".join(lines) + "\n"


NOTES = """### Reading the hang matrix

- **Expected verdicts were decided before any run**, from what each fault is, and are not
  moved to fit the results: a wrong cell stays wrong. A stopped process (SIGSTOP) is expected
  `STUCK_ALIVE`, not `RANK_DEAD`: it still exists, its sockets stay open and SIGCONT resumes
  it; only a process that is gone is dead. An extra or mismatched collective is expected
  `COLLECTIVE_MISMATCH` naming the odd rank even where Gloo lets the others finish their side.
  `ALL_STALLED` names no rank and is not judged on phase. One expectation was changed after
  the first run, and why: a SIGSTOPped rank was first expected in phase `forward`; but the
  stop halts every thread of the process, its watcher too, and a rank ships its record only
  once it has been stalled for a third of the budget, so no rank can tell its phase after a
  stop at the start of a forward. Its phase is no longer judged; the incident must say the
  stack is unavailable and why (the process is stopped).
- **What the faults do on Gloo without rankwatch** (`--mechanics`: the same jobs, no
  rankwatch; a job is hung when no rank finishes a step for 15 s with every rank alive). Run on
  DDP (all nine) and FSDP2 (the first four) before the detector existed: a rank stuck in its
  dataset, asleep or spinning in its forward, SIGSTOPped, and every rank blocked on a FIFO:
  hung, every rank alive. An extra 1-float `all_reduce` on the world group paired on DDP with
  DDP's own bucket all-reduce (4,192 floats): Gloo aborted the culprit
  (`op.preamble.length <= op.nbytes`, SIGABRT) and the others' collectives raised
  "Connection reset by peer"; on FSDP2 the same call hung. The metric therefore has a group of
  its own, where an extra call pairs with the others' call of the same size and the job hangs.
  A 3-float against a 2-float all-reduce (4 ranks) hangs: the three others finish their side
  and go on, the culprit stays inside; 1 float against 2 completes silently on every rank.
  float64 against float32 (same element count) makes a *receiving* rank abort with the same
  size check (rank 1 here, not the culprit) and the others raise; int32 against float32
  (same size) completes silently: on Gloo no dtype mismatch hangs, so that cell measures
  what a user sees when the job dies of one. SIGKILL: the peers' next collective raises
  "Connection reset by peer" within seconds (the job fails rather than hangs). In the matrix a
  rank whose collective raised is kept alive by the harness, as a launcher's grace period
  would, so the root can still speak.
- **Latency.** The budget runs from the last step any rank finished (which ends before the
  fault begins), and the root wakes when it runs out (every rank also without progress for a
  third of it); the other ranks' records it reads then are at most one poll (0.5 s) old, their
  age taken from the writer's clock within that range. A budget-bound incident therefore comes
  at 15 s plus what it takes to publish, counted from the last step; the "in time" column
  allows 15.5 s from the fault. A mismatch or a dead rank is raised as soon as two polls see it,
  much sooner.
- **Ending every job.** Each rank leads a process group of its own and dies with the harness
  (`PR_SET_PDEATHSIG`); every cell ends with SIGTERM and SIGCONT to every group, a grace, then
  SIGCONT and SIGKILL; "left" counts the job's processes still alive afterwards (read from
  `/proc`), and `ps` after the whole run showed none of them.
- **Quiet rows.** A live window every 0.5 s over the last 10 steps (smaller than the defaults,
  as in the 3D matrix), until the root has had at least 200; the first step compiles a
  function in the forward (`torch.compile`, inductor's C++ on CPU), after step 150 every rank
  evaluates (100 batches of 0.2 s, no gradients: 20 s without a step), after step 300 every
  rank saves a `torch.distributed.checkpoint` through a storage writer that takes 60 s (the
  pipeline's stages save under keys of their own). The forward computes 40 ms a step (the
  harness's own per-step work, about 2 ms, was 10 % of a 22 ms step: on the `RESIDUAL_HEAVY`
  line), and one outlier step of a window's 10 may be left out of its means
  (`RANKWATCH_OUTLIER_STEPS_MAX_FRACTION=0.1`; the default 5 % of a default 100-step window
  is five steps, of ten none: the evaluation's and the checkpoint's long step read as
  residual). A quiet row is right when it opens no incident of any class.
- **What this run found** (the hang rules of the commit above, with each rank's finished
  calls; the "offline verdict" column was added while it ran and read afterwards, with the
  harness's `offline_verdict`, from each cell's hang record files as the cell left them).
  Right, each within the budget: a rank stuck in its dataset, asleep or spinning in its
  forward, on every shape (its phase, its frames, what the others wait in: DDP's bucket
  all-reduce by its group and number, op `unknown`, as it is issued in C++; FSDP2's
  all-gather; a pipeline stage's receive from its peer, followed through to the stuck rank);
  an extra all-reduce on every shape (`COLLECTIVE_MISMATCH` naming its owner: the others only
  wait for it); a larger all-reduce on every shape (on DDP, FSDP2 and the pipeline the others
  finish their side and go on and the culprit is left inside alone; under TP x DP the culprit
  and its ring neighbour are left inside one against one, and the two ranks that finished say
  which call they agreed to: 2 floats); a float64 all-reduce against float32 where the root
  survives (Gloo aborts a *receiving* rank; one rank's call fails and one waits, one against
  one, and the rank that finished its side, or whose call failed with the others' dtype, makes
  the float64 rank the odd one), and under TP x DP, where the rank Gloo aborts is rank 0, the
  root: rank 1 sees the root's process gone, stands in for it (the store is the launcher's)
  and names itself the odd one from the same records; SIGKILL (`RANK_DEAD` in about 6 s), the
  root SIGKILLed (`RANK_DEAD` naming rank 0, from rank 1 standing in), SIGSTOP (named, "the
  process is stopped") and every rank blocked (`ALL_STALLED`, nobody named) everywhere; the
  four quiet rows (the 60 s `torch.distributed.checkpoint` save, the 20 s evaluation and the
  compiling first step open no incident of any class; the quiet rows were run again, alone,
  after the two harness changes above, and their cells replace the first run's). Every
  budget-bound incident came 15.0 s after the fault (the budget runs from the last step,
  which ends before the fault begins).
- **Limits.** CPU and Gloo only, 4 ranks on one machine; the root is the culprit only in
  `root_sigkill` (and is the rank Gloo aborts in TP x DP's dtype cell); every job's store is
  the launcher's, as under `torchrun`: where rank 0 serves it, a root that is gone takes the
  records with it and nobody classifies live (docs/hang.md). NCCL behaves differently on
  mismatches (it hangs where Gloo aborts or completes). Never run on GPUs."""


EXPLAIN = f"""Every cell is a real run of {
    WORLD
} processes under `torch.distributed` (Gloo, CPU) on one
machine, laid out as `torchrun` lays out a job: the harness serves the c10d store, as the
agent does, and every rank is its client (`TORCHELASTIC_USE_AGENT_STORE=True`). Each rank
starts rankwatch with the publishers `init(on_incident=...)` builds (`RankWatch` over
`default_publishers`, plus a counter of the root's live windows; `/metrics` on, the hang
budget at its default of {BUDGET_S:.0f} s) and `watch()`es its model, optimizer and loader
(a map-style dataset read in the training thread); every rank's forward sleeps {
    COMPUTE_S * 1e3:.0f} ms per step ({QUIET_COMPUTE_S * 1e3:.0f} ms in the quiet rows)
and every step ends with an `all_reduce` of a 2-float metric (a logged loss) on a group of
all ranks made for it. At step {FAULT_STEP} the fault starts on the culprit rank (rank 0, the
root that classifies, only in `root_sigkill`). The harness records
the time the fault started (the last rank's, when all stall), then polls what a person sees:
the first `hang` incident (`on_incident` on any rank: the root, or a rank standing in for a
root that is gone), the first WARNING line of a `rankwatch` logger about the hang on any rank
(it must name the culprit rank), and `rankwatch_hang_active` at 1 on the root's `/metrics`
(once the root's process is gone, on the other ranks'); latencies are from the fault. It stops
at all three or {CELL_TIMEOUT_S:.0f} s after the fault, sends SIGTERM (and SIGCONT) to every
rank's process group, waits {TERM_GRACE_S:.0f} s, counts the hang records written and reads
them back as `rankwatch replay` does ("offline verdict": what a user has of a job whose root
did not survive), then SIGCONT and SIGKILL to every group, and counts the job's processes
still alive afterwards ("left": 0 everywhere is the goal). A cell is right when class, named
ranks, phase (where one is expected) and a collective (where one is expected) match and the
log line (naming the rank) and the gauge were seen, with no hang incident before the fault;
the last column says whether all three came within {IN_TIME_S:g} s of the fault (the budget and one
poll of the records: see "Latency" below). A rank whose collective raised (Gloo refuses some
mismatches, and a dead peer's closed socket fails the others' collectives) is kept alive by
the harness, as a launcher's grace period would (a rank blocked in a collective outlives
`torchrun`'s SIGTERM for its 30 s when a Python handler is installed, as rankwatch's is with
the artifact folder set), so the root, or a rank standing in for it, can still speak; the
errors are listed below the table."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DOC), help="Markdown file ('-': print)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--scenarios", default=",".join([*SCENARIOS, QUIET]))
    parser.add_argument(
        "--mechanics", action="store_true", help="run the fault cells without rankwatch"
    )
    parser.add_argument(
        "--by-scenario",
        action="store_true",
        help="run a scenario on every shape before the next (a run stopped early then covers "
        "every shape)",
    )
    parser.add_argument(
        "--skip", default="", help="comma-separated cells not to run (shape/scenario)"
    )
    parser.add_argument(
        "--keep", default="", help="copy each cell's files (hang records, logs) into this folder"
    )
    parser.add_argument("--json", default="", help="also write the cells as JSON here")
    parser.add_argument(
        "--from-json",
        default="",
        help="render the cells saved here (--json; comma-separated: later files' cells replace "
        "earlier ones of the same cell)",
    )
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    scenarios = [s for s in args.scenarios.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            parser.error(f"--shapes: unknown shape {s!r} (one of {', '.join(SHAPES)})")
    for s in scenarios:
        if s not in (*SCENARIOS, QUIET):
            parser.error(f"--scenarios: unknown scenario {s!r}")
    start = time.monotonic()
    commit = None
    machine = _machine()
    if args.from_json:
        cells, commit, machine = load_runs(args.from_json.split(","))
    else:
        specs = cells_of(
            shapes, [s for s in scenarios if s != QUIET or not args.mechanics], args.mechanics
        )
        if args.by_scenario:
            specs.sort(key=lambda s: scenarios.index(s.scenario))
        specs = [s for s in specs if s.key not in args.skip.split(",")]
        cells = run_matrix(
            specs,
            log=lambda line: print(line, file=sys.stderr, flush=True),
            json_path=args.json,
            keep=Path(args.keep) if args.keep else None,
        )
    text = render(cells, commit, machine)
    if args.out == "-":
        print(text)
    else:
        write_section(SECTION, text, Path(args.out), OWNER)
    right = sum(c.right for c in cells)
    print(f"{right}/{len(cells)} cells right in {time.monotonic() - start:.0f} s")
    return 0 if right == len(cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())

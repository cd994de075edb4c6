"""The demo job behind ``rankwatch demo``: a small DDP world with scripted stragglers.

The parent process spawns ``ranks`` workers (Gloo on CPU). Every worker trains a tiny model
under :class:`~rankwatch.exporter.RankWatch`. The DeepEP group is simulated: whatever
the number of training ranks, the root keeps the cumulative counters of 16 simulated EP ranks
on two simulated nodes (:class:`SimulatedDeepEP`) and feeds them to the real root pipeline of
the DeepEP collector (windows, validation, normal-mode diagnosis, log lines, NPZ artifacts), so
the five DeepEP phases show the diagnoses of the DeepEP validation run. The root (rank 0)
publishes both engines' windows to ``/metrics``, OTLP (when an endpoint is set), log lines and
NPZ artifacts, and forwards every report through a channel to the parent, which draws the live
table, keeps the run's incidents, draws the heatmaps and writes the step-time window files and
the final summary.

The timeline is owned by the root: at the start of every step it broadcasts which phase the
world is in and whether to stop, so all ranks agree on both without a shared clock.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = [
    "DEEPEP_PHASES",
    "SCENARIOS",
    "SIM_EP_SIZE",
    "SIM_LATE_RANK",
    "SIM_RANKS_PER_NODE",
    "STEP_PHASES",
    "DemoOptions",
    "Segment",
    "SimulatedDeepEP",
    "Timeline",
    "parse_timeline",
    "preflight",
    "run_demo",
    "scenario_timeline",
]

# What the straggler rank does in each step-time phase.
STEP_PHASES: dict[str, str] = {
    "balanced": "every rank does the same work",
    "input": "the straggler rank sleeps in its data loading",
    "compute": "the straggler rank's forward pass is slowed",
}
# The simulator's five DeepEP normal-mode phases, in the order of the DeepEP validation run.
DEEPEP_PHASES: tuple[str, ...] = (
    "baseline",
    "pre_dispatch_delay",
    "pre_combine_delay",
    "all_hca_pressure",
    "single_hca_pressure",
)
# The simulated DeepEP group, whatever the number of training ranks: EP 16 over two nodes of
# eight, the layout of the DeepEP validation run, whose rank 9 is the late one.
SIM_EP_SIZE = 16
SIM_RANKS_PER_NODE = 8
SIM_LATE_RANK = 9
# Named timelines as shares of the duration.
SCENARIOS: dict[str, tuple[tuple[str, float], ...]] = {
    "full": (("balanced", 0.2), ("input", 0.3), ("compute", 0.3), ("balanced", 0.2)),
    "critical-straggler": (("input", 0.6), ("balanced", 0.4)),
    "balanced": (("balanced", 1.0),),
}


@dataclass(frozen=True)
class Segment:
    """One stretch of the timeline: a step-time phase held for ``seconds``."""

    phase: str
    seconds: float


@dataclass(frozen=True)
class Timeline:
    """The scripted step-time phases in order, plus where each one starts."""

    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("timeline: needs at least one segment")
        for seg in self.segments:
            if seg.phase not in STEP_PHASES:
                raise ValueError(
                    f"timeline: unknown phase {seg.phase!r}, expected one of {list(STEP_PHASES)}"
                )
            if not (math.isfinite(seg.seconds) and seg.seconds > 0):
                raise ValueError(
                    f"timeline: phase {seg.phase!r} needs a duration > 0 s, got {seg.seconds!r}"
                )

    @property
    def total_seconds(self) -> float:
        return sum(s.seconds for s in self.segments)

    def index_at(self, elapsed_s: float) -> int:
        """Index of the segment running ``elapsed_s`` seconds in (the last one after the end)."""
        end = 0.0
        for i, seg in enumerate(self.segments):
            end += seg.seconds
            if elapsed_s < end:
                return i
        return len(self.segments) - 1

    def scaled(self, total_seconds: float) -> Timeline:
        """The same proportions stretched or squeezed to last ``total_seconds``."""
        factor = total_seconds / self.total_seconds
        return Timeline(tuple(Segment(s.phase, s.seconds * factor) for s in self.segments))

    def spec(self) -> str:
        """The timeline written back in ``phase:seconds`` form."""
        return ",".join(f"{s.phase}:{s.seconds:g}" for s in self.segments)


def parse_timeline(spec: str) -> Timeline:
    """Parse ``"balanced:10,input:30,balanced:20"`` (phase:seconds, comma separated)."""
    segments = []
    for part in spec.split(","):
        part = part.strip()
        phase, sep, seconds = part.partition(":")
        if not sep or not phase.strip():
            raise ValueError(f"timeline: expected phase:seconds, got {part!r} in {spec!r}")
        try:
            value = float(seconds)
        except ValueError:
            raise ValueError(
                f"timeline: seconds of {phase.strip()!r} must be a number, got {seconds!r}"
            ) from None
        segments.append(Segment(phase.strip(), value))
    return Timeline(tuple(segments))


def scenario_timeline(name: str, duration_s: float) -> Timeline:
    """A named scenario laid out over ``duration_s`` seconds."""
    if name not in SCENARIOS:
        raise ValueError(f"scenario: unknown scenario {name!r}, expected one of {list(SCENARIOS)}")
    return Timeline(tuple(Segment(p, share * duration_s) for p, share in SCENARIOS[name]))


def deepep_phase_at(elapsed_s: float, total_s: float) -> int:
    """Index into :data:`DEEPEP_PHASES`: the five phases share the run equally."""
    share = total_s / len(DEEPEP_PHASES)
    return min(int(elapsed_s // share), len(DEEPEP_PHASES) - 1)


# --- options ---------------------------------------------------------------------------------

EXIT_OK, EXIT_FAILURE, EXIT_INTERRUPTED = 0, 1, 130
# Spawning the ranks and importing torch can take long on a busy two-core machine.
STARTUP_TIMEOUT_S = 180.0
# From a stop request (end of timeline, Ctrl-C, a failed rank) to the root's "done".
STOP_TIMEOUT_S = 30.0
# From "done" to every process having exited.
JOIN_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class DemoOptions:
    """Everything ``rankwatch demo`` can be told; validated when built."""

    ranks: int = 4
    timeline: Timeline = field(default_factory=lambda: scenario_timeline("full", 60.0))
    port: int = 9464
    addr: str = "127.0.0.1"
    out: Path = Path("rankwatch-out")
    straggler_rank: int = 1
    straggler_ms: float = 40.0
    interval_seconds: float = 1.0
    live: bool | None = None
    # Pause after every step, outside the timed step: keeps a few ranks on two cores polite.
    step_pause_ms: float = 25.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int):
            raise TypeError(f"DemoOptions.ranks: expected an int, got {self.ranks!r}")
        if not 2 <= self.ranks <= 8:
            raise ValueError(f"DemoOptions.ranks: must be in 2..8, got {self.ranks}")
        if not 0 <= self.straggler_rank < self.ranks:
            raise ValueError(
                f"DemoOptions.straggler_rank: must be below ranks ({self.ranks}), "
                f"got {self.straggler_rank}"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"DemoOptions.port: must be in 0..65535, got {self.port}")
        for name in ("straggler_ms", "interval_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"DemoOptions.{name}: must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.step_pause_ms) and self.step_pause_ms >= 0):
            raise ValueError(f"DemoOptions.step_pause_ms: must be >= 0, got {self.step_pause_ms!r}")


def _rank_config(options: DemoOptions, run_id: str) -> Any:
    """The RankwatchConfig every rank runs with: the environment, then the demo's settings."""
    from rankwatch.exporter.config import RankwatchConfig

    return RankwatchConfig.from_env(
        run_id=run_id,
        interval_seconds=options.interval_seconds,
        metrics_addr=options.addr,
        metrics_port=options.port,
    )


# --- what every rank runs ----------------------------------------------------------------------


class _Batches:
    """An endless loader of random regression batches; ``delay_s`` makes fetching slow."""

    def __init__(self, rank: int, seed: int, batch: int = 64, features: int = 64) -> None:
        import torch

        self._torch = torch
        self._gen = torch.Generator().manual_seed(seed * 1000 + rank)
        self.batch, self.features = batch, features
        self.delay_s = 0.0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self.delay_s:
            time.sleep(self.delay_s)  # the scripted input-pipeline straggler
        x = self._torch.randn(self.batch, self.features, generator=self._gen)
        return x, x.sum(dim=1, keepdim=True)


def _tiny_model(features: int = 64, hidden: int = 256) -> Any:
    """A small MLP that returns its own loss; ``model.delay_s`` slows its forward pass.

    The loss is computed inside ``forward`` and the layers are big enough that forward and
    backward dominate the step, so the untimed rest of the loop stays a small residual.
    """
    import torch

    class TinyModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(features, hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(hidden, hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(hidden, 1),
            )
            self.delay_s = 0.0

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if self.delay_s:
                time.sleep(self.delay_s)  # the scripted compute straggler
            return torch.nn.functional.mse_loss(self.net(x), y)

    return TinyModel()


class SimulatedDeepEP:
    """The demo's DeepEP group: :data:`SIM_EP_SIZE` simulated ranks on two simulated nodes.

    Real DeepEP needs GPUs, and the validation run's five diagnoses need an EP group of 16 over
    two nodes (an NVLink domain per node, RDMA between them), whatever number of training ranks
    the demo spawns. So the root keeps the group's cumulative counter block itself: every
    ``interval_seconds`` a thread adds one simulated window (of the phase that covers most of
    it) to the block and hands a copy, as the gather would, to a real
    :class:`~rankwatch.exporter.deepep.root.DeepEPRoot`, which forms and validates the windows,
    diagnoses them, writes the log lines and NPZ artifacts and publishes through the hub.
    """

    def __init__(
        self,
        options: DemoOptions,
        publishers: list[Any],
        phase_at: Callable[[float], str],
        run_id: str,
    ) -> None:
        import uuid

        import numpy as np
        from rankwatch.diagnosis.config import LowLatencyConfig, NormalConfig
        from rankwatch.diagnosis.deepep.normal.schema import counter_length
        from rankwatch.diagnosis.deepep.normal.simulator import NormalSimulator
        from rankwatch.diagnosis.report import RankInfo
        from rankwatch.exporter.config import DeepEPConfig
        from rankwatch.exporter.deepep.root import DeepEPRoot

        self.interval_s = options.interval_seconds
        self.phase_at = phase_at  # wall-clock time -> DeepEP phase
        self.sim = NormalSimulator(
            SIM_EP_SIZE, SIM_RANKS_PER_NODE, seed=options.seed, slow_rank=SIM_LATE_RANK
        )
        self.counters = np.zeros((SIM_EP_SIZE, counter_length(SIM_EP_SIZE)), dtype=np.int64)
        rpn = SIM_RANKS_PER_NODE
        members = [
            RankInfo(rank=r, hostname=f"sim-node{r // rpn}", local_rank=r % rpn)
            for r in range(SIM_EP_SIZE)
        ]
        config = DeepEPConfig.from_env()
        self.root = DeepEPRoot(
            members=members,
            ranks_per_node=SIM_RANKS_PER_NODE,
            config=config,
            normal_config=NormalConfig.from_env(),
            low_latency_config=LowLatencyConfig.from_env(),
            normal=True,
            low_latency=False,
            instance_id=uuid.uuid4().hex,
            group_name="ep",
            publishers=publishers,
            log_to_file=True,
            log_rank=0,
            run=run_id,
        )
        self._last_s = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rankwatch-demo-deepep", daemon=True)

    def start(self) -> None:
        now = time.time()
        self.root.start(now)
        self._last_s = now
        self._thread.start()

    def snapshot(self) -> None:
        """Add the window since the last snapshot and submit the cumulative block."""
        import torch
        from rankwatch.diagnosis.deepep.normal.window import snapshot_counters
        from rankwatch.exporter.deepep.snapshot import PendingSnapshot

        now = time.time()
        phase = self.phase_at((self._last_s + now) / 2)
        self.counters += snapshot_counters(self.sim.window(phase))
        self._last_s = now
        rows = torch.from_numpy(self.counters.copy())
        self.root.submit(("normal",), PendingSnapshot(rows=rows, taken_at_s=now))

    def _run(self) -> None:
        while not self._stop.wait(max(0.0, self._last_s + self.interval_s - time.time())):
            self.snapshot()

    def stop(self, timeout_seconds: float) -> None:
        """Take one last snapshot (nothing since the last interval is lost), then let the root
        finish what it was given."""
        self._stop.set()
        self._thread.join(timeout_seconds)
        if time.time() - self._last_s >= self.interval_s / 2:
            self.snapshot()
        self.root.stop(timeout_seconds)


class ChannelPublisher:
    """Forwards every window report from the root to the demo's parent process.

    Never blocks the collectors: when the parent falls behind, reports are dropped and counted.
    """

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.dropped = 0

    def publish(self, report: Any) -> None:
        try:
            self.channel.put_nowait(("report", report))
        except queue.Full:
            self.dropped += 1

    def close(self, timeout_seconds: float) -> None:
        """Nothing to flush: the queue's own thread delivers what was put."""


def _route_logs(path: Path) -> None:
    # The exporter logs incident events (JSON lines) and DeepEP windows; in the demo they go
    # to a file per rank instead of through the live table.
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger = logging.getLogger("rankwatch")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _worker(
    rank: int,
    options: DemoOptions,
    channel: Any,
    stop_event: Any,
    master_port: int,
    run_id: str,
) -> None:
    """Entry point of one spawned rank: report any failure to the parent, then exit.

    The rank leaves with ``os._exit`` once its messages are in the pipe and its logs are
    flushed: the process group is already destroyed, and the interpreter's own finalisation
    (a full garbage collection over everything torch loaded) can take seconds on a busy machine.
    """
    code = 0
    try:
        _run_rank(rank, options, channel, stop_event, master_port, run_id)
    except BaseException:
        code = 1
        with contextlib.suppress(Exception):
            channel.put(("error", rank, traceback.format_exc()), timeout=5.0)
    with contextlib.suppress(Exception):
        channel.close()
        channel.join_thread()
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _run_rank(
    rank: int,
    options: DemoOptions,
    channel: Any,
    stop_event: Any,
    master_port: int,
    run_id: str,
) -> None:
    import torch
    import torch.distributed as dist
    from rankwatch.exporter.cli.live_table import Progress
    from rankwatch.exporter.publish.hub import PublisherHub
    from rankwatch.exporter.step_time.rank_watch import RankWatch
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    _route_logs(options.out / "logs" / f"rank{rank}.log")
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(options.ranks),
        DEEPEP_DIAGNOSE_ENABLE="1",
        DEEPEP_DIAGNOSE_INTERVAL=str(options.interval_seconds),
        DEEPEP_DIAGNOSE_EXPORT_NPZ="1",
        DEEPEP_DIAGNOSE_LOG_PATH=str(options.out / "deepep"),
    )
    dist.init_process_group(
        "gloo", rank=rank, world_size=options.ranks, timeout=datetime.timedelta(seconds=60)
    )
    config = _rank_config(options, run_id)
    publishers: list[Any] = []
    if rank == 0:
        # Only the root publishes; /metrics lives on the root's port. Both collectors hand
        # their windows to the same hub, which keeps the series of each group side by side.
        hub = PublisherHub(config, local_rank=0, rank=0)
        publishers = [hub, ChannelPublisher(channel)]
        channel.put(("ready", hub.metrics_url))
    model = DistributedDataParallel(_tiny_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = _Batches(rank, options.seed)
    rw = RankWatch(None, None, config, publishers)
    loader = iter(rw.watch(model, optimizer, batches))
    timeline = options.timeline
    total = timeline.total_seconds
    delay_s = options.straggler_ms / 1000.0
    pause_s = options.step_pause_ms / 1000.0
    # [stop, step-time phase, DeepEP phase], decided by the root and broadcast every step.
    control = torch.zeros(3, dtype=torch.int64)
    steps = 0
    # The root's record of which timeline segment each step id ran in.
    segment_of_step: list[tuple[int, int]] = []
    t0 = time.monotonic()
    deepep: SimulatedDeepEP | None = None
    if rank == 0:
        started_at = time.time()
        channel.put(("started", started_at))
        deepep = SimulatedDeepEP(
            options,
            publishers,
            lambda at: DEEPEP_PHASES[deepep_phase_at(at - started_at, total)],
            run_id,
        )
        deepep.start()
    last_progress = -1.0
    while True:
        if rank == 0:
            elapsed = time.monotonic() - t0
            control[0] = int(elapsed >= total or stop_event.is_set())
            control[1] = timeline.index_at(elapsed)
            control[2] = deepep_phase_at(elapsed, total)
            if elapsed - last_progress >= 0.25:
                last_progress = elapsed
                progress = Progress(elapsed, int(control[1]), int(control[2]), steps)
                with contextlib.suppress(queue.Full):
                    channel.put_nowait(("progress", progress))
        # Outside the timed step: the with block below closed it, the loader opens the next.
        dist.broadcast(control, src=0)
        if int(control[0]):
            break
        phase = timeline.segments[int(control[1])].phase
        slow = rank == options.straggler_rank
        batches.delay_s = delay_s if slow and phase == "input" else 0.0
        model.module.delay_s = delay_s if slow and phase == "compute" else 0.0
        x, y = next(loader)
        # The demo's control traffic and pause after the step are not training work: an
        # explicit step adopts the one the fetch opened and ends it here (without it a step
        # runs from one fetch to the next).
        with rw.step():
            loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        rw.collect()  # ships rows every sync_step calls in sync mode; a no-op when async
        steps += 1
        if rw.timer is not None:
            segment_of_step.append((rw.timer.last_step_id, int(control[1])))
        time.sleep(pause_s)

    elapsed = time.monotonic() - t0
    stopping = time.monotonic()
    # This rank's step rows, for the step-time window files the parent writes.
    if rw.timer is not None:
        channel.put(("rows", rank, rw.timer.read(0)[0]))
    if rank == 0:
        channel.put(("segments", segment_of_step))
    # Stop DeepEP first (its last window goes through the hub), then the step collector, which
    # publishes the final long-window summary on the root and closes the publishers.
    if deepep is not None:
        deepep.stop(config.shutdown_timeout_seconds + options.interval_seconds)
    rw.close(config.shutdown_timeout_seconds)
    dist.destroy_process_group()
    if rank == 0:
        shutdown = time.monotonic() - stopping
        channel.put(("done", {"steps": steps, "elapsed_s": elapsed, "shutdown_s": shutdown}))


# --- the parent: spawn, watch, stop, summarise -----------------------------------------------


class _Interrupts:
    """Counts SIGINT/SIGTERM; the first asks for a clean stop, the second for an immediate one."""

    def __init__(self) -> None:
        self.count = 0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1

    @contextlib.contextmanager
    def ignored(self) -> Iterator[None]:
        """While spawning: children inherit an ignored SIGINT, so a Ctrl-C reaches only the
        parent, which stops every rank at the same step instead of killing them mid-collective."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_port(addr: str, port: int) -> None:
    """Raise ``OSError`` naming the address when ``/metrics`` could not listen there."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen on {addr}:{port}: {exc.strerror}") from None


@dataclass
class _RunState:
    """What the parent learned from the ranks while supervising them."""

    metrics_url: str | None = None
    started_at_s: float | None = None
    done: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)
    last_progress: Any = None
    stop_reason: str = ""
    rows: dict[int, Any] = field(default_factory=dict)
    # Set when waiting for the ranks to stop on their own makes no sense any more.
    force_stop: bool = False
    exited: set[int] = field(default_factory=set)  # ranks seen exiting with an error
    segment_of_step: list[tuple[int, int]] = field(default_factory=list)


def preflight(options: DemoOptions) -> None:
    """Refuse, before spawning anything, what would make the demo fail at once: a bad
    ``RANKWATCH_*``/``DEEPEP_*`` environment (``ValueError``/``TypeError``) or a ``/metrics``
    port already taken (``OSError``)."""
    from rankwatch.exporter.config import DeepEPConfig

    _rank_config(options, "preflight")
    DeepEPConfig.from_env()
    check_port(options.addr, options.port)


def run_demo(options: DemoOptions) -> int:
    """Run the demo end to end; returns the exit code (0, 1, or 130 after Ctrl-C)."""
    import torch.multiprocessing as mp
    from rankwatch.exporter.cli.live_table import LiveView
    from rankwatch.exporter.publish.summary import RunRecorder, summary_text, write_summary

    preflight(options)
    run_id = "demo-" + time.strftime("%Y%m%d-%H%M%S")
    config = _rank_config(options, run_id)
    options.out.mkdir(parents=True, exist_ok=True)
    _clear_previous_run(options.out)
    recorder = RunRecorder(config)
    ctx = mp.get_context("spawn")
    channel = ctx.Queue(maxsize=4096)
    stop_event = ctx.Event()
    master_port = _free_port()
    interrupts = _Interrupts()
    state = _RunState()
    header = (
        f"rankwatch demo: {options.ranks} ranks, timeline {options.timeline.spec()}, "
        f"straggler rank {options.straggler_rank}, output {options.out}; DeepEP group "
        f"simulated at EP {SIM_EP_SIZE} over {SIM_EP_SIZE // SIM_RANKS_PER_NODE} nodes "
        f"(late rank {SIM_LATE_RANK})"
    )
    procs = []
    with interrupts.ignored():
        for rank in range(options.ranks):
            proc = ctx.Process(
                target=_worker,
                args=(rank, options, channel, stop_event, master_port, run_id),
                name=f"rankwatch-demo-rank{rank}",
            )
            proc.start()
            procs.append(proc)
    interrupts.install()
    renderer = _HeatmapRenderer(options)
    try:
        with LiveView(
            header=header,
            segments=[(s.phase, s.seconds) for s in options.timeline.segments],
            deepep_phases=DEEPEP_PHASES,
            recorder=recorder,
            live=options.live,
        ) as view:
            _supervise(procs, channel, stop_event, interrupts, view, recorder, state, renderer)
    finally:
        _reap(procs, channel, recorder, state, lambda: interrupts.count >= 2)
    # Our handlers stay installed until the summary is written: a Ctrl-C now only shortens
    # the wait for the heatmaps (a second one skips it).
    heatmaps = renderer.finish(state.started_at_s, cancelled=lambda: interrupts.count >= 2)
    step_windows = _write_step_windows(options, state, config, run_id)
    run = {
        "run_id": run_id,
        "ranks": options.ranks,
        "timeline": options.timeline.spec(),
        "straggler_rank": options.straggler_rank,
        # The DeepEP group is simulated, independent of the training ranks.
        "deepep_group": {
            "simulated": True,
            "ep_size": SIM_EP_SIZE,
            "ranks_per_node": SIM_RANKS_PER_NODE,
            "late_rank": SIM_LATE_RANK,
            "phases": list(DEEPEP_PHASES),
        },
        "steps": _steps(state),
        "duration_s": round(_elapsed(state), 1),
        "started_at_s": state.started_at_s,
        "interrupted": interrupts.count > 0,
        "stop_reason": state.stop_reason or "timeline finished",
        "metrics_url": state.metrics_url,
        "errors": state.errors,
    }
    summary = recorder.summary(run)
    summary["files"] = {
        "summary": str(options.out / "summary.json"),
        "verdict": str(options.out / "summary.txt"),
        "deepep_windows": str(options.out / "deepep"),
        "step_windows": str(options.out / "step-windows") if step_windows else "none written",
        "heatmaps": str(options.out / "heatmaps") if heatmaps else "none rendered",
        "logs": str(options.out / "logs"),
    }
    write_summary(options.out, summary)
    interrupts.restore()
    print()
    print(summary_text(summary), end="", flush=True)
    if interrupts.count:
        return EXIT_INTERRUPTED
    if state.errors or state.done is None:
        return EXIT_FAILURE
    return EXIT_OK


# What a demo run writes under --out: a new run removes exactly these, nothing else there.
_OWN_FILES = (
    "summary.json",
    "summary.txt",
    "deepep/deepep-normal-*.npz",
    "deepep/deepep_diagnose_rank*.log",
    "heatmaps/*/deepep-normal-*.png",
    "step-windows/step-window-*.json",
    "logs/rank*.log",
)


def _clear_previous_run(out: Path) -> None:
    # Windows of two runs in one folder would interleave in a replay.
    for pattern in _OWN_FILES:
        for path in out.glob(pattern):
            path.unlink(missing_ok=True)
    for folder in sorted(out.glob("heatmaps/*"), reverse=True):
        with contextlib.suppress(OSError):  # not empty: something of the user's is in it
            folder.rmdir()


def _steps(state: _RunState) -> int | None:
    if state.done is not None:
        return int(state.done["steps"])
    return None if state.last_progress is None else int(state.last_progress.steps)


def _elapsed(state: _RunState) -> float:
    if state.done is not None:
        return float(state.done["elapsed_s"])
    return 0.0 if state.last_progress is None else float(state.last_progress.elapsed_s)


def _absorb(msg: Any, recorder: Any, state: _RunState) -> None:
    """Keep what a rank sent: reports go to the recorder, the rest into ``state``."""
    kind = msg[0]
    if kind == "report":
        recorder.publish(msg[1])
    elif kind == "progress":
        state.last_progress = msg[1]
    elif kind == "ready":
        state.metrics_url = msg[1]
    elif kind == "started":
        state.started_at_s = msg[1]
    elif kind == "done":
        state.done = msg[1]
    elif kind == "rows":
        state.rows[msg[1]] = msg[2]
    elif kind == "segments":
        state.segment_of_step = msg[1]
    elif kind == "error":
        _, rank, text = msg
        last = text.strip().splitlines()[-1] if text.strip() else "unknown error"
        state.errors.append(f"rank {rank}: {last}")
        print(f"rank {rank} failed:\n{text}", file=sys.stderr, flush=True)


def _handle_message(msg: Any, view: Any, recorder: Any, state: _RunState) -> None:
    """Keep the message, then show it."""
    _absorb(msg, recorder, state)
    kind = msg[0]
    if kind == "report":
        view.report(msg[1])
    elif kind == "progress":
        view.progress(msg[1])
    elif kind == "ready":
        view.note(f"/metrics at {msg[1]}" if msg[1] else "/metrics disabled")
    elif kind == "error":
        view.note(f"{state.errors[-1]}")


def _supervise(
    procs: list[Any],
    channel: Any,
    stop_event: Any,
    interrupts: _Interrupts,
    view: Any,
    recorder: Any,
    state: _RunState,
    renderer: _HeatmapRenderer,
) -> None:
    """Relay messages to the view until the root reports done, stopping the ranks when asked."""
    started = time.monotonic()
    stop_since: float | None = None

    def request_stop(reason: str, note: str) -> None:
        nonlocal stop_since
        if stop_since is None:
            stop_since = time.monotonic()
            state.stop_reason = reason
            stop_event.set()
            view.note(note)

    while state.done is None:
        with contextlib.suppress(queue.Empty):
            _handle_message(channel.get(timeout=0.1), view, recorder, state)
        if state.last_progress is not None:
            renderer.poll(state.started_at_s, state.last_progress.elapsed_s)
        now = time.monotonic()
        if interrupts.count >= 2:
            state.stop_reason = "interrupted twice"
            state.force_stop = True
            view.note("second interrupt: stopping the ranks now")
            return
        if interrupts.count == 1:
            if state.metrics_url is None and state.started_at_s is None:
                state.stop_reason = "interrupted during start-up"
                state.force_stop = True
                return  # nothing to stop cleanly yet
            request_stop(
                "interrupted",
                "Ctrl-C: stopping every rank at its next step and writing the summary "
                "(Ctrl-C again to stop at once)",
            )
        failed = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
        for i in failed:
            if i not in state.exited:
                state.exited.add(i)
                code = procs[i].exitcode
                how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
                state.errors.append(f"rank {i}: {how}")
        if failed:
            request_stop("a rank failed", f"rank(s) {failed} exited early: stopping the others")
            if all(p.exitcode is not None for p in procs) or procs[0].exitcode is not None:
                state.force_stop = True
                return  # nobody left to report done
        if state.started_at_s is None and now - started > STARTUP_TIMEOUT_S:
            state.stop_reason = "start-up timed out"
            state.force_stop = True
            view.note(f"the ranks did not start within {STARTUP_TIMEOUT_S:.0f} s")
            return
        if stop_since is not None and now - stop_since > STOP_TIMEOUT_S:
            state.force_stop = True
            view.note(f"the ranks did not stop within {STOP_TIMEOUT_S:.0f} s")
            return


def _reap(
    procs: list[Any],
    channel: Any,
    recorder: Any,
    state: _RunState,
    hurry: Callable[[], bool],
) -> None:
    """Wait for every rank to exit (draining the channel so none blocks on it), unless
    ``state.force_stop`` or ``hurry()`` says not to; then terminate what is left."""
    deadline = time.monotonic() + (0.0 if state.force_stop else JOIN_TIMEOUT_S)
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline and not hurry():
        try:
            _absorb(channel.get(timeout=0.1), recorder, state)
        except queue.Empty:
            continue
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
    # Reports still queued after the ranks exited (e.g. the final summary window).
    while True:
        try:
            msg = channel.get_nowait()
        except (queue.Empty, OSError, EOFError):
            break
        _absorb(msg, recorder, state)
    channel.close()
    channel.cancel_join_thread()


class _HeatmapRenderer:
    """Draws one representative DeepEP window per phase (the last one wholly inside it) on a
    thread of its own, as soon as the phase is over, so the pictures are ready at the end."""

    def __init__(self, options: DemoOptions) -> None:
        self.options = options
        self.share = options.timeline.total_seconds / len(DEEPEP_PHASES)
        self.written: list[Path] = []
        self._scheduled: set[int] = set()
        self._jobs: queue.Queue[tuple[int, float] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="rankwatch-heatmaps", daemon=True)
        self._thread.start()

    def poll(self, started_at_s: float | None, elapsed_s: float) -> None:
        """Schedule every phase that ended at least two windows ago."""
        if started_at_s is None:
            return
        margin = 2 * self.options.interval_seconds
        for index in range(len(DEEPEP_PHASES)):
            if index not in self._scheduled and elapsed_s >= (index + 1) * self.share + margin:
                self._scheduled.add(index)
                self._jobs.put((index, started_at_s))

    def finish(
        self,
        started_at_s: float | None,
        timeout_s: float = 60.0,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> list[Path]:
        """Schedule what is left, wait (bounded, or until ``cancelled()``) for the thread,
        return the written files."""
        if started_at_s is not None:
            for index in range(len(DEEPEP_PHASES)):
                if index not in self._scheduled:
                    self._scheduled.add(index)
                    self._jobs.put((index, started_at_s))
        self._jobs.put(None)
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline and not cancelled():
            self._thread.join(0.1)
        return list(self.written)

    def _pick(self, index: int, started_at_s: float) -> Path | None:
        from rankwatch.diagnosis.deepep.artifact import ArtifactError, load_window_artifact

        best: tuple[float, Path] | None = None
        for path in sorted((self.options.out / "deepep").glob("*.npz")):
            try:
                _, _, meta = load_window_artifact(path)
            except (ArtifactError, OSError):
                continue
            start = meta.start_time_s - started_at_s
            end = meta.end_time_s - started_at_s
            inside = index * self.share <= start and end <= (index + 1) * self.share
            if inside and (best is None or end > best[0]):
                best = (end, path)
        return None if best is None else best[1]

    def _run(self) -> None:
        from rankwatch.exporter.cli.heatmap import render_all

        while (job := self._jobs.get()) is not None:
            index, started_at_s = job
            path = self._pick(index, started_at_s)
            if path is None:
                continue
            out_dir = self.options.out / "heatmaps" / f"{index + 1}-{DEEPEP_PHASES[index]}"
            try:
                self.written += render_all(path, out_dir)
            except (ValueError, OSError) as exc:
                print(f"heatmap of {path} failed: {exc}", file=sys.stderr)


def _write_step_windows(
    options: DemoOptions, state: _RunState, config: Any, run_id: str
) -> list[Path]:
    """Step-time window files: one per timeline segment, and the whole run's long window.

    ``rankwatch diagnose`` and ``rankwatch replay`` read them back; each carries the diagnosis
    it had when written, so a replay shows whether the engine still agrees.
    """
    import numpy as np
    from rankwatch.diagnosis.step_time.artifact import save_window
    from rankwatch.diagnosis.step_time.rules import diagnose_arrays

    if not state.rows or not state.segment_of_step:
        return []
    folder = options.out / "step-windows"
    folder.mkdir(parents=True, exist_ok=True)
    cfg = config.diagnosis.step_time
    ids = np.array([i for i, _ in state.segment_of_step], dtype=np.float64)
    segs = np.array([k for _, k in state.segment_of_step])
    windows: list[tuple[str, int, str, Any]] = []
    for k, seg in enumerate(options.timeline.segments):
        wanted = ids[segs == k]
        if len(wanted) >= 2:
            windows.append((f"step-window-{k + 1}-{seg.phase}.json", k, seg.phase, wanted))
    windows.append(("step-window-run.json", len(options.timeline.segments), "run", ids))
    written = []
    for name, index, phase, wanted in windows:
        per_rank = {r: rows[np.isin(rows[:, 0], wanted)] for r, rows in state.rows.items()}
        size = int(min(len(wanted), cfg.summary_window_steps))
        if size < 2:
            continue
        report = diagnose_arrays(per_rank, strategy="ddp", window=size, config=cfg)
        meta = {
            "run_id": run_id,
            "window_index": index,
            "phase": phase,
            "straggler_rank": options.straggler_rank,
        }
        written.append(
            save_window(
                folder / name,
                per_rank,
                strategy="ddp",
                window=size,
                config=cfg,
                meta=meta,
                report=report,
            )
        )
    return written

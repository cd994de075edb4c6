"""One rank of the demo job: a tiny DDP model under rankwatch, a scripted straggler, and (on
the root) the simulated DeepEP group.

The DeepEP group is simulated: whatever the number of training ranks, the root keeps the
cumulative counters of 16 simulated EP ranks on two simulated nodes (:class:`SimulatedDeepEP`)
and feeds them to the real root pipeline of the DeepEP collector (windows, validation,
normal-mode diagnosis, log lines, NPZ artifacts). The timeline is owned by the root: at the
start of every step it broadcasts which phase the world is in and whether to stop, so all ranks
agree on both without a shared clock. Every report also goes through a channel to the parent.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rankwatch.exporter.cli.demo_plan import (
    DEEPEP_PHASES,
    SIM_EP_SIZE,
    SIM_LATE_RANK,
    SIM_RANKS_PER_NODE,
    DemoOptions,
    deepep_phase_at,
)

__all__ = ["ChannelPublisher", "SimulatedDeepEP", "rank_config", "run_worker"]


def rank_config(options: DemoOptions, run_id: str) -> Any:
    """The RankwatchConfig every rank runs with: the environment, then the demo's settings."""
    from rankwatch.exporter.config import RankwatchConfig

    return RankwatchConfig.from_env(
        run_id=run_id,
        interval_seconds=options.interval_seconds,
        metrics_addr=options.addr,
        metrics_port=options.port,
    )


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
    ``model.device_s`` is every rank's device time (:attr:`DemoOptions.device_ms`).
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
            self.device_s = 0.0

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if self.device_s + self.delay_s:
                # the device's share of every rank's step, plus the scripted compute straggler
                time.sleep(self.device_s + self.delay_s)
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
        config: Any = None,
    ) -> None:
        import uuid

        import numpy as np

        from rankwatch.diagnosis.deepep.normal.schema import counter_length
        from rankwatch.diagnosis.deepep.normal.simulator import NormalSimulator
        from rankwatch.diagnosis.report import RankInfo
        from rankwatch.exporter.config import RankwatchConfig
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
        # The rank's one configuration object (its DeepEP settings and thresholds included).
        if config is None:
            config = RankwatchConfig.from_env()
        self.root = DeepEPRoot(
            members=members,
            ranks_per_node=SIM_RANKS_PER_NODE,
            config=config.deepep,
            normal_config=config.diagnosis.normal,
            low_latency_config=config.diagnosis.low_latency,
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


def run_worker(
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
    from torch.nn.parallel import DistributedDataParallel

    from rankwatch.exporter.cli.live_table import Progress
    from rankwatch.exporter.publish.hub import PublisherHub
    from rankwatch.exporter.step_time.rank_watch import RankWatch

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
    config = rank_config(options, run_id)
    publishers: list[Any] = []
    if rank == 0:
        # Only the root publishes; /metrics lives on the root's port. Both collectors hand
        # their windows to the same hub, which keeps the series of each group side by side.
        hub = PublisherHub(config, local_rank=0, rank=0)
        publishers = [hub, ChannelPublisher(channel)]
        channel.put(("ready", hub.metrics_url))
    model = DistributedDataParallel(_tiny_model())
    model.module.device_s = options.device_ms / 1000.0
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
            config,
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
        # Outside the timed step (the with block below closed it, the loader opens the next),
        # and not a training wait: the other ranks would wait here for the root's own
        # bookkeeping (the demo's channel, its DeepEP simulation), which is not training.
        with rw.untimed_collectives():
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

"""``RankWatch``: the object a training script holds.

::

    rw = RankWatch(group=None, config=RankwatchConfig.from_env(), publishers=[...])
    loader = rw.watch(model, optimizer, loader)      # hooks; or time steps explicitly:
    for batch in loader:
        ...                                          # with rw.step(): with rw.phase("forward"):
        rw.collect()                                 # sync mode: every sync_step calls ship rows
    rw.close()                                       # before destroy_process_group()

Construction is collective when ``torch.distributed`` is initialised: for the world
(``group=None``) or a list of global ranks, every process of the job constructs a
``RankWatch`` with the same ``group`` (processes outside a list get an object that times
nothing and ships nothing); for a process-group handle, only its members do. Each member then
runs one background thread that ships its rows (see :mod:`.collector`); the group's lowest rank
is its root: it starts the group's aggregator (:mod:`rankwatch.exporter.aggregator`), which
builds and diagnoses the windows off every training process, and publishes what it sends back.
Without ``torch.distributed`` the process is a group of one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from rankwatch.diagnosis.config import option_env
from rankwatch.diagnosis.report import WindowReport
from rankwatch.diagnosis.step_time import normalize_strategy
from rankwatch.exporter.aggregator.process import ADDRESS_KEY, Aggregator
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.hang.file import HangFileWriter, install_sigterm
from rankwatch.exporter.hang.record import DeclaredPhase, install_checkpoint_phases
from rankwatch.exporter.hang.root import HangRoot
from rankwatch.exporter.hang.standin import LocalHangReports, StandIn
from rankwatch.exporter.hang.watch import HangWatcher, pid_namespace
from rankwatch.exporter.identity import local_identity
from rankwatch.exporter.layout import GroupLayout
from rankwatch.exporter.publish.protocol import Publisher, check_publishers
from rankwatch.exporter.publish.recorder import RunRecorder, end_of_run_text
from rankwatch.exporter.run_name import resolve_run_name
from rankwatch.exporter.step_time.collectives import install_collective_waits
from rankwatch.exporter.step_time.collector import RowShipper
from rankwatch.exporter.step_time.device_mesh import mesh_layout, model_mesh
from rankwatch.exporter.step_time.device_waits import fsdp_device_waits
from rankwatch.exporter.step_time.gpu_events import (
    EventPool,
    GpuTimeline,
    cuda_capturing,
    cuda_event_factory,
    cuda_stream_of,
)
from rankwatch.exporter.step_time.hooks import (
    WatchedLoader,
    detect_strategy,
    install,
    model_device,
    unwrap_optimizer,
)
from rankwatch.exporter.step_time.node_relay import LeaderRoute, leader_socket_name, node_leader
from rankwatch.exporter.step_time.pipeline import install_pipeline_phases
from rankwatch.exporter.step_time.timer import (
    BACKWARD_WAIT,
    FORWARD_WAIT,
    PHASES,
    TIMED_SIGNALS,
    StepTimer,
)
from rankwatch.exporter.storage import GuardedWrites

__all__ = ["RankWatch"]

log = logging.getLogger(__name__)

# Events per step on the GPU clock: two per phase occurrence plus the step's own pair, and two
# per sync wait; the pool holds enough for this many steps in flight before a step goes
# untimed. Sync waits per step are counted generously (a few collectives a step); FSDP2 adds
# three waits per unit when it is watched (see ``watch``).
_GPU_STEPS_IN_FLIGHT = 64
_SYNC_WAITS_PER_STEP = 8
_EVENTS_PER_STEP = 2 * (len(PHASES) + 1) * 2 + 2 * _SYNC_WAITS_PER_STEP


class _Inert:
    """Context manager that does nothing (a disabled or non-member ``RankWatch``)."""

    def __enter__(self) -> _Inert:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_INERT = _Inert()


def _has_hub(publishers: Iterable[Any]) -> bool:
    """Some publisher is a ``PublisherHub`` (which logs incident lines itself). Not imported
    to ask: the hub's module imports the OpenTelemetry SDK, half a second at every rank's start,
    and no hub exists unless someone imported it."""
    hub = sys.modules.get("rankwatch.exporter.publish.hub")
    return hub is not None and any(isinstance(p, hub.PublisherHub) for p in publishers)


# RankWatch objects made so far per group of ranks, in this process: every member makes them in
# the same order (construction is collective), so the count names one group's store keys.
_GENERATIONS: dict[tuple[int, ...], int] = {}


def _group_key(ranks: tuple[int, ...]) -> str:
    """A name of this ``RankWatch`` of these ranks, the same on every member."""
    generation = _GENERATIONS.get(ranks, 0)
    _GENERATIONS[ranks] = generation + 1
    digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
    return f"{digest}-{generation}"


def _group_store(key: str) -> Any:
    """A prefix of the job's c10d store private to the group ``key`` names (the aggregator's
    address, identities, hang records)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore(f"rankwatch/step/{key}/", _get_default_store())


def _store_address(store: Any) -> tuple[str, int, str] | None:
    """``(host, port, token)`` of the group's aggregator from the store, once its root set it
    (never waits: one look)."""
    if not store.check([ADDRESS_KEY]):
        return None
    value = store.get(ADDRESS_KEY).decode()
    host_port, _, token = value.rpartition(":")
    host, _, port = host_port.rpartition(":")
    return host, int(port), token


def _resolve_layout(group: Any) -> tuple[GroupLayout | None, bool]:
    """(layout, members_only) for the ``group`` argument; layout None for a non-member handle."""
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if isinstance(group, bool):
        raise TypeError(
            f"RankWatch: field group: expected None, a list of ranks or a "
            f"ProcessGroup, got {group!r}"
        )
    if isinstance(group, int):
        if group == dist.GroupMember.NON_GROUP_MEMBER:
            return None, True
        raise TypeError(
            f"RankWatch: field group: expected None, a list of ranks or a ProcessGroup, got "
            f"{group!r}"
        )
    if not (group is None or isinstance(group, (list, tuple))) and not (
        dist.is_available() and isinstance(group, dist.ProcessGroup)
    ):
        raise TypeError(
            f"RankWatch: field group: expected None, a list of ranks or a ProcessGroup, got "
            f"{type(group).__name__} {group!r}"
        )
    if not initialised:
        if group is None:
            return GroupLayout((0,), 0), False
        if isinstance(group, (list, tuple)) and list(group) == [0]:
            return GroupLayout((0,), 0), False
        raise ValueError(
            f"RankWatch: field group: value {group!r} needs torch.distributed to be "
            "initialised (without it the only group is [0])"
        )
    world, me = dist.get_world_size(), dist.get_rank()
    if group is None:
        return GroupLayout(tuple(range(world)), me), False
    if isinstance(group, (list, tuple)):
        ranks: list[int] = []
        for r in group:
            if isinstance(r, bool) or not isinstance(r, int):
                raise TypeError(
                    f"RankWatch: field group: rank {r!r} in {list(group)!r} is not an int"
                )
            if not 0 <= r < world:
                raise ValueError(
                    f"RankWatch: field group: rank {r} in {list(group)!r} is outside the world "
                    f"0..{world - 1}"
                )
            ranks.append(r)
        if not ranks:
            raise ValueError("RankWatch: field group: value [] is empty")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"RankWatch: field group: value {list(group)!r} repeats a rank")
        return GroupLayout(tuple(sorted(ranks)), me), False
    if isinstance(group, dist.ProcessGroup):
        return GroupLayout(tuple(sorted(dist.get_process_group_ranks(group))), me), True
    raise TypeError(
        f"RankWatch: field group: expected None, a list of ranks or a ProcessGroup, got "
        f"{type(group).__name__} {group!r}"
    )


class RankWatch:
    """Times every training step of this rank and, on the group's root, diagnoses windows.

    ``group``: None (the world), a list of global ranks, or a process group (the training
    group; rankwatch builds its own Gloo group over the same ranks). ``strategy``: ``"ddp"``,
    ``"fsdp"`` or None (detected by :meth:`watch`, else ``config.strategy``, else DDP rules).
    ``publishers`` receive every window report on the root and are closed by :meth:`close`.
    ``gpu_timing``: None times the GPU clock with CUDA events when the watched model is on
    CUDA (or, without ``watch``, when CUDA is available); False never; True requires CUDA. The
    events are recorded on the current stream of the watched model's device, one event pool
    per device; a watched model off CUDA turns GPU timing off (with one warning when it was
    asked for, or when the model is on another accelerator).
    """

    def __init__(
        self,
        group: Any = None,
        strategy: str | None = None,
        config: RankwatchConfig | None = None,
        publishers: Sequence[Publisher] = (),
        *,
        gpu_timing: bool | None = None,
    ) -> None:
        if config is None:
            config = RankwatchConfig.from_env()
        if not isinstance(config, RankwatchConfig):
            raise TypeError(f"RankWatch: field config: expected a RankwatchConfig, got {config!r}")
        if strategy is not None and not isinstance(strategy, str):
            raise TypeError(f"RankWatch: field strategy: expected a str or None, got {strategy!r}")
        self._explicit_strategy: str | None = (
            normalize_strategy(strategy) if strategy not in (None, "") else None
        )
        if self._explicit_strategy is None and config.strategy:
            self._explicit_strategy = config.strategy
        checked_publishers = check_publishers(publishers, "RankWatch")
        if gpu_timing is not None and not isinstance(gpu_timing, bool):
            raise TypeError(
                f"RankWatch: field gpu_timing: expected True, False or None, got {gpu_timing!r}"
            )
        self.config = config
        self.publishers: tuple[Publisher, ...] = checked_publishers
        self._gpu_timing = gpu_timing
        self._detected_strategy: str | None = None
        self._handles: list[Any] = []
        self._watched: set[int] = set()
        self._optimizers_watched = False
        self._pools: dict[str, EventPool] = {}  # one event pool per CUDA device
        self._gpu_off_warned = False
        self._collects = 0
        self._closed = False
        self._collector: RowShipper | None = None
        self._aggregator: Aggregator | None = None
        self._hang: HangWatcher | None = None
        self._undo_sigterm: Any = None
        self._layout: GroupLayout | None = None
        self.timer: StepTimer | None = None
        if not config.enabled:
            return
        layout, _ = _resolve_layout(group)
        if not config.run_id:  # RankWatch made without init(): the shared name (run_name)
            run = resolve_run_name(config)
            if run.name:
                config = self.config = dataclasses.replace(config, run_id=run.name)
        if layout is None or not layout.is_member:
            return
        self._layout = layout
        if layout.is_root and not config.run_id:
            log.warning(
                "rankwatch: the run has no name (no RANKWATCH_RUN_ID, no Slurm, Kubernetes "
                "Job or torchrun run id in the environment, and no torch.distributed store to "
                "share one over): its run label is empty; set RANKWATCH_RUN_ID to the same "
                "value on every rank"
            )
        self.timer = StepTimer(config.max_buffered_steps)
        self._want_gpu(self._cuda_available() if gpu_timing is None else gpu_timing)
        identity = local_identity(config.node_name_env)
        key = _group_key(layout.ranks)
        store = _group_store(key) if len(layout.ranks) > 1 else None
        if store is not None:
            # Where this rank runs, for a stand-in root's reports (the aggregator hears it in
            # each rank's hello).
            store.set(
                f"info/{layout.rank}", "\n".join((identity[0], str(identity[1]), *identity[2:]))
            )
        address: Any
        if layout.is_root:
            self._aggregator = Aggregator(layout, config, self.publishers, store=store)
            address = self._aggregator.address
        else:
            assert store is not None
            address = functools.partial(_store_address, store)
        # Node leaders: the other ranks of this node ship through its lowest one.
        leader = node_leader(layout.rank, layout.ranks, config.node_leaders, dict(os.environ))
        route = None
        if leader is not None and leader != layout.rank:
            route = address = LeaderRoute(
                layout.rank, leader, leader_socket_name(key, leader), address
            )
        self._collector = RowShipper(
            layout,
            self.timer,
            config,
            self.publishers,
            address,
            lambda: self.strategy,
            identity,
            relay_name=leader_socket_name(key, leader) if leader == layout.rank else None,
        )
        if route is not None:
            route.connection = self._collector.connection
        self._collector.start()
        if config.hang_enabled:
            self._start_hang_watch(layout, store, identity[0])

    def _start_hang_watch(self, layout: GroupLayout, store: Any, host: str) -> None:
        """Every rank's hang watcher; the root's runs the group's hang loop, the others' stand in
        for a root that is gone (see docs/hang.md)."""
        collector, config, timer = self._collector, self.config, self.timer
        assert collector is not None and timer is not None
        aggregator = self._aggregator
        root = standin = None
        loop = HangRoot(
            layout.ranks,
            layout.rank,
            store,
            config.hang_poll_seconds,
            aggregator.publish_hang
            if aggregator is not None
            else LocalHangReports(layout, config, self.publishers, store).publish,
            group=config.group_name,
            host=host,
            pidns=pid_namespace(),
            broken=aggregator.broken if aggregator is not None else set,
            progress_age=aggregator.progress_age if aggregator is not None else lambda r: None,
            # The hub logs the incident's line; without one the hang loop logs it.
            log_lines=not _has_hub(self.publishers),
            warmup_steps=config.hang_warmup_steps,
        )
        if layout.is_root:
            root = loop
        elif store is not None:
            standin = StandIn(
                loop, layout.root, layout.ranks, root_unreachable=collector.unreachable
            )
        folder = config.artifact_dir
        writer = None
        if folder:
            # The storage-fault policy of every writer: a fault is said once, counted, retried.
            guard = GuardedWrites(
                "hang_records",
                "hang records",
                option_env(RankwatchConfig, "artifact_dir"),
                folder,
            )
            guard.check_folder(folder)
            writer = HangFileWriter(
                folder,
                layout.rank,
                host,
                config.run_id,
                config.group_name,
                config.hang_stack_frames,
                guard,
            )
        self._hang = HangWatcher(
            layout.rank,
            timer,
            config,
            store,
            host,
            threading.get_ident(),
            root=root,
            file=writer,
            standin=standin,
        )
        if writer is not None:
            self._undo_sigterm = install_sigterm(self._hang.on_sigterm)
        self._hang.start()

    # ---- properties ----------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """This process times steps and ships them (enabled, member, not closed)."""
        return self.timer is not None and not self._closed

    @property
    def is_root(self) -> bool:
        """This process builds and publishes the group's windows."""
        return self._layout is not None and self._layout.is_root

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks of the group (empty outside it)."""
        return self._layout.ranks if self._layout is not None else ()

    @property
    def strategy(self) -> str | None:
        """The training strategy handed to the diagnosis (explicit, else detected)."""
        return self._explicit_strategy or self._detected_strategy

    @property
    def latest_report(self) -> WindowReport | None:
        """The last window report published (root only; None elsewhere or before the first). In
        a group larger than ``root_rank_budget`` its per-rank part holds that many ranks
        (``group_size`` says how many the group has)."""
        return self._aggregator.latest_report if self._aggregator is not None else None

    # ---- timing --------------------------------------------------------------------------

    def step(self, step_id: int | None = None) -> Any:
        """Context manager around one training step; ``step_id`` defaults to previous + 1."""
        timer = self.timer
        if timer is None:
            return _INERT
        if step_id is None:  # the usual case: the timer's context manager, one call shorter
            ctx = timer._step_ctx
            ctx.next_id = None
            return ctx
        return timer.step(step_id)

    def phase(self, name: str, budget_seconds: float | None = None) -> Any:
        """Context manager around one phase: input_wait, h2d, forward, backward, optimizer.

        With ``budget_seconds`` the phase is declared long (``with rw.phase("checkpoint",
        budget_seconds=600):``): any name, and while it runs the hang watcher's budget for the
        group is at least that long (a timed phase's name is timed as well)."""
        if budget_seconds is not None:
            return self._declared_phase(name, budget_seconds)
        if self.timer is None:
            if name not in PHASES:  # same contract whether or not this rank is timing
                raise ValueError(
                    f"phase: field name: value {name!r} is not one of {', '.join(PHASES)}"
                )
            return _INERT
        try:  # the timer's own context manager, without a second call on the hot path
            return self.timer._phases[name]
        except (KeyError, TypeError):
            return self.timer.phase(name)  # raises the error naming the field

    def _declared_phase(self, name: str, budget_seconds: float) -> Any:
        if not isinstance(name, str) or not name or len(name) > 64:
            raise ValueError(
                f"phase: field name: value {name!r} must be a text of 1..64 characters"
            )
        if (
            isinstance(budget_seconds, bool)
            or not isinstance(budget_seconds, (int, float))
            or not 0 < budget_seconds <= 86_400
        ):
            raise ValueError(
                f"phase: field budget_seconds: value {budget_seconds!r} must be a number in "
                "(0, 86400]"
            )
        if self.timer is None:
            return _INERT
        timed = self.timer._phases.get(name)
        return DeclaredPhase(self.timer, name, float(budget_seconds), timed)

    def sync_wait(self) -> Any:
        """Context manager around a wait at a synchronisation point outside the watched model.

        The hooks time DDP's own synchronisation points; a collective the training loop runs
        outside the model (a token-count all-gather before the forward pass, an all-reduced
        metric) lines the ranks up too, and the ranks that arrive early wait there. Wrapped
        in ``with rw.sync_wait():`` that wait joins ``forward_wait`` (and ``forward``; inside
        a timed backward: ``backward_wait``), so the rank that waited least is still named.
        Run it on every rank at the same point of every step: the waits are compared only
        when every rank timed them. With GPU timing on, the block is also timed on the compute
        stream (CUDA events before and after it): put the collective's ``wait()`` inside it.
        Blocks do not nest (``RuntimeError``).
        """
        if self.timer is None:
            return _INERT
        return self.timer._sync_wait

    def untimed_collectives(self) -> Any:
        """Context manager: collectives the training thread waits in inside it are not timed as
        waits. Every other collective is (see ``watch``); use this for control traffic that is
        not training, such as a harness broadcasting a stop flag from rank 0 between steps,
        where the ranks would otherwise be compared on how long they waited for rank 0's own
        bookkeeping. Blocks nest."""
        if self.timer is None:
            return _INERT
        return self.timer._untimed

    def end_step(self) -> None:
        """End the training step the hooks opened now that its optimizer has stepped: it ends
        where the optimizer step ended, so what the loop does next (a checkpoint save, which
        every rank waits through together) is in no step, and the next fetch or forward opens
        the next one. A step whose optimizer has not stepped is discarded; nothing happens
        when no step is open. (On the GPU clock the step is discarded: its end marker cannot
        be placed in the past.)"""
        if self.timer is not None:
            self.timer.finish_open_step()

    def rebaseline(self, reason: str) -> None:
        """Start the group's pace baseline again (you changed the batch size, the sequence
        length or the model on purpose): the next windows are warm-up, then form a new
        baseline, and a job slowdown is judged against it. Call it on every rank (only the
        root's call counts). ``reason`` is kept for the report and logged."""
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"reason: expected a non-empty string, got {reason!r}")
        if self._aggregator is not None:
            self._aggregator.rebaseline(reason)

    def collect(self) -> None:
        """Mark one training step for collection; in sync mode every ``sync_step``-th call
        ships rows (and, on the root, builds a window) on the background thread."""
        timer = self.timer
        if timer is None:
            return
        if timer.gpu is not None:
            timer.poll_gpu(8)
        if self.config.async_mode or self._collector is None:
            return
        self._collects += 1
        if self._collects % self.config.sync_step == 0:
            self._collector.trigger()

    def watch(
        self,
        model: Any = None,
        optimizer: Any = None,
        dataloader: Iterable[Any] | None = None,
        *,
        mesh: Any = None,
    ) -> Any:
        """Install hooks: forward/backward on ``model``, step hooks on ``optimizer`` (one or a
        sequence; a framework's wrapper holding the optimizer in ``.optimizer`` is accepted),
        and return ``dataloader`` wrapped to time input wait and the batch's host-to-device
        copy (None if not given).

        With a watched loader a step runs from one batch fetch to the next (work after the
        optimizer lands in the step's residual); without one the last optimizer's step closes
        it. The loader must be iterated by the training thread (the thread calling ``watch``):
        a prefetching thread's fetches are not timed. The strategy is detected from a
        DDP/FSDP wrapper around ``model`` (inside a ``torch.compile`` wrapper too). Every
        wait of the training thread for a collective is timed as a sync wait from here on
        (:mod:`.collectives`), until :meth:`close`.

        ``mesh``: the job's device mesh, so the diagnosis compares only ranks that should do
        equal work (the ranks of one pipeline stage): a ``DeviceMesh`` (a submesh stands for
        its root mesh), or dimension sizes over the group's ranks in row-major order
        (``{"pp": 2, "dp": 2}``). Without it, the root mesh of the model's first DTensor
        parameter, if any. Every rank passes the same mesh; it must hold every rank of the
        group.
        """
        import torch

        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"watch: field model: expected a torch.nn.Module, got {model!r}")
        optimizers: list[torch.optim.Optimizer] = []
        if optimizer is not None:
            items = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
            for item in items:
                # A framework's wrapper is accepted: its optimizer is found inside it.
                opt = unwrap_optimizer(item)
                if opt is None:
                    raise TypeError(
                        f"watch: field optimizer: expected a torch.optim.Optimizer, a wrapper "
                        f"holding one in .optimizer (or a list of them), got {item!r}"
                    )
                optimizers.append(opt)
        if dataloader is not None and (
            isinstance(dataloader, (str, bytes)) or not isinstance(dataloader, Iterable)
        ):
            raise TypeError(f"watch: field dataloader: expected an iterable, got {dataloader!r}")
        for obj in (model, *optimizers):
            if obj is not None and id(obj) in self._watched:
                raise ValueError(f"watch: {type(obj).__name__} {id(obj):#x} is already watched")
        device = model_device(model) if model is not None else None
        if model is not None:
            detected = detect_strategy(model)
            if detected is not None:
                self._detected_strategy = detected
                if self._explicit_strategy not in (None, detected):
                    log.warning(
                        "rankwatch: strategy %r given, but the model is wrapped for %r; using %r",
                        self._explicit_strategy,
                        detected,
                        self._explicit_strategy,
                    )
        layout = mesh_layout(mesh, self.ranks) if self.ranks else None
        if self.timer is None:
            return dataloader
        if layout is None and model is not None:
            layout = model_mesh(model, self.ranks)
        if layout is not None and self._aggregator is not None:
            self._aggregator.set_mesh(layout)
        if model is not None:
            self._gpu_for_model(device)
        if device is not None:
            # Collectives on accelerator tensors (NCCL) do not block the host: this rank's
            # CPU clock cannot contain a wait, and the diagnosis must know it.
            self.timer.async_collectives = device.type != "cpu"
        self._handles.extend(install(self.timer, model, optimizers))
        self._handles.extend(install_collective_waits(self.timer))
        self._handles.extend(install_pipeline_phases(self.timer))
        if self._hang is not None:
            self._hang.training_thread = threading.get_ident()
            self._handles.extend(
                install_checkpoint_phases(self.timer, self.config.hang_checkpoint_budget_seconds)
            )
        if model is not None and self.timer.gpu is not None:
            self._watch_device_waits(model)
        self._watched.update(id(o) for o in (model, *optimizers) if o is not None)
        self._optimizers_watched |= bool(optimizers)
        if dataloader is None:
            return None
        return WatchedLoader(
            dataloader,
            self.timer,
            device,
            training_thread=threading.get_ident(),
            optimizers_watched=bool(optimizers) or self._optimizers_watched,
            optimizer_silent_batches=self.config.optimizer_silent_batches,
        )

    # ---- shutdown ------------------------------------------------------------------------

    def close(self, timeout_seconds: float | None = None) -> None:
        """Stop within ``timeout_seconds`` (default: the configured
        ``shutdown_timeout_seconds``): remove hooks, ship the last rows, let the root publish
        the summary window, stop the thread, close the publishers (incidents still open close
        with reason ``run ended``). Then the root prints the run's verdict and where its
        summary is to stderr, when a :class:`RunRecorder` is among the publishers (``init``
        adds one) and ``config.end_summary`` is on. Call it before
        ``torch.distributed.destroy_process_group()``. Idempotent."""
        if timeout_seconds is None:
            timeout_seconds = self.config.shutdown_timeout_seconds
        if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)):
            raise TypeError(
                f"close: field timeout_seconds: expected a number, got {timeout_seconds!r}"
            )
        if not timeout_seconds > 0 or timeout_seconds == float("inf"):
            raise ValueError(
                f"close: field timeout_seconds: must be a finite number > 0, got "
                f"{timeout_seconds!r}"
            )
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_seconds
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.timer is not None:
            # A step left open when the loop ended is written if its optimizer ran (a
            # trainer stopping at its step count fetches no next batch), else discarded.
            self.timer.finish_open_step()
            self.timer.drain_gpu(min(1.0, 0.2 * timeout_seconds))
        if self._hang is not None:
            self._hang.stop(min(1.0, max(0.0, deadline - time.monotonic())))
            if self._undo_sigterm is not None:
                self._undo_sigterm()
        if self._collector is not None:
            self._collector.stop(max(0.0, deadline - time.monotonic()))
        if self._aggregator is not None:
            # The summary window: the aggregator waits for the other ranks' final rows, then
            # its report reaches the publishers before they close.
            self._aggregator.stop(max(0.05, deadline - time.monotonic()))
        for pub in self.publishers:
            try:
                pub.close(max(0.05, deadline - time.monotonic()))
            except Exception:
                log.exception("rankwatch: closing publisher %r failed", pub)
        if self.is_root and self.config.end_summary:
            self._print_end_summary()

    def _print_end_summary(self) -> None:
        """The run's verdict, its incidents and where its summary is, on stderr (root only),
        from the run recorder among the publishers (``init`` adds one)."""
        recorder = next((p for p in self.publishers if isinstance(p, RunRecorder)), None)
        if recorder is None:
            return
        try:
            guards = [] if recorder.guard is None else [recorder.guard]
            faults = [text for g in guards if (text := g.not_written()) is not None]
            if self._aggregator is not None:
                faults = self._aggregator.not_written + faults
            text = end_of_run_text(recorder.summary(recorder.run), recorder.written, faults)
            sys.stderr.write(text)
            sys.stderr.flush()
        except Exception:  # the end of a run must not fail because of its summary
            log.exception("rankwatch: the end-of-run summary failed")

    def __enter__(self) -> RankWatch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------

    @staticmethod
    def _cuda_available() -> bool:
        import torch

        return bool(torch.cuda.is_available())

    def _gpu_for_model(self, device: Any) -> None:
        """GPU timing on the watched model's device, or off with one warning saying why."""
        on_cuda = device is not None and device.type == "cuda"
        if self._gpu_timing is False:
            return
        if on_cuda:
            self._want_gpu(True, device)
            return
        self._want_gpu(False)
        if self._gpu_timing or (device is not None and device.type != "cpu"):
            self._warn_gpu_off(
                f"the watched model is on {device}, and GPU timing uses CUDA events on the "
                "model's own device"
            )

    def _watch_device_waits(self, model: Any) -> None:
        """FSDP2's waits on the compute stream, on the GPU clock (:mod:`.device_waits`); the
        event pool grows by their pairs."""
        timer = self.timer
        assert timer is not None and timer.gpu is not None
        shadows = fsdp_device_waits(timer, model)
        self._handles.extend(shadows)
        timer.gpu.pool.capacity += 2 * len(shadows) * timer.gpu.max_pending_steps

    def _warn_gpu_off(self, why: str) -> None:
        if not self._gpu_off_warned:
            self._gpu_off_warned = True
            log.warning("rankwatch: GPU timing is off: %s; steps are timed on the CPU clock", why)

    def _want_gpu(self, on: bool, device: Any = None) -> None:
        timer = self.timer
        if timer is None:
            return
        if not on:
            if timer.gpu is not None:
                timer.set_gpu(None)
            return
        if not self._cuda_available():
            raise ValueError("RankWatch: field gpu_timing: value True needs CUDA")
        import torch

        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else device
        if timer.gpu is not None and timer.gpu.device == dev:
            return
        # A pending step's ring slot must not come round again before its GPU times land.
        in_flight = max(1, min(_GPU_STEPS_IN_FLIGHT, timer.capacity // 2))
        pool = self._pools.get(str(dev))
        if pool is None:  # events of one device never meet another device's stream
            pool = self._pools[str(dev)] = EventPool(
                in_flight * _EVENTS_PER_STEP, cuda_event_factory()
            )
        timer.set_gpu(
            GpuTimeline(
                pool,
                len(TIMED_SIGNALS),
                0,
                in_flight,
                stream=cuda_stream_of(dev),
                device=dev,
                capturing=cuda_capturing(),
                wait_signals=(FORWARD_WAIT, BACKWARD_WAIT),
                max_errors=self.config.gpu_device_errors_before_off,
            )
        )

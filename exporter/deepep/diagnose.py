"""DeepEP diagnosis inside every EP rank: a drop-in for DeepXTrace's ``Diagnose`` factory.

Every EP rank calls :meth:`Diagnose.create_from_env`. The factory takes its settings from the
process's one :class:`RankwatchConfig` (``config=rw.config``, or read from the environment:
``DEEPEP_DIAGNOSE_*`` in ``RankwatchConfig.deepep``, the thresholds in
``RankwatchConfig.diagnosis``) on every rank, compares them across the group with one
all-gather, and fails on *every* rank with the same message when they disagree or one rank's
value is invalid; when diagnosis is disabled it returns None everywhere. The object it returns
owns the counter block DeepEP writes (:mod:`.counters`), takes stream-ordered snapshots
(:mod:`.snapshot`), and gathers them to the group's root, which forms windows, runs the
normal-mode and low-latency diagnosis, and hands a :class:`WindowReport` to each publisher.

Collection runs either on a background thread every ``DEEPEP_DIAGNOSE_INTERVAL`` seconds over
a private Gloo group (``DEEPEP_DIAGNOSE_ASYNC=1``), or on the training thread through the EP
group every ``DEEPEP_DIAGNOSE_SYNC_STEP`` calls of :meth:`Diagnose.diagnose_normal_sync` /
:meth:`Diagnose.diagnose_ll_sync`. Either way the root diagnoses on its own worker thread (from
``DEEPEP_DIAGNOSE_ROOT_PROCESS_MIN_EP`` ranks on, in a child process: :mod:`.root_process`), so
the training thread never waits for a diagnosis or a publisher.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rankwatch.diagnosis.config import LowLatencyConfig, NormalConfig, option_env
from rankwatch.diagnosis.deepep.normal.schema import internode_ranks_per_node
from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.exporter.config import DeepEPConfig, RankwatchConfig
from rankwatch.exporter.deepep.counters import DeepEPCounters, allocate_counters
from rankwatch.exporter.deepep.root import HISTORY_WINDOWS, DeepEPRoot, RootSpec
from rankwatch.exporter.deepep.root_process import DeepEPRootProcess, runs_off_process
from rankwatch.exporter.deepep.snapshot import (
    DeepEPWindow,
    OrderedSnapshotter,
    PendingSnapshot,
    gather_rows,
)
from rankwatch.exporter.gloo import create_gloo_group
from rankwatch.exporter.identity import DEFAULT_NODE_NAME_ENV, local_rank_from_env, node_hostname
from rankwatch.exporter.publish.protocol import Publisher, check_publishers
from rankwatch.exporter.run_name import resolve_run_name

__all__ = ["HISTORY_WINDOWS", "Diagnose", "infer_ranks_per_node"]

log = logging.getLogger(__name__)


_DEFAULT_LOG_PATH = DeepEPConfig().log_path
_LOG_PATH_ENV = option_env(DeepEPConfig, "log_path")

# Settings every member must agree on, in the order they are reported when they differ.
_SETTING_NAMES: tuple[str, ...] = (
    *(
        option_env(DeepEPConfig, name)
        for name in ("enable", "async_mode", "interval_seconds", "sync_step", "warmup_seconds")
    ),
    "enable_ll_diagnose",
    "enable_normal_diagnose",
    "ranks_per_node",
    "counter device",
)


@dataclass(frozen=True)
class _Member:
    """What one rank tells the others at creation (all-gathered)."""

    rank: int
    hostname: str
    local_rank: int | None
    settings: tuple[Any, ...]
    error: str | None
    instance_id: str


def _check_group(group: object) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized (init_process_group first)")
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"group: global rank {dist.get_rank()} is not a member of the group it passed"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup, got {group!r}")
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"group: global rank {dist.get_rank()} is not a member of the group it passed"
        )
    return group


def _as_cuda_stream(stream: object) -> Any:
    """The producer stream as a ``torch.cuda.Stream`` (None stays None)."""
    if stream is None or isinstance(stream, torch.cuda.Stream):
        return stream
    if isinstance(stream, torch.Stream):
        if stream.device.type != "cuda":
            raise ValueError(f"snapshot_stream: must be a CUDA stream, got {stream!r}")
        return torch.cuda.Stream(
            stream_id=stream.stream_id,
            device_index=stream.device_index,
            device_type=stream.device_type,
        )
    raise TypeError(f"snapshot_stream: expected a CUDA stream or None, got {stream!r}")


def _counter_device(group: dist.ProcessGroup, stream: Any) -> torch.device:
    # The counters live where DeepEP's kernels run; a CPU (Gloo) EP group keeps them on the CPU.
    if stream is not None:
        return torch.device("cuda", stream.device_index)
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _log_to_file(deepep: DeepEPConfig, env: Mapping[str, str]) -> bool:
    # DeepXTrace writes its per-rank log file only when a log path is given. An object cannot
    # tell "set to the default" from "not set", so: the variable is present (whatever its value;
    # as before) or the object holds another path than the default (a programmatic override).
    return _LOG_PATH_ENV in env or deepep.log_path != _DEFAULT_LOG_PATH


def infer_ranks_per_node(hostnames: Sequence[str]) -> int:
    """Ranks per node from the members' hostnames (in group order).

    The diagnosis lays ranks out node by node, so the hostnames must form contiguous blocks of
    one size; anything else raises ``ValueError`` asking for an explicit ``ranks_per_node``.
    """
    if isinstance(hostnames, str) or not hostnames:
        raise ValueError(f"hostnames: expected a non-empty list of names, got {hostnames!r}")
    blocks: list[tuple[str, int]] = []
    for name in hostnames:
        if blocks and blocks[-1][0] == name:
            blocks[-1] = (name, blocks[-1][1] + 1)
        else:
            blocks.append((name, 1))
    names = [b[0] for b in blocks]
    sizes = {b[1] for b in blocks}
    if len(set(names)) != len(names) or len(sizes) != 1:
        raise ValueError(
            "ranks_per_node: cannot infer it, the EP ranks are not laid out node by node in "
            f"equal blocks (hosts in group order: {list(hostnames)}); pass ranks_per_node"
        )
    return sizes.pop()


def _exception_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Diagnose:
    """DeepEP diagnosis of one EP group, on one rank. Build it with :meth:`create_from_env`.

    Every member holds the counter block DeepEP writes; the group's root (group rank 0) also
    forms windows, diagnoses them, publishes reports, and keeps the last
    :data:`HISTORY_WINDOWS` windows in :attr:`recent_windows` (from ``root_process_min_ep`` on
    a child process of the root does all but the publishing, and keeps the windows).
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup,
        config: DeepEPConfig,
        members: Sequence[RankInfo],
        ranks_per_node: int,
        counters: DeepEPCounters,
        snapshot_stream: Any,
        publishers: Sequence[Publisher],
        instance_id: str,
        group_name: str,
        normal_config: NormalConfig,
        low_latency_config: LowLatencyConfig,
        gather_timeout_seconds: float,
        log_to_file: bool = False,
        run: str = "",
        gloo_lazy_connect: bool = True,
    ) -> None:
        self.group = group
        self.config = config
        self.ranks = tuple(members)
        self.ep_size = len(self.ranks)
        self.rank = dist.get_rank(group)
        self.global_rank = dist.get_rank()
        self.root_global_rank = self.ranks[0].rank
        self.is_root = self.rank == 0
        self.ranks_per_node = ranks_per_node
        self.counters = counters
        self.enable_async = config.async_mode
        self.enable_normal_diagnose = counters.normal is not None
        self.enable_ll_diagnose = counters.low_latency is not None
        self.interval = config.interval_seconds
        self.sync_step = config.sync_step
        self.instance_id = instance_id
        self.group_name = group_name
        self.publishers = tuple(publishers)
        self.normal_config = normal_config
        self.low_latency_config = low_latency_config
        self.gather_timeout_seconds = gather_timeout_seconds
        self._log_to_file = log_to_file
        self._dispatch_bundle = counters.dispatch_bundle()
        self._combine_bundle = counters.combine_bundle()
        self._snapshotter = OrderedSnapshotter(counters.storage, snapshot_stream)
        self._run = run
        self._gloo_lazy_connect = gloo_lazy_connect
        self._calls = {"normal": 0, "low_latency": 0}
        self._state = "created"
        self._lock = threading.Lock()
        self._stop_requested = threading.Event()
        self._wake = threading.Event()
        self._collector: threading.Thread | None = None
        self._worker: threading.Thread | None = None
        self._cpu_group: dist.ProcessGroup | None = None
        self._cpu_row_order: list[int] | None = None
        # The group's root forms windows, diagnoses and publishes (built by start()).
        self._root: DeepEPRoot | DeepEPRootProcess | None = None
        self.collector_error: str | None = None
        if self.enable_async:
            self._make_cpu_group()

    # ------------------------------------------------------------------ factory

    @classmethod
    def create_from_env(
        cls,
        group: dist.ProcessGroup,
        enable_ll_diagnose: bool = False,
        enable_normal_diagnose: bool = True,
        snapshot_stream: Any = None,
        publishers: Sequence[Publisher] = (),
        ranks_per_node: int | None = None,
        *,
        group_name: str = "ep",
        gather_timeout_seconds: float = 60.0,
        env: Mapping[str, str] | None = None,
        config: RankwatchConfig | None = None,
    ) -> Diagnose | None:
        """Build the diagnosis for ``group`` from ``DEEPEP_DIAGNOSE_*``; None when disabled.

        Collective: every member of ``group`` must call it. ``snapshot_stream`` is the stream
        that writes the counters (``buffer.get_comm_stream()``); ``ranks_per_node`` defaults to
        what the members' hostnames show. ``publishers`` receive every window's report on the
        root. Bad settings or arguments on any rank raise on every rank (``ValueError`` or
        ``TypeError`` naming the setting, the value and the rank).

        ``config`` is the process's one configuration object, e.g. ``rw.config`` of the
        ``RankWatch`` that ``init()`` returned: every setting comes from it (``config.deepep``,
        ``config.diagnosis.normal``, ``config.diagnosis.low_latency``, ``config.node_name_env``,
        ``config.run_id``). When None, ``RankwatchConfig.from_env(env)`` builds it. ``env``
        (default: ``os.environ``) still gives what is not a setting: the node name held by the
        variable ``node_name_env`` names, and ``LOCAL_RANK``.
        """
        group = _check_group(group)
        source = os.environ if env is None else env
        global_rank = dist.get_rank()
        local_error: BaseException | None = None
        settings: tuple[Any, ...] = ()
        rw_config: RankwatchConfig | None = None
        node_name_env = DEFAULT_NODE_NAME_ENV
        stream: Any = None
        internode_rpn: int | None = None
        try:
            if config is not None and not isinstance(config, RankwatchConfig):
                raise TypeError(
                    "config: expected a RankwatchConfig (e.g. rw.config) or None, "
                    f"got {type(config).__name__}: {config!r}"
                )
            for name, flag in (
                ("enable_ll_diagnose", enable_ll_diagnose),
                ("enable_normal_diagnose", enable_normal_diagnose),
            ):
                if not isinstance(flag, bool):
                    raise TypeError(f"{name}: expected a bool, got {flag!r}")
            if ranks_per_node is not None and (
                isinstance(ranks_per_node, bool)
                or not isinstance(ranks_per_node, int)
                or ranks_per_node < 1
                or group.size() % ranks_per_node
            ):
                raise ValueError(
                    f"ranks_per_node: must be a positive divisor of the EP size {group.size()}, "
                    f"got {ranks_per_node!r}"
                )
            if enable_normal_diagnose:
                # DeepEP's internode normal mode fixes the node size (8) and its EP sizes.
                internode_rpn = internode_ranks_per_node(group.size(), ranks_per_node)
            if not isinstance(group_name, str) or not group_name:
                raise ValueError(f"group_name: expected a non-empty string, got {group_name!r}")
            if (
                isinstance(gather_timeout_seconds, bool)
                or not isinstance(gather_timeout_seconds, (int, float))
                or not 0 < gather_timeout_seconds < float("inf")
            ):
                raise ValueError(
                    "gather_timeout_seconds: must be a finite number > 0, "
                    f"got {gather_timeout_seconds!r}"
                )
            publishers = check_publishers(publishers, "Diagnose.create_from_env")
            stream = _as_cuda_stream(snapshot_stream)
            # One object for every setting: the same one init() built when it is passed in.
            rw_config = RankwatchConfig.from_env(source) if config is None else config
            node_name_env = rw_config.node_name_env
            deepep = rw_config.deepep
            settings = (
                deepep.enable,
                deepep.async_mode,
                deepep.interval_seconds,
                deepep.sync_step,
                deepep.warmup_seconds,
                enable_ll_diagnose,
                enable_normal_diagnose,
                ranks_per_node,
                _counter_device(group, stream).type,
            )
        except (TypeError, ValueError) as exc:
            local_error = exc
        me = _Member(
            rank=global_rank,
            hostname=node_hostname(node_name_env, source),
            # Lenient: unset or bad, the layout below falls back to the rank's position on its
            # host (a bad value is logged), since a label must not stop training.
            local_rank=local_rank_from_env(source),
            settings=settings,
            error=None if local_error is None else _exception_text(local_error),
            instance_id=uuid.uuid4().hex if dist.get_rank(group) == 0 else "",
        )
        gathered: list[Any] = [None] * group.size()
        dist.all_gather_object(gathered, me, group=group)
        members: list[_Member] = gathered
        failed = [m for m in members if m.error is not None]
        if failed:
            if local_error is not None:
                # This rank's own mistake keeps its own type and message.
                raise local_error
            detail = "; ".join(f"global rank {m.rank}: {m.error}" for m in failed)
            raise ValueError(f"DeepEP diagnosis settings are invalid on another rank: {detail}")
        _check_consistent(members)
        assert rw_config is not None
        deepep = rw_config.deepep
        if not deepep.enable or not (enable_ll_diagnose or enable_normal_diagnose):
            return None
        hostnames = [m.hostname for m in members]
        if ranks_per_node is not None:
            rpn = ranks_per_node
        elif enable_normal_diagnose and internode_rpn is not None:
            rpn = internode_rpn
        else:
            rpn = infer_ranks_per_node(hostnames)
        infos = []
        for m in members:
            same_host = [o.rank for o in members if o.hostname == m.hostname]
            local = m.local_rank if m.local_rank is not None else sorted(same_host).index(m.rank)
            infos.append(RankInfo(rank=m.rank, hostname=m.hostname, local_rank=local))
        counters = allocate_counters(
            group.size(),
            normal=enable_normal_diagnose,
            low_latency=enable_ll_diagnose,
            device=_counter_device(group, stream),
        )
        return cls(
            group=group,
            config=deepep,
            members=infos,
            ranks_per_node=rpn,
            counters=counters,
            snapshot_stream=stream,
            publishers=publishers,
            instance_id=members[0].instance_id,
            group_name=group_name,
            normal_config=rw_config.diagnosis.normal,
            low_latency_config=rw_config.diagnosis.low_latency,
            gather_timeout_seconds=float(gather_timeout_seconds),
            log_to_file=_log_to_file(deepep, source),
            # No launcher named the run: the name rank 0 shared (the step-time one, if any).
            run=rw_config.run_id or resolve_run_name(rw_config, env=source).name,
            gloo_lazy_connect=rw_config.gloo_lazy_connect,
        )

    def _make_cpu_group(self) -> None:
        # Asynchronous gathers run on our own thread: they need a Gloo group of their own, with
        # exactly the EP members (non-contiguous too). Local synchronization lets only the
        # members create it, so ranks of other EP groups do not have to take part. It is made
        # like the step-time group (lazily connected when ``gloo_lazy_connect`` is on).
        ep_ranks = [r.rank for r in self.ranks]
        timeout = datetime.timedelta(seconds=self.gather_timeout_seconds)
        cpu_group = create_gloo_group(ep_ranks, True, timeout, self._gloo_lazy_connect)
        assert isinstance(cpu_group, dist.ProcessGroup)
        order = dist.get_process_group_ranks(cpu_group)
        self._cpu_group = cpu_group
        self._cpu_row_order = None if order == ep_ranks else [order.index(r) for r in ep_ranks]

    # ------------------------------------------------------------------ DeepEP-facing API

    def get_normal_dispatch_stats_tensor(self) -> tuple[torch.Tensor, ...] | None:
        """The ten-tensor bundle for ``Buffer.dispatch(normal_dispatch_stats=...)``."""
        return self._dispatch_bundle

    def get_normal_combine_stats_tensor(self) -> tuple[torch.Tensor, ...] | None:
        """The five-tensor bundle for ``Buffer.combine(normal_combine_stats=...)``."""
        return self._combine_bundle

    def get_stats_ll_stats_tensor(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The low-latency ``(dispatch, combine)`` int64[EP] counters, or ``(None, None)``."""
        ll = self.counters.low_latency
        if ll is None:
            return (None, None)
        return (ll[0], ll[1])

    def get_instance_id(self) -> uuid.UUID:
        """The id shared by every member of this diagnosis instance."""
        return uuid.UUID(hex=self.instance_id)

    @property
    def latest_report(self) -> WindowReport | None:
        """The last report the root published (always None on other ranks)."""
        return None if self._root is None else self._root.latest_report

    @property
    def recent_windows(self) -> deque[DeepEPWindow]:
        """The root's last :data:`HISTORY_WINDOWS` windows (empty on other ranks, and when the
        root's windows are built in its child process: ``root_process_min_ep``)."""
        return self._root.recent_windows if self._root is not None else deque()

    @property
    def rejected_windows(self) -> Counter[str]:
        """Rejected windows by ``part:reason`` (root only)."""
        return self._root.rejected_windows if self._root is not None else Counter()

    @property
    def collector_thread(self) -> threading.Thread | None:
        """The asynchronous collection thread once started (None in synchronous mode)."""
        return self._collector

    @property
    def dropped_snapshots(self) -> int:
        """Snapshots the root dropped because its worker was behind."""
        return 0 if self._root is None else self._root.dropped_snapshots

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start collecting: the warm-up clock, the root's worker, the async thread.

        Every member calls it. Calling it again is a no-op; after :meth:`stop` it raises.
        """
        with self._lock:
            if self._state == "started":
                return
            if self._state == "stopped":
                raise RuntimeError("Diagnose.start: this instance was stopped; create a new one")
            self._state = "started"
        started = time.time()
        if self.is_root:
            spec = RootSpec(
                members=self.ranks,
                ranks_per_node=self.ranks_per_node,
                config=self.config,
                normal_config=self.normal_config,
                low_latency_config=self.low_latency_config,
                normal=self.enable_normal_diagnose,
                low_latency=self.enable_ll_diagnose,
                instance_id=self.instance_id,
                group_name=self.group_name,
                log_to_file=self._log_to_file,
                log_rank=self.global_rank,
                run=self._run,
            )
            # Off the training process from root_process_min_ep on (root_process.py).
            make = (
                DeepEPRootProcess
                if runs_off_process(self.config, self.ep_size)
                else DeepEPRoot.from_spec
            )
            self._root = make(spec, self.publishers, self._snapshotter.copy_stream)
            self._root.start(started)
        if self.enable_async:
            self._collector = threading.Thread(
                target=self._collect_async,
                args=(started,),
                name="rankwatch-deepep-collect",
                daemon=True,
            )
            self._collector.start()
        atexit.register(self._stop_at_exit)

    def start_async_diagnose(self) -> None:
        """DeepXTrace's name for :meth:`start` in asynchronous mode."""
        self._require_mode(True, "start_async_diagnose")
        self.start()

    def stop(self, timeout_seconds: float | None = None) -> None:
        """Stop collecting and release the Gloo group; call it before destroying process groups.

        In asynchronous mode the stop travels with the next collective, so every member's
        thread takes one final snapshot (nothing written before the first member's stop is
        lost) and exits together; the root then finishes diagnosing what was gathered. What a
        member writes after that collective is not collected: members stop as training ends.
        Waits at most ``timeout_seconds`` (default: interval + 10 s) per thread. Idempotent.
        """
        if timeout_seconds is not None and (
            isinstance(timeout_seconds, bool)
            or not isinstance(timeout_seconds, (int, float))
            or not timeout_seconds >= 0
        ):
            raise ValueError(f"timeout_seconds: must be a number >= 0, got {timeout_seconds!r}")
        with self._lock:
            if self._state == "stopped":
                return
            was_started = self._state == "started"
            self._state = "stopped"
        atexit.unregister(self._stop_at_exit)
        wait = self.interval + 10.0 if timeout_seconds is None else float(timeout_seconds)
        collector_done = True
        if self._collector is not None:
            self._stop_requested.set()
            self._wake.set()
            self._collector.join(wait)
            collector_done = not self._collector.is_alive()
            if not collector_done:
                log.warning(
                    "DeepEP collection thread did not stop within %.1f s (a member has not "
                    "reached its next collective); leaving it as a daemon",
                    wait,
                )
        if self._root is not None and was_started:
            self._root.stop(wait)
        if self._cpu_group is not None and collector_done and dist.is_initialized():
            try:
                dist.destroy_process_group(self._cpu_group)
                self._cpu_group = None
            except (RuntimeError, ValueError) as exc:
                log.warning("destroying the DeepEP Gloo group failed: %s", exc)

    def stop_async_diagnose(self) -> None:
        """DeepXTrace's name for :meth:`stop` in asynchronous mode."""
        self._require_mode(True, "stop_async_diagnose")
        self.stop()

    def _stop_at_exit(self) -> None:
        # At interpreter exit: do not wait long for peers that may already be gone.
        self.stop(timeout_seconds=min(self.interval, 2.0))

    def __enter__(self) -> Diagnose:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ synchronous mode

    def diagnose_normal_sync(self, diagnose_step: int = 0) -> None:
        """Call once per step on every member; every ``sync_step`` calls, collect a window.

        Synchronous mode only. The snapshot is ordered on the producer stream and gathered
        through the EP group (every member must call at the same point); the root diagnoses it
        on its worker thread and publishes. ``diagnose_step`` > 0 overrides ``sync_step``.
        """
        self._sync_call("normal", diagnose_step, "diagnose_normal_sync")

    def diagnose_ll_sync(self, diagnose_step: int = 0) -> None:
        """Low-latency counterpart of :meth:`diagnose_normal_sync`."""
        self._sync_call("low_latency", diagnose_step, "diagnose_ll_sync")

    def _require_mode(self, async_mode: bool, caller: str) -> None:
        if self.enable_async != async_mode:
            want = "1" if async_mode else "0"
            raise RuntimeError(
                f"Diagnose.{caller}: only available with DEEPEP_DIAGNOSE_ASYNC={want}, "
                f"this instance has async={int(self.enable_async)}"
            )

    def diagnose_sync_blocking(
        self, part: str, diagnose_step: int = 0
    ) -> tuple[bool, WindowReport | None]:
        """Like :meth:`diagnose_normal_sync` / :meth:`diagnose_ll_sync` (``part`` is
        ``"normal"`` or ``"low_latency"``), but the root forms, diagnoses and publishes the
        window on the calling thread and returns it.

        Returns ``(collected, report)``: ``collected`` is True on every member when this call
        gathered a snapshot; ``report`` is the root's report of the window (None on the other
        members, and when the snapshot was only a boundary). This is what DeepXTrace's
        synchronous calls promise (results on rank 0); it costs the root one diagnosis per
        collection on the training thread, so the non-blocking calls are preferred otherwise.
        """
        if part not in ("normal", "low_latency"):
            raise ValueError(f"part: must be 'normal' or 'low_latency', got {part!r}")
        caller = "diagnose_normal_sync" if part == "normal" else "diagnose_ll_sync"
        collected, pending = self._sync_collect(part, diagnose_step, caller)
        if pending is None:
            return collected, None
        assert self._root is not None  # only the root holds gathered rows
        try:
            return collected, self._root.process((part,), pending)
        except Exception as exc:  # a window that cannot be processed must not end training
            log.exception("DeepEP window processing failed: %s", exc)
            return collected, None

    def _sync_call(self, part: str, diagnose_step: int, caller: str) -> None:
        _, pending = self._sync_collect(part, diagnose_step, caller)
        if pending is not None:
            self._enqueue((part,), pending)

    def _sync_collect(
        self, part: str, diagnose_step: int, caller: str
    ) -> tuple[bool, PendingSnapshot | None]:
        """Count one call; every ``sync_step`` calls gather a snapshot through the EP group.
        Returns whether this call gathered, and the gathered rows on the root."""
        if isinstance(diagnose_step, bool) or not isinstance(diagnose_step, int):
            raise TypeError(f"diagnose_step: expected an int, got {diagnose_step!r}")
        if diagnose_step < 0:
            raise ValueError(f"diagnose_step: must be >= 0, got {diagnose_step!r}")
        self._require_mode(False, caller)
        enabled = self.enable_normal_diagnose if part == "normal" else self.enable_ll_diagnose
        if not enabled:
            return False, None
        with self._lock:
            if self._state != "started":
                raise RuntimeError(f"Diagnose.{caller}: call start() first (state: {self._state})")
        self._calls[part] += 1
        step_round = diagnose_step if diagnose_step > 0 else self.sync_step
        if self._calls[part] % step_round:
            return False, None
        region = (
            self.counters.normal_region if part == "normal" else self.counters.low_latency_region
        )
        local = self._snapshotter.device_copy(region)
        if local is None:
            return False, None
        return True, gather_rows(local, self.group, self.root_global_rank, self.is_root)

    # ------------------------------------------------------------------ asynchronous mode

    def _collect_async(self, started: float) -> None:
        assert self._cpu_group is not None
        parts = tuple(
            p
            for p, on in (
                ("normal", self.enable_normal_diagnose),
                ("low_latency", self.enable_ll_diagnose),
            )
            if on
        )
        region = slice(self.counters.normal_region.start, self.counters.low_latency_region.stop)
        warmup = self.config.warmup_seconds
        # The first snapshot lands at the end of warm-up: it becomes the windows' boundary.
        next_tick = started + (warmup if warmup > 0 else self.interval)
        flag = torch.zeros(1, dtype=torch.int64)
        try:
            while True:
                delay = next_tick - time.time()
                if delay > 0:
                    self._wake.wait(delay)
                # Every member must run the same number of gathers: the stop request of any
                # member travels with this collective, so all of them leave after the same one.
                flag.fill_(1 if self._stop_requested.is_set() else 0)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._cpu_group)
                local = self._snapshotter.host_copy(region)
                pending = gather_rows(
                    local,
                    self._cpu_group,
                    self.root_global_rank,
                    self.is_root,
                    self._cpu_row_order,
                )
                if pending is not None:
                    self._enqueue(parts, pending)
                if int(flag.item()):
                    return
                next_tick = max(next_tick + self.interval, time.time())
        except Exception as exc:  # a dead peer or a destroyed group ends collection, not training
            self.collector_error = _exception_text(exc)
            log.error(
                "DeepEP collection thread exits (instance %s, EP %d, global rank %d): %s",
                self.instance_id,
                self.ep_size,
                self.global_rank,
                self.collector_error,
            )

    # ------------------------------------------------------------------ root side

    def _enqueue(self, parts: tuple[str, ...], pending: PendingSnapshot) -> None:
        assert self._root is not None  # only the root gathers rows
        self._root.submit(parts, pending)


def _check_consistent(members: Sequence[_Member]) -> None:
    """Raise on every rank, with the same message, when members' settings disagree."""
    enabled = {m.settings[0] for m in members}
    # Only enablement matters while diagnosis is off everywhere.
    count = len(_SETTING_NAMES) if enabled == {True} else 1
    problems = []
    for i in range(count):
        values: dict[Any, list[int]] = {}
        for m in members:
            values.setdefault(m.settings[i], []).append(m.rank)
        if len(values) > 1:
            spread = ", ".join(f"{v!r} on global ranks {r}" for v, r in values.items())
            problems.append(f"{_SETTING_NAMES[i]} differs across the EP group: {spread}")
    if problems:
        raise ValueError(
            "DeepEP diagnosis settings must match on every rank: " + "; ".join(problems)
        )

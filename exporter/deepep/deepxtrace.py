"""DeepXTrace's ``deepxtrace.diagnose`` module, served by rankwatch's DeepEP collector.

After :func:`install_as_deepxtrace`, ``import deepxtrace.diagnose`` and
``from deepxtrace import diagnose as ds`` give this module (the way PyMySQL's
``install_as_MySQLdb()`` serves code written for MySQLdb): code written for DeepXTrace, and the
``Buffer`` of DeepEP's DeepXTrace integration (DeepEP pull request 720), run unchanged while
rankwatch's collector (:class:`rankwatch.exporter.deepep.Diagnose`) does the work, so its
metrics, incidents, NPZ artifacts and dashboards come with it.

It speaks two contracts:

* DeepXTrace 0.1, the released low-latency tool: ``Diagnose(group, interval=20,
  enable_ll_diagnose=True, enable_normal_diagnose=False, enable_async=False)``, its
  environment variables and defaults (``DEEPEP_DIAGNOSE_ENABLE`` on, ``DEEPEP_DIAGNOSE_INTERVAL``
  20, ``DEEPEP_DIAGNOSE_WARMING_TIME`` = the interval), ``diagnose_ll_sync()`` returning the
  list of result dicts (dispatch, combine) on group rank 0, ``start_async_diagnose()`` /
  ``stop_async_diagnose()``, the static ``diagnose_matrix`` and the per-rank log file
  ``diagnose_rank<r>.log`` its heatmap tool reads;
* the normal-mode one of DeepXTrace pull request 17 and DeepEP pull request 720:
  :data:`NORMAL_STATS_SCHEMA` (the 15 counter names, in order), ``get_stats_normal_stats_tensor()``
  returning those 15 tensors, ``snapshot_stream=``, ``create_from_env`` and
  ``diagnose_normal_sync(step)``.

Differences a caller can see: the counters are cumulative and never zeroed (rankwatch diffs
consecutive snapshots, so the results are those of the interval, as DeepXTrace's are); the
first asynchronous window starts at the end of warm-up instead of including it; a synchronous
call diagnoses on the calling thread of rank 0, as DeepXTrace's does.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
import types
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rankwatch.diagnosis.config import option_env
from rankwatch.diagnosis.deepep.low_latency import LowLatencyResult, diagnose_matrix
from rankwatch.diagnosis.report import WindowReport
from rankwatch.exporter.config import DeepEPConfig, RankwatchConfig
from rankwatch.exporter.deepep.counters import LOW_LATENCY_PHASES, bundle_views
from rankwatch.exporter.deepep.diagnose import Diagnose as _Collector
from rankwatch.exporter.publish.protocol import Publisher, check_publishers
from rankwatch.exporter.storage import GuardedRotatingFileHandler, GuardedWrites

__all__ = [
    "NORMAL_STATS_SCHEMA",
    "WARMING_TIME_ENV",
    "DeepXTraceLog",
    "Diagnose",
    "check_normal_stats_tensors",
    "install_as_deepxtrace",
    "uninstall_deepxtrace",
]

log = logging.getLogger(__name__)

# DeepEP's name for each normal-mode counter -> rankwatch's schema row. The one place the two
# vocabularies meet: DeepEP (pull request 720, deep_ep/buffer.py _REQUIRED_NORMAL_STATS_SCHEMA)
# checks the names and their order, and passes the tensors to its kernels by name.
_NORMAL_STATS_FIELDS: tuple[tuple[str, tuple[str, str]], ...] = (
    ("normal_notify_dispatch_full_kernel_duration_ns_stats", ("notify_dispatch", "duration_ns")),
    ("normal_notify_dispatch_full_kernel_count_stats", ("notify_dispatch", "count")),
    (
        "normal_cached_notify_dispatch_full_kernel_duration_ns_stats",
        ("cached_notify_dispatch", "duration_ns"),
    ),
    ("normal_cached_notify_dispatch_full_kernel_count_stats", ("cached_notify_dispatch", "count")),
    (
        "normal_cached_notify_combine_full_kernel_duration_ns_stats",
        ("cached_notify_combine", "duration_ns"),
    ),
    ("normal_cached_notify_combine_full_kernel_count_stats", ("cached_notify_combine", "count")),
    ("normal_dispatch_final_completion_cost_stats", ("dispatch_final", "cost")),
    ("normal_dispatch_final_completion_sample_count_stats", ("dispatch_final", "sample")),
    ("normal_dispatch_final_completion_token_count_stats", ("dispatch_final", "token")),
    ("normal_dispatch_rdma_recv_completion_cost_stats", ("dispatch_rdma_recv", "cost")),
    ("normal_dispatch_rdma_recv_completion_sample_count_stats", ("dispatch_rdma_recv", "sample")),
    ("normal_dispatch_rdma_recv_completion_token_count_stats", ("dispatch_rdma_recv", "token")),
    ("normal_combine_logical_recv_completion_cost_stats", ("combine_logical_recv", "cost")),
    (
        "normal_combine_logical_recv_completion_sample_count_stats",
        ("combine_logical_recv", "sample"),
    ),
    (
        "normal_combine_logical_recv_completion_token_count_stats",
        ("combine_logical_recv", "token"),
    ),
)

NORMAL_STATS_SCHEMA: tuple[str, ...] = tuple(name for name, _ in _NORMAL_STATS_FIELDS)
"""The 15 normal-mode counters in the order DeepEP's ``Buffer`` requires (notify -> dispatch ->
combine); ``get_stats_normal_stats_tensor()`` returns the tensors in this order."""

_NORMAL_STATS_ROWS: tuple[tuple[str, str], ...] = tuple(row for _, row in _NORMAL_STATS_FIELDS)

WARMING_TIME_ENV = "DEEPEP_DIAGNOSE_WARMING_TIME"
"""DeepXTrace's warm-up variable (seconds); translated into ``DEEPEP_DIAGNOSE_WARMUP_SECONDS``."""

_ENABLE_ENV = option_env(DeepEPConfig, "enable")
_ASYNC_ENV = option_env(DeepEPConfig, "async_mode")
_INTERVAL_ENV = option_env(DeepEPConfig, "interval_seconds")
_WARMUP_ENV = option_env(DeepEPConfig, "warmup_seconds")
_LOG_PATH_ENV = option_env(DeepEPConfig, "log_path")
# DeepXTrace's defaults where they differ from rankwatch's own.
_DEEPXTRACE_INTERVAL_SECONDS = 20
_DEEPXTRACE_OFF = ("0", "false", "off")
_PHASE_TITLES = {"dispatch": "Dispatch", "combine": "Combine"}

_PACKAGE = "deepxtrace"
_MODULE = "deepxtrace.diagnose"
_installed_publishers: tuple[Publisher, ...] = ()
_installed_config: RankwatchConfig | None = None


# --------------------------------------------------------------------------- installing


def _served_by_us(module: object) -> bool:
    return getattr(module, "__rankwatch_served__", False) is True


def _real_deepxtrace() -> str | None:
    """Where a real DeepXTrace is (imported or importable), or None; imports nothing."""
    loaded = sys.modules.get(_PACKAGE)
    if loaded is not None:
        return None if _served_by_us(loaded) else str(getattr(loaded, "__file__", loaded))
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None:
        return None
    return str(spec.origin or list(spec.submodule_search_locations or []) or spec.name)


def install_as_deepxtrace(
    force: bool = False,
    *,
    publishers: Sequence[Publisher] = (),
    config: RankwatchConfig | None = None,
) -> None:
    """Serve ``deepxtrace`` and ``deepxtrace.diagnose`` from rankwatch (``sys.modules``).

    Call it before DeepEP (or your code) imports DeepXTrace. A real DeepXTrace that is installed
    or already imported is left alone: this raises ``RuntimeError`` naming where it is, unless
    ``force=True``. ``publishers`` (e.g. ``rw.publishers`` from ``rankwatch.exporter.init()``)
    receive every window report of the diagnosis objects created afterwards; ``config`` (e.g.
    ``rw.config``) gives them rankwatch's other settings (run id, node name, thresholds) while
    the ``DEEPEP_DIAGNOSE_*`` ones keep DeepXTrace's meaning. Calling it again replaces both.
    """
    global _installed_publishers, _installed_config
    if not isinstance(force, bool):
        raise TypeError(f"force: expected a bool, got {force!r}")
    checked = check_publishers(publishers, "install_as_deepxtrace")
    if config is not None and not isinstance(config, RankwatchConfig):
        raise TypeError(
            "config: expected a RankwatchConfig (e.g. rw.config) or None, "
            f"got {type(config).__name__}"
        )
    real = _real_deepxtrace()
    if real is not None and not force:
        raise RuntimeError(
            f"install_as_deepxtrace: a real DeepXTrace is installed ({real}); rankwatch does not "
            "replace it. Uninstall it, or pass force=True to serve deepxtrace from rankwatch"
        )
    package = types.ModuleType(_PACKAGE, "DeepXTrace's package, served by rankwatch.")
    package.__path__ = []
    package.__spec__ = importlib.machinery.ModuleSpec(_PACKAGE, None, is_package=True)
    package.__rankwatch_served__ = True  # type: ignore[attr-defined]
    this = sys.modules[__name__]
    package.diagnose = this  # type: ignore[attr-defined]
    sys.modules[_PACKAGE] = package
    sys.modules[_MODULE] = this
    _installed_publishers = checked
    _installed_config = config


def uninstall_deepxtrace() -> None:
    """Undo :func:`install_as_deepxtrace` (a real DeepXTrace in ``sys.modules`` stays)."""
    global _installed_publishers, _installed_config
    if _served_by_us(sys.modules.get(_PACKAGE)):
        del sys.modules[_PACKAGE]
    if sys.modules.get(_MODULE) is sys.modules[__name__]:
        del sys.modules[_MODULE]
    _installed_publishers = ()
    _installed_config = None


# Marks this module for _served_by_us when it stands in sys.modules["deepxtrace.diagnose"].
__rankwatch_served__ = True


# --------------------------------------------------------------------------- counters


def check_normal_stats_tensors(tensors: object, ep_size: int) -> dict[str, torch.Tensor]:
    """Check a normal-mode counter set against :data:`NORMAL_STATS_SCHEMA`; name -> tensor.

    ``tensors`` is either the 15 tensors in schema order (what
    ``get_stats_normal_stats_tensor()`` returns) or a mapping from the 15 names to them (how
    DeepEP's ``Buffer`` holds them). Each must be a contiguous 1-D int64 tensor: the notify
    counters hold one value, the completion counters ``ep_size``. Raises
    ``ValueError``/``TypeError`` naming the counter (or the missing and unknown names) and what
    is wrong.
    """
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size: must be a positive int, got {ep_size!r}")
    if isinstance(tensors, Mapping):
        missing = [n for n in NORMAL_STATS_SCHEMA if n not in tensors]
        unknown = sorted(str(n) for n in tensors if n not in NORMAL_STATS_SCHEMA)
        if missing or unknown:
            raise ValueError(
                f"tensors: not the NORMAL_STATS_SCHEMA names: missing {missing}, unknown {unknown}"
            )
        tensors = [tensors[n] for n in NORMAL_STATS_SCHEMA]
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
        raise TypeError(
            "tensors: expected 15 tensors or a mapping of their names, "
            f"got {type(tensors).__name__}"
        )
    if len(tensors) != len(NORMAL_STATS_SCHEMA):
        raise ValueError(
            f"tensors: expected {len(NORMAL_STATS_SCHEMA)} tensors (NORMAL_STATS_SCHEMA), "
            f"got {len(tensors)}"
        )
    out: dict[str, torch.Tensor] = {}
    for (name, (_, field)), t in zip(_NORMAL_STATS_FIELDS, tensors, strict=True):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int64:
            raise TypeError(f"{name}: expected dtype torch.int64, got {t.dtype}")
        length = 1 if field in ("duration_ns", "count") else ep_size
        if t.dim() != 1 or t.numel() != length or not t.is_contiguous():
            raise ValueError(
                f"{name}: expected a contiguous 1-D tensor of {length} values, "
                f"got shape {tuple(t.shape)}"
            )
        out[name] = t
    return out


# --------------------------------------------------------------------------- DeepXTrace's log


def _verdict(result: LowLatencyResult | None) -> dict[str, list[list[Any]]]:
    """DeepXTrace's result dict of one phase; an idle (rejected) window is DeepXTrace's
    all-zero matrix, which flags nothing."""
    if result is None:
        return {"abnormal_cols": [], "abnormal_rows": [], "abnormal_points": []}
    return {
        "abnormal_cols": [list(c) for c in result.abnormal_cols],
        "abnormal_rows": [list(r) for r in result.abnormal_rows],
        "abnormal_points": [list(p) for p in result.abnormal_points],
    }


class DeepXTraceLog:
    """DeepXTrace's per-rank log file, written from rankwatch's window reports (a publisher).

    ``diagnose_rank<rank>.log`` under ``log_path``, rotated at midnight keeping two old files,
    lines ``[<ISO time>.<ms>] <message>`` exactly as DeepXTrace writes them: per low-latency
    phase ``[Diagnose] InstanceID: <uuid> EPSize: <n>, diagnose: {...}, Dispatch Wait Recv Cost
    Per Token Matrix[src_rank, dst_rank]``, then with ``details`` one ``rank=<i> [<values>]``
    line per matrix row, the rows DeepXTrace's heatmap tool parses. Windows rejected before
    diagnosis (e.g. idle) and normal-mode windows are left to rankwatch's own log lines.
    """

    def __init__(
        self, log_path: str, rank: int, *, ep_size: int, instance_id: uuid.UUID, details: bool
    ) -> None:
        self.path = os.path.join(log_path, f"diagnose_rank{rank}.log")
        self.ep_size = ep_size
        self.instance_id = instance_id
        self.details = details
        self._lock = threading.Lock()
        self._handler: logging.Handler | None = None
        # An unusable log folder never stops training: the storage-fault policy (said once,
        # counted, retried on a schedule) covers opening the file as well as every line.
        self.guard = GuardedWrites(
            "deepxtrace_log", "DeepXTrace log lines", _LOG_PATH_ENV, log_path
        )
        handler = GuardedRotatingFileHandler(self.path, self.guard, backup_count=2)
        handler.setFormatter(
            logging.Formatter("[%(asctime)s.%(msecs)03d] %(message)s", "%Y-%m-%dT%H:%M:%S")
        )
        self._handler = handler

    def lines(self, report: WindowReport) -> list[str]:
        """The messages one report gives (without the time stamp)."""
        out: list[str] = []
        for phase in LOW_LATENCY_PHASES:
            result = (report.low_latency or {}).get(phase)
            if result is None:
                continue
            out.append(
                f"[Diagnose] InstanceID: {self.instance_id} EPSize: {self.ep_size}, diagnose: "
                f"{_verdict(result)}, {_PHASE_TITLES[phase]} Wait Recv Cost Per Token "
                "Matrix[src_rank, dst_rank]"
            )
            if self.details:
                for i, row in enumerate(np.asarray(result.matrix, dtype=np.int64).tolist()):
                    out.append(f"rank={i} [{' '.join(f'{v:8d}' for v in row)}]")
        return out

    def publish(self, report: WindowReport) -> None:
        """Append the report's lines to the file."""
        with self._lock:
            if self._handler is None:
                return
            for line in self.lines(report):
                self._handler.handle(
                    logging.makeLogRecord(
                        {"msg": line, "levelno": logging.INFO, "levelname": "INFO"}
                    )
                )

    def close(self, timeout_seconds: float) -> None:
        """Close the file (idempotent)."""
        with self._lock:
            if self._handler is not None:
                self._handler.close()
                self._handler = None


class _LateLog:
    """Publisher slot for the DeepXTrace log, filled once the collector knows rank and path."""

    def __init__(self) -> None:
        self.target: DeepXTraceLog | None = None

    def publish(self, report: WindowReport) -> None:
        if self.target is not None:
            self.target.publish(report)

    def close(self, timeout_seconds: float) -> None:
        if self.target is not None:
            self.target.close(timeout_seconds)


# --------------------------------------------------------------------------- Diagnose


def _deepxtrace_env(
    env: Mapping[str, str],
    interval: object,
    enable_default: str,
    enable_async: bool | None = None,
) -> dict[str, str]:
    """The environment rankwatch's configuration reads, with DeepXTrace's names and defaults
    translated: enable is on unless 0/false/off; the interval defaults to ``interval``;
    ``DEEPEP_DIAGNOSE_WARMING_TIME`` is the warm-up. With ``enable_async`` given (DeepXTrace's
    constructor) the mode is that argument and the warm-up defaults to the interval in
    asynchronous mode and is zero in synchronous mode, where DeepXTrace has none."""
    out = dict(env)
    enabled = env.get(_ENABLE_ENV, enable_default).strip().lower() not in _DEEPXTRACE_OFF
    out[_ENABLE_ENV] = "1" if enabled else "0"
    out.setdefault(_INTERVAL_ENV, str(interval))
    if WARMING_TIME_ENV in env:
        out[_WARMUP_ENV] = env[WARMING_TIME_ENV]
    if enable_async is not None:
        out[_ASYNC_ENV] = "1" if enable_async else "0"
        if enable_async:
            out.setdefault(_WARMUP_ENV, out[_INTERVAL_ENV])
        else:
            out[_WARMUP_ENV] = "0"
    return out


def _ll_verdicts(report: WindowReport | None) -> list[dict[str, list[list[Any]]]]:
    """DeepXTrace's return value: one result dict per phase (dispatch, combine)."""
    results = {} if report is None else (report.low_latency or {})
    return [_verdict(results.get(phase)) for phase in LOW_LATENCY_PHASES]


def _normal_verdicts(report: WindowReport | None) -> list[dict[str, Any]]:
    """One dict for the window: rankwatch's normal-mode report (probes, incidents), or
    ``{"status": "invalid", "reason": ...}`` when the window could not be diagnosed."""
    if report is not None and report.normal is not None:
        return [{"status": "ok", **report.normal.to_dict(include_arrays=False)}]
    reason = None if report is None else report.normal_invalid_reason
    return [{"status": "invalid", "reason": reason or "boundary"}]


class Diagnose:
    """DeepXTrace's ``Diagnose`` over rankwatch's DeepEP collector.

    Collective: every member of ``group`` constructs it at the same point. With
    ``DEEPEP_DIAGNOSE_ENABLE`` off (DeepXTrace's default is on) nothing is collected and the
    getters return None. Synchronous objects collect from construction; asynchronous ones from
    :meth:`start_async_diagnose`. ``collector`` is the rankwatch collector doing the work (None
    when disabled), for its ``latest_report``, ``recent_windows`` and the rest.
    """

    diagnose_matrix = staticmethod(diagnose_matrix)

    def __init__(
        self,
        group: dist.ProcessGroup,
        interval: int | float = _DEEPXTRACE_INTERVAL_SECONDS,
        enable_ll_diagnose: bool = True,
        enable_normal_diagnose: bool = False,
        enable_async: bool = False,
        snapshot_stream: Any = None,
    ) -> None:
        if not isinstance(enable_async, bool):
            raise TypeError(f"enable_async: expected a bool, got {enable_async!r}")
        if (
            isinstance(interval, bool)
            or not isinstance(interval, (int, float))
            or not 0 < interval < float("inf")
        ):
            raise ValueError(f"interval: must be a finite number of seconds > 0, got {interval!r}")
        env = _deepxtrace_env(os.environ, interval, "1", enable_async)
        self._setup(group, enable_ll_diagnose, enable_normal_diagnose, snapshot_stream, env)

    @classmethod
    def create_from_env(
        cls,
        group: dist.ProcessGroup,
        enable_ll_diagnose: bool = False,
        enable_normal_diagnose: bool = True,
        snapshot_stream: Any = None,
    ) -> Diagnose | None:
        """The normal-mode factory: None unless ``DEEPEP_DIAGNOSE_ENABLE`` is on (default
        off); ``DEEPEP_DIAGNOSE_ASYNC`` (default 1) picks the collection mode; the warm-up is
        ``DEEPEP_DIAGNOSE_WARMING_TIME`` (or ``DEEPEP_DIAGNOSE_WARMUP_SECONDS``, default 0).
        Collective."""
        env = _deepxtrace_env(os.environ, _DEEPXTRACE_INTERVAL_SECONDS, "0")
        obj = cls.__new__(cls)
        obj._setup(group, enable_ll_diagnose, enable_normal_diagnose, snapshot_stream, env)
        return obj if obj.collector is not None else None

    def _setup(
        self,
        group: dist.ProcessGroup,
        enable_ll_diagnose: bool,
        enable_normal_diagnose: bool,
        snapshot_stream: Any,
        env: Mapping[str, str],
    ) -> None:
        self._log = _LateLog()
        config = _installed_config
        if config is not None:
            try:
                config = dataclasses.replace(config, deepep=DeepEPConfig.from_env(env))
            except (TypeError, ValueError):
                # Let the factory read the same bad value: it reports it on every rank.
                config = None
        try:
            collector = _Collector.create_from_env(
                group,
                enable_ll_diagnose=enable_ll_diagnose,
                enable_normal_diagnose=enable_normal_diagnose,
                snapshot_stream=snapshot_stream,
                publishers=(*_installed_publishers, self._log),
                env=env,
                config=config,
            )
        except ValueError as exc:
            if WARMING_TIME_ENV in env and _WARMUP_ENV in str(exc):
                raise ValueError(f"{exc} (the value of {WARMING_TIME_ENV})") from exc
            raise
        self.collector = collector
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = group.size()
        self.stop_diagnose = threading.Event()
        self.enable_async = collector.enable_async if collector is not None else False
        self.enable_ll_diagnose = collector is not None and collector.enable_ll_diagnose
        self.enable_normal_diagnose = collector is not None and collector.enable_normal_diagnose
        self._normal_stats: tuple[torch.Tensor, ...] | None = None
        if collector is None:
            return
        deepep = collector.config
        low_latency = collector.low_latency_config
        self.interval = deepep.interval_seconds
        self.warm_time = deepep.warmup_seconds
        self.sync_step = deepep.sync_step
        self.enable_details = deepep.log_details
        self.thres_col = low_latency.thres_col
        self.thres_row = low_latency.thres_row
        self.thres_point = low_latency.thres_point
        self.excluding_zeros = low_latency.excluding_zeros
        self.instance_id = collector.get_instance_id()
        if collector.is_root:
            self._log.target = DeepXTraceLog(
                deepep.log_path,
                self.rank,
                ep_size=self.group_size,
                instance_id=self.instance_id,
                details=deepep.log_details,
            )
        if collector.counters.low_latency is not None:
            # DeepXTrace's documented attributes, for code that reads them directly.
            self.ll_dispatch_wait_recv_cost_stats = collector.counters.low_latency[0]
            self.ll_combine_wait_recv_cost_stats = collector.counters.low_latency[1]
        if collector.counters.normal is not None:
            views = bundle_views(collector.counters.normal, self.group_size, _NORMAL_STATS_ROWS)
            check_normal_stats_tensors(views, self.group_size)
            self._normal_stats = views
        if not self.enable_async:
            collector.start()  # DeepXTrace's synchronous calls need no start

    # ------------------------------------------------------------------ counters

    def get_stats_ll_stats_tensor(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The low-latency ``(dispatch, combine)`` cumulative int64[EP] receive-wait counters for
        ``low_latency_dispatch(dispatch_wait_recv_cost_stats=)`` /
        ``low_latency_combine(combine_wait_recv_cost_stats=)``, or ``(None, None)``."""
        if self.collector is None:
            return (None, None)
        return self.collector.get_stats_ll_stats_tensor()

    def get_stats_normal_stats_tensor(self) -> tuple[torch.Tensor | None, ...]:
        """The 15 normal-mode counters in :data:`NORMAL_STATS_SCHEMA` order (views into one
        int64 block), or 15 Nones when normal mode is off."""
        if self._normal_stats is None:
            return (None,) * len(NORMAL_STATS_SCHEMA)
        return self._normal_stats

    def get_normal_dispatch_stats_tensor(self) -> tuple[torch.Tensor, ...] | None:
        """The ten-tensor bundle of the normal dispatch (DeepXTrace pull request 17)."""
        return None if self.collector is None else self.collector.get_normal_dispatch_stats_tensor()

    def get_normal_combine_stats_tensor(self) -> tuple[torch.Tensor, ...] | None:
        """The five-tensor bundle of the normal combine (DeepXTrace pull request 17)."""
        return None if self.collector is None else self.collector.get_normal_combine_stats_tensor()

    def get_all_stats_tensor(self) -> np.ndarray | None:
        """Rank 0: the last low-latency window as ``[EP, 2, EP]`` (rows: reporting rank;
        dispatch, combine); None elsewhere or before one."""
        report = None if self.collector is None else self.collector.latest_report
        if report is None or not report.low_latency:
            return None
        return np.stack([report.low_latency[p].matrix for p in LOW_LATENCY_PHASES], axis=1)

    def get_instance_id(self) -> uuid.UUID | None:
        """The id every member of this instance shares (None when disabled)."""
        return None if self.collector is None else self.instance_id

    # ------------------------------------------------------------------ synchronous

    def diagnose_ll_sync(self, diagnose_step: int = 0) -> list[dict[str, Any]] | None:
        """Every ``diagnose_step`` (default ``DEEPEP_DIAGNOSE_SYNC_STEP``) calls, gather and
        diagnose the low-latency window: rank 0 gets ``[dispatch, combine]`` result dicts,
        the other ranks ``[]``; other calls return None. Every rank calls it at the same point."""
        return self._sync("low_latency", diagnose_step, _ll_verdicts)

    def diagnose_normal_sync(self, diagnose_step: int = 0) -> list[dict[str, Any]] | None:
        """Normal-mode counterpart of :meth:`diagnose_ll_sync`; rank 0 gets one dict with the
        window's probes and incidents."""
        return self._sync("normal", diagnose_step, _normal_verdicts)

    def _sync(self, part: str, diagnose_step: int, verdicts: Any) -> list[Any] | None:
        if self.collector is None:
            return None
        collected, report = self.collector.diagnose_sync_blocking(part, diagnose_step)
        if not collected:
            return None
        return verdicts(report) if self.collector.is_root else []

    # ------------------------------------------------------------------ lifecycle

    def start_async_diagnose(self) -> threading.Thread | None:
        """Start asynchronous collection; the collection thread (None when disabled)."""
        if self.collector is None:
            return None
        self.collector.start_async_diagnose()
        return self.collector.collector_thread

    def stop_async_diagnose(self) -> None:
        """Stop asynchronous collection on every member (after one final snapshot)."""
        if self.collector is None:
            return
        self.collector.stop_async_diagnose()
        self._closed()

    def start(self) -> None:
        """Start collecting (either mode; DeepXTrace pull request 17's name)."""
        if self.collector is not None:
            self.collector.start()

    def stop(self) -> None:
        """Stop collecting (either mode) and close the DeepXTrace log file."""
        if self.collector is not None:
            self.collector.stop()
            self._closed()

    def _closed(self) -> None:
        self.stop_diagnose.set()
        self._log.close(1.0)

"""The root side of one EP group's DeepEP diagnosis: cumulative snapshots in, reports out.

:class:`DeepEPRoot` forms windows from consecutive gathered snapshots
(:class:`~.snapshot.CounterWindows`), validates them, runs the normal-mode and
low-latency diagnosis, writes the log lines and NPZ artifacts, and hands each
:class:`WindowReport` to the publishers, all on a worker thread of its own so whoever feeds it
(the collection thread or the training thread) never waits. :class:`~.diagnose.Diagnose` runs one
on the group's root and feeds it the gathered snapshots; anything else that holds cumulative
counter blocks of a whole EP group (the demo's simulated group) can feed one directly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from rankwatch.diagnosis.config import LowLatencyConfig, NormalConfig, option_env
from rankwatch.diagnosis.deepep.artifact import ArtifactStore
from rankwatch.diagnosis.deepep.log_lines import LINE_PREFIX, invalid_window_line, normal_log_lines
from rankwatch.diagnosis.deepep.low_latency import LowLatencyResult, diagnose_low_latency
from rankwatch.diagnosis.deepep.normal import NormalDiagnoser
from rankwatch.diagnosis.deepep.normal.schema import counter_length
from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.exporter.config import DeepEPConfig
from rankwatch.exporter.deepep.windows import LOW_LATENCY_PHASES, CounterWindows, DeepEPWindow
from rankwatch.exporter.publish.protocol import Publisher, publish_to_all
from rankwatch.exporter.storage import GuardedFileHandler, GuardedWrites

if TYPE_CHECKING:  # torch stays out of the root's child process (root_child.py)
    from rankwatch.exporter.deepep.snapshot import PendingSnapshot

__all__ = ["HISTORY_WINDOWS", "DeepEPRoot", "RootBase", "RootSpec"]

# The log lines keep the logger name they always had, so existing log routing still applies.
log = logging.getLogger("rankwatch.exporter.deepep")
_LOG_PATH_ENV = option_env(DeepEPConfig, "log_path")

# Windows the root keeps for inspection and artifacts; bounded like every other history.
HISTORY_WINDOWS = 16
# Gathered snapshots waiting for the root's worker. A dropped snapshot loses nothing: the
# counters are cumulative, so the next window simply spans both intervals.
_QUEUE_DEPTH = 16
_STOP = object()
# The longest a blocking process() call waits for the snapshots queued before it.
_TURN_WAIT_SECONDS = 60.0


@dataclass(frozen=True)
class RootSpec:
    """One EP group's root: its members in group order (their count is the EP size), the
    counters' node layout, the settings, which engines run, its names, and where its log lines
    go (``deepep_diagnose_rank<log_rank>.log`` under the log path when ``log_to_file``).
    Both roots take one (:class:`DeepEPRoot`, and
    :class:`~.root_process.DeepEPRootProcess`, which hands it to its child)."""

    members: tuple[RankInfo, ...]
    ranks_per_node: int
    config: DeepEPConfig
    normal_config: NormalConfig
    low_latency_config: LowLatencyConfig
    normal: bool
    low_latency: bool
    instance_id: str
    group_name: str
    log_to_file: bool = False
    log_rank: int = 0
    run: str = ""

    def __post_init__(self) -> None:
        members = self.members
        if isinstance(members, (str, bytes)) or not isinstance(members, Sequence) or not members:
            raise ValueError(f"members: expected a non-empty sequence of RankInfo, got {members!r}")
        for member in members:
            if not isinstance(member, RankInfo):
                raise TypeError(f"members: expected RankInfo items, got {member!r}")
        object.__setattr__(self, "members", tuple(members))
        rpn = self.ranks_per_node
        if isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1 or len(members) % rpn:
            raise ValueError(
                f"ranks_per_node: must be a positive divisor of the EP size {len(members)}, "
                f"got {rpn!r}"
            )
        if not isinstance(self.group_name, str) or not self.group_name:
            raise ValueError(f"group_name: expected a non-empty string, got {self.group_name!r}")


class RootBase:
    """What both roots hold: the spec's fields as attributes, the publishers, the queue of
    snapshots waiting, the last report and the counts."""

    def __init__(self, spec: RootSpec, publishers: Sequence[Publisher], copy_stream: Any) -> None:
        if not isinstance(spec, RootSpec):
            raise TypeError(f"spec: expected a RootSpec, got {spec!r}")
        self.spec = spec
        self.ranks = spec.members
        self.ep_size = len(self.ranks)
        self.ranks_per_node = spec.ranks_per_node
        self.config = spec.config
        self.normal_config = spec.normal_config
        self.low_latency_config = spec.low_latency_config
        self.enable_normal_diagnose = spec.normal
        self.enable_ll_diagnose = spec.low_latency
        self.instance_id = spec.instance_id
        self.group_name = spec.group_name
        self.publishers = tuple(publishers)
        self._copy_stream = copy_stream
        self._lock = threading.Lock()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=_QUEUE_DEPTH)
        self._latest: WindowReport | None = None
        self.rejected_windows: Counter[str] = Counter()
        self.dropped_snapshots = 0

    @property
    def latest_report(self) -> WindowReport | None:
        """The last report published."""
        with self._lock:
            return self._latest

    def _queue_nowait(self, item: Any) -> bool:
        """Queue ``item`` for the root's thread without waiting; False (counted, said) when the
        queue is full. A dropped snapshot loses nothing: the next window spans both."""
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            self.dropped_snapshots += 1
            log.warning("DeepEP root is behind: dropped one snapshot (windows will merge)")
            return False


class DeepEPRoot(RootBase):
    """Windows, diagnosis, logs, artifacts and publishing for one EP group.

    ``members`` are the EP ranks in group order (their count is the EP size); ``log_rank`` names
    the log file (``deepep_diagnose_rank<log_rank>.log``) when ``log_to_file`` is set (see
    :class:`RootSpec`; :meth:`from_spec` builds one from it). Call :meth:`start`, then
    :meth:`submit` each gathered cumulative snapshot, then :meth:`stop`.
    """

    def __init__(
        self,
        *,
        members: Sequence[RankInfo],
        ranks_per_node: int,
        config: DeepEPConfig,
        normal_config: NormalConfig,
        low_latency_config: LowLatencyConfig,
        normal: bool,
        low_latency: bool,
        instance_id: str,
        group_name: str,
        publishers: Sequence[Publisher] = (),
        log_to_file: bool = False,
        log_rank: int = 0,
        run: str = "",
        copy_stream: Any = None,
    ) -> None:
        spec = RootSpec(
            members=tuple(members),
            ranks_per_node=ranks_per_node,
            config=config,
            normal_config=normal_config,
            low_latency_config=low_latency_config,
            normal=normal,
            low_latency=low_latency,
            instance_id=instance_id,
            group_name=group_name,
            log_to_file=log_to_file,
            log_rank=log_rank,
            run=run,
        )
        super().__init__(spec, publishers, copy_stream)
        # Windows are formed in order by one thread at a time: the worker, or a caller of
        # process() (DeepXTrace's synchronous calls return the window's results). Every
        # snapshot takes a ticket when it comes, and is formed in its ticket's turn: a blocking
        # call right after queued ones must not difference its snapshot before theirs (they
        # would then be rejected as stale).
        self._process_lock = threading.Lock()
        self._turns = threading.Condition()
        self._issued = 0  # tickets handed out
        self._served = 0  # the ticket whose turn it is
        self._skipped: set[int] = set()  # tickets of snapshots dropped before their turn
        self._worker: threading.Thread | None = None
        self._windows: CounterWindows | None = None
        self._normal_diagnoser: NormalDiagnoser | None = None
        self._log_handler: logging.Handler | None = None
        self._artifacts: ArtifactStore | None = None
        # Storage faults of the NPZ windows and the log file follow one policy (said once,
        # counted, retried on a schedule, never raised): rankwatch.exporter.storage.
        self.npz_guard: GuardedWrites | None = None
        self.log_guard: GuardedWrites | None = None
        self.recent_windows: deque[DeepEPWindow] = deque(maxlen=HISTORY_WINDOWS)

    @classmethod
    def from_spec(
        cls, spec: RootSpec, publishers: Sequence[Publisher] = (), copy_stream: Any = None
    ) -> DeepEPRoot:
        """The root ``spec`` describes."""
        if not isinstance(spec, RootSpec):
            raise TypeError(f"spec: expected a RootSpec, got {spec!r}")
        values = {f.name: getattr(spec, f.name) for f in fields(spec)}
        return cls(**values, publishers=publishers, copy_stream=copy_stream)

    def start(
        self,
        started_at_s: float,
        *,
        boundary_first: bool = False,
        first_window_index: int = 0,
        worker: bool = True,
    ) -> None:
        """Open the window builder (warm-up counts from ``started_at_s``), logs, artifacts and
        the worker thread. A root started again mid-run (the child of
        :mod:`.root_process`) takes ``boundary_first`` and numbers its windows from
        ``first_window_index``; without ``worker`` only :meth:`process_rows` feeds it."""
        self._windows = CounterWindows(
            self.ep_size,
            self.ranks_per_node,
            normal=self.enable_normal_diagnose,
            low_latency=self.enable_ll_diagnose,
            warmup_seconds=self.config.warmup_seconds,
            started_at_s=started_at_s,
            instance_id=self.instance_id,
            boundary_first=boundary_first,
        )
        self._windows.next_window_index = first_window_index
        if self.enable_normal_diagnose:
            self._normal_diagnoser = NormalDiagnoser(self.normal_config)
        self._attach_log_file()
        if self.config.export_npz:
            self.npz_guard = GuardedWrites(
                "deepep_npz", "DeepEP NPZ windows", _LOG_PATH_ENV, self.config.log_path
            )
            self.npz_guard.check_folder(self.config.log_path)
            self._artifacts = ArtifactStore(self.config.log_path, self.config.npz_retention)
        if not worker:
            return
        self._worker = threading.Thread(
            target=self._work, name="rankwatch-deepep-root", daemon=True
        )
        self._worker.start()

    def submit(self, parts: tuple[str, ...], pending: PendingSnapshot) -> None:
        """Queue one gathered cumulative snapshot (``parts``: which counter regions it holds,
        normal first). Never blocks: when the worker is behind the snapshot is dropped and
        counted, and the next window spans both intervals."""
        ticket = self._ticket()
        if not self._queue_nowait((ticket, parts, pending)):
            self._finish(ticket)

    def _ticket(self) -> int:
        with self._turns:
            self._issued += 1
            return self._issued - 1

    def _finish(self, ticket: int) -> None:
        """``ticket`` is done (formed, or dropped): the next ones' turn comes."""
        with self._turns:
            self._skipped.add(ticket)
            while self._served in self._skipped:
                self._skipped.discard(self._served)
                self._served += 1
            self._turns.notify_all()

    def _in_turn(
        self, ticket: int, parts: tuple[str, ...], pending: PendingSnapshot
    ) -> WindowReport | None:
        with self._turns:
            # Bounded: a worker that never gets there must not hold a caller forever (its
            # snapshot is then formed out of order, and a stale one is rejected by name).
            self._turns.wait_for(lambda: self._served >= ticket, _TURN_WAIT_SECONDS)
        try:
            return self._process(parts, pending)
        finally:
            self._finish(ticket)

    def stop(self, wait_seconds: float) -> None:
        """Finish what was queued (waiting at most ``wait_seconds``) and close the log file."""
        if self._worker is not None:
            with contextlib.suppress(queue.Full):
                self._queue.put(_STOP, timeout=wait_seconds)
            self._worker.join(wait_seconds)
        if self._log_handler is not None:
            log.removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            ticket, parts, pending = item
            try:
                self._in_turn(ticket, parts, pending)
            except Exception as exc:  # one bad window must not end diagnosis
                log.exception("DeepEP window processing failed: %s", exc)

    def process(self, parts: tuple[str, ...], pending: PendingSnapshot) -> WindowReport | None:
        """Form, diagnose and publish one snapshot's window on the calling thread; its report,
        or None when the snapshot was only a boundary. For callers that must return the
        results (DeepXTrace's synchronous calls); :meth:`submit` is the non-blocking way."""
        if self._windows is None:
            raise RuntimeError("DeepEPRoot.process: call start() first")
        return self._in_turn(self._ticket(), parts, pending)

    def _process(self, parts: tuple[str, ...], pending: PendingSnapshot) -> WindowReport | None:
        with self._process_lock:
            return self._process_locked(parts, pending)

    def _process_locked(
        self, parts: tuple[str, ...], pending: PendingSnapshot
    ) -> WindowReport | None:
        return self.process_rows(parts, pending.to_numpy(self._copy_stream), pending.taken_at_s)

    def process_rows(
        self, parts: tuple[str, ...], rows: np.ndarray, taken_at_s: float
    ) -> WindowReport | None:
        """Form, diagnose and publish the window of one gathered ``[EP, n]`` int64 block on the
        calling thread (``parts``: which counter regions it holds, normal first); its report, or
        None when the block was only a boundary."""
        if self._windows is None:
            raise RuntimeError("DeepEPRoot.process_rows: call start() first")
        ep = self.ep_size
        n_normal = counter_length(ep)
        offset = 0
        normal = low_latency = None
        if "normal" in parts:
            normal = rows[:, offset : offset + n_normal]
            offset += n_normal
        if "low_latency" in parts:
            n_ll = len(LOW_LATENCY_PHASES) * ep
            low_latency = rows[:, offset : offset + n_ll].reshape(ep, len(LOW_LATENCY_PHASES), ep)
        window = self._windows.feed(taken_at_s, normal=normal, low_latency=low_latency)
        if window is None:
            return None
        self.recent_windows.append(window)
        report = self._diagnose(window)
        self._publish(report)
        return report

    def _diagnose(self, window: DeepEPWindow) -> WindowReport:
        seconds: dict[str, float] = {}
        normal_report = None
        reason = window.normal_invalid_reason
        if reason is not None:
            self.rejected_windows[f"normal:{reason}"] += 1
            self._log_rejection(
                "normal", window.window_index, reason, window.normal_invalid_detail or reason
            )
        if window.normal is not None and self._normal_diagnoser is not None:
            t0 = time.perf_counter()
            try:
                normal_report = self._normal_diagnoser.diagnose(window.normal)
            except Exception as exc:
                reason = "diagnosis_error"
                self.rejected_windows[f"normal:{reason}"] += 1
                log.exception(
                    "normal-mode diagnosis of window %d failed: %s", window.window_index, exc
                )
            seconds["normal"] = time.perf_counter() - t0
        ll_results: dict[str, LowLatencyResult] | None = None
        ll_reason = None
        if window.low_latency_invalid_reason is not None:
            ll_reason = window.low_latency_invalid_reason
            self.rejected_windows[f"low_latency:{ll_reason}"] += 1
            self._log_rejection(
                "low_latency",
                window.window_index,
                ll_reason,
                window.low_latency_invalid_detail or ll_reason,
            )
        if window.low_latency is not None:
            t0 = time.perf_counter()
            ll_results = {
                phase: diagnose_low_latency(mat.astype(np.float64), phase, self.low_latency_config)
                for phase, mat in window.low_latency.items()
            }
            seconds["low_latency"] = time.perf_counter() - t0
        report = WindowReport(
            group=self.group_name,
            window_index=window.window_index,
            created_at_s=time.time(),
            ranks=self.ranks,
            run=self.spec.run,
            normal=normal_report,
            normal_invalid_reason=reason,
            low_latency=ll_results,
            low_latency_invalid_reason=ll_reason,
            diagnosis_seconds=seconds,
        )
        self._log_report(window, report)
        self._save_artifact(window, report)
        return report

    def _publish(self, report: WindowReport) -> None:
        with self._lock:
            self._latest = report
        publish_to_all(self.publishers, report, log)

    # ------------------------------------------------------------------ log lines

    def _prefix(self, window_index: int) -> str:
        return (
            f"{LINE_PREFIX} InstanceID: {self.instance_id} EPSize: {self.ep_size} "
            f"WindowIndex: {window_index}"
        )

    def _log_rejection(self, part: str, window_index: int, reason: str, detail: str) -> None:
        # An idle window is routine; a reset or a bad counter is worth a warning. A one-node
        # group has no normal-mode counters at all: said once, loudly, then counted quietly.
        quiet = reason == "empty_window" or (
            reason == "intranode_path" and self.rejected_windows[f"{part}:{reason}"] > 1
        )
        level = logging.DEBUG if quiet else logging.WARNING
        if part == "normal":
            line = invalid_window_line(self.instance_id, self.ep_size, window_index, reason, detail)
        else:
            payload = json.dumps({"reason": reason, "message": detail}, separators=(",", ":"))
            line = f"{self._prefix(window_index)} LowLatency invalid: {payload}"
        log.log(level, line)

    def _log_report(self, window: DeepEPWindow, report: WindowReport) -> None:
        if report.normal is not None:
            for line in normal_log_lines(
                report.normal,
                window.normal,
                details=self.config.log_details,
                instance_id=self.instance_id,
            ):
                log.info(line)
        for phase, result in (report.low_latency or {}).items():
            payload = json.dumps(result.to_dict(), separators=(",", ":"))
            log.info(f"{self._prefix(window.window_index)} LowLatency {phase}: {payload}")

    def _save_artifact(self, window: DeepEPWindow, report: WindowReport) -> None:
        store, normal, guard = self._artifacts, window.normal, self.npz_guard
        if store is None or normal is None or guard is None:
            return
        try:
            guard.run(
                store.directory, lambda: store.save(normal, report.normal), folder=store.directory
            )
        except ValueError as exc:  # a window the format cannot hold must not end diagnosis
            log.warning("DeepEP artifact of window %d not written: %s", window.window_index, exc)

    def _attach_log_file(self) -> None:
        # DeepXTrace writes its log lines to a file under DEEPEP_DIAGNOSE_LOG_PATH; do the same
        # when the variable is set, and otherwise leave the lines to the application's logging.
        if not self.spec.log_to_file:
            return
        path = os.path.join(self.config.log_path, f"deepep_diagnose_rank{self.spec.log_rank}.log")
        # An unusable log folder must not stop training: said once, the lines still go to the
        # application's logging, and the file is retried on the guard's schedule.
        self.log_guard = GuardedWrites(
            "deepep_log", "DeepEP log lines", _LOG_PATH_ENV, self.config.log_path
        )
        self.log_guard.check_folder(self.config.log_path)
        handler = GuardedFileHandler(path, self.log_guard)
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s"))
        handler.setLevel(logging.INFO)
        log.addHandler(handler)
        if log.level == logging.NOTSET or log.level > logging.INFO:
            log.setLevel(logging.INFO)
        self._log_handler = handler

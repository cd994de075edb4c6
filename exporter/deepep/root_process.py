"""The EP root's DeepEP windows off the training process: the root's handle on its child.

In a training process, the EP root's window work (the window's deltas and checks, the
normal-mode and low-latency diagnosis, the log lines, the NPZ files) holds the interpreter lock
that training needs, at a cost that grows with the EP size (``docs/benchmarks.md``,
``bench_deepep_root``). :class:`DeepEPRootProcess` has the interface of
:class:`~.root.DeepEPRoot` and does that work in ``python -m rankwatch.exporter.deepep.root_child``
instead: a sender thread turns each gathered snapshot into int64 rows and writes them raw to the
child's pipe (a frame naming shape and dtype, then the bytes: no Python objects per counter), the
child answers each one with its ``WindowReport``, and a relay thread hands the reports to this
process's publishers (the hub, ``/metrics``, OTLP, incidents stay here), as the step-time root's
relay does for the group's aggregator.

Faults. Training never waits on the child: :meth:`submit` only queues (a full queue drops the
snapshot and counts it; counters are cumulative, so the next window spans both). A child that
ends (killed, crashed) or leaves a snapshot unanswered for ``root_stall_seconds`` (stopped,
stuck) is said in one line, killed, and started again after a back-off (1 s doubling to 60 s);
its first snapshot is then a boundary. The snapshots it did not answer are windows that do not
come: one report per lost child says so (``normal_invalid_reason`` /
``low_latency_invalid_reason`` ``root_process_lost``), so ``/metrics`` counts the gap among the
invalid windows. :meth:`stop` is bounded by its timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rankwatch.diagnosis.report import WindowReport
from rankwatch.exporter.child_frames import FrameReader, frame
from rankwatch.exporter.child_pipe import Backoff, ChildPipe
from rankwatch.exporter.config import DeepEPConfig
from rankwatch.exporter.deepep.root import RootBase, RootSpec
from rankwatch.exporter.deepep.root_child import SNAPSHOT_DTYPE, RootSetup
from rankwatch.exporter.deepep.windows import DeepEPWindow
from rankwatch.exporter.publish.protocol import Publisher, publish_to_all
from rankwatch.exporter.storage import child_storage_errors

if TYPE_CHECKING:
    from rankwatch.exporter.deepep.snapshot import PendingSnapshot

__all__ = ["LOST_REASON", "DeepEPRootProcess", "runs_off_process"]

log = logging.getLogger("rankwatch.exporter.deepep")

_MODULE = "rankwatch.exporter.deepep.root_child"
# The invalid-window reason of the windows a lost child did not answer.
LOST_REASON = "root_process_lost"
_RELAY_POLL_SECONDS = 5.0  # the relay looks at unanswered snapshots at least this often
_STOP = object()


def runs_off_process(config: DeepEPConfig, ep_size: int) -> bool:
    """Whether an EP group of ``ep_size`` ranks has its root's window work in a child process
    (``root_process_min_ep``: from that size on; 0 never)."""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size: must be a positive int, got {ep_size!r}")
    least = config.root_process_min_ep
    return least > 0 and ep_size >= least


class DeepEPRootProcess(RootBase):
    """:class:`~.root.DeepEPRoot`'s work for one EP group, in a child process (see the module
    docstring), described by ``spec`` as a :class:`~.root.DeepEPRoot` is. The same calls:
    :meth:`start`, :meth:`submit` each gathered cumulative snapshot, :meth:`stop`. The windows
    stay in the child: :attr:`recent_windows` is always empty here, :attr:`rejected_windows` is
    the child's count as of its last answer.
    """

    def __init__(
        self, spec: RootSpec, publishers: Sequence[Publisher] = (), copy_stream: Any = None
    ) -> None:
        super().__init__(spec, publishers, copy_stream)
        self.recent_windows: deque[DeepEPWindow] = deque(maxlen=0)
        self._rejected_before: Counter[str] = Counter()  # of the children that ended
        self.lost_snapshots = 0  # sent to a child that ended before answering, or to none
        self.restarts = 0
        self.snapshot_bytes = 0  # the last snapshot's raw bytes through the pipe
        self._answered = threading.Condition(self._lock)
        self._unanswered: dict[int, float] = {}  # seq -> when it was sent (monotonic)
        self._reports: dict[int, WindowReport | None] = {}  # answers process() waits for
        self._waiting: set[int] = set()
        self._seq = 0
        self._next_index = 0
        self._started_at_s = 0.0
        self._child_started = 0.0
        self._ready_at: float | None = None  # when the current child was ready
        self._backoff = Backoff()
        self._pipe: ChildPipe | None = None
        self._stopping = False
        self._killed_stuck = False
        self._done = threading.Event()
        self._sender: threading.Thread | None = None
        self._relay: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id (None between a lost child and its successor)."""
        pipe = self._pipe
        return None if pipe is None else pipe.pid

    @property
    def ready(self) -> bool:
        """The current child has read its setup and waits for snapshots."""
        return self._ready_at is not None

    def start(self, started_at_s: float) -> None:
        """Start the child (warm-up counts from ``started_at_s``), the sender and the relay."""
        self._started_at_s = started_at_s
        try:
            self._spawn(boundary_first=False)
        except OSError as exc:  # training goes on; the relay tries once more after a back-off
            log.warning(
                "DeepEP root child cannot start: %s; no DeepEP windows until it does: trying "
                "again in %.0f s",
                exc,
                self._backoff.upcoming(self._child_started),
            )
        self._sender = threading.Thread(
            target=self._send_loop, name="rankwatch-deepep-send", daemon=True
        )
        self._relay = threading.Thread(
            target=self._relay_loop, name="rankwatch-deepep-relay", daemon=True
        )
        self._sender.start()
        self._relay.start()

    def submit(self, parts: tuple[str, ...], pending: PendingSnapshot) -> None:
        """Queue one gathered cumulative snapshot for the child; never blocks (a full queue
        drops it, counted: the next window spans both intervals)."""
        self._enqueue(parts, pending, wait=False)

    def _enqueue(self, parts: tuple[str, ...], pending: PendingSnapshot, wait: bool) -> int | None:
        with self._lock:
            self._seq += 1
            seq = self._seq
            if wait:  # before the sender can see it: its answer must find the waiter
                self._waiting.add(seq)
        if self._queue_nowait((seq, parts, pending)):
            return seq
        with self._lock:
            self._waiting.discard(seq)
        return None

    def process(self, parts: tuple[str, ...], pending: PendingSnapshot) -> WindowReport | None:
        """The snapshot's window formed, diagnosed and published by the child, waited for at
        most ``root_stall_seconds`` (DeepXTrace's synchronous calls); None when it was only a
        boundary, or did not come in time."""
        if self._sender is None:
            raise RuntimeError("DeepEPRootProcess.process: call start() first")
        seq = self._enqueue(parts, pending, wait=True)
        if seq is None:
            return None
        deadline = time.monotonic() + self.config.root_stall_seconds
        with self._answered:
            while seq not in self._reports:
                left = deadline - time.monotonic()
                if left <= 0 or not self._answered.wait(left):
                    break
            self._waiting.discard(seq)
            return self._reports.pop(seq, None)

    def stop(self, wait_seconds: float) -> None:
        """Let the child answer what was queued and end, within ``wait_seconds`` (else it is
        killed); the threads end with it."""
        if self._sender is None or self._stopping:
            return
        deadline = time.monotonic() + wait_seconds
        self._stopping = True
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=max(0.0, wait_seconds))
        if not self._done.wait(max(0.0, deadline - time.monotonic())):
            log.warning(
                "DeepEP root child (pid %s) did not end within %.1f s; killed it",
                self.pid,
                wait_seconds,
            )
        pipe = self._pipe
        if pipe is not None:
            pipe.kill()
        for thread in (self._sender, self._relay):
            if thread is not None:
                thread.join(max(0.05, deadline - time.monotonic()))

    # ---- the child's life ------------------------------------------------------------------

    def _spawn(self, *, boundary_first: bool) -> None:
        self._child_started = time.monotonic()
        self._ready_at = None
        setup = RootSetup(
            spec=self.spec,
            started_at_s=self._started_at_s,
            boundary_first=boundary_first,
            first_window_index=self._next_index,
            log_level=log.getEffectiveLevel(),
        )
        pipe = ChildPipe.spawn(_MODULE)
        pipe.write(frame(setup))
        self._pipe = pipe

    # ---- the sender thread -----------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            pipe = self._pipe
            if item is _STOP:
                if pipe is None or not pipe.write(frame(("stop",))):
                    self._done.set()  # no child to wait for
                return
            seq, parts, pending = item
            try:
                # The gathered block's own memory when it can be (a 72 MiB block at EP 1,024:
                # a copy would cost the training process ~0.1 s of CPU).
                rows = np.ascontiguousarray(
                    pending.to_numpy(self._copy_stream, copy=False), dtype=np.int64
                )
            except Exception as exc:  # a snapshot that cannot be read must not end the sender
                log.exception("DeepEP snapshot could not be read: %s", exc)
                self._answer(seq, None)
                continue
            header = (
                "snapshot",
                seq,
                parts,
                float(pending.taken_at_s),
                rows.shape,
                SNAPSHOT_DTYPE,
                rows.nbytes,
            )
            with self._lock:
                self._unanswered[seq] = time.monotonic()
            # Two writes, one frame: the header is small, the rows go from their own memory.
            sent = pipe is not None and pipe.write(frame(header)) and pipe.write(rows.data)
            self.snapshot_bytes = rows.nbytes
            if not sent:
                # No child, or it ended while we wrote: this window will not come. The relay
                # counts what a lost child left unanswered.
                with self._lock:
                    if self._unanswered.pop(seq, None) is not None:
                        self.lost_snapshots += 1
                self._answer(seq, None)
                if self._stopping:  # stop() killed the child: nothing more can be sent
                    return

    # ---- the relay thread ------------------------------------------------------------------

    def _relay_loop(self) -> None:
        while True:
            pipe = self._pipe
            if pipe is not None:  # None: the first child could not start
                self._read_child(pipe)
                # The child ended.
                pipe.reap()
                if self._stopping:
                    self._done.set()
                    return
                self._child_lost(pipe)
            if not self._restart():
                self._done.set()
                return

    def _read_child(self, pipe: ChildPipe) -> None:
        """Read the child's answers until its end of the pipe closes; meanwhile kill it once
        a snapshot waits longer than the stall budget."""
        reader = FrameReader()
        fd = pipe.from_child
        assert fd is not None
        poll = min(_RELAY_POLL_SECONDS, self.config.root_stall_seconds / 4)
        while True:
            try:
                ready, _, _ = select.select([fd], [], [], poll)
                chunk = os.read(fd, 1 << 20) if ready else None
            except OSError:
                chunk = b""
            if chunk is None:
                self._watch(pipe)
                continue
            if not chunk:
                return
            reader.feed(chunk)
            for message in reader.frames():
                self._handle(message)

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "answer":
            _, seq, report, rejected, counts = message
            child_storage_errors("deepep_root", counts)
            with self._lock:
                self._unanswered.pop(seq, None)
                self.rejected_windows = self._rejected_before + Counter(rejected)
            if report is not None:
                self._deliver(report)
            self._answer(seq, report)
        elif kind == "ready":
            self._ready_at = time.monotonic()
        elif kind == "log":
            _, level, name, text = message
            logging.getLogger(name).log(level, "%s", text)
        elif kind == "done":
            child_storage_errors("deepep_root", message[1])
            if self._stopping:
                self._done.set()

    def _answer(self, seq: int, report: WindowReport | None) -> None:
        with self._answered:
            if seq in self._waiting:
                self._reports[seq] = report
                self._answered.notify_all()

    def _deliver(self, report: WindowReport) -> None:
        with self._lock:
            self._latest = report
            self._next_index = report.window_index + 1
        publish_to_all(self.publishers, report, log)

    def _watch(self, pipe: ChildPipe) -> None:
        if self._stopping:
            return
        with self._lock:
            oldest = min(self._unanswered.values(), default=None)
        if oldest is None:
            return
        # A snapshot sent while the child was starting waits from when it was ready (its
        # start-up, numpy's import, counts against the budget until then).
        waited = time.monotonic() - max(oldest, self._ready_at or self._child_started)
        if waited > self.config.root_stall_seconds:
            self._killed_stuck = True
            log.warning(
                "DeepEP root child (pid %s) has not answered a snapshot for %.0f s; killed it: "
                "no DeepEP windows until it is back, starting it again in %.0f s",
                pipe.pid,
                waited,
                self._backoff.upcoming(self._child_started),
            )
            pipe.kill()

    def _child_lost(self, pipe: ChildPipe) -> None:
        """One line (unless the stall watch said it), and one report naming the gap."""
        if not self._killed_stuck:
            log.warning(
                "DeepEP root child (pid %s) ended (status %s); no DeepEP windows until it is "
                "back: starting it again in %.0f s",
                pipe.pid,
                pipe.returncode,
                self._backoff.upcoming(self._child_started),
            )
        self._killed_stuck = False
        with self._lock:
            lost = list(self._unanswered)
            self._unanswered.clear()
            self.lost_snapshots += len(lost)
            self._rejected_before = Counter(self.rejected_windows)
            index = self._next_index
        for seq in lost:
            self._answer(seq, None)
        normal, low = self.enable_normal_diagnose, self.enable_ll_diagnose
        self._deliver(
            WindowReport(
                group=self.group_name,
                window_index=index,
                created_at_s=time.time(),
                ranks=self.ranks,
                run=self.spec.run,
                normal_invalid_reason=LOST_REASON if normal else None,
                low_latency_invalid_reason=LOST_REASON if low else None,
            )
        )
        with self._lock:
            for part, on in (("normal", normal), ("low_latency", low)):
                if on:
                    self._rejected_before[f"{part}:{LOST_REASON}"] += 1
            self.rejected_windows = Counter(self._rejected_before)

    def _restart(self) -> bool:
        """A new child after the back-off (its first snapshot a boundary); False when stopping
        meanwhile, or when it cannot start."""
        self._pipe = None
        if not self._backoff.wait(self._child_started, lambda: self._stopping):
            return False
        try:
            self._spawn(boundary_first=True)
        except OSError as exc:
            log.warning("DeepEP root child cannot start again: %s; no more DeepEP windows", exc)
            return False
        self.restarts += 1
        log.info("DeepEP root child is back (pid %s); windows resume", self.pid)
        return True

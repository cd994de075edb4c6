"""Every rank's hang watcher: a background thread (``rankwatch-hang-<rank>``) that notices when
its training thread stopped progressing and then says where it is.

While the job progresses it costs a look at a few of the timer's attributes every
``hang_poll_seconds`` and ships nothing. Once this rank has not progressed for a third of its
budget (:data:`SUSPECT_FRACTION`) it builds its record (:mod:`.record`: phase, the
collective it is blocked in, group sequence numbers, the training thread's top frames) and
writes it as JSON under ``hang/<rank>`` in the c10d store of rankwatch's own group, every poll,
with a beat counter; the store is served by a thread of its own in the store host's process,
so this works while every training thread waits in a collective of the job's own groups. Once
the rank progresses again it keeps writing until it has finished a step, so the root sees the
job move on. With ``artifact_dir`` set the same record (and its frames) is kept in
``hang-rank<R>-<pid>.json`` while the rank is suspect, refreshed on SIGTERM
(:mod:`.file`), and removed when the rank progresses again.

When the rank closes rankwatch, or its interpreter exits without an uncaught error, it writes a
last record that says it *left*: the root then never calls it dead, and opens a hang for it only
when a living rank waits for it (see :mod:`rankwatch.diagnosis.hang.classify`).

On the root the same thread runs the group's hang loop (:class:`.hang_root.HangRoot`); on the
others it stands in for a root that is gone (:class:`.hang_standin.StandIn`).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from types import FrameType
from typing import Any

from rankwatch.diagnosis.hang import Collective, RankRecord
from rankwatch.diagnosis.step_time.table import column
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.gloo import own_group_names
from rankwatch.exporter.hang.file import HangFileWriter
from rankwatch.exporter.hang.finished_calls import FinishedCalls
from rankwatch.exporter.hang.record import (
    CallsInFlight,
    DeviceWaitClock,
    GroupSeqs,
    collective_in_frames,
    current_phase,
    frame_lines,
    long_work_in_frames,
)
from rankwatch.exporter.step_time.timer import StepTimer

__all__ = ["SUSPECT_FRACTION", "HangWatcher", "record_key"]

log = logging.getLogger(__name__)

# A rank writes its record once it has not progressed for this share of its budget, so the
# root has fresh records (and frames) when the budget runs out.
SUSPECT_FRACTION = 1.0 / 3.0
_STEP_COL = column("cpu", "step")
_HISTORY_STEPS = 64  # the newest steps whose median raises the budget
_HISTORY_EVERY_SECONDS = 5.0
# Polls a rank that progresses again keeps writing when it finishes no step.
_RECOVERY_POLLS = 20
# A budget that moved by more than this factor since the last record is written at once.
_BUDGET_CHANGE = 1.25


def record_key(rank: int) -> str:
    """The store key of ``rank``'s hang record (under rankwatch's group prefix)."""
    return f"hang/{rank}"


def pid_namespace() -> int:
    """An id of this process's pid namespace (0 when unknown): pids compare only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class HangWatcher:
    """The hang watcher of one rank (see the module docstring). ``store``: rankwatch's own
    group's store (None: a group of one, nothing shipped). ``root``: the group's hang loop,
    on the root only, called every poll with this rank's record. ``standin``: on the other
    ranks, a :class:`.hang_standin.StandIn`, called every poll while this rank is suspect."""

    def __init__(
        self,
        rank: int,
        timer: StepTimer,
        config: RankwatchConfig,
        store: Any,
        host: str,
        training_thread: int,
        root: Any = None,
        on_suspect: Callable[[RankRecord | None], None] | None = None,
        file: HangFileWriter | None = None,
        standin: Any = None,
    ) -> None:
        self.rank, self.timer, self.config, self.store = rank, timer, config, store
        self.host = host
        self.training_thread = training_thread
        self.root = root
        self.standin = standin
        self.on_suspect = on_suspect
        self.file = file
        self.groups = GroupSeqs()
        self.calls_in_flight = CallsInFlight()
        self.device_waits = DeviceWaitClock()
        self.pid = os.getpid()
        self.pidns = pid_namespace()
        self._beat = 0
        self._stop = threading.Event()
        self._marks = -1
        self._progress_ns = time.perf_counter_ns()
        self._median_step_seconds = 0.0
        self._history_at = 0.0
        self.suspect = False  # this rank has shipped a suspect record and not yet recovered
        self._steps_at_suspect = 0
        self._recovering = 0  # polls written since the rank progressed again
        self.latest: RankRecord | None = None
        self._budget_sent = 0.0  # the budget in the last record written
        # The last collective that raised on the training thread, and the steps written then
        # (reported until the next step: an old failure says nothing of a later hang).
        self.failed: tuple[Collective | None, int] = (None, -1)
        self.finished = FinishedCalls()
        timer.on_wait_error = self._wait_failed
        timer.on_wait_done = self.finished.note
        self._thread = threading.Thread(
            target=self._run, name=f"rankwatch-hang-{rank}", daemon=True
        )
        if store is not None:
            first = self._record(time.perf_counter_ns(), frames=False)
            self._budget_sent = first.budget_seconds
            self._write(first)

    def start(self) -> None:
        self._thread.start()
        atexit.register(self._at_exit)

    def stop(self, timeout_seconds: float, *, how: str = "closed rankwatch") -> None:
        """End the thread (bounded), then tell the root this rank left (``how``)."""
        atexit.unregister(self._at_exit)
        deadline = time.monotonic() + max(0.0, timeout_seconds)
        self._stop.set()
        if self.timer.on_wait_error == self._wait_failed:
            self.timer.on_wait_error = None
        if self.timer.on_wait_done == self.finished.note:
            self.timer.on_wait_done = None
        if self._thread.is_alive():
            self._thread.join(max(0.0, deadline - time.monotonic()))
        if self.store is not None and not self._thread.is_alive():
            self._leave(how, max(0.05, deadline - time.monotonic()))

    def _at_exit(self) -> None:
        """The interpreter exits without ``close()``: a rank that ends normally left; one ended
        by an uncaught error did not (the root names it dead once its process is gone)."""
        if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None):
            self._stop.set()
            return
        self.stop(1.0, how="its process exited")

    def _leave(self, how: str, timeout_seconds: float) -> None:
        """The last record, marked as left, written from a helper thread so that a store that
        stopped answering cannot hold up the close or the exit beyond ``timeout_seconds``."""
        record = self._record(time.perf_counter_ns(), frames=False, calls=True)
        writer = threading.Thread(
            target=self._write, args=(record, how), name=f"rankwatch-left-{self.rank}", daemon=True
        )
        writer.start()
        writer.join(timeout_seconds)

    # ---- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        poll = self.config.hang_poll_seconds
        wait = poll
        while not self._stop.wait(wait):
            wait = poll
            try:
                self.tick()
            except Exception:  # the watcher must never take training down with it
                log.exception("rankwatch: rank %d hang watcher failed; it stops", self.rank)
                return
            loop = self.loop
            if loop is not None:
                # The root looks again when the group's budget runs out, if that is sooner.
                wait = min(poll, max(0.01, loop.next_check - time.monotonic()))

    @property
    def loop(self) -> Any:
        """The group's hang loop this rank runs: the root's, or a stand-in's once the root is
        gone (None otherwise)."""
        if self.root is not None:
            return self.root
        if self.standin is not None and self.standin.acting:
            return self.standin.loop
        return None

    def tick(self) -> None:
        """One look: progress, suspicion, the record shipped, and on the root its loop."""
        now = time.perf_counter_ns()
        timer = self.timer
        marks = timer.marks
        if marks != self._marks:
            self._marks, self._progress_ns = marks, now
        stalled = (now - self._progress_ns) / 1e9
        budget = self.budget_seconds(now)
        record: RankRecord | None = None
        if stalled >= budget * SUSPECT_FRACTION:
            if not self.suspect:
                self.suspect = True
                self._steps_at_suspect = timer.written
            self._recovering = 0
            record = self._record(now, frames=True)
        elif self.suspect:
            # Progressing again: keep saying so until a step is finished (or for a bounded
            # number of polls: an evaluation loop finishes no step), then stop.
            record = self._record(now, frames=False)
            self._recovering += 1
            if timer.written > self._steps_at_suspect or self._recovering > _RECOVERY_POLLS:
                self.suspect = False
                if self.file is not None:
                    self.file.remove()
        elif not (
            self._budget_sent / _BUDGET_CHANGE <= budget <= self._budget_sent * _BUDGET_CHANGE
        ):
            # The budget moved (a declared long phase, warm-up over, an epoch's first batch):
            # the root judges the group by every rank's budget, so it must know.
            record = self._record(now, frames=False)
        if record is not None:
            self._budget_sent = record.budget_seconds
            self.latest = record
            if self.store is not None:
                self._write(record)
            if self.on_suspect is not None:
                self.on_suspect(record if self.suspect else None)
        if self.root is not None:
            self.root.tick(self._record(now, frames=False) if record is None else record)
        elif self.standin is not None and (self.suspect or self.standin.acting):
            # A suspect rank looks whether the root is gone (and then stands in for it).
            self.standin.tick(self._record(now, frames=False) if record is None else record)
        if self.suspect and record is not None and self.file is not None:
            self.write_file("suspect", force=False)

    def write_file(self, reason: str, *, force: bool) -> None:
        """This rank's hang record file (its record first; on the root, every rank's as last
        seen and the open verdict)."""
        if self.file is None or self.latest is None:
            return
        records = [self.latest]
        verdict = None
        loop = self.loop
        if loop is not None:
            records += [r for r in loop.seen if r.rank != self.rank]
            verdict = loop.open_evidence
        self.file.write(records, verdict, reason, force=force)

    def on_sigterm(self) -> None:
        """SIGTERM: refresh the file of a suspect rank (the handler's job, main thread)."""
        if self.suspect:
            self.write_file("sigterm", force=True)

    def budget_seconds(self, now_ns: int) -> float:
        """This rank's budget now: the configured one, raised to ``hang_step_multiple`` times
        the median of its newest steps, to the warm-up budget before ``hang_warmup_steps``
        steps and while an epoch's first batch is awaited, and to a declared phase's own."""
        cfg, timer = self.config, self.timer
        budget = cfg.hang_budget_seconds
        mono = time.monotonic()
        if mono - self._history_at >= _HISTORY_EVERY_SECONDS:
            self._history_at = mono
            self._median_step_seconds = _median_step_seconds(timer)
        budget = max(budget, cfg.hang_step_multiple * self._median_step_seconds)
        if timer.written < cfg.hang_warmup_steps or timer.first_fetch:
            budget = max(budget, cfg.hang_warmup_budget_seconds)
        for _, declared, _ in list(timer.declared):
            budget = max(budget, declared)
        return budget

    def _record(self, now_ns: int, *, frames: bool, calls: bool = False) -> RankRecord:
        """This rank's record now; with ``frames`` its frames and the collective it is in;
        with ``frames`` or ``calls`` its groups' sequence numbers and finished calls."""
        timer = self.timer
        phase, phase_seconds = current_phase(timer, now_ns, self._progress_ns)
        top: list[str] = []
        note = ""
        collective = None
        crossing = False
        budget = self.budget_seconds(now_ns)
        if frames:
            frame = sys._current_frames().get(self.training_thread)
            if frame is None:
                note = "stack unavailable: the training thread has ended"
            else:
                top = frame_lines(frame, self.config.hang_stack_frames)
                # A checkpoint being written or a recompilation, seen in the frames: a long
                # phase of its own, with its budget (the group's, through this record).
                work = long_work_in_frames(frame)
                if work and not timer.declared:
                    phase = work
                    budget = max(
                        budget,
                        self.config.hang_checkpoint_budget_seconds
                        if work == "checkpoint"
                        else self.config.hang_warmup_budget_seconds,
                    )
                wait_start = timer._sync_wait._start
                in_wait = wait_start >= 0
                entered = (now_ns - wait_start) / 1e9 if in_wait else phase_seconds
                look = self._beat
                in_flight = None if in_wait else partial(self.calls_in_flight.check, look)
                try:
                    collective = collective_in_frames(frame, self.groups.seq_of, entered, in_flight)
                except Exception as exc:  # a frame's arguments unreadable: frames still go
                    note = f"collective unreadable: {type(exc).__name__}"
                crossing = self.calls_in_flight.refused_look == look
            del frame
            if collective is None:
                collective = self._device_collective(now_ns)
        self._beat += 1
        seqs, sizes = self.groups.read() if frames or calls else ({}, {})
        finished = self.finished.calls(own_group_names()) if frames or calls else ()
        return RankRecord(
            rank=self.rank,
            host=self.host,
            pid=self.pid,
            phase=phase,
            phase_seconds=round(phase_seconds, 3),
            stalled_seconds=round((now_ns - self._progress_ns) / 1e9, 3),
            since_step_seconds=round(max(0.0, now_ns - timer.step_end_ns) / 1e9, 3),
            steps=timer.written,
            budget_seconds=budget,
            collective=collective,
            failed_collective=self.failed[0] if self.failed[1] == timer.written else None,
            group_seqs=seqs,
            group_sizes=sizes,
            finished_calls=finished,
            frames=tuple(top),
            frames_note=note,
            crossing_call=crossing,
        )

    def _wait_failed(self, frame: FrameType) -> None:
        """A timed collective wait raised on the training thread: which call it was."""
        try:
            found = collective_in_frames(frame, self.groups.seq_of, None)
        except Exception:  # unreadable: the error goes on to the caller as it was
            found = None
        written = self.timer.written
        # A sync wait the user opened around the call sees the error after the shadow
        # inside it has read the call: its frames no longer show it, so it keeps that one.
        if found is not None or self.failed[1] != written:
            self.failed = (found, written)

    def _device_collective(self, now_ns: int) -> Collective | None:
        """On the GPU clock: the collective the device has been inside for at least a third
        of the budget (its group and op unseen from here: the default group's number)."""
        gpu = self.timer.gpu
        if gpu is None:
            return None
        seconds = self.device_waits.seconds(gpu.wait_markers(), now_ns / 1e9)
        if seconds is None or seconds < self.budget_seconds(now_ns) * SUSPECT_FRACTION:
            return None
        found = self.groups.seq_of(None)
        group, seq = found if found is not None else ("", 0)
        return Collective(group=group, op="device_wait", seq=seq, seconds=round(seconds, 3))

    def _write(self, record: RankRecord, left: str = "") -> None:
        payload = record.to_dict()
        payload["beat"] = self._beat
        payload["pidns"] = self.pidns
        payload["written_at_s"] = time.time()  # the root ages the record by it (bounded)
        if left:
            payload["left"] = left
        try:
            self.store.set(record_key(self.rank), json.dumps(payload))
        except Exception as exc:  # the store is gone: the root will name this rank silent
            log.debug("rankwatch: rank %d cannot write its hang record: %s", self.rank, exc)


def _median_step_seconds(timer: StepTimer) -> float:
    """Median step time of the newest steps the timer wrote (0.0 before any)."""
    written = timer.written
    n = min(written, _HISTORY_STEPS, timer.capacity)
    rows = timer._rows
    values = []
    for i in range(written - n, written):
        row = rows[i % timer.capacity]
        if row is not None:
            ms = row[_STEP_COL]
            if ms == ms:
                values.append(ms)
    return statistics.median(values) / 1e3 if values else 0.0

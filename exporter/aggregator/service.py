"""The aggregator's loop: intake, windows, files and answers, on one thread.

It runs in a child process of the group's root (:mod:`.process` starts it; a group of one runs
it on a thread instead: nothing there grows with ranks). One selector waits on the listening
socket, every rank's connection and the control pipe from the root's process; each turn reads
what is ready, feeds :class:`~.windows.GroupWindows`, and when a window is due diagnoses it,
saves its file (``artifact_dir``), sends the root's process the report bounded to
``rank_budget`` ranks (:mod:`.bounded`), and in a larger group answers each rank with its own
means. It writes the progress board (:mod:`.board`) as ranks move.

Control frames (:mod:`rankwatch.exporter.child_frames`), from the root's process: ``mesh``
(the job's device mesh), ``hang`` (a hang report to number and send back in window order),
``stop`` (wait for the final shipments, then the summary window, then ``done`` and end). To
it: ``listening`` (the intake's address), ``report``, ``log`` (process mode: the child's log
records, re-logged by the parent through the job's logging), ``done``.
"""

from __future__ import annotations

import logging
import os
import selectors
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.diagnosis.step_time.mesh import MeshLayout
from rankwatch.diagnosis.step_time.report import RANK_MEAN_KEYS
from rankwatch.exporter.aggregator.board import CONNECTED, FINAL, HUNG_UP, REFUSED, ProgressBoard
from rankwatch.exporter.aggregator.bounded import bounded_report
from rankwatch.exporter.aggregator.intake import Event, Intake, raise_open_file_limit
from rankwatch.exporter.aggregator.windows import GroupWindows, Window
from rankwatch.exporter.aggregator.wire import Blocks, Rows, encode_own
from rankwatch.exporter.child_frames import FrameReader, frame
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.step_time.artifacts import StepArtifactWriter
from rankwatch.exporter.storage import storage_error_counts

__all__ = ["ServiceSetup", "run_service"]

log = logging.getLogger(__name__)

_BOARD_SECONDS = 0.1  # the board is written at most this often (and at every window)


@dataclass(frozen=True)
class ServiceSetup:
    """Everything the aggregator needs from the root's process (pickled to a child)."""

    config: RankwatchConfig
    ranks: tuple[int, ...]
    token: str
    host: str
    board_fd: int
    first_window_index: int = 0
    mesh: MeshLayout | None = None
    process: bool = True  # a child process (else a thread of the root's process)
    log_level: int = logging.INFO  # the root process's level for rankwatch's loggers


class _Service:
    def __init__(self, setup: ServiceSetup, control_in: int, control_out: int) -> None:
        self.setup = setup
        self.config = setup.config
        self.root = setup.ranks[0]
        self.budget = setup.config.root_rank_budget
        self.control_in, self.control_out = control_in, control_out
        self.selector = selectors.DefaultSelector()
        limit = raise_open_file_limit() if setup.process else None
        self.intake = Intake(setup.host, setup.token, setup.ranks, self.selector, file_limit=limit)
        self.windows = GroupWindows(
            setup.ranks, setup.config, first_window_index=setup.first_window_index
        )
        self.windows.mesh = setup.mesh
        self.board = ProgressBoard(setup.board_fd, setup.ranks)
        self.artifacts = StepArtifactWriter.from_config(setup.config)
        self.reader = FrameReader()
        os.set_blocking(control_in, False)
        self.selector.register(control_in, selectors.EVENT_READ, "control")
        self.stop_at: float | None = None  # monotonic deadline of the final shipments
        self.ended = False
        self._board_at = 0.0

    # ---- to the root's process -------------------------------------------------------------

    def send(self, message: tuple[Any, ...]) -> None:
        data = frame(message)
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.control_out, view)
            except BlockingIOError:
                time.sleep(0.001)
                continue
            view = view[n:]

    # ---- the loop --------------------------------------------------------------------------

    def run(self) -> None:
        host, port = self.intake.address
        self.send(("listening", host, port))
        while not self.ended:
            now = time.monotonic()
            timeout = 0.02 if self.stop_at is not None else self.windows.due(now)
            shipments: list[Rows] = []
            blocks: list[Blocks] = []
            for key, events in self.selector.select(timeout):
                if key.data == "control":
                    self._control()
                else:
                    for event in self.intake.ready(key, events):
                        if event.rows is not None:
                            shipments.append(event.rows)
                        elif event.blocks is not None:
                            blocks.append(event.blocks)
                        else:
                            self._event(event)
                if self.ended:
                    return
            now = time.monotonic()
            # Every rank's rows and blocks of this turn at once: one pass, not one per rank.
            if blocks:
                self.windows.take_blocks(blocks)
            if shipments:
                self.windows.take_all(shipments, now)
            if self.stop_at is not None:
                if not self.windows.finals_missing() or now >= self.stop_at:
                    self._finish(now)
                    return
            else:
                window = self.windows.tick(now)
                if window is not None:
                    self._publish(window)
            self._write_board(now)

    def _event(self, event: Event) -> None:
        w = self.windows
        if event.kind == "hello" and event.hello is not None:
            h = event.hello
            w.hello(RankInfo(h.rank, h.hostname, h.local_rank, h.gpu, h.gpu_uuid))
        elif event.kind == "closed":
            w.hung_up(event.rank)
        elif event.kind == "refused":
            w.refused(event.rank)

    def _control(self) -> None:
        try:
            chunk = os.read(self.control_in, 1 << 20)
        except BlockingIOError:
            return
        if not chunk:  # the root's process is gone: nobody to report to
            self.ended = True
            return
        self.reader.feed(chunk)
        for message in self.reader.frames():
            kind = message[0]
            if kind == "mesh":
                self.windows.mesh = message[1]
            elif kind == "rebaseline":
                self.windows.pace.rebaseline(message[1])
                log.warning("rankwatch: the pace baseline starts again: %s", message[1])
            elif kind == "hang":
                self._send_report(self.windows.hang_report(message[1]))
            elif kind == "stop":
                self.stop_at = time.monotonic() + float(message[1])

    # ---- windows out -----------------------------------------------------------------------

    def _publish(self, window: Window) -> None:
        if self.artifacts is not None:
            self.artifacts.save(window.report, window.per_rank, window.steps)
        self._send_report(window.report)
        if window.report.window_kind == "live":
            self._answer_ranks(window.report)
        self._write_board(time.monotonic(), force=True)

    def _send_report(self, report: WindowReport) -> None:
        bounded = bounded_report(report, self.root, self.budget)
        counts = storage_error_counts() if self.setup.process else {}
        self.send(("report", bounded, counts))

    def _answer_ranks(self, report: WindowReport) -> None:
        """In a group larger than the budget, each rank's own means go back to it (it serves
        them on its own ``/metrics``); the root's own are in the report."""
        st = report.step_time
        if st is None or report.size <= self.budget:
            return
        values = np.empty(len(RANK_MEAN_KEYS))
        for rank, means in st.rank_means.items():
            if rank == self.root:
                continue
            for i, key in enumerate(RANK_MEAN_KEYS):
                v = means.get(key)
                values[i] = np.nan if v is None else v
            self.intake.send(rank, encode_own(rank, report.window_index, st.clock, values))

    def _write_board(self, now: float, force: bool = False) -> None:
        self.board.beat(now)
        if not force and now < self._board_at + _BOARD_SECONDS:
            return
        self._board_at = now
        w = self.windows
        if not w.changed:
            return
        items = []
        st = w.state
        for rank in w.changed:
            i = w.index[rank]
            state = (
                REFUSED
                if st.refused[i]
                else HUNG_UP
                if st.hung_up[i]
                else FINAL
                if st.final[i]
                else CONNECTED
            )
            items.append((rank, w.progress_at(rank), state))
        w.changed = set()
        self.board.progress(items)

    def _finish(self, now: float) -> None:
        window = self.windows.summary(now)
        if window is not None:
            self._publish(window)
        faults = []
        if self.artifacts is not None:
            text = self.artifacts.guard.not_written()
            if text is not None:
                faults.append(text)
        counts = storage_error_counts() if self.setup.process else {}
        self.send(("done", faults, counts))
        self.ended = True

    def close(self) -> None:
        self.intake.close()
        self.selector.close()
        self.board.close(close_fd=self.setup.process)  # a thread shares its root's board


def run_service(setup: ServiceSetup, control_in: int, control_out: int) -> None:
    """Run the aggregator until ``stop`` is done or the root's process is gone."""
    service = _Service(setup, control_in, control_out)
    try:
        service.run()
    finally:
        service.close()

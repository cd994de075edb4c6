"""The per-rank hang record file in the artifact folder.

Its format is :mod:`rankwatch.diagnosis.hang.artifact`'s.

A killed job leaves no live incident to read, so a suspect rank keeps its record on disk:
written (atomically) while the rank does not progress, at most every
:data:`WRITE_EVERY_SECONDS`, by the hang watcher's thread; removed once the rank moved on.
On SIGTERM (the launcher stopping the job, the watchdog's abort) the handler refreshes it
before handing the signal to whatever handled it before (the previous Python handler is
called; the default one is restored and the signal raised again; an ignored one stays
ignored). Python runs that handler only on the main thread between bytecodes: a training
thread blocked in C never runs it, which is why the file is written ahead, on suspicion.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rankwatch.diagnosis.hang import RankRecord
from rankwatch.diagnosis.hang.artifact import FORMAT, VERSION, hang_file_name
from rankwatch.exporter.hang.record import frame_lines
from rankwatch.exporter.storage import GuardedWrites, atomic_write

__all__ = ["WRITE_EVERY_SECONDS", "HangFileWriter", "install_sigterm"]

log = logging.getLogger(__name__)

WRITE_EVERY_SECONDS = 2.0
_MAX_THREADS = 32


def thread_stacks(limit: int) -> dict[str, list[str]]:
    """Every Python thread's top frames, by thread name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out: dict[str, list[str]] = {}
    for ident, frame in list(sys._current_frames().items())[:_MAX_THREADS]:
        out[f"{names.get(ident, 'thread')}-{ident}"] = frame_lines(frame, limit)
    return out


class HangFileWriter:
    """Writes and removes one rank's hang record file."""

    def __init__(
        self,
        folder: str,
        rank: int,
        host: str,
        run: str,
        group: str,
        frames: int,
        guard: GuardedWrites,
    ) -> None:
        self.folder, self.guard = folder, guard
        self.path = Path(folder, hang_file_name(rank, os.getpid()))
        self.rank, self.host, self.run, self.group, self.frames = rank, host, run, group, frames
        self.written_at = -float("inf")
        self.exists = False

    def write(
        self,
        records: list[RankRecord],
        verdict: dict[str, Any] | None,
        reason: str,
        *,
        force: bool = False,
    ) -> None:
        """Write the file (at most every ``WRITE_EVERY_SECONDS`` unless ``force``)."""
        now = time.monotonic()
        if not force and now - self.written_at < WRITE_EVERY_SECONDS:
            return
        self.written_at = now
        body = {
            "format": FORMAT,
            "version": VERSION,
            "rank": self.rank,
            "host": self.host,
            "pid": os.getpid(),
            "run": self.run,
            "group": self.group,
            "written_at_s": time.time(),
            "reason": reason,
            "records": [r.to_dict() for r in records],
            "stacks": thread_stacks(self.frames),
            "verdict": verdict,
        }
        text = json.dumps(body, default=str)

        def write() -> bool:
            # Not the Path: this writer removes its own file when the rank moves on, which the
            # policy would otherwise read as the folder removed under it.
            atomic_write(self.path, text)
            return True

        # A storage fault is said once, counted and never raised (exporter/storage.py).
        if self.guard.run(self.path, write, self.folder):
            self.exists = True

    def remove(self) -> None:
        """The rank moved on: the file would name a hang that is over."""
        if self.exists:
            self.exists = False
            with contextlib.suppress(OSError):
                self.path.unlink()


def install_sigterm(on_term: Callable[[], None]) -> Callable[[], None] | None:
    """Call ``on_term()`` on SIGTERM, then the handler there was before (see the module
    docstring). Only from the main thread (Python's rule); returns an undo, or None when not
    installed."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        try:
            on_term()
        except Exception:  # the launcher's stop must go through whatever happens here
            log.exception("rankwatch: writing the hang record on SIGTERM failed")
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):
        return None

    def undo() -> None:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, previous)

    return undo

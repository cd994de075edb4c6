"""The control pipes between a training process and a helper it started.

A helper is ``python -m <module>`` with its control frames (:mod:`.child_frames`) on its stdin
and stdout (its side: :func:`take_control_pipes`), or, where nothing grows (a group of one),
the same service on a thread of this process over two ``os.pipe()`` pairs. :class:`ChildPipe`
holds either: the locked writer, the closing of the control end (the helper reads it as its
parent gone), the kill and the reap. The group's aggregator (``aggregator/process.py``) and the
EP root's DeepEP child (``deepep/root_process.py``) both talk to their helper through one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rankwatch.exporter.child_frames import ForwardLogs, read_frame

__all__ = ["Backoff", "ChildPipe", "take_control_pipes"]

_FIRST_BACKOFF_SECONDS = 1.0
_MAX_BACKOFF_SECONDS = 60.0
_HEALTHY_SECONDS = 60.0  # up this long, the back-off starts again from the first


class ChildPipe:
    """One helper's control pipes. Build it with :meth:`spawn` (a child process) or
    :meth:`over_fds` (a service on a thread, given the descriptors of its pipes)."""

    def __init__(
        self, proc: subprocess.Popen[bytes] | None, to_child: int, from_child: int
    ) -> None:
        self.proc = proc
        self._to_child: int | None = to_child
        self.from_child: int | None = from_child
        # Writes and the closing of the control end: a descriptor closed by one thread must
        # never be written to by another (its number may already name another file).
        self._write_lock = threading.Lock()

    @classmethod
    def spawn(cls, module: str, pass_fds: Sequence[int] = ()) -> ChildPipe:
        """Start ``python -m module`` (``OSError`` when it cannot start)."""
        proc = subprocess.Popen(
            [sys.executable, "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=tuple(pass_fds),
            close_fds=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        return cls(proc, proc.stdin.fileno(), proc.stdout.fileno())

    @classmethod
    def over_fds(cls, to_child: int, from_child: int) -> ChildPipe:
        """A service on a thread of this process: this side's ends of its two pipes."""
        return cls(None, to_child, from_child)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    def write(self, data: bytes | memoryview) -> bool:
        """Write all of ``data`` (blocking while the helper does not read); False once the
        control end is closed or the helper is gone."""
        with self._write_lock:
            fd = self._to_child
            if fd is None:
                return False
            try:
                view = memoryview(data).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
                return True
            except OSError:
                return False

    def close_control(self) -> None:
        """Close the control end (the helper reads it as its parent gone)."""
        with self._write_lock:
            fd, self._to_child = self._to_child, None
            proc = self.proc
            if fd is None:
                return
            with contextlib.suppress(OSError, ValueError):
                if proc is not None and proc.stdin is not None:
                    proc.stdin.close()
                else:
                    os.close(fd)

    def kill(self) -> None:
        """End a helper process at once (a stopped one too); a thread's service is ended by
        closing its control end."""
        proc = self.proc
        if proc is None:
            self.close_control()
        elif proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()

    def reap(self, wait_seconds: float = 5.0) -> None:
        """After the helper's end of the pipe closed: close ours, wait for the process."""
        self.close_control()
        proc = self.proc
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(wait_seconds)
            if proc.stdout is not None:
                with contextlib.suppress(OSError, ValueError):
                    proc.stdout.close()
        elif self.from_child is not None:
            with contextlib.suppress(OSError):
                os.close(self.from_child)
        self.from_child = None


class Backoff:
    """The wait between a helper's end and its next start: 1 s, doubling to 60 s while helpers
    keep ending, from 1 s again once one stayed up for 60 s."""

    def __init__(self) -> None:
        self.seconds = _FIRST_BACKOFF_SECONDS

    def upcoming(self, started_at: float) -> float:
        """The next wait, for a helper started at ``started_at`` (``time.monotonic()``)."""
        if time.monotonic() - started_at > _HEALTHY_SECONDS:
            self.seconds = _FIRST_BACKOFF_SECONDS
        return self.seconds

    def wait(self, started_at: float, stopping: Callable[[], bool]) -> bool:
        """Wait :meth:`upcoming` (doubling the one after); False as soon as ``stopping()``."""
        end = time.monotonic() + self.upcoming(started_at)
        self.seconds = min(_MAX_BACKOFF_SECONDS, self.seconds * 2)
        while time.monotonic() < end:
            if stopping():
                return False
            time.sleep(0.05)
        return True


def take_control_pipes(setup_type: type) -> tuple[Any, int]:
    """In a helper process: its setup (the first frame on stdin, None unless a ``setup_type``)
    and the descriptor its frames go out on. Prints go to stderr, never into the frames; log
    records go to the parent (:class:`~.child_frames.ForwardLogs`) at the setup's
    ``log_level``; Ctrl-C is ignored (the parent decides when a helper ends: its stop, or its
    end of the pipe closing, so a Ctrl-C to the process group cannot cut the last window
    short). The frames after the setup are read from descriptor 0."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control_out = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # Unbuffered: nothing past the setup frame may sit in a buffer the service does not read.
    with open(0, "rb", buffering=0, closefd=False) as stdin:
        setup: Any = read_frame(stdin)
    if not isinstance(setup, setup_type):
        return None, control_out
    root = logging.getLogger()
    root.handlers[:] = [ForwardLogs(control_out)]
    root.setLevel(getattr(setup, "log_level", logging.WARNING))
    return setup, control_out

"""What every rankwatch file writer does when storage fails: the one storage-fault policy.

A full disk, a read-only mount, a folder removed by a cleanup job, a permission taken away, a
path that is a file or a device: rankwatch's files (step windows, the run summary, DeepEP NPZ
windows and log files) are a convenience, training is not. Every writer runs its writes through
one :class:`GuardedWrites`, which holds the policy (``docs/reliability.md`` states it for users):

- **Never raises.** Any ``OSError`` of a write is caught; the caller gets None.
- **Says it once.** The first failure with a given errno says one warning line naming what is
  not written, the setting (its environment variable) and value, the path and the errno name
  (``ENOSPC``...); later failures with the same errno are only counted.
- **Counts it.** Every failed attempt adds one to a process-wide count per writer, published as
  ``rankwatch_storage_errors_total{writer=...}``.
- **Retries on a bounded schedule.** After a failure the writer skips its writes (counted as
  lost) until the next retry: ``FIRST_RETRY_SECONDS`` after the first failure, twice the last
  wait after each further one, never more than ``MAX_RETRY_SECONDS`` apart. The first write that
  succeeds again is said at INFO and the schedule starts over. A write made once (the summary,
  at the end of the run) is not retried.
- **A folder removed during the run is created again** by the next write, said once (``ENOENT``)
  and counted: the files in it are gone, the files to come are not lost. A log file removed
  under its open stream is opened again the same way (its lines would otherwise go into a
  deleted file).
- **Keeps what was written.** Writers write atomically (temporary file, then rename), so a
  failed write leaves every earlier file as it was and no partial file behind.

A folder that is unusable from the start (a file, ``/dev/null``, read-only, not writable) is
said at start-up by :meth:`GuardedWrites.check_folder` in the same words, and retried on the
same schedule. :class:`GuardedFileHandler` and :class:`GuardedRotatingFileHandler` put a log file
written through ``logging`` (whose own handlers print a traceback per failed line) under a guard.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from logging.handlers import TimedRotatingFileHandler
from pathlib import Path
from typing import TypeVar

__all__ = [
    "FIRST_RETRY_SECONDS",
    "MAX_RETRY_SECONDS",
    "GuardedFileHandler",
    "GuardedRotatingFileHandler",
    "GuardedWrites",
    "StorageFault",
    "atomic_write",
    "child_storage_errors",
    "ensure_folder",
    "errno_name",
    "storage_error_counts",
    "writable_folder",
]

log = logging.getLogger("rankwatch.storage")

# The first retry comes this long after a failure; each further failure doubles the wait.
FIRST_RETRY_SECONDS = 30.0
MAX_RETRY_SECONDS = 600.0

T = TypeVar("T")

_counts_lock = threading.Lock()
_counts: dict[str, int] = {}
# The same counts of the children that write for this process (the group's aggregator writes
# the step windows), as they last reported them.
_child_counts: dict[str, dict[str, int]] = {}


def storage_error_counts() -> dict[str, int]:
    """Failed writes of this process and the children that write for it, per writer (every
    writer created so far is present, with 0 until it fails): the values of
    ``rankwatch_storage_errors_total``."""
    with _counts_lock:
        out = dict(_counts)
        for counts in _child_counts.values():
            for writer, n in counts.items():
                out[writer] = out.get(writer, 0) + n
        return out


def child_storage_errors(child: str, counts: dict[str, int]) -> None:
    """What a child that writes for this process reported of its own failed writes (its
    totals so far: each report replaces the last)."""
    with _counts_lock:
        _child_counts[child] = {str(k): int(v) for k, v in counts.items()}


def errno_name(exc: OSError) -> str:
    """``exc``'s errno as its symbolic name (``ENOSPC``), or ``OSError`` when it has none."""
    code = exc.errno
    return errno.errorcode.get(code, f"errno {code}") if code is not None else type(exc).__name__


def ensure_folder(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` and its parents when missing; ``NotADirectoryError`` (``ENOTDIR``)
    when it exists and is not a folder (a file, or a device such as ``/dev/null``)."""
    folder = Path(path)
    with contextlib.suppress(FileExistsError):  # checked below, with the errno that says so
        folder.mkdir(parents=True, exist_ok=True)
    if not folder.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "exists and is not a folder", str(folder))
    return folder


def writable_folder(path: str | os.PathLike[str]) -> Path:
    """:func:`ensure_folder`, then ``PermissionError`` (``EACCES``) or ``OSError`` (``EROFS``)
    when this process may not create files in it."""
    folder = ensure_folder(path)
    if not os.access(folder, os.W_OK | os.X_OK):
        code = errno.EROFS if _read_only(folder) else errno.EACCES
        raise OSError(code, os.strerror(code), str(folder))
    return folder


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename:
    readers see the old file or the new one, never a part; a failure leaves no temporary."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)  # readable like any file written by open(), not mkstemp's 0600
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


@dataclass(frozen=True)
class StorageFault:
    """One failed write: what was not written, the setting that chose the place, the path the
    error names, and the error."""

    what: str  # in words: "step windows", "the run summary"
    variable: str  # the environment variable of the setting, e.g. RANKWATCH_ARTIFACT_DIR
    value: str  # the setting's value (the folder)
    path: str  # the file or folder the error is about
    errno_name: str  # ENOSPC, EROFS, ENOENT, EACCES, ENOTDIR...
    reason: str  # the system's words for it

    def why(self) -> str:
        """Setting, path and error in one phrase (the end block and the warning use it)."""
        where = f"{self.variable}={self.value!r}"
        if self.path and self.path != self.value:
            where += f", at {self.path}"
        return f"{where}: {self.errno_name} ({self.reason})"


class GuardedWrites:
    """The storage-fault policy for one writer (see the module's description).

    ``writer`` is the label of ``rankwatch_storage_errors_total`` (``step_windows``,
    ``summary``, ``deepep_npz``...); ``what`` says in words what is lost when a write fails;
    ``variable`` and ``value`` name the setting that chose the place. Thread-safe.
    """

    def __init__(
        self,
        writer: str,
        what: str,
        variable: str,
        value: str,
        *,
        first_retry_seconds: float = FIRST_RETRY_SECONDS,
        max_retry_seconds: float = MAX_RETRY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        retries: bool = True,
    ) -> None:
        for name, text in (("writer", writer), ("what", what), ("variable", variable)):
            if not isinstance(text, str) or not text:
                raise ValueError(f"{name}: expected a non-empty string, got {text!r}")
        if not 0 < first_retry_seconds <= max_retry_seconds:
            raise ValueError(
                "first_retry_seconds, max_retry_seconds: expected 0 < first <= max, got "
                f"{first_retry_seconds!r}, {max_retry_seconds!r}"
            )
        self.writer = writer
        self.what = what
        self.variable = variable
        self.value = str(value)
        self.first_retry_seconds = float(first_retry_seconds)
        self.max_retry_seconds = float(max_retry_seconds)
        self._clock = clock
        self.retries = retries  # False: a write made once (the run summary), never retried
        self._lock = threading.Lock()
        self._said: set[str] = set()
        self._next_try = 0.0
        self._delay = 0.0  # the wait after the next failure (0: none failed since the last write)
        self.errors = 0  # storage errors counted (failed writes, folders found removed)
        self.lost = 0  # writes that failed or were skipped while waiting for a retry
        self.written = 0
        self.last_fault: StorageFault | None = None
        self._last_file: Path | None = None
        with _counts_lock:
            _counts.setdefault(writer, 0)

    @property
    def failing(self) -> bool:
        """True from a failure until the next write that succeeds."""
        with self._lock:
            return self._delay > 0

    def ready(self) -> bool:
        """False while waiting for the next retry (the write is to be skipped: it is counted)."""
        with self._lock:
            if self._delay > 0 and (not self.retries or self._clock() < self._next_try):
                self.lost += 1
                return False
            return True

    def check_folder(self, folder: str | os.PathLike[str]) -> bool:
        """At start-up: True when ``folder`` can hold files (created when missing); otherwise
        the failure is said and counted like a failed write, and retried on the schedule."""
        return self.run(folder, lambda: writable_folder(folder), lost=False) is not None

    def run(
        self,
        path: str | os.PathLike[str],
        write: Callable[[], T],
        folder: str | os.PathLike[str] | None = None,
        *,
        lost: bool = True,
    ) -> T | None:
        """``write()``'s result, or None when it failed (said, counted) or was skipped while
        waiting for a retry. ``path`` is what the write is about (named in the warning);
        ``folder``, when given, is created when missing; when ``write()`` returns the
        :class:`~pathlib.Path` it wrote, a later write finding that file gone says once that
        the folder was removed. ``lost=False``: a failure loses no output (a check)."""
        if not self.ready():
            return None
        try:
            if folder is not None:
                # The newest file written is never pruned: gone, someone removed the folder
                # (or emptied it); whoever recreated the folder, this writer says so.
                last = self._last_file
                if last is not None and not os.path.lexists(last):
                    self.removed(last)
                ensure_folder(folder)
            result = write()
        except OSError as exc:
            self.failed(path, exc, lost=lost)
            return None
        if isinstance(result, Path):
            self._last_file = result
        self.succeeded()
        return result

    def removed(self, path: str | os.PathLike[str]) -> None:
        """``path`` (the folder, or a log file) was removed during the run and is about to be
        created again: counted, said once."""
        self._count(
            FileNotFoundError(errno.ENOENT, "removed during the run; created again", str(path)),
            path,
        )

    def failed(
        self, path: str | os.PathLike[str], exc: OSError, *, lost: bool = True
    ) -> StorageFault:
        """Record one failed write of ``path`` (for writers that catch the error themselves):
        counted, said once per errno, and the next retry scheduled."""
        with self._lock:
            self.lost += int(lost)
            self._delay = (
                self.first_retry_seconds
                if self._delay == 0
                else min(2 * self._delay, self.max_retry_seconds)
            )
            self._next_try = self._clock() + self._delay
            delay = self._delay
        then = (
            f"retrying in {delay:.0f} s, then at most every {self.max_retry_seconds:.0f} s"
            if self.retries
            else "not retried"
        )
        fault = self._count(exc, path, then)
        with self._lock:
            self.last_fault = fault
        return fault

    def _count(self, exc: OSError, path: str | os.PathLike[str], then: str = "") -> StorageFault:
        fault = StorageFault(
            what=self.what,
            variable=self.variable,
            value=self.value,
            # The file meant, not a temporary name the error may carry.
            path=str(path),
            errno_name=errno_name(exc),
            reason=exc.strerror or str(exc),
        )
        with self._lock:
            self.errors += 1
            say = fault.errno_name not in self._said
            self._said.add(fault.errno_name)
        with _counts_lock:
            _counts[self.writer] = _counts.get(self.writer, 0) + 1
        if say:
            log.warning(
                'rankwatch: %s%s: %s%s (counted in rankwatch_storage_errors_total{writer="%s"})',
                self.what,
                " not written" if then else "",
                fault.why(),
                f"; {then}" if then else "",
                self.writer,
            )
        return fault

    def succeeded(self) -> None:
        """Record a write that worked: after failures, said once at INFO, schedule reset."""
        with self._lock:
            self.written += 1
            recovered = self._delay > 0
            self._delay = 0.0
        if recovered:
            log.info(
                "rankwatch: %s written again under %s=%r", self.what, self.variable, self.value
            )

    def not_written(self) -> str | None:
        """For the end of the run: what was not written and why, or None when nothing was
        lost."""
        with self._lock:
            fault, lost, failing = self.last_fault, self.lost, self._delay > 0
        if fault is None or lost == 0:
            return None
        if not self.retries:
            return f"{self.what} ({fault.why()})"
        later = "" if failing else "; written again since"
        return f"{self.what}: {lost} not written ({fault.why()}){later}"


class _GuardedEmit(logging.FileHandler):
    """A file handler under a :class:`GuardedWrites`: an ``OSError`` (opening, writing,
    rotating) is the guard's, never a traceback on stderr; a log file removed under the open
    stream is a failure too (``ENOENT``), and the retry opens it again."""

    guard: GuardedWrites

    def emit(self, record: logging.LogRecord) -> None:
        if not self.guard.ready():
            return
        self._failed = False
        try:
            if self.stream is not None and (self.guard.failing or self._gone()):
                if not self.guard.failing:
                    self.guard.removed(self.baseFilename)
                self.close_stream()
            if self.stream is None:
                ensure_folder(os.path.dirname(self.baseFilename))
            super().emit(record)  # a write error reaches handleError below
        except OSError as exc:
            self._fail(exc)
            return
        if not self._failed:
            self.guard.succeeded()

    def _gone(self) -> bool:
        """True when the file the stream writes is no longer at its path (removed, renamed)."""
        stream = self.stream
        assert stream is not None
        try:
            there = os.stat(self.baseFilename)
        except FileNotFoundError:
            return True
        return not os.path.samestat(there, os.fstat(stream.fileno()))

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            self._fail(exc)
        else:
            super().handleError(record)

    def _fail(self, exc: OSError) -> None:
        self._failed = True
        self.close_stream()
        self.guard.failed(self.baseFilename, exc)

    def close_stream(self) -> None:
        """Drop the open stream (reopened at the next line); a close error is the guard's."""
        stream, self.stream = self.stream, None
        if stream is not None:
            with contextlib.suppress(OSError):  # the failure that got us here is counted
                stream.close()


class GuardedFileHandler(_GuardedEmit):
    """A log file (opened at its first line) whose storage faults follow ``guard``."""

    def __init__(self, path: str, guard: GuardedWrites) -> None:
        self.guard = guard
        self._failed = False
        super().__init__(path, encoding="utf-8", delay=True)


class GuardedRotatingFileHandler(_GuardedEmit, TimedRotatingFileHandler):
    """A log file rotated at midnight keeping ``backup_count`` old files, whose storage
    faults follow ``guard``."""

    def __init__(self, path: str, guard: GuardedWrites, backup_count: int) -> None:
        self.guard = guard
        self._failed = False
        TimedRotatingFileHandler.__init__(
            self,
            path,
            when="midnight",
            interval=1,
            backupCount=backup_count,
            encoding="utf-8",
            delay=True,
        )

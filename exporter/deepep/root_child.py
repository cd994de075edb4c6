"""The EP root's DeepEP child: ``python -m rankwatch.exporter.deepep.root_child``.

Started by :class:`~.root_process.DeepEPRootProcess` on the EP group's root. It reads the
setup, then one frame per gathered snapshot followed by the snapshot's raw counter bytes, and
runs a :class:`~.root.DeepEPRoot` on them: windows, validation, the normal-mode and low-latency
diagnosis, the log lines (to the parent's logging, and to the DeepXTrace log file when one is
kept) and the NPZ artifacts. Each snapshot is answered with its report (None for a boundary),
which the parent's publishers publish. It ends on ``stop`` or when the parent's end of the pipe
closes. torch is never loaded here.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from rankwatch.exporter.child_frames import frame, read_exactly_into, read_frame
from rankwatch.exporter.child_pipe import take_control_pipes
from rankwatch.exporter.deepep.root import DeepEPRoot, RootSpec
from rankwatch.exporter.storage import storage_error_counts

__all__ = ["SNAPSHOT_DTYPE", "RootSetup", "check_snapshot_header", "main"]

log = logging.getLogger("rankwatch.exporter.deepep")

# Gathered counter blocks cross the pipe as raw little-endian int64, row-major.
SNAPSHOT_DTYPE = "<i8"


@dataclass(frozen=True)
class RootSetup:
    """What the child needs to be the EP group's root (the first frame it reads): the root,
    when its warm-up began, whether its first snapshot is a boundary (a child started again),
    the index of its first window, and the parent's log level."""

    spec: RootSpec
    started_at_s: float
    boundary_first: bool
    first_window_index: int
    log_level: int


def check_snapshot_header(ep_size: int, shape: Any, dtype: Any, nbytes: Any) -> tuple[int, int]:
    """The ``(rows, columns)`` of a snapshot's raw bytes, or ``ValueError`` naming the field
    and value: ``ep_size`` rows, at least one column, :data:`SNAPSHOT_DTYPE`, and ``nbytes``
    exactly what they hold."""
    if (
        not isinstance(shape, tuple)
        or len(shape) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape)
    ):
        raise ValueError(f"shape: expected (rows, columns) ints, got {shape!r}")
    rows, columns = shape
    if rows != ep_size or columns < 1:
        raise ValueError(f"shape: expected ({ep_size}, n >= 1) for EP {ep_size}, got {shape!r}")
    if dtype != SNAPSHOT_DTYPE:
        raise ValueError(f"dtype: expected {SNAPSHOT_DTYPE!r}, got {dtype!r}")
    want = rows * columns * 8
    if isinstance(nbytes, bool) or nbytes != want:
        raise ValueError(f"nbytes: expected {want} for shape {shape!r}, got {nbytes!r}")
    return rows, columns


def _answer(fd: int, message: tuple[Any, ...]) -> None:
    data = memoryview(frame(message))
    while data:
        data = data[os.write(fd, data) :]


def serve(setup: RootSetup, stdin: Any, out_fd: int) -> None:
    """The child's loop: snapshots in, answers out, until ``stop`` or the parent is gone."""
    root = DeepEPRoot.from_spec(setup.spec)
    root.start(
        setup.started_at_s,
        boundary_first=setup.boundary_first,
        first_window_index=setup.first_window_index,
        worker=False,
    )
    _answer(out_fd, ("ready",))
    try:
        while True:
            message = read_frame(stdin)
            if message is None or message[0] == "stop":
                return
            _, seq, parts, taken_at_s, shape, dtype, nbytes = message
            rows, columns = check_snapshot_header(root.ep_size, shape, dtype, nbytes)
            block = np.empty((rows, columns), dtype=np.int64)
            if not read_exactly_into(stdin, block.data):
                return
            report = None
            try:
                report = root.process_rows(parts, block, taken_at_s)
            except Exception as exc:  # one bad window must not end the child
                log.exception("DeepEP window processing failed: %s", exc)
            counts = storage_error_counts()
            _answer(out_fd, ("answer", seq, report, dict(root.rejected_windows), counts))
    finally:
        root.stop(0.0)
        _answer(out_fd, ("done", storage_error_counts()))


def main() -> int:
    # Run as __main__, this module's classes are not the ones the parent pickled: take them
    # from the module by its name.
    from rankwatch.exporter.deepep.root_child import RootSetup as setup_type

    setup, control_out = take_control_pipes(setup_type)
    if setup is None:
        return 0
    with open(0, "rb", buffering=0, closefd=False) as stdin:
        try:
            serve(setup, stdin, control_out)
        except OSError:  # the parent is gone: nobody to answer
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

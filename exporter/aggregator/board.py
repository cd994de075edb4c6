"""The progress board: what the aggregator knows of each rank, shared with the root's process.

The root's hang loop runs in the training process (it reads every rank's record from the c10d
store), but what the aggregator alone knows (when each rank's shipped steps last advanced, which
ranks' connections closed) it needs only while the group looks hung. So the aggregator writes
it into a small shared memory board as it learns it, and the hang loop reads it when it asks:
nothing crosses a pipe or takes the training process's interpreter lock while the job runs.

Layout: one float64 row per rank of the group, in the group's rank order: the monotonic time
its steps last advanced (NaN: none yet), its connection state (:data:`STATES`); and a header
row whose first cell is the aggregator's beat (the monotonic time of its last loop turn: the
parent tells a stuck aggregator by it). ``time.monotonic`` is the same clock in every process
of a host (Linux: ``CLOCK_MONOTONIC``), and the aggregator runs on the root's host.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import tempfile
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["CONNECTED", "FINAL", "HUNG_UP", "REFUSED", "UNKNOWN", "ProgressBoard"]

UNKNOWN, CONNECTED, FINAL, HUNG_UP, REFUSED = 0.0, 1.0, 2.0, 3.0, 4.0
_COLUMNS = 2


class ProgressBoard:
    """A board over a file descriptor both processes map (:meth:`create` makes one)."""

    def __init__(self, fd: int, ranks: Sequence[int]) -> None:
        self.fd = fd
        self.ranks = tuple(ranks)
        self._index = {r: i for i, r in enumerate(self.ranks)}
        size = (len(self.ranks) + 1) * _COLUMNS * 8
        self._map = mmap.mmap(fd, size)
        cells = np.ndarray((len(self.ranks) + 1, _COLUMNS), dtype=np.float64, buffer=self._map)
        self._beat = cells[0]
        self._rows = cells[1:]

    @classmethod
    def create(cls, ranks: Sequence[int]) -> ProgressBoard:
        """A new board (all unknown) over an unnamed temporary file, for a child to inherit."""
        with tempfile.TemporaryFile() as handle:
            fd = os.dup(handle.fileno())
        os.ftruncate(fd, (len(ranks) + 1) * _COLUMNS * 8)
        board = cls(fd, ranks)
        board._rows[:, 0] = math.nan
        board._rows[:, 1] = UNKNOWN
        board._beat[:] = math.nan
        return board

    # ---- the aggregator writes -------------------------------------------------------------

    def beat(self, now: float) -> None:
        self._beat[0] = now

    def progress(self, items: Iterable[tuple[int, float | None, float]]) -> None:
        """``(rank, progress time or None, state)`` of ranks whose entry moved."""
        for rank, at, state in items:
            row = self._rows[self._index[rank]]
            row[0] = math.nan if at is None else at
            row[1] = state

    # ---- the root's process reads ----------------------------------------------------------

    def last_beat(self) -> float | None:
        value = float(self._beat[0])
        return None if math.isnan(value) else value

    def progress_age(self, rank: int, now: float) -> float | None:
        """Seconds since ``rank``'s shipped steps last advanced (None: unknown)."""
        i = self._index.get(rank)
        if i is None:
            return None
        at = float(self._rows[i, 0])
        return None if math.isnan(at) else max(0.0, now - at)

    def hung_up(self) -> set[int]:
        """Ranks whose connection to the aggregator closed or was refused."""
        states = self._rows[:, 1]
        gone = np.flatnonzero((states == HUNG_UP) | (states == REFUSED))
        return {self.ranks[i] for i in gone.tolist()}

    def reset(self) -> None:
        """Forget what a previous aggregator wrote (a new one starts)."""
        self._rows[:, 0] = math.nan
        self._rows[:, 1] = UNKNOWN
        self._beat[:] = math.nan

    def close(self, *, close_fd: bool = True) -> None:
        """Unmap the board, and close its descriptor unless another user in this process
        still maps it (``close_fd=False``)."""
        # The arrays are views of the map: drop them first, or the map cannot close.
        del self._beat, self._rows
        with contextlib.suppress(BufferError):  # a view still alive elsewhere: it goes with it
            self._map.close()
        if close_fd:
            with contextlib.suppress(OSError):
                os.close(self.fd)

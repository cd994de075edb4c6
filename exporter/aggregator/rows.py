"""The aggregator's bounded copy of every rank's rows: one ring per rank, in one array.

``GroupRows`` keeps the newest ``capacity`` rows of each rank of a group in step order, in a
single ``[ranks, capacity, ROW_WIDTH]`` float64 array with per-rank counters beside it, so
that the usual round (every rank ships the same number of rows, each after its last) is taken
in a few numpy operations whatever the size of the group (:meth:`GroupRows.append_batch`), and
the usual live window (every rank at the same last steps) is one gather
(:meth:`GroupRows.last_rows`). Anything else goes through the per-rank path, which is the
reference the batched one is tested against.

Rows whose step id is not above the last one kept are dropped (resent or out of order).
``progress_at[i]`` is the monotonic time rank ``i``'s last step id last increased. The array is
allocated once, untouched (the operating system gives its pages as rows arrive), and never
grows: memory is ``ranks x capacity x ROW_WIDTH x 8`` bytes at most.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from rankwatch.diagnosis.step_time.table import ROW_WIDTH, rows_after

__all__ = ["GroupRows"]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]


class GroupRows:
    """The newest rows of each rank of a group (see the module docstring); ranks are
    addressed by their index in ``ranks``."""

    def __init__(self, ranks: Sequence[int], capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"GroupRows.capacity: must be >= 1, got {capacity!r}")
        self.ranks = tuple(ranks)
        self.index = {r: i for i, r in enumerate(self.ranks)}
        n = len(self.ranks)
        self.capacity = capacity
        self.data = np.empty((n, capacity, ROW_WIDTH))
        self.count = np.zeros(n, dtype=np.int64)  # rows ever kept, per rank
        self.last_step = np.full(n, -1.0)
        self.progress_at = np.full(n, time.monotonic())
        self.rejected = np.zeros(n, dtype=np.int64)

    def size(self, i: int) -> int:
        """Rows of rank ``i`` kept now."""
        return int(min(self.count[i], self.capacity))

    def nbytes(self) -> int:
        """Bytes of the rows and counters (the rows' pages once every ring is full)."""
        arrays = (self.data, self.count, self.last_step, self.progress_at, self.rejected)
        return sum(a.nbytes for a in arrays)

    # ---- taking rows -----------------------------------------------------------------------

    def append(self, i: int, rows: FloatArray, now: float | None = None) -> int:
        """Append one rank's rows (ascending step ids expected); how many were kept."""
        received = len(rows)
        rows = rows_after(rows, float(self.last_step[i]))
        kept = len(rows)
        self.rejected[i] += received - kept
        if kept == 0:
            return 0
        cap = self.capacity
        if kept > cap:  # only the newest ``cap`` rows can stay; count the rest as passed by
            self.count[i] += kept - cap
            rows = rows[-cap:]
        n = len(rows)
        a = int(self.count[i] % cap)
        split = min(n, cap - a)
        ring = self.data[i]
        ring[a : a + split] = rows[:split]
        if split < n:  # the batch wraps around the ring's end
            ring[: n - split] = rows[split:]
        self.count[i] += n
        self.last_step[i] = rows[-1, 0]
        self.progress_at[i] = time.monotonic() if now is None else now
        return kept

    def append_batch(self, idx: IntArray, shipments: Sequence[FloatArray], now: float) -> IntArray:
        """Append ``shipments[j]`` (the same number of rows each) to rank ``idx[j]``, in one
        pass for every shipment that follows its rank's last step in ascending order; returns
        the positions of the others (untouched: the caller takes them through :meth:`append`).
        ``idx`` must not repeat a rank."""
        m = len(shipments)
        k = len(shipments[0]) if m else 0
        if k == 0:
            return np.empty(0, dtype=np.int64)
        if k > self.capacity:
            return np.arange(m)
        firsts = np.fromiter((s[0, 0] for s in shipments), np.float64, m)
        ok = firsts > self.last_step[idx]
        if k > 1:
            lasts = np.fromiter((s[-1, 0] for s in shipments), np.float64, m)
            # Ascending inside: checked in full only where the span is not exactly k - 1 steps.
            span = lasts - firsts
            for j in np.flatnonzero(ok & (span != k - 1)).tolist():
                ids = shipments[j][:, 0]
                ok[j] = bool((ids[1:] > ids[:-1]).all())
        else:
            lasts = firsts
        take = np.flatnonzero(ok)
        if take.size:
            rank_idx = idx[take]
            starts = (self.count[rank_idx] % self.capacity).tolist()
            data, cap = self.data, self.capacity
            # One or two slice copies per shipment (where it wraps the ring's end): cheaper
            # than stacking the shipments and scattering them by index (measured at 16,384
            # ranks x 100 rows: 63 ms against 520).
            for j, i, a in zip(take.tolist(), rank_idx.tolist(), starts, strict=True):
                rows = shipments[j]
                if a + k <= cap:
                    data[i, a : a + k] = rows
                else:
                    data[i, a:] = rows[: cap - a]
                    data[i, : k - (cap - a)] = rows[cap - a :]
            self.count[rank_idx] += k
            self.last_step[rank_idx] = lasts[take]
            self.progress_at[rank_idx] = now
        return np.flatnonzero(~ok)

    # ---- reading rows ----------------------------------------------------------------------

    def tail(self, i: int, n: int, max_step: float | None = None) -> FloatArray:
        """Copy of rank ``i``'s last ``n`` rows (ascending), only rows with step id <=
        ``max_step``. Only those rows are copied: a live window reads about a tenth of a full
        ring."""
        size = self.size(i)
        if size == 0 or n <= 0:
            return np.empty((0, ROW_WIDTH))
        count = int(self.count[i])
        first = count - size  # rows are numbered from the first ever kept
        end = count if max_step is None else self._rows_upto(i, first, size, max_step)
        start = max(first, end - n)
        if start == end:
            return np.empty((0, ROW_WIDTH))
        cap = self.capacity
        a, b = start % cap, end % cap
        ring = self.data[i]
        if a < b:
            return ring[a:b].copy()
        return np.concatenate((ring[a:], ring[:b]))

    def _rows_upto(self, i: int, first: int, size: int, max_step: float) -> int:
        """Number of the first row of rank ``i`` with a step id above ``max_step``."""
        if max_step >= self.last_step[i]:
            return first + size
        cap = self.capacity
        a = first % cap
        older = min(size, cap - a)  # rows in slots a.. before the ring wraps to slot 0
        ring = self.data[i]
        k = int(np.searchsorted(ring[a : a + older, 0], max_step, side="right"))
        if k < older or older == size:
            return first + k
        newer = ring[: size - older, 0]
        return first + older + int(np.searchsorted(newer, max_step, side="right"))

    def last_rows(self, idx: IntArray, n: int, skip: IntArray | None = None) -> FloatArray:
        """``[len(idx), n, ROW_WIDTH]``: each rank of ``idx``'s last ``n`` rows before its
        newest ``skip[j]`` (none skipped by default); each must hold that many. A view of the
        rings when ``idx`` is every rank in order and every ring ends at the same place (the
        usual round: no copy of a window that can be a gigabyte), else a copy. Read-only."""
        end = self.count[idx] if skip is None else self.count[idx] - skip
        stop = end % self.capacity
        a = int(stop[0]) if len(stop) else 0
        if len(stop) and (stop == a).all():
            # Every ring ends at the same place (the usual round): whole slices of rows, no
            # index per value; no copy at all for every rank in order where the window does
            # not cross the ring's end.
            whole = len(idx) == len(self.ranks) and bool((idx == np.arange(len(idx))).all())

            def part(lo: int, hi: int) -> FloatArray:
                return self.data[:, lo:hi] if whole else self.data[idx, lo:hi]

            if a >= n:
                rows = part(a - n, a)
                rows.flags.writeable = False
                return rows
            return np.concatenate((part(self.capacity - (n - a), self.capacity), part(0, a)), 1)
        slots = (end[:, None] - n + np.arange(n)) % self.capacity
        return self.data[idx[:, None], slots]

"""The wire format of shipped step rows, and the root's bounded copy of each rank's rows.

A message is one float64 array of ``(1 + CHUNK_ROWS) x ROW_WIDTH``: a header row (magic,
version, sender, sequence, row count, flags, rows lost, strategy) and up to ``CHUNK_ROWS``
rows, NaN-padded, so every message has the same size and the root can keep one receive
buffer posted per peer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from rankwatch.diagnosis.step_time.table import ROW_WIDTH, rows_after

__all__ = [
    "CHUNK_ROWS",
    "FLAG_END_OF_ROUND",
    "FLAG_FINAL",
    "MESSAGE_SHAPE",
    "TAG",
    "Message",
    "RowBuffer",
    "decode_message",
    "encode_message",
    "message_buffer",
]

CHUNK_ROWS = 512  # rows per message
MESSAGE_SHAPE = (1 + CHUNK_ROWS, ROW_WIDTH)  # a header row and the rows, float64
TAG = 5277  # Gloo tag of rankwatch messages (the group is ours alone; any fixed tag works)
MAGIC = 52770.0
# 2: rows carry the GPU clock's sync waits (``ROW_WIDTH`` grew); a version 1 sender's rows have
# another width, so its messages are refused by version, not misread.
VERSION = 2.0
FLAG_END_OF_ROUND = 1
FLAG_FINAL = 2
STRATEGY_CODES: dict[str | None, int] = {None: 0, "ddp": 1, "fsdp": 2}
_CODE_STRATEGY = {v: k for k, v in STRATEGY_CODES.items()}
# The header row starts with: magic, version, sender, seq, rows, flags, lost, strategy code.


@dataclass(slots=True)
class Message:
    """One decoded shipment chunk (not frozen: the root decodes thousands per window, and a
    frozen dataclass costs four times as much to build)."""

    sender: int
    seq: int
    flags: int
    lost: int
    strategy: str | None
    rows: NDArray[np.float64]

    @property
    def end_of_round(self) -> bool:
        return bool(self.flags & FLAG_END_OF_ROUND)

    @property
    def final(self) -> bool:
        return bool(self.flags & FLAG_FINAL)


def message_buffer() -> NDArray[np.float64]:
    """A message-sized float64 array."""
    return np.full(MESSAGE_SHAPE, math.nan)


def encode_message(
    out: NDArray[np.float64],
    rows: NDArray[np.float64],
    *,
    sender: int,
    seq: int,
    flags: int,
    lost: int,
    strategy: str | None,
) -> None:
    """Fill ``out`` (from :func:`message_buffer`) with a header and up to ``CHUNK_ROWS`` rows."""
    n = len(rows)
    if n > CHUNK_ROWS:
        raise ValueError(f"encode_message: field rows: {n} rows exceed CHUNK_ROWS={CHUNK_ROWS}")
    if rows.ndim != 2 or rows.shape[1] != ROW_WIDTH:
        raise ValueError(
            f"encode_message: field rows: shape {rows.shape}, expected [n, {ROW_WIDTH}]"
        )
    out[0] = 0.0
    out[0, :8] = (
        MAGIC,
        VERSION,
        sender,
        seq,
        n,
        flags,
        lost,
        STRATEGY_CODES.get(strategy, 0),
    )
    out[1 : 1 + n] = rows
    out[1 + n :] = math.nan


def decode_message(buf: NDArray[np.float64]) -> Message:
    """Parse a received message; ``ValueError`` if it is not one of ours."""
    magic, version, sender, seq, n_rows, flags, lost, strategy = buf[0, :8].tolist()
    if magic != MAGIC or version != VERSION:
        raise ValueError(
            f"decode_message: field header: magic/version {magic!r}/{version!r} is not a "
            f"rankwatch v{VERSION:g} message (every rank must run the same rankwatch version)"
        )
    n = int(n_rows)
    if not 0 <= n <= CHUNK_ROWS:
        raise ValueError(f"decode_message: field rows: value {n} out of 0..{CHUNK_ROWS}")
    return Message(
        int(sender),
        int(seq),
        int(flags),
        int(lost),
        _CODE_STRATEGY.get(int(strategy)),
        buf[1 : 1 + n].copy(),
    )


class RowBuffer:
    """The root's bounded copy of one rank's rows, in step order.

    Rows whose step id is not above the last one kept are dropped (resent or out of order).
    ``progress_at`` is the monotonic time the rank's last step id last increased. Memory grows
    with the rows received, up to ``capacity`` rows (``ROW_WIDTH`` float64 each).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"RowBuffer.capacity: must be >= 1, got {capacity!r}")
        self.capacity = capacity
        self._data = np.empty((0, ROW_WIDTH))
        self.count = 0  # rows ever appended
        self.last_step = -1.0
        self.progress_at = time.monotonic()
        self.rejected = 0

    def __len__(self) -> int:
        return min(self.count, self.capacity)

    def append(self, rows: NDArray[np.float64], now: float | None = None) -> int:
        """Append rows (ascending step ids expected); returns how many were kept."""
        received = len(rows)
        rows = rows_after(rows, self.last_step)
        kept = len(rows)
        self.rejected += received - kept
        if kept == 0:
            return 0
        cap = self.capacity
        if kept > cap:  # only the newest ``cap`` rows can stay; count the rest as passed by
            self.count += kept - cap
            rows = rows[-cap:]
        n = len(rows)
        if len(self._data) < cap:
            # Still filling for the first time, so rows sit in slots 0..count-1: grow in order
            # (or start at full size when this batch overwrites every slot anyway).
            if n == cap:
                self._data = np.empty((cap, ROW_WIDTH))
            elif len(self._data) < self.count + n:
                size = min(cap, max(self.count + n, 2 * len(self._data), 256))
                grown = np.empty((size, ROW_WIDTH))
                grown[: self.count] = self._data[: self.count]
                self._data = grown
        a = self.count % cap
        split = min(n, cap - a)
        self._data[a : a + split] = rows[:split]
        if split < n:  # the batch wraps around the ring's end
            self._data[: n - split] = rows[split:]
        self.count += n
        self.last_step = rows.item(-1, 0)
        self.progress_at = time.monotonic() if now is None else now
        return kept

    def tail(self, n: int, max_step: float | None = None) -> NDArray[np.float64]:
        """Copy of the last ``n`` rows (ascending), only rows with step id <= ``max_step``.

        Only those rows are copied: a live window reads about a tenth of a full ring, and
        copying the whole ring to unwrap it cost a 4,096-rank root about 30 ms per window.
        """
        size = len(self)
        if size == 0 or n <= 0:
            return np.empty((0, ROW_WIDTH))
        first = self.count - size  # rows are numbered from the first ever appended
        end = self.count if max_step is None else self._rows_upto(first, size, max_step)
        start = max(first, end - n)
        if start == end:
            return np.empty((0, ROW_WIDTH))
        cap = self.capacity
        a, b = start % cap, end % cap
        if a < b:
            return self._data[a:b].copy()
        return np.concatenate((self._data[a:], self._data[:b]))

    def _rows_upto(self, first: int, size: int, max_step: float) -> int:
        """Number of the first row with a step id above ``max_step`` (ids ascend)."""
        if max_step >= self.last_step:
            return first + size
        cap = self.capacity
        a = first % cap
        older = min(size, cap - a)  # rows in slots a.. before the ring wraps to slot 0
        ids = self._data[a : a + older, 0]
        k = int(np.searchsorted(ids, max_step, side="right"))
        if k < older or older == size:
            return first + k
        newer = self._data[: size - older, 0]
        return first + older + int(np.searchsorted(newer, max_step, side="right"))

"""Bounded per-rank state for long step-time windows: rows of the newest steps, sums of older.

A window's means are sums over its aligned steps divided by their number, so the root does not
need every row of a 10,000-step summary: it keeps, per rank,

* the newest rows (at least ``tail_rows``, held by the caller; the live window is cut from
  them), and
* for older steps, one *block* per ``block_steps`` consecutive step ids (step id //
  ``block_steps``): for each clock the sums of the window means' keys over the block's steps
  (the per-step clamped residual is summed per step, so it stays exact), which keys were
  measured on every step / on any step (the rules of :mod:`.table`), whether every step
  could be read on the GPU clock, and which step ids of the block the rank sent (a bitmask).

Memory is ``ranks x (tail_rows + summary_window / block_steps)`` small records instead of
``ranks x buffered steps`` rows. Everything is derived from :mod:`.table` (its columns,
its per-step reduction and its clock rule), so columns added there are carried here unchanged.

Exactness. :meth:`StepBlocks.reduce` returns the same :class:`~.table.WindowMeans` as
:func:`~.table.reduce_window` on the full rows (up to floating-point summation order)
when the window's aligned steps all lie in the kept rows, or when the older part covers whole
blocks in which every present rank sent the same step ids. Two cases are approximate, and
:attr:`StepBlocks.approximate` says so: the window start, which is rounded to a whole block
(the window holds between ``window - block_steps + 1`` and ``window`` aligned steps, never more),
and an old block in which ranks sent different step ids (rows lost on one rank), where a rank's
block means stand for the common steps.

Outlier steps. With an :class:`~.table.OutlierRule`, a window that lies in the kept rows is
judged as :func:`~.table.reduce_window` judges it (same rule, same steps: exact). A window
that reaches into the blocks is judged per block: each closed block leaves out its rank's rare
outlier steps against the block's own median and fraction (``block_steps`` steps), and the
kept rows of the window against theirs. A step that is an outlier of the whole window is an
outlier of its block unless its block holds more than the allowed fraction of them; so the
summary may keep a step the whole window would leave out (or the reverse), and says how many
it left out all the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import groupby, pairwise

import numpy as np

from rankwatch.diagnosis.step_time.table import (
    _ASYNC_COL,
    CLOCKS,
    MEAN_KEYS,
    ROW_WIDTH,
    SIGNALS,
    SYNC_SIGNALS,
    BoolArray,
    FloatArray,
    OutlierRule,
    WindowMeans,
    _align,
    _check_table,
    _reduce_cube,
    _table_is_clean,
    column,
    gpu_steps,
    rows_after,
    validate_outliers,
    validate_window,
)

__all__ = ["BLOCK_STEPS", "StepBlocks", "block_record_dtype", "every_step_keys"]

BLOCK_STEPS = 100  # default step ids per block


def block_record_dtype(block_steps: int = BLOCK_STEPS) -> np.dtype:
    """One closed block of one rank as plain data (what a rank ships of its older steps, so
    that the group's aggregator keeps them without reducing any rows): the block's index, its
    step count, per clock the sums of the window means' keys, which were measured and how
    many steps they stand for, whether every step could be read on the GPU clock, whether the
    rank flagged collectives that do not block its host, and which step ids it sent."""
    keys, clocks = len(MEAN_KEYS), len(CLOCKS)
    return np.dtype(
        [
            ("index", "<i8"),
            ("steps", "<i8"),
            ("sums", "<f8", (clocks, keys)),
            ("measured", "?", (clocks, keys)),
            ("kept", "<i8", (clocks,)),
            ("gpu_ok", "?"),
            ("async", "?"),
            ("mask", "u1", (-(-block_steps // 8),)),
        ]
    )


def every_step_keys() -> BoolArray:
    """``[MEAN_KEYS]``: True where a key is measured only when present on *every* step.

    Probed from :func:`~.table._reduce_cube` itself (a two-step rank on which one signal
    is absent on the second step), so the rule follows the reduction wherever it changes.
    Derived keys (the residual) depend on every-step keys, so they combine the same way.
    """
    out = np.ones(len(MEAN_KEYS), dtype=bool)
    for k, key in enumerate(MEAN_KEYS):
        if key in SIGNALS or key in SYNC_SIGNALS:
            cols = [column(clock, key) for clock in CLOCKS]
        else:
            continue  # derived (the residual): combines like the keys it is made of
        cube = np.full((1, 2, ROW_WIDTH), 1.0)
        cube[0, :, 0] = (0.0, 1.0)
        cube[0, 1, cols] = np.nan
        wm = _reduce_cube([0], np.ones(1, dtype=bool), cube, cube[0, :, 0], clock="cpu")
        out[k] = not bool(wm.measured[0, k])
    return out


_EVERY = every_step_keys()
_KEYS = len(MEAN_KEYS)


class StepBlocks:
    """Block sums for a fixed set of ranks (the group root's state beside its row tails).

    ``add(rank, rows)`` takes each rank's rows in ascending step order (rows not above the
    rank's last step id are dropped: :func:`~.table.rows_after`). A rank may sum its own blocks
    (``records=True``, :meth:`taken_records`) and another instance keep them
    (:meth:`put_records`) without the rows.
    ``reduce(tails, window)`` builds the window means from the caller's kept rows (the newest
    ``tail_rows`` or fewer of each rank) and the blocks.
    """

    def __init__(
        self,
        ranks: Sequence[int],
        *,
        window_steps: int,
        tail_rows: int,
        block_steps: int = BLOCK_STEPS,
        outliers: OutlierRule | None = None,
        records: bool = False,
    ) -> None:
        window_steps = validate_window(window_steps)
        if block_steps < 1:
            raise ValueError(f"StepBlocks.block_steps: value {block_steps!r} must be >= 1")
        # The tail must hold a closed block and the open one, so no row is lost between them.
        if tail_rows < 2 * block_steps:
            raise ValueError(
                f"StepBlocks.tail_rows: value {tail_rows!r} must be >= 2 x block_steps "
                f"({2 * block_steps})"
            )
        self.ranks = tuple(ranks)
        self.outliers = validate_outliers(outliers)
        self._row = {r: i for i, r in enumerate(self.ranks)}
        self.block_steps = block_steps
        self.tail_rows = tail_rows
        n, slots = len(self.ranks), -(-window_steps // block_steps) + 1
        self.slots = slots
        # Per rank, read and written once per shipment: plain lists (numpy scalars cost more).
        self._last = [-1.0] * n  # last step id taken
        self._open = [-1] * n  # block index of the open block
        self._pending: list[list[FloatArray]] = [[] for _ in self.ranks]
        # Closed blocks: a ring of ``slots`` per rank; ``_index`` -1 marks an empty slot.
        self._index = np.full((n, slots), -1, dtype=np.int64)
        self._steps = np.zeros((n, slots), dtype=np.int64)
        self._sums = np.zeros((n, slots, len(CLOCKS), _KEYS))
        self._measured = np.zeros((n, slots, len(CLOCKS), _KEYS), dtype=bool)
        # Steps each block's means stand for, per clock (its steps less the outliers left out).
        self._kept = np.zeros((n, slots, len(CLOCKS)), dtype=np.int64)
        self._gpu_ok = np.zeros((n, slots), dtype=bool)
        # A block in which the rank flagged collectives that do not block its host.
        self._async = np.zeros((n, slots), dtype=bool)
        self._mask = np.zeros((n, slots, -(-block_steps // 8)), dtype=np.uint8)
        self._closing: list[tuple[int, FloatArray]] = []
        # (rank row, slot) of the blocks stored since the last taken_records (``records``: a
        # rank that ships its own closed blocks).
        self._stored: list[tuple[int, int]] | None = [] if records else None
        self.record_dtype = block_record_dtype(block_steps)
        self.approximate = False  # the last reduce() rounded or approximated (see module doc)

    # ---- feeding ---------------------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes held by the block records and the rows of the open blocks."""
        arrays = (
            self._index,
            self._steps,
            self._sums,
            self._measured,
            self._kept,
            self._gpu_ok,
            self._async,
            self._mask,
        )
        pending = sum(p.nbytes for rows in self._pending for p in rows)
        return sum(a.nbytes for a in arrays) + pending

    def add(self, rank: int, rows: FloatArray) -> None:
        """Append one rank's new rows (ascending step ids); closes the blocks they complete."""
        i = self._row[rank]
        rows = rows_after(rows, self._last[i])
        if len(rows) == 0:
            return
        self._last[i] = rows.item(-1, 0)
        size = self.block_steps
        first, last = int(rows.item(0, 0) // size), int(rows.item(-1, 0) // size)
        if first == last:  # a shipment within one block (the usual case)
            runs = [(first, 0, len(rows))]
        else:  # cut at each block edge; blocks the ids skipped get no run
            edges = np.arange(first + 1, last + 1) * size
            cuts = [0, *np.searchsorted(rows[:, 0], edges).tolist(), len(rows)]
            runs = [(first + k, a, b) for k, (a, b) in enumerate(pairwise(cuts)) if b > a]
        for block, start, stop in runs:
            if block != self._open[i]:
                self._close(i)
                self._open[i] = block
            self._pending[i].append(rows[start:stop])

    def _close(self, i: int) -> None:
        if self._pending[i]:
            parts = self._pending[i]
            block = parts[0] if len(parts) == 1 else np.concatenate(parts)
            self._closing.append((i, block))
            self._pending[i] = []

    def flush(self) -> None:
        """Reduce the blocks closed since the last flush (batched over ranks by row count)."""
        closing, self._closing = self._closing, []
        # Oldest blocks first, so a rank that closed more blocks than the ring holds in one
        # shipment keeps its newest ones; runs of equal length reduce together.
        closing.sort(key=lambda item: float(item[1][0, 0]))
        for _, run in groupby(closing, key=lambda item: len(item[1])):
            group = list(run)
            self._store([i for i, _ in group], np.stack([b for _, b in group]))

    def _store(self, rows_of: list[int], cube: FloatArray) -> None:
        n = len(rows_of)
        idx = np.asarray(rows_of)
        present = np.ones(n, dtype=bool)
        ids = cube[:, :, 0]
        block = (ids[:, 0] // self.block_steps).astype(np.int64)
        slot = block % self.slots
        steps = cube.shape[1]
        names = list(range(n))
        with np.errstate(over="ignore", invalid="ignore"):
            for c, clock in enumerate(CLOCKS):
                wm = _reduce_cube(names, present, cube, ids[0], clock=clock, outliers=self.outliers)
                kept = steps - np.asarray(wm.outlier_steps or (0,) * n, dtype=np.int64)
                self._sums[idx, slot, c] = wm.means * kept[:, None]
                self._measured[idx, slot, c] = wm.measured
                self._kept[idx, slot, c] = kept
        self._gpu_ok[idx, slot] = gpu_steps(cube).all(axis=1)
        self._async[idx, slot] = np.nan_to_num(cube[:, :, _ASYNC_COL]).any(axis=1)
        self._index[idx, slot] = block
        self._steps[idx, slot] = steps
        if self._stored is not None:
            self._stored += zip(idx.tolist(), slot.tolist(), strict=True)
        if steps == self.block_steps:  # every step id of the block (the usual case)
            self._mask[idx, slot] = np.packbits(np.ones(steps, dtype=bool))
            return
        offsets = (ids - (block * self.block_steps)[:, None]).astype(np.int64)
        bits = np.zeros((n, self.block_steps), dtype=bool)
        bits[np.arange(n)[:, None], offsets] = True
        self._mask[idx, slot] = np.packbits(bits, axis=1)

    # ---- records: closed blocks as plain data ----------------------------------------------

    def taken_records(self) -> tuple[list[int], np.ndarray]:
        """The blocks closed (and stored by :meth:`flush`) since the last call, as records
        (:func:`block_record_dtype`) with the rank each belongs to, oldest first."""
        if self._stored is None:
            raise ValueError("taken_records: these blocks were made without records=True")
        stored, self._stored = self._stored, []
        out = np.zeros(len(stored), dtype=self.record_dtype)
        if not stored:
            return [], out
        rows, slots = (np.asarray(x, dtype=np.int64) for x in zip(*stored, strict=True))
        out["index"] = self._index[rows, slots]
        out["steps"] = self._steps[rows, slots]
        out["sums"] = self._sums[rows, slots]
        out["measured"] = self._measured[rows, slots]
        out["kept"] = self._kept[rows, slots]
        out["gpu_ok"] = self._gpu_ok[rows, slots]
        out["async"] = self._async[rows, slots]
        out["mask"] = self._mask[rows, slots]
        return [self.ranks[i] for i in rows.tolist()], out

    def put_records(self, ranks: Sequence[int], records: np.ndarray) -> None:
        """Keep closed blocks summed elsewhere (each rank sums its own: :meth:`taken_records`),
        as if :meth:`add` had closed them here; ``records[j]`` belongs to ``ranks[j]``. A
        record older than its rank's slot already holds is ignored (it came late)."""
        if len(records) == 0:
            return
        if records.dtype != self.record_dtype:
            raise ValueError(
                f"field records: dtype {records.dtype}, expected the block records of "
                f"{self.block_steps}-step blocks"
            )
        rows = np.fromiter((self._row[r] for r in ranks), np.int64, len(records))
        block = records["index"]
        if (block < 0).any():
            raise ValueError(f"field records: block index {int(block.min())} is negative")
        slot = block % self.slots
        newer = block >= self._index[rows, slot]
        rows, slot, records = rows[newer], slot[newer], records[newer]
        self._index[rows, slot] = records["index"]
        self._steps[rows, slot] = records["steps"]
        self._sums[rows, slot] = records["sums"]
        self._measured[rows, slot] = records["measured"]
        self._kept[rows, slot] = records["kept"]
        self._gpu_ok[rows, slot] = records["gpu_ok"]
        self._async[rows, slot] = records["async"]
        self._mask[rows, slot] = records["mask"]

    # ---- windows ---------------------------------------------------------------------------

    def reduce(
        self,
        tails: Mapping[int, FloatArray | None],
        window: int,
        *,
        complete: Sequence[int] = (),
    ) -> WindowMeans:
        """Window means over the last ``window`` step ids every present rank sent.

        ``tails`` maps every rank to its newest kept rows (ascending; None or empty: absent),
        each holding at least its last ``tail_rows`` rows. ``complete`` names the ranks whose
        tail still holds every row they ever sent; when every present rank's does, the window
        comes from the rows alone.
        """
        window = validate_window(window)
        self.flush()
        self.approximate = False
        ranks = list(self.ranks)
        pmask = np.zeros(len(ranks), dtype=bool)
        kept: list[tuple[int, FloatArray]] = []
        for rank, rows in tails.items():
            if rows is not None and len(rows):
                i = self._row[rank]
                pmask[i] = True
                kept.append((i, np.asarray(rows, dtype=np.float64)))
        kept.sort(key=lambda x: x[0])
        rows_of = np.asarray([i for i, _ in kept], dtype=np.int64)
        tails_list = [t for _, t in kept]
        if not kept:
            return _reduce_cube(ranks, pmask, np.empty((0, 0, ROW_WIDTH)), np.empty(0))
        # Steps from ``split`` on come from the rows (every present rank kept all its rows
        # from there); older ones from closed blocks.
        bs = self.block_steps
        split = max(-(-int(t[0, 0]) // bs) * bs for t in tails_list)
        done = set(complete)
        if all(ranks[i] in done for i in rows_of):
            split = 0  # no present rank's ring dropped a row: every row is there
        elif min(int(t[-1, 0]) for t in tails_list) < split:
            self.approximate = True  # a rank's rows ended before the others' kept rows begin
        parts = [t[t[:, 0] >= split] for t in tails_list] if split else tails_list
        table = np.concatenate(parts)
        lengths = [len(p) for p in parts]
        present_ranks = [ranks[i] for i in rows_of]
        _check_table(table, lengths, present_ranks)
        with np.errstate(over="ignore", invalid="ignore"):
            cube, ids = _align(table, lengths, present_ranks, window)
            if cube.shape[1] >= window or split == 0:
                return _reduce_cube(ranks, pmask, cube, ids, outliers=self.outliers)
            return self._combine(ranks, pmask, rows_of, cube, ids, split, window)

    def reduce_cube(
        self,
        present_ranks: Sequence[int],
        cube: FloatArray,
        window: int,
        *,
        complete: bool,
    ) -> WindowMeans:
        """:meth:`reduce` for present ranks whose newest kept rows lie side by side: ``cube``
        is ``[len(present_ranks), n, ROW_WIDTH]`` in the ranks' order here, each rank's last
        ``n`` rows (a group's aggregator keeps them so), and ``complete`` says every present
        rank's rows are all there. The same means, without a table of every tail; rows not
        with the same ascending step ids, or not clean, go the general way."""
        window = validate_window(window)
        rows_of = np.fromiter((self._row[r] for r in present_ranks), np.int64, len(present_ranks))
        m, n = cube.shape[:2] if cube.ndim == 3 else (0, 0)
        ids = cube[0, :, 0] if m and n else np.empty(0)
        usual = (
            m > 0
            and n > 0
            and cube.shape[2] == ROW_WIDTH
            and bool((np.diff(rows_of) > 0).all())
            and bool((np.diff(ids) > 0).all())
            and bool((cube[:, :, 0] == ids).all())
            and _table_is_clean(cube)
        )
        if not usual:
            tails: dict[int, FloatArray | None] = dict.fromkeys(self.ranks)
            for j, rank in enumerate(present_ranks):
                tails[rank] = cube[j] if cube.ndim == 3 else None
            return self.reduce(tails, window, complete=present_ranks if complete else ())
        self.flush()
        self.approximate = False
        ranks = list(self.ranks)
        pmask = np.zeros(len(ranks), dtype=bool)
        pmask[rows_of] = True
        bs = self.block_steps
        # As reduce(): steps from ``split`` on come from the rows, older ones from blocks.
        split = 0 if complete else -(-int(ids[0]) // bs) * bs
        start = int(np.searchsorted(ids, split))
        tail, tail_ids = cube[:, start:], ids[start:]
        with np.errstate(over="ignore", invalid="ignore"):
            if tail.shape[1] >= window or split == 0:
                return _reduce_cube(
                    ranks, pmask, tail[:, -window:], tail_ids[-window:], outliers=self.outliers
                )
            return self._combine(ranks, pmask, rows_of, tail, tail_ids, split, window)

    def _combine(
        self,
        ranks: list[int],
        pmask: BoolArray,
        rows_of: np.ndarray,
        cube: FloatArray,
        ids: FloatArray,
        split: int,
        window: int,
    ) -> WindowMeans:
        bs = self.block_steps
        n_tail = cube.shape[1]
        # Closed blocks older than ``split``, newest first.
        ks = np.arange(split // bs - 1, max(split // bs - 1 - self.slots, -1), -1)
        slots = ks % self.slots
        every_slot = np.ix_(rows_of, slots)
        valid = self._index[every_slot] == ks  # [present, blocks]
        masks = np.where(valid[:, :, None], self._mask[every_slot], 0)
        common = np.bitwise_and.reduce(masks, axis=0)  # [blocks, bytes]
        counts = np.unpackbits(common, axis=1).sum(axis=1)
        take = (np.cumsum(counts) <= window - n_tail) & (counts > 0)
        used = np.flatnonzero(take)
        ragged = bool((masks[:, used] != common[None, used]).any())
        # The window start cut a block: some older common steps were left out short of the window.
        short = n_tail + int(counts[used].sum()) < window
        rounded = short and bool((counts[~take] > 0).any())
        self.approximate = self.approximate or ragged or rounded
        # Block sums stand for the common steps (exact unless ragged).
        at = np.ix_(rows_of, slots[used])  # the present ranks' used blocks, taken once each
        own = np.maximum(self._steps[at], 1)
        scale = counts[used][None, :] / own  # [present, used]
        sums = (self._sums[at] * scale[:, :, None, None]).sum(axis=1)
        kept = (self._kept[at] * scale[:, :, None]).sum(axis=1)
        meas = self._measured[at]  # [present, used, clocks, keys]
        every = np.where(_EVERY, meas.all(axis=1), meas.any(axis=1))
        gpu_blocks = bool(self._gpu_ok[at].all())
        async_collectives = bool(self._async[at].any())
        steps = n_tail + int(counts[used].sum())
        use_gpu = gpu_blocks and (n_tail == 0 or bool(gpu_steps(cube).all()))
        c = CLOCKS.index("gpu" if use_gpu else "cpu")
        block_sums, block_meas, block_kept = sums[:, c], every[:, c], kept[:, c]
        if n_tail:
            tail = _reduce_cube(
                list(range(len(rows_of))),
                np.ones(len(rows_of), dtype=bool),
                cube,
                ids,
                clock=CLOCKS[c],
                outliers=self.outliers,
            )
            tail_kept = n_tail - np.asarray(tail.outlier_steps or (0,) * len(rows_of))
            block_sums = block_sums + tail.means * tail_kept[:, None]
            block_kept = block_kept + tail_kept
            block_meas = np.where(_EVERY, block_meas & tail.measured, block_meas | tail.measured)
            async_collectives = async_collectives or tail.async_collectives
        means = np.zeros((len(ranks), _KEYS))
        measured = np.zeros((len(ranks), _KEYS), dtype=bool)
        left_out = np.rint(steps - block_kept).astype(np.int64)
        # Every step kept (the usual window): divide by the step count itself, as before.
        divisor = np.maximum(block_kept, 1.0)[:, None] if left_out.any() else steps
        sub = block_sums / divisor
        sub[~block_meas] = 0.0
        means[rows_of] = sub
        measured[rows_of] = block_meas
        if used.size:
            oldest = int(used[-1])
            first_bit = int(np.flatnonzero(np.unpackbits(common[oldest]))[0])
            first = int(ks[oldest]) * bs + first_bit
        else:
            first = int(ids[0])
        last = int(ids[-1]) if n_tail else first
        outlier_steps = np.zeros(len(ranks), dtype=np.int64)
        outlier_steps[rows_of] = left_out
        return WindowMeans(
            tuple(ranks),
            means,
            measured,
            pmask,
            steps,
            CLOCKS[c],
            (first, last),
            async_collectives,
            tuple(int(n) for n in outlier_steps) if left_out.any() else (),
        )

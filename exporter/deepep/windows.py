"""The root's DeepEP windows: consecutive gathered cumulative snapshots in, windows out.

A window is the difference of two snapshots: snapshots taken during warm-up are discarded, the
first one after warm-up becomes the boundary, and a counter that went down rejects the window
with a reason instead of producing nonsense deltas. Free of torch, so the EP root's child
process (:mod:`.root_process`) builds windows without loading it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from rankwatch.diagnosis.deepep.normal.schema import counter_length
from rankwatch.diagnosis.deepep.normal.window import (
    CounterSnapshot,
    InvalidWindowError,
    NormalWindow,
)

__all__ = ["LOW_LATENCY_PHASES", "CounterWindows", "DeepEPWindow"]

# The low-latency counters' phases, in the order of their rows in the counter block.
LOW_LATENCY_PHASES: tuple[str, ...] = ("dispatch", "combine")


@dataclass(frozen=True)
class DeepEPWindow:
    """One window of DeepEP counters as the root formed it (before diagnosis).

    ``normal`` is None when normal mode did not produce a window this time; then
    ``normal_invalid_reason`` says why if it was rejected. ``low_latency`` maps a phase
    (``dispatch``/``combine``) to the ``[receiver, peer]`` int64 delta matrix.
    """

    window_index: int
    start_time_s: float
    end_time_s: float
    normal: NormalWindow | None = None
    normal_invalid_reason: str | None = None
    low_latency: dict[str, np.ndarray] | None = None
    low_latency_invalid_reason: str | None = None
    # The full message of a rejection, for the log line (the reason is the short code).
    normal_invalid_detail: str | None = None
    low_latency_invalid_detail: str | None = None


def _low_latency_delta(prev: np.ndarray | None, cur: np.ndarray) -> dict[str, np.ndarray]:
    """Per-phase ``[receiver, peer]`` deltas, or InvalidWindowError with the reason."""
    if np.any(cur < 0):
        raise _ll_wrapped(cur)
    delta = cur if prev is None else cur - prev
    if np.any(delta < 0):
        recv, phase, peer = np.argwhere(delta < 0)[0]
        raise InvalidWindowError(
            "counter_reset",
            f"rank {recv} {LOW_LATENCY_PHASES[phase]}[{peer}] went down by "
            f"{-delta[recv, phase, peer]}",
        )
    if not np.any(delta > 0):
        raise InvalidWindowError("empty_window", "no low-latency wait recorded")
    return {p: delta[:, i, :].copy() for i, p in enumerate(LOW_LATENCY_PHASES)}


def _stale(taken_at_s: float, previous_s: float) -> InvalidWindowError | None:
    """A snapshot taken before the previous one (reordered, or the clock went back)."""
    if taken_at_s < previous_s:
        return InvalidWindowError(
            "stale_snapshot",
            f"taken at {taken_at_s!r}, before the previous snapshot at {previous_s!r}",
        )
    return None


def _wrapped(counters: np.ndarray) -> InvalidWindowError:
    dst, col = np.argwhere(counters < 0)[0]
    return InvalidWindowError(
        "counter_wraparound", f"rank {dst} counter[{col}] = {counters[dst, col]} is negative"
    )


def _ll_wrapped(cur: np.ndarray) -> InvalidWindowError:
    recv, phase, peer = np.argwhere(cur < 0)[0]
    return InvalidWindowError(
        "counter_wraparound",
        f"rank {recv} {LOW_LATENCY_PHASES[phase]}[{peer}] = {cur[recv, phase, peer]} is negative",
    )


def _integral_block(name: str, arr: np.ndarray) -> np.ndarray:
    """``arr`` as int64, or InvalidWindowError: a float block with NaN/inf or fractions is not
    a counter reading (casting it would turn NaN into a huge negative count)."""
    if np.issubdtype(arr.dtype, np.integer):
        return arr.astype(np.int64, copy=True)
    if arr.dtype == np.bool_ or arr.dtype.kind not in "f":
        raise InvalidWindowError("bad_value", f"{name}: expected integer counters, got {arr.dtype}")
    if not np.all(np.isfinite(arr)):
        raise InvalidWindowError("non_finite", f"{name}: contains NaN or inf")
    if np.any(arr != np.round(arr)):
        raise InvalidWindowError("bad_value", f"{name}: non-integer values")
    return arr.astype(np.int64)


class CounterWindows:
    """The root's window builder: consecutive cumulative snapshots in, windows out.

    Normal and low-latency parts keep their own boundary, because synchronous collection
    snapshots them at different calls. With ``warmup_seconds > 0`` every snapshot taken before
    ``started_at_s + warmup_seconds`` is discarded and the first one at or after it becomes the
    boundary; with no warm-up the boundary is the all-zero block the counters started from.
    With ``boundary_first`` (a root started again mid-run) the first snapshot after warm-up is
    the boundary even without a warm-up.
    """

    def __init__(
        self,
        ep_size: int,
        ranks_per_node: int,
        *,
        normal: bool,
        low_latency: bool,
        warmup_seconds: float = 0.0,
        started_at_s: float | None = None,
        instance_id: str = "",
        boundary_first: bool = False,
    ) -> None:
        if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
            raise ValueError(f"ep_size: must be a positive int, got {ep_size!r}")
        if (
            isinstance(ranks_per_node, bool)
            or not isinstance(ranks_per_node, int)
            or ranks_per_node < 1
            or ep_size % ranks_per_node
        ):
            raise ValueError(
                f"ranks_per_node: must be a positive divisor of ep_size={ep_size}, "
                f"got {ranks_per_node!r}"
            )
        if (
            isinstance(warmup_seconds, bool)
            or not isinstance(warmup_seconds, (int, float))
            or not warmup_seconds >= 0
            or warmup_seconds == float("inf")
        ):
            raise ValueError(
                f"warmup_seconds: must be a finite number >= 0, got {warmup_seconds!r}"
            )
        self.ep_size = ep_size
        self.ranks_per_node = ranks_per_node
        self.instance_id = instance_id
        self._enabled = {"normal": normal, "low_latency": low_latency}
        self._warmup_end = (time.time() if started_at_s is None else started_at_s) + float(
            warmup_seconds
        )
        # A root started again mid-run (``boundary_first``) has no snapshot to difference its
        # first one against: the counters did not start from zero for it.
        fresh = warmup_seconds <= 0 and not boundary_first
        self._has_boundary = {"normal": fresh, "low_latency": fresh}
        self._prev_normal: CounterSnapshot | None = None
        self._prev_ll: np.ndarray | None = None
        self._prev_ll_taken_at = 0.0
        self._prev_time = {"normal": self._warmup_end, "low_latency": self._warmup_end}
        self._sequence = 0
        self.next_window_index = 0

    def feed(
        self,
        taken_at_s: float,
        normal: np.ndarray | None = None,
        low_latency: np.ndarray | None = None,
    ) -> DeepEPWindow | None:
        """Take one gathered snapshot; return its window, or None while only a boundary.

        ``normal`` is the gathered ``[EP, counter_length(EP)]`` block, ``low_latency`` the
        gathered ``[EP, 2, EP]`` block (rows are reporting ranks); pass what was snapshotted.

        Bad counter data rejects the window with a reason (``non_finite``, ``bad_value``,
        ``counter_wraparound``, ``stale_snapshot`` for a snapshot taken before the previous
        one, ``counter_reset``, ``empty_window``). Only a reset or an idle snapshot becomes the
        next boundary: an unusable reading does not, so the next good snapshot forms a window
        against the last good one. A block of the wrong shape raises
        :class:`InvalidWindowError` (reason ``shape_mismatch``) and changes nothing.
        """
        if normal is None and low_latency is None:
            raise ValueError("feed: expected normal and/or low_latency, got neither")
        if (
            isinstance(taken_at_s, bool)
            or not isinstance(taken_at_s, (int, float))
            or not math.isfinite(taken_at_s)
        ):
            raise ValueError(f"taken_at_s: expected a finite unix time, got {taken_at_s!r}")
        ep = self.ep_size
        normal_arr = ll_arr = None
        # Check both shapes first: a wrong block must not leave one part half-fed.
        if normal is not None:
            if not self._enabled["normal"]:
                raise ValueError("normal: normal mode is not enabled for these windows")
            normal_arr = np.asarray(normal)
            if normal_arr.shape != (ep, counter_length(ep)):
                raise InvalidWindowError(
                    "shape_mismatch",
                    f"normal: expected shape {(ep, counter_length(ep))}, got {normal_arr.shape}",
                )
        if low_latency is not None:
            if not self._enabled["low_latency"]:
                raise ValueError("low_latency: low-latency mode is not enabled for these windows")
            ll_arr = np.asarray(low_latency)
            expected = (ep, len(LOW_LATENCY_PHASES), ep)
            if ll_arr.shape != expected:
                raise InvalidWindowError(
                    "shape_mismatch", f"low_latency: expected shape {expected}, got {ll_arr.shape}"
                )
        self._sequence += 1
        out: dict[str, Any] = {}
        start = taken_at_s
        if normal_arr is not None:
            snap: CounterSnapshot | None = None
            problem: InvalidWindowError | None = None
            try:
                snap = CounterSnapshot(normal_arr, sequence=self._sequence, taken_at_s=taken_at_s)
            except InvalidWindowError as exc:
                problem = exc
            if problem is None and self._prev_normal is not None:
                problem = _stale(taken_at_s, self._prev_normal.taken_at_s)
            if snap is not None and problem is None and np.any(snap.counters < 0):
                problem = _wrapped(snap.counters)
            if self._has_boundary["normal"]:
                start = min(start, self._prev_time["normal"])
                try:
                    if problem is not None:
                        raise problem
                    assert snap is not None
                    out["normal"] = NormalWindow.from_snapshots(
                        self._prev_normal,
                        snap,
                        self.ranks_per_node,
                        window_index=self.next_window_index,
                        instance_id=self.instance_id,
                    )
                except InvalidWindowError as exc:
                    out["normal_invalid_reason"] = exc.reason
                    out["normal_invalid_detail"] = str(exc)
            # A reading that could not form a window is no boundary for the next one either.
            if problem is None and (self._has_boundary["normal"] or taken_at_s >= self._warmup_end):
                self._has_boundary["normal"] = True
                self._prev_normal = snap
                self._prev_time["normal"] = taken_at_s
        if ll_arr is not None:
            cur: np.ndarray | None = None
            ll_problem: InvalidWindowError | None = None
            try:
                cur = _integral_block("low_latency", ll_arr)
            except InvalidWindowError as exc:
                ll_problem = exc
            if ll_problem is None and self._prev_ll is not None:
                ll_problem = _stale(taken_at_s, self._prev_ll_taken_at)
            if cur is not None and ll_problem is None and np.any(cur < 0):
                ll_problem = _ll_wrapped(cur)
            if self._has_boundary["low_latency"]:
                start = min(start, self._prev_time["low_latency"])
                try:
                    if ll_problem is not None:
                        raise ll_problem
                    assert cur is not None
                    out["low_latency"] = _low_latency_delta(self._prev_ll, cur)
                except InvalidWindowError as exc:
                    out["low_latency_invalid_reason"] = exc.reason
                    out["low_latency_invalid_detail"] = str(exc)
            if ll_problem is None and (
                self._has_boundary["low_latency"] or taken_at_s >= self._warmup_end
            ):
                self._has_boundary["low_latency"] = True
                self._prev_ll = cur
                self._prev_ll_taken_at = taken_at_s
                self._prev_time["low_latency"] = taken_at_s
        if not out:
            return None
        window = DeepEPWindow(
            window_index=self.next_window_index,
            start_time_s=start,
            end_time_s=taken_at_s,
            **out,
        )
        self.next_window_index += 1
        return window

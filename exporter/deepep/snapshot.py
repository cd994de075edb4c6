"""Ordered snapshots of the DeepEP counter block, their gather, and the root's windows.

A snapshot must not tear: DeepEP's kernels keep adding to the counters while we read them. The
copy is therefore enqueued on the stream that writes the counters (the *producer* stream, e.g.
``Buffer.get_comm_stream()``), so it sees exactly the kernels enqueued before it:

* synchronous collection (training thread): one device-to-device copy on the producer stream,
  the current stream waits for its event, and the stable copy is gathered through the EP group;
* asynchronous collection (background thread): the same device copy, a private stream waits for
  its event and copies the stable buffer into pinned host memory, and the host copy is gathered
  through a Gloo group with the same members.

Without a producer stream the copy is unordered and best-effort (one warning). On CPU tensors
there are no streams: the copy is a plain clone and the rest of the path is unchanged.

The group's root turns consecutive cumulative snapshots into windows (:class:`CounterWindows`):
a window is the difference of two snapshots, snapshots taken during warm-up are discarded, the
first one after warm-up becomes the boundary, and a counter that went down rejects the window
with a reason instead of producing nonsense deltas.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rankwatch.diagnosis.deepep.normal.schema import counter_length
from rankwatch.diagnosis.deepep.normal.window import (
    CounterSnapshot,
    InvalidWindowError,
    NormalWindow,
)
from rankwatch.exporter.deepep.counters import LOW_LATENCY_PHASES

__all__ = [
    "CounterWindows",
    "DeepEPWindow",
    "OrderedSnapshotter",
    "PendingSnapshot",
    "gather_rows",
]

UNORDERED_WARNING = (
    "no producer stream was given: DeepEP counter snapshots are unordered best-effort copies "
    "that may mix counts of a kernel still running; pass snapshot_stream=buffer.get_comm_stream()"
)


@dataclass
class PendingSnapshot:
    """A gathered ``[EP, n]`` block on its way to the host.

    On CUDA the tensor may still be written by the gather; ``ready`` is the event recorded after
    it, so the host copy can wait for it on a private stream instead of the training thread.
    """

    rows: torch.Tensor
    taken_at_s: float
    ready: Any = None  # torch.cuda.Event on CUDA, else None

    def to_numpy(self, copy_stream: Any = None) -> np.ndarray:
        """The block as int64 numpy; on CUDA waits only on this (background) thread."""
        if not self.rows.is_cuda:
            return self.rows.numpy().astype(np.int64, copy=True)
        with torch.cuda.device(self.rows.device):
            stream = copy_stream if copy_stream is not None else torch.cuda.Stream()
            host = torch.empty(self.rows.shape, dtype=self.rows.dtype, pin_memory=True)
            if self.ready is not None:
                stream.wait_event(self.ready)
            # The rows were allocated on another stream; keep them alive for this one.
            self.rows.record_stream(stream)
            done = torch.cuda.Event()
            with torch.cuda.stream(stream):
                host.copy_(self.rows, non_blocking=True)
                done.record(stream)
            done.synchronize()
        return host.numpy().astype(np.int64, copy=True)


class OrderedSnapshotter:
    """Takes stream-ordered copies of (a region of) one rank's counter storage.

    ``producer_stream`` is the CUDA stream that writes the counters; None falls back to
    unordered copies with a single warning. On CPU storage it is ignored.
    """

    def __init__(self, storage: torch.Tensor, producer_stream: Any = None) -> None:
        if not isinstance(storage, torch.Tensor) or storage.dim() != 1:
            raise TypeError(f"storage: expected a 1-D torch.Tensor, got {storage!r}")
        if storage.dtype != torch.int64:
            raise TypeError(f"storage: expected dtype torch.int64, got {storage.dtype}")
        self._storage = storage
        self._cuda = storage.is_cuda
        self._producer = producer_stream if self._cuda else None
        self._warned = False
        self._staging: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._copy_stream: Any = None
        if self._cuda:
            with torch.cuda.device(storage.device):
                self._staging = torch.empty_like(storage)
                # Zeroed: it is also what a snapshot hands out before its first real copy.
                self._host = torch.zeros(storage.shape, dtype=storage.dtype, pin_memory=True)
                self._copy_stream = torch.cuda.Stream()
                self._staged = torch.cuda.Event()
                self._copied = torch.cuda.Event()

    @property
    def ordered(self) -> bool:
        """True when copies are ordered with the counter writer (always on CPU)."""
        return not self._cuda or self._producer is not None

    @property
    def copy_stream(self) -> Any:
        """The private CUDA stream used for host copies (None on CPU)."""
        return self._copy_stream

    def _warn_unordered(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(UNORDERED_WARNING, RuntimeWarning, stacklevel=3)

    def device_copy(self, region: slice) -> torch.Tensor | None:
        """Synchronous path: a stable copy on the counters' device; the current stream waits.

        Returns None while the current stream is being captured into a CUDA graph (a snapshot
        cannot be taken there, and every rank is capturing at the same call).
        """
        src = self._storage[region]
        if not self._cuda:
            return src.clone()
        if torch.cuda.is_current_stream_capturing():
            return None
        with torch.cuda.device(self._storage.device):
            consumer = torch.cuda.current_stream()
            stream = self._producer
            if stream is None:
                self._warn_unordered()
                stream = consumer
            # A fresh buffer each time: the gather reading the previous one may still be queued.
            out = torch.empty_like(src)
            event = torch.cuda.Event()
            with torch.cuda.stream(stream):
                out.copy_(src, non_blocking=True)
                event.record(stream)
            if stream is not consumer:
                out.record_stream(stream)
                consumer.wait_event(event)
            return out

    def host_copy(self, region: slice) -> torch.Tensor:
        """Asynchronous path (background thread only): a stable copy in host memory."""
        src = self._storage[region]
        if not self._cuda:
            return src.clone()
        assert self._staging is not None and self._host is not None
        n = src.numel()
        with torch.cuda.device(self._storage.device):
            if self._producer is not None and _capturing(self._producer):
                # Nothing may be enqueued on a stream under CUDA-graph capture. Hand out the
                # last stable copy: cumulative counters just move into the next window.
                return self._host[:n].clone()
            if self._producer is not None:
                staging = self._staging[region]
                # One D2D copy at this point of the producer stream: later kernels cannot leak in.
                with torch.cuda.stream(self._producer):
                    staging.copy_(src, non_blocking=True)
                    self._staged.record(self._producer)
                self._copy_stream.wait_event(self._staged)
                source = staging
            else:
                self._warn_unordered()
                source = src
            with torch.cuda.stream(self._copy_stream):
                self._host[:n].copy_(source, non_blocking=True)
                self._copied.record(self._copy_stream)
            # Waiting here blocks this background thread only, never the training thread.
            self._copied.synchronize()
            return self._host[:n].clone()


def _capturing(stream: Any) -> bool:
    with torch.cuda.stream(stream):
        return bool(torch.cuda.is_current_stream_capturing())


def gather_rows(
    local: torch.Tensor,
    group: dist.ProcessGroup,
    root_global_rank: int,
    is_root: bool,
    row_order: Sequence[int] | None = None,
) -> PendingSnapshot | None:
    """Gather every member's 1-D ``local`` to the root as ``[group size, n]`` rows.

    ``root_global_rank`` is the root's *global* rank (what ``dist.gather`` expects, whatever the
    group). ``row_order[i]`` is the gathered row that belongs at position ``i`` (used when the
    gathering group orders its members differently from the EP group). Non-roots get None.
    """
    taken_at = time.time()
    size = dist.get_world_size(group)
    gather_list = [torch.empty_like(local) for _ in range(size)] if is_root else None
    dist.gather(local, gather_list=gather_list, dst=root_global_rank, group=group)
    if gather_list is None:
        return None
    if row_order is not None:
        gather_list = [gather_list[i] for i in row_order]
    rows = torch.stack(gather_list)
    ready = None
    if rows.is_cuda:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(rows.device))
    return PendingSnapshot(rows=rows, taken_at_s=taken_at, ready=ready)


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
        warm = warmup_seconds > 0
        self._has_boundary = {"normal": not warm, "low_latency": not warm}
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

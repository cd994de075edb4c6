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

The group's root turns consecutive cumulative snapshots into windows
(:class:`~.windows.CounterWindows`, re-exported here).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

# The root's windows live in their own module (torch-free, for the root's child process); they
# are still importable from here.
from rankwatch.exporter.deepep.windows import CounterWindows, DeepEPWindow

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

    def to_numpy(self, copy_stream: Any = None, *, copy: bool = True) -> np.ndarray:
        """The block as int64 numpy; on CUDA waits only on this (background) thread. Without
        ``copy`` the array may share the gathered block's memory (for a reader that only reads
        it: the root's child process is sent its bytes)."""
        if not self.rows.is_cuda:
            return self.rows.numpy().astype(np.int64, copy=copy)
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
        # The pinned buffer is this call's own: no copy needed when the caller only reads.
        return host.numpy().astype(np.int64, copy=copy)


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

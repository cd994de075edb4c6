"""The DeepEP counter block of one rank: one contiguous int64 allocation, handed out as views.

DeepEP's kernels add to cumulative counters that rankwatch owns. Every counter of a rank lives
in a single int64 tensor so that one device-to-device copy snapshots all of them at one point of
the producer stream:

``[ normal-mode block (counter_length(EP) values) | low-latency block (2 x EP values) ]``

The normal-mode part follows the schema table (:func:`counter_slots`); the two bundles DeepEP's
normal ``dispatch`` and ``combine`` take are views into it, in ``DISPATCH_BUNDLE`` and
``COMBINE_BUNDLE`` order. The kernels index every per-rank view by global rank: the logical
source for ``dispatch_final`` and ``combine_logical_recv``, the RDMA sender with this rank's own
GPU index for ``dispatch_rdma_recv`` (and this rank itself for its local lane); the views pass
that through unchanged and the diagnosis reads it so. The low-latency part is two
``int64[EP]`` vectors (dispatch, combine) indexed by peer rank. A part that is not enabled has
length zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rankwatch.diagnosis.deepep.normal.schema import (
    COMBINE_BUNDLE,
    DISPATCH_BUNDLE,
    counter_length,
    counter_slots,
)
from rankwatch.exporter.deepep.windows import LOW_LATENCY_PHASES

__all__ = ["LOW_LATENCY_PHASES", "DeepEPCounters", "allocate_counters", "bundle_views"]

# LOW_LATENCY_PHASES, the row order of the low-latency part (DeepEP's low_latency_dispatch then
# low_latency_combine), is defined with the windows that read it.


def bundle_views(
    normal_block: torch.Tensor, ep_size: int, order: tuple[tuple[str, str], ...]
) -> tuple[torch.Tensor, ...]:
    """Views into ``normal_block`` for the schema rows in ``order`` (a DeepEP bundle).

    Each view shares storage with the block, so a kernel writing through it updates the block.
    """
    if not isinstance(normal_block, torch.Tensor):
        raise TypeError(f"normal_block: expected a torch.Tensor, got {type(normal_block).__name__}")
    slots = counter_slots(ep_size)
    expected = counter_length(ep_size)
    if normal_block.dim() != 1 or normal_block.numel() != expected:
        raise ValueError(
            f"normal_block: expected a 1-D tensor of {expected} values for ep_size={ep_size}, "
            f"got shape {tuple(normal_block.shape)}"
        )
    if normal_block.dtype != torch.int64:
        raise TypeError(f"normal_block: expected dtype torch.int64, got {normal_block.dtype}")
    views = []
    for key in order:
        if key not in slots:
            raise ValueError(f"order: unknown schema row {key!r}")
        slot = slots[key]
        views.append(normal_block[slot.offset : slot.stop])
    return tuple(views)


@dataclass(frozen=True)
class DeepEPCounters:
    """One rank's counters: the allocation and the views DeepEP writes through.

    ``storage`` is the whole allocation; ``normal`` (length ``counter_length(ep_size)``) and
    ``low_latency`` (shape ``[2, ep_size]``, rows in :data:`LOW_LATENCY_PHASES` order) are views
    into it, or None when that mode is disabled.
    """

    storage: torch.Tensor
    ep_size: int
    normal: torch.Tensor | None
    low_latency: torch.Tensor | None

    @property
    def normal_region(self) -> slice:
        """Where the normal-mode part sits in ``storage``."""
        return slice(0, 0 if self.normal is None else self.normal.numel())

    @property
    def low_latency_region(self) -> slice:
        """Where the low-latency part sits in ``storage``."""
        start = self.normal_region.stop
        return slice(start, start + (0 if self.low_latency is None else self.low_latency.numel()))

    def dispatch_bundle(self) -> tuple[torch.Tensor, ...] | None:
        """The ten-tensor bundle for DeepEP's normal dispatch, or None if normal mode is off."""
        if self.normal is None:
            return None
        return bundle_views(self.normal, self.ep_size, DISPATCH_BUNDLE)

    def combine_bundle(self) -> tuple[torch.Tensor, ...] | None:
        """The five-tensor bundle for DeepEP's normal combine, or None if normal mode is off."""
        if self.normal is None:
            return None
        return bundle_views(self.normal, self.ep_size, COMBINE_BUNDLE)


def allocate_counters(
    ep_size: int, *, normal: bool, low_latency: bool, device: torch.device | str = "cpu"
) -> DeepEPCounters:
    """Allocate a zeroed counter block for an EP group of ``ep_size`` ranks on ``device``."""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size: must be a positive int, got {ep_size!r}")
    for name, flag in (("normal", normal), ("low_latency", low_latency)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {flag!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: not a torch device ({exc}), got {device!r}") from None
    n_normal = counter_length(ep_size) if normal else 0
    n_ll = len(LOW_LATENCY_PHASES) * ep_size if low_latency else 0
    # At least one element so the allocation is real even with both modes off.
    storage = torch.zeros(max(1, n_normal + n_ll), dtype=torch.int64, device=dev)
    return DeepEPCounters(
        storage=storage,
        ep_size=ep_size,
        normal=storage[:n_normal] if normal else None,
        low_latency=storage[n_normal : n_normal + n_ll].view(len(LOW_LATENCY_PHASES), ep_size)
        if low_latency
        else None,
    )

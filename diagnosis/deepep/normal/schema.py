"""The DeepEP normal-mode counter schema: one named table, everything else derives from it.

Every rank owns one contiguous int64 block. Its slots, in order (notify -> dispatch -> combine):

====================== ============= ========= =============================================
probe                  field         length    indexed by
====================== ============= ========= =============================================
notify_dispatch        duration_ns   1         (this rank's kernel)
notify_dispatch        count         1
cached_notify_dispatch duration_ns   1
cached_notify_dispatch count         1
cached_notify_combine  duration_ns   1
cached_notify_combine  count         1
dispatch_final         cost          EP        logical source rank
dispatch_final         sample        EP
dispatch_final         token         EP
dispatch_rdma_recv     cost          EP        RDMA sender rank (same GPU index, see below)
dispatch_rdma_recv     sample        EP
dispatch_rdma_recv     token         EP
combine_logical_recv   cost          EP        logical source rank
combine_logical_recv   sample        EP
combine_logical_recv   token         EP
====================== ============= ========= =============================================

All values are cumulative since the block was zeroed. A rank's block describes what *it*
received, so gathering one block per rank yields ``[destination, source]`` rows; the window
code transposes them into source-oriented ``[src, dst]`` matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "COMBINE_BUNDLE",
    "COMPLETION_FIELDS",
    "COMPLETION_PROBES",
    "DISPATCH_BUNDLE",
    "INTERNODE_NODE_COUNTS",
    "MAX_INTERNODE_EP",
    "NOTIFY_FIELDS",
    "NOTIFY_PROBES",
    "NVL_DOMAIN_SIZE",
    "PROBES",
    "SCHEMA",
    "CounterSlot",
    "counter_length",
    "counter_slots",
    "internode_ranks_per_node",
]

NOTIFY_PROBES: tuple[str, ...] = (
    "notify_dispatch",
    "cached_notify_dispatch",
    "cached_notify_combine",
)
COMPLETION_PROBES: tuple[str, ...] = (
    "dispatch_final",
    "dispatch_rdma_recv",
    "combine_logical_recv",
)
PROBES: tuple[str, ...] = NOTIFY_PROBES + COMPLETION_PROBES
NOTIFY_FIELDS: tuple[str, ...] = ("duration_ns", "count")

# DeepEP's internode kernels, the only ones that record these counters, fix the NVLink domain at
# NUM_MAX_NVL_PEERS = 8 GPUs and are compiled for these node (RDMA rank) counts only
# (SWITCH_RDMA_RANKS; the Buffer's dispatch/combine configs list the same EP sizes).
NVL_DOMAIN_SIZE = 8
INTERNODE_NODE_COUNTS: tuple[int, ...] = (2, 3, 4, 6, 8, 12, 16, 18, 20)
MAX_INTERNODE_EP = NVL_DOMAIN_SIZE * max(INTERNODE_NODE_COUNTS)
COMPLETION_FIELDS: tuple[str, ...] = ("cost", "sample", "token")

# (probe, field, per_rank): per_rank=True means one entry per EP rank, else a single scalar.
SCHEMA: tuple[tuple[str, str, bool], ...] = tuple(
    [(p, f, False) for p in NOTIFY_PROBES for f in NOTIFY_FIELDS]
    + [(p, f, True) for p in COMPLETION_PROBES for f in COMPLETION_FIELDS]
)

# Which schema rows the DeepEP dispatch (10 tensors) and combine (5 tensors) kernels take,
# in the order they take them.
DISPATCH_BUNDLE: tuple[tuple[str, str], ...] = (
    ("notify_dispatch", "duration_ns"),
    ("notify_dispatch", "count"),
    ("cached_notify_dispatch", "duration_ns"),
    ("cached_notify_dispatch", "count"),
    ("dispatch_final", "cost"),
    ("dispatch_final", "sample"),
    ("dispatch_final", "token"),
    ("dispatch_rdma_recv", "cost"),
    ("dispatch_rdma_recv", "sample"),
    ("dispatch_rdma_recv", "token"),
)
COMBINE_BUNDLE: tuple[tuple[str, str], ...] = (
    ("cached_notify_combine", "duration_ns"),
    ("cached_notify_combine", "count"),
    ("combine_logical_recv", "cost"),
    ("combine_logical_recv", "sample"),
    ("combine_logical_recv", "token"),
)


@dataclass(frozen=True)
class CounterSlot:
    """Where one schema row lives inside a rank's int64 block."""

    probe: str
    field: str
    offset: int
    length: int

    @property
    def stop(self) -> int:
        return self.offset + self.length


def counter_slots(ep_size: int) -> dict[tuple[str, str], CounterSlot]:
    """The block layout for an EP group of ``ep_size`` ranks, keyed by ``(probe, field)``."""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size: must be a positive int, got {ep_size!r}")
    slots: dict[tuple[str, str], CounterSlot] = {}
    offset = 0
    for probe, fld, per_rank in SCHEMA:
        length = ep_size if per_rank else 1
        slots[(probe, fld)] = CounterSlot(probe, fld, offset, length)
        offset += length
    return slots


def counter_length(ep_size: int) -> int:
    """Number of int64 values in one rank's block: 6 + 9 * ep_size."""
    slots = counter_slots(ep_size)
    return max(s.stop for s in slots.values())


def internode_ranks_per_node(ep_size: int, ranks_per_node: int | None = None) -> int | None:
    """The node size normal-mode counters of an EP group follow, as DeepEP fixes it.

    An EP group of more than 8 ranks runs DeepEP's internode kernels: 8 GPUs per NVLink domain,
    so the result is 8 and ``ranks_per_node`` may only be None or 8; an EP size the internode
    kernels cannot run (not a multiple of 8, above 160, or a node count they are not compiled
    for, e.g. 40) raises ``ValueError``. A group of 8 or
    fewer runs the intranode kernels, which record no normal-mode counters: None (the caller
    keeps its own layout, one node).
    """
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size: must be a positive int, got {ep_size!r}")
    if ep_size <= NVL_DOMAIN_SIZE:
        return None
    if ep_size % NVL_DOMAIN_SIZE or ep_size // NVL_DOMAIN_SIZE not in INTERNODE_NODE_COUNTS:
        supported = ", ".join(str(n * NVL_DOMAIN_SIZE) for n in INTERNODE_NODE_COUNTS)
        raise ValueError(
            f"ep_size: DeepEP's internode normal mode runs multiples of {NVL_DOMAIN_SIZE} ranks "
            f"up to {MAX_INTERNODE_EP} ({supported}), got {ep_size}"
        )
    if ranks_per_node is not None and ranks_per_node != NVL_DOMAIN_SIZE:
        raise ValueError(
            f"ranks_per_node: DeepEP's internode normal mode fixes {NVL_DOMAIN_SIZE} GPUs per "
            f"NVLink domain, got {ranks_per_node!r} for EP size {ep_size}"
        )
    return NVL_DOMAIN_SIZE

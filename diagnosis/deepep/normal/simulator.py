"""A seeded simulator of DeepEP normal-mode counters, for tests, benchmarks and the demo.

It models one EP group laid out node by node and produces, per window, the deltas of all six
probes the way the kernels would count them:

* Notify: every launch, ranks arrive with a small random skew and the kernel holds each rank
  until the last one arrives, so a rank's duration is the kernel's own time plus its wait. A
  rank delayed before a stage waits least, so its duration ratio drops far below 1.
* Completion: per source -> destination pair and call, a routed token count (top-k routing
  over experts spread evenly on the ranks), one sample per active channel, and a cost per
  sample in cycles that depends on the path (intra-node NVLink or inter-node RDMA), mildly on
  the load, on a fixed per-path spread and on per-window noise.
* The RDMA receive matrix is laid out as DeepEP's internode dispatch kernel writes it: a
  token owner sends over RDMA to the rank with its own local GPU index on each destination node
  (that rank forwards over NVLink), and the receiving rank records the edge under the sender's
  rank. So only ``src -> dst`` cells with ``src % ranks_per_node == dst % ranks_per_node`` carry
  samples: the inter-node edges of each rail, and the diagonal, the rank's own local lane (a
  copy that never leaves the GPU). One sample per channel and call that had tokens.

Phases (the five of the validation run, see ``PHASES``):

``baseline``
    nothing wrong.
``pre_dispatch_delay``
    ``slow_rank`` reaches both dispatch Notify kernels late; Completion unchanged.
``pre_combine_delay``
    ``slow_rank`` reaches the combine Notify kernel late; Completion unchanged.
``all_hca_pressure``
    every HCA is loaded, so exactly the paths that cross the network slow down: inter-node
    Completion cost rises 1.371x (dispatch final), 1.447x (RDMA receive) and 1.514x
    (combine); NVLink paths inside a node are untouched. On one node nothing changes.
``single_hca_pressure``
    one HCA per node is loaded: the GPUs sharing it (local indices ``pressured_local_ranks``,
    ranks 0/1/8/9 at EP16) send (dispatch), relay (RDMA receive) and receive (combine) slower;
    their NVLink traffic stalls behind the congested sends. On one node nothing changes.

Further faults (``FAULT_PHASES``), for the accuracy matrix:

``node_pair_pressure``
    the network between ``pressured_nodes`` is congested: dense paths between those two
    nodes (both directions) slow by ``node_pair_factor``, RDMA edges between them too.
``slow_link``
    one degraded GPU pair ``slow_link``: every dense path between the two ranks, both
    directions, slows by ``link_factor``.
``slow_row``
    rank ``slow_rank``'s dispatch sends slow by ``row_factor`` (only dispatch sees it).
``hot_expert``
    rank ``hot_rank`` hosts an expert ``hot_factor`` times as popular as the others: it
    receives that many more tokens in dispatch and sends that many back in combine, and its
    cost per sample rises with the load (no hardware is slow).

``rank_hang``
    rank ``hang_rank`` stops: its counters advance by nothing and no rank receives anything
    from it, while every other rank goes on (the window in which a hang begins).

``window`` takes one phase or a sequence of phases applied together (a persistent local
fault while all HCAs are loaded). Randomness comes from one ``numpy`` generator seeded at
construction: the same seed and calls give the same counters.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np

from rankwatch.diagnosis.deepep.normal.schema import (
    COMPLETION_PROBES,
    NOTIFY_PROBES,
    counter_length,
)
from rankwatch.diagnosis.deepep.normal.window import (
    CounterSnapshot,
    NormalWindow,
    snapshot_counters,
)

__all__ = [
    "ALL_PHASES",
    "FAULT_PHASES",
    "PHASES",
    "NormalSimulator",
    "SimulatorProfile",
    "phase_timeline",
]

PHASES: tuple[str, ...] = (
    "baseline",
    "pre_dispatch_delay",
    "pre_combine_delay",
    "all_hca_pressure",
    "single_hca_pressure",
)

# Faults beyond the validation run's five phases (see the module docstring).
FAULT_PHASES: tuple[str, ...] = (
    "node_pair_pressure",
    "slow_link",
    "slow_row",
    "hot_expert",
    "rank_hang",
)
ALL_PHASES: tuple[str, ...] = PHASES + FAULT_PHASES

# Completion cost growth of the all-HCA phase, per probe (the validation run's medians).
ALL_HCA_FACTORS: dict[str, float] = {
    "dispatch_final": 1.371,
    "dispatch_rdma_recv": 1.447,
    "combine_logical_recv": 1.514,
}


@dataclass(frozen=True)
class SimulatorProfile:
    """Workload and hardware figures the simulator draws from (defaults: the EP16 run)."""

    tokens_per_rank: int = 4096
    top_k: int = 8
    experts_per_rank: int = 8
    channels: int = 12
    iterations_per_window: int = 64
    # Average Notify kernel time per launch without waiting, ns.
    notify_base_ns: tuple[float, float, float] = (25_000.0, 12_000.0, 10_000.0)
    arrival_skew_ns: float = 3_000.0
    late_arrival_ns: float = 700_000.0
    # Cycles per sample: (intra-node, inter-node) for the dense probes, one value for RDMA.
    dispatch_cycles: tuple[float, float] = (40_000.0, 110_000.0)
    rdma_cycles: float = 70_000.0
    # The RDMA receive probe's local lane (the rank's own tokens for its own node).
    rdma_local_cycles: float = 20_000.0
    combine_cycles: tuple[float, float] = (45_000.0, 125_000.0)
    load_exponent: float = 0.3
    path_spread: float = 0.03
    window_noise: float = 0.02
    # Single-HCA pressure: slowdown of the RDMA leg, and of the same ranks' NVLink traffic
    # (their channels stall behind the congested sends).
    hca_rdma_factor: float = 1.9
    hca_nvlink_factor: float = 1.35
    node_pair_factor: float = 1.6
    link_factor: float = 2.5
    row_factor: float = 1.6
    hot_factor: float = 3.0

    def __post_init__(self) -> None:
        # Spreads and the load exponent may be 0 (switch the effect off); the rest must be > 0.
        may_be_zero = ("load_exponent", "path_spread", "window_noise", "arrival_skew_ns")
        for f in fields(self):
            value = getattr(self, f.name)
            for v in value if isinstance(value, tuple) else (value,):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
                    raise ValueError(f"SimulatorProfile.{f.name}: expected numbers, got {value!r}")
                if v < 0 or (v == 0 and f.name not in may_be_zero):
                    raise ValueError(f"SimulatorProfile.{f.name}: must be > 0, got {value!r}")


class NormalSimulator:
    """Cumulative DeepEP normal-mode counters of a simulated group (seeded, reproducible).

    ``window(phase)`` draws one window of deltas; ``advance(phase)`` draws one, adds it to the
    cumulative counters and returns the gathered snapshot (``last_window`` is the window that
    was added, so ``NormalWindow.from_snapshots`` of consecutive snapshots reproduces it).
    """

    def __init__(
        self,
        ep_size: int = 16,
        ranks_per_node: int = 8,
        seed: int = 0,
        *,
        slow_rank: int = 9,
        pressured_local_ranks: Sequence[int] = (0, 1),
        profile: SimulatorProfile | None = None,
        pressured_nodes: tuple[int, int] | None = None,
        slow_link: tuple[int, int] | None = None,
        hot_rank: int | None = None,
        hang_rank: int | None = None,
    ) -> None:
        for name, value in (("ep_size", ep_size), ("ranks_per_node", ranks_per_node)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value!r}")
        if ep_size % ranks_per_node:
            raise ValueError(
                f"ranks_per_node: must divide ep_size={ep_size}, got {ranks_per_node!r}"
            )
        if isinstance(slow_rank, bool) or not isinstance(slow_rank, int):
            raise TypeError(f"slow_rank: expected an int, got {slow_rank!r}")
        if not 0 <= slow_rank < ep_size:
            raise ValueError(f"slow_rank: must be in [0, {ep_size}), got {slow_rank!r}")
        pressured = tuple(pressured_local_ranks)
        for r in pressured:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < ranks_per_node:
                raise ValueError(
                    f"pressured_local_ranks: each must be in [0, {ranks_per_node}), got {r!r}"
                )
        n_nodes = ep_size // ranks_per_node
        self.pressured_nodes = (
            (0, min(1, n_nodes - 1)) if pressured_nodes is None else pressured_nodes
        )
        self.slow_link = (min(1, ep_size - 1), ep_size - 1) if slow_link is None else slow_link
        self.hot_rank = ep_size // 2 if hot_rank is None else hot_rank
        self.hang_rank = slow_rank if hang_rank is None else hang_rank
        for name, pair, bound in (
            ("pressured_nodes", self.pressured_nodes, n_nodes),
            ("slow_link", self.slow_link, ep_size),
        ):
            if len(pair) != 2 or not all(isinstance(v, int) and 0 <= v < bound for v in pair):
                raise ValueError(f"{name}: expected two ints in [0, {bound}), got {pair!r}")
        for name, rank in (("hot_rank", self.hot_rank), ("hang_rank", self.hang_rank)):
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ep_size:
                raise ValueError(f"{name}: must be in [0, {ep_size}), got {rank!r}")
        self.ep_size = ep_size
        self.ranks_per_node = ranks_per_node
        self.slow_rank = slow_rank
        self.pressured_local_ranks = pressured
        self.profile = SimulatorProfile() if profile is None else profile
        self.rng = np.random.default_rng(seed)
        self.window_index = 0
        self.sequence = 0
        self._cumulative: np.ndarray | None = None
        self.last_window: NormalWindow | None = None

        ep, rpn = ep_size, ranks_per_node
        node = np.arange(ep) // rpn
        self._local = np.arange(ep) % rpn
        self._inter = node[:, None] != node[None, :]
        self._same_node = ~self._inter
        # A fixed per-path spread: real links are not identical, but nothing here is slow.
        self._spread = {
            p: np.exp(self.rng.normal(0.0, self.profile.path_spread, (ep, ep)))
            for p in COMPLETION_PROBES
        }

    @property
    def pressured_ranks(self) -> tuple[int, ...]:
        """Global ranks behind the pressured HCA of every node (0/1/8/9 at EP16)."""
        return tuple(
            int(r) for r in np.flatnonzero(np.isin(self._local, self.pressured_local_ranks))
        )

    # --- Notify ---------------------------------------------------------------------------

    def _notify(self, phases: tuple[str, ...]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        prof, ep = self.profile, self.ep_size
        iters = prof.iterations_per_window
        # Dispatch alternates non-cached and cached calls; combine runs cached every call.
        launches = {
            "notify_dispatch": iters - iters // 2,
            "cached_notify_dispatch": iters // 2,
            "cached_notify_combine": iters,
        }
        late_by_phase = {
            "pre_dispatch_delay": ("notify_dispatch", "cached_notify_dispatch"),
            "pre_combine_delay": ("cached_notify_combine",),
        }
        late_probes = {p for ph in phases for p in late_by_phase.get(ph, ())}
        out = {}
        for base, probe in zip(prof.notify_base_ns, NOTIFY_PROBES, strict=True):
            n = launches[probe]
            arrival = self.rng.exponential(prof.arrival_skew_ns, (n, ep))
            if probe in late_probes:
                arrival[:, self.slow_rank] += prof.late_arrival_ns * self.rng.uniform(0.9, 1.1, n)
            own = base * np.exp(self.rng.normal(0.0, 0.02, (n, ep)))
            # Each rank waits in the kernel until the last rank has arrived.
            duration = own + (arrival.max(axis=1, keepdims=True) - arrival)
            out[probe] = (np.rint(duration.sum(axis=0)), np.full(ep, float(n)))
        return out

    # --- Completion -----------------------------------------------------------------------

    def _tokens(self, calls: int, hot: np.ndarray | None = None) -> np.ndarray:
        """Routed tokens ``[src, dst]``; ``hot`` multiplies a cell's expert selections (a hot
        expert is picked that many times more often, whatever the group size)."""
        prof, ep = self.profile, self.ep_size
        experts = prof.experts_per_rank * ep
        # Probability that a token picks at least one of a destination's experts.
        p = 1.0 - np.prod(
            [(experts - prof.experts_per_rank - i) / (experts - i) for i in range(prof.top_k)]
        )
        tokens = self.rng.binomial(prof.tokens_per_rank * calls, p, (ep, ep)).astype(np.float64)
        return tokens if hot is None else np.rint(tokens * hot)

    def _cost(self, probe: str, per_sample: np.ndarray, samples: np.ndarray) -> np.ndarray:
        noise = np.exp(self.rng.normal(0.0, self.profile.window_noise, per_sample.shape))
        return np.rint(per_sample * self._spread[probe] * noise * samples)

    def _phase_factor(self, phase: str, probe: str) -> np.ndarray | float:
        prof, ep, rpn = self.profile, self.ep_size, self.ranks_per_node
        multi_node = ep > rpn
        if phase == "all_hca_pressure":
            # Every HCA is loaded: only paths that cross the network slow down.
            return np.where(self._inter, ALL_HCA_FACTORS[probe], 1.0)
        factor = np.ones((ep, ep))
        if phase == "single_hca_pressure" and multi_node:
            hit = np.isin(self._local, self.pressured_local_ranks)
            leg = np.where(self._inter, prof.hca_rdma_factor, prof.hca_nvlink_factor)
            if probe == "dispatch_final":  # token owners send through their own HCA
                factor[hit, :] = leg[hit, :]
            elif probe == "combine_logical_recv":  # token owners receive through their own HCA
                factor[:, hit] = leg[:, hit]
            else:  # RDMA edges of the loaded HCA's rails, both ends behind it
                factor[hit[:, None] & self._inter] = prof.hca_rdma_factor
        elif phase == "node_pair_pressure" and multi_node:
            a, b = self.pressured_nodes
            node = np.arange(ep) // rpn
            pair = (node[:, None] == a) & (node[None, :] == b)
            pair |= pair.T
            factor[pair] = prof.node_pair_factor
        elif phase == "slow_link" and probe != "dispatch_rdma_recv":
            a, b = self.slow_link
            factor[a, b] = factor[b, a] = prof.link_factor
        elif phase == "slow_row" and probe == "dispatch_final":
            factor[self.slow_rank, :] = prof.row_factor
        return factor

    def _completion(
        self, phases: tuple[str, ...], extra: Mapping[str, np.ndarray] | None
    ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        prof, ep, rpn = self.profile, self.ep_size, self.ranks_per_node
        calls = prof.iterations_per_window
        out = {}
        hot_dispatch = hot_combine = None
        if "hot_expert" in phases:
            # The hot expert receives (dispatch column) and returns (combine row) more tokens.
            hot_dispatch = np.ones((ep, ep))
            hot_dispatch[:, self.hot_rank] = prof.hot_factor
            hot_combine = hot_dispatch.T.copy()
        for probe, cycles, hot in (
            ("dispatch_final", prof.dispatch_cycles, hot_dispatch),
            ("combine_logical_recv", prof.combine_cycles, hot_combine),
        ):
            tokens = self._tokens(calls, hot)
            samples = np.minimum(tokens, prof.channels * calls).astype(np.float64)
            load = np.where(samples > 0, tokens / np.maximum(samples, 1.0), 0.0)
            mean_load = float(load[samples > 0].mean()) if np.any(samples > 0) else 1.0
            base = np.where(self._inter, cycles[1], cycles[0])
            per_sample = base * (np.maximum(load, 1e-9) / mean_load) ** prof.load_exponent
            for phase in phases:
                per_sample = per_sample * self._phase_factor(phase, probe)
            if extra is not None and probe in extra:
                per_sample = per_sample * extra[probe]
            out[probe] = (self._cost(probe, per_sample, samples), samples, tokens)

        # RDMA receive, as the kernel counts it: cell [s, d] holds what sender s sent over RDMA
        # to d's node (d has s's local index); the diagonal is s's local lane.
        probe = "dispatch_rdma_recv"
        n_nodes = ep // rpn
        experts = prof.experts_per_rank * ep
        per_node = prof.experts_per_rank * rpn
        # Probability that a token picks at least one expert of a given node.
        p_node = 1.0 - np.prod(
            [(experts - per_node - i) / (experts - i) for i in range(prof.top_k)]
        )
        node_tokens = self.rng.binomial(prof.tokens_per_rank * calls, p_node, (ep, n_nodes))
        rail = self._local[:, None] == self._local[None, :]
        tokens = np.where(rail, node_tokens[:, np.arange(ep) // rpn], 0).astype(np.float64)
        samples = np.where(tokens > 0, float(prof.channels * calls), 0.0)
        load = np.where(samples > 0, tokens / np.maximum(samples, 1.0), 0.0)
        mean_load = float(load[samples > 0].mean()) if np.any(samples > 0) else 1.0
        base = np.where(self._inter, prof.rdma_cycles, prof.rdma_local_cycles)
        per_sample = base * (np.maximum(load, 1e-9) / mean_load) ** prof.load_exponent
        for phase in phases:
            per_sample = per_sample * self._phase_factor(phase, probe)
        if extra is not None and probe in extra:
            per_sample = per_sample * extra[probe]
        out[probe] = (self._cost(probe, per_sample, samples), samples, tokens)
        return {p: out[p] for p in COMPLETION_PROBES}

    # --- public ---------------------------------------------------------------------------

    def window(
        self,
        phase: str | Sequence[str] = "baseline",
        window_index: int | None = None,
        *,
        extra_cost_factor: Mapping[str, np.ndarray] | None = None,
    ) -> NormalWindow:
        """Draw one window of counter deltas for ``phase`` (integer-valued, like real counters).

        ``extra_cost_factor`` multiplies a Completion probe's cost per sample by a ``[src, dst]``
        matrix on top of the phase, to inject any other slowdown.
        """
        phases = (phase,) if isinstance(phase, str) else tuple(phase)
        for name in phases:
            if name not in ALL_PHASES:
                raise ValueError(f"phase: must be one of {list(ALL_PHASES)}, got {name!r}")
        if extra_cost_factor is not None:
            for probe, factor in extra_cost_factor.items():
                if probe not in COMPLETION_PROBES:
                    raise ValueError(f"extra_cost_factor: unknown probe {probe!r}")
                arr = np.asarray(factor, dtype=np.float64)
                if arr.shape not in ((), (self.ep_size, self.ep_size)):
                    raise ValueError(
                        f"extra_cost_factor[{probe}]: expected a scalar or shape "
                        f"{(self.ep_size, self.ep_size)}, got {arr.shape}"
                    )
                if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
                    raise ValueError(f"extra_cost_factor[{probe}]: must be finite and > 0")
        index = self.window_index if window_index is None else window_index
        notify = self._notify(phases)
        completion = self._completion(phases, extra_cost_factor)
        if "rank_hang" in phases:
            # The hung rank's own block stands still and nobody receives from it.
            h = self.hang_rank
            for pair in notify.values():
                for arr in pair:
                    arr[h] = 0.0
            for triple in completion.values():
                for mat in triple:
                    mat[h, :] = 0.0
                    mat[:, h] = 0.0
        return NormalWindow(
            ep_size=self.ep_size,
            ranks_per_node=self.ranks_per_node,
            notify=notify,
            completion=completion,
            window_index=index,
            extra={"phase": "+".join(phases)},
        )

    def advance(
        self,
        phase: str | Sequence[str] = "baseline",
        *,
        extra_cost_factor: Mapping[str, np.ndarray] | None = None,
    ) -> CounterSnapshot:
        """Add one window of ``phase`` to the cumulative counters; return the gathered snapshot.

        The snapshot is ``int64 [EP (reporting rank), 6 + 9 * EP]`` in the schema's layout.
        """
        win = self.window(phase, self.window_index, extra_cost_factor=extra_cost_factor)
        delta = snapshot_counters(win)
        self._cumulative = delta if self._cumulative is None else self._cumulative + delta
        self.last_window = win
        self.window_index += 1
        self.sequence += 1
        return CounterSnapshot(
            counters=self._cumulative.copy(),
            sequence=self.sequence,
            taken_at_s=float(self.sequence),
        )

    def zero_snapshot(self) -> CounterSnapshot:
        """The all-zero snapshot counters start from (sequence 0)."""
        ep = self.ep_size
        return CounterSnapshot(np.zeros((ep, counter_length(ep)), dtype=np.int64), sequence=0)


def phase_timeline(
    windows_per_phase: int = 4,
    baseline_windows: int = 4,
    phases: Sequence[str] = PHASES[1:],
) -> Iterator[tuple[int, str]]:
    """``(window_index, phase)`` pairs: baseline windows first (they bootstrap the global
    history), then ``windows_per_phase`` windows of each phase, each followed by a return to
    baseline so one phase does not bleed into the next."""
    for name, value in (
        ("windows_per_phase", windows_per_phase),
        ("baseline_windows", baseline_windows),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: must be an int >= 0, got {value!r}")
    for phase in phases:
        if phase not in PHASES:
            raise ValueError(f"phases: unknown phase {phase!r}, expected some of {list(PHASES)}")
    index = 0
    for _ in range(baseline_windows):
        yield index, "baseline"
        index += 1
    for phase in phases:
        for _ in range(windows_per_phase):
            yield index, phase
            index += 1
        yield index, "baseline"
        index += 1

"""A normal-mode diagnosis window: counter deltas between two cumulative snapshots.

A window holds, per Notify probe, each rank's summed kernel duration and launch count, and per
Completion probe three ``[src, dst]`` matrices (cost, samples, tokens). Derived metrics divide
by the count: a cell or rank with zero samples is *invalid* (NaN), never a zero cost.
Problems with the input raise :class:`InvalidWindowError`, whose ``reason`` is a short code the
exporter counts (``counter_reset``, ``counter_wraparound``, ``shape_mismatch``, ``non_finite``,
``negative_value``, ``stale_snapshot``, ``empty_window``, ``intranode_path`` for a one-node
group whose counters have never moved, ``bad_value``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankwatch.diagnosis.deepep.normal.schema import (
    COMPLETION_PROBES,
    NOTIFY_PROBES,
    counter_length,
    counter_slots,
)

__all__ = ["CounterSnapshot", "InvalidWindowError", "NormalWindow", "snapshot_counters"]


class InvalidWindowError(ValueError):
    """The window cannot be diagnosed; ``reason`` names why in one snake_case word."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def _as_array(name: str, value: Any, shape: tuple[int, ...]) -> np.ndarray:
    try:
        # Casting would silently drop an imaginary part: complex data is no counter delta.
        if np.iscomplexobj(value):
            raise InvalidWindowError("bad_value", f"{name}: complex values are not counts")
        arr = np.asarray(value, dtype=np.float64)
    except InvalidWindowError:
        raise
    except (TypeError, ValueError) as exc:
        raise InvalidWindowError("bad_value", f"{name}: not numeric ({exc})") from None
    if arr.shape != shape:
        raise InvalidWindowError(
            "shape_mismatch", f"{name}: expected shape {shape}, got {arr.shape}"
        )
    if not np.all(np.isfinite(arr)):
        bad = np.argwhere(~np.isfinite(arr))[0]
        raise InvalidWindowError(
            "non_finite", f"{name}{list(bad)}: value {arr[tuple(bad)]!r} is not finite"
        )
    if np.any(arr < 0):
        bad = np.argwhere(arr < 0)[0]
        raise InvalidWindowError(
            "negative_value", f"{name}{list(bad)}: value {arr[tuple(bad)]!r} is negative"
        )
    arr.setflags(write=False)
    return arr


def _entries(name: str, value: object, arity: int, fields: str) -> dict[Any, tuple[Any, ...]]:
    """``value`` as ``{probe: (arity arrays)}``, or InvalidWindowError naming ``name``."""
    if not isinstance(value, Mapping):
        raise InvalidWindowError(
            "bad_value", f"{name}: expected a mapping {{probe: ({fields})}}, got {value!r}"[:200]
        )
    out: dict[Any, tuple[Any, ...]] = {}
    for probe, entry in value.items():
        try:
            items = None if isinstance(entry, (str, bytes)) else tuple(entry)
        except TypeError:
            items = None
        if items is None or len(items) != arity:
            raise InvalidWindowError(
                "shape_mismatch", f"{name}[{probe}]: expected ({fields}), got {entry!r}"[:200]
            )
        out[probe] = items
    return out


def _check_identity(window: NormalWindow) -> None:
    """The window's identity fields: what artifacts, log lines and reports carry along."""
    index = window.window_index
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
        raise InvalidWindowError("bad_value", f"window_index: must be an int >= 0, got {index!r}")
    object.__setattr__(window, "window_index", int(index))
    if not isinstance(window.instance_id, str):
        raise InvalidWindowError(
            "bad_value", f"instance_id: expected a string, got {window.instance_id!r}"
        )
    for name in ("start_time_s", "end_time_s"):
        value = getattr(window, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not math.isfinite(value)
        ):
            raise InvalidWindowError("bad_value", f"{name}: must be a finite number, got {value!r}")
        object.__setattr__(window, name, float(value))
    if not isinstance(window.extra, Mapping):
        raise InvalidWindowError("bad_value", f"extra: expected a mapping, got {window.extra!r}")


@dataclass(frozen=True)
class NormalWindow:
    """Counter deltas of one window, source-oriented.

    ``notify[probe] = (duration_ns[EP], count[EP])`` per rank;
    ``completion[probe] = (cost[src, dst], samples[src, dst], tokens[src, dst])``.
    Arrays are validated (shape, finite, non-negative) and stored read-only as float64.
    """

    ep_size: int
    ranks_per_node: int
    notify: Mapping[str, tuple[np.ndarray, np.ndarray]]
    completion: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    window_index: int = 0
    instance_id: str = ""
    start_time_s: float = 0.0
    end_time_s: float = 0.0
    extra: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ep, rpn = self.ep_size, self.ranks_per_node
        if isinstance(ep, bool) or not isinstance(ep, (int, np.integer)) or ep < 1:
            raise InvalidWindowError("bad_value", f"ep_size: must be a positive int, got {ep!r}")
        if isinstance(rpn, bool) or not isinstance(rpn, (int, np.integer)) or rpn < 1 or ep % rpn:
            raise InvalidWindowError(
                "bad_value",
                f"ranks_per_node: must be a positive divisor of ep_size={ep}, got {rpn!r}",
            )
        object.__setattr__(self, "ep_size", int(ep))
        object.__setattr__(self, "ranks_per_node", int(rpn))
        _check_identity(self)
        raw_notify = _entries("notify", self.notify, 2, "duration_ns, count")
        raw_completion = _entries("completion", self.completion, 3, "cost, samples, tokens")
        unknown = (set(raw_notify) - set(NOTIFY_PROBES)) | (
            set(raw_completion) - set(COMPLETION_PROBES)
        )
        if unknown:
            raise InvalidWindowError("bad_value", f"probe: unknown probe name(s) {sorted(unknown)}")
        notify: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for probe, pair in raw_notify.items():
            notify[probe] = (
                _as_array(f"notify[{probe}].duration_ns", pair[0], (ep,)),
                _as_array(f"notify[{probe}].count", pair[1], (ep,)),
            )
        completion: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for probe, triple in raw_completion.items():
            completion[probe] = (
                _as_array(f"completion[{probe}].cost", triple[0], (ep, ep)),
                _as_array(f"completion[{probe}].samples", triple[1], (ep, ep)),
                _as_array(f"completion[{probe}].tokens", triple[2], (ep, ep)),
            )
        object.__setattr__(self, "notify", notify)
        object.__setattr__(self, "completion", completion)

    @property
    def num_nodes(self) -> int:
        return self.ep_size // self.ranks_per_node

    def node_of(self, rank: int | np.ndarray) -> int | np.ndarray:
        """Node index of a rank (ranks are laid out node by node)."""
        return rank // self.ranks_per_node

    def notify_avg_ns(self, probe: str) -> np.ndarray:
        """Average Notify kernel duration per rank in ns; NaN where the rank launched none."""
        duration, count = self.notify[probe]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(count > 0, duration / np.maximum(count, 1), np.nan)

    def cost_per_sample(self, probe: str) -> np.ndarray:
        """Completion cost per sample, ``[src, dst]``; NaN for cells with zero samples."""
        cost, samples, _ = self.completion[probe]
        return np.where(samples > 0, cost / np.maximum(samples, 1), np.nan)

    def tokens_per_sample(self, probe: str) -> np.ndarray:
        """Tokens per sample, ``[src, dst]`` (load context); NaN for cells with zero samples."""
        _, samples, tokens = self.completion[probe]
        return np.where(samples > 0, tokens / np.maximum(samples, 1), np.nan)

    @classmethod
    def from_snapshots(
        cls,
        prev: CounterSnapshot | None,
        cur: CounterSnapshot,
        ranks_per_node: int,
        *,
        window_index: int = 0,
        instance_id: str = "",
    ) -> NormalWindow:
        """The window between two gathered cumulative snapshots (``prev=None``: since zero)."""
        if prev is not None and not isinstance(prev, CounterSnapshot):
            raise TypeError(f"prev: expected a CounterSnapshot or None, got {type(prev).__name__}")
        if not isinstance(cur, CounterSnapshot):
            raise TypeError(f"cur: expected a CounterSnapshot, got {type(cur).__name__}")
        ep = cur.ep_size
        if prev is not None:
            if prev.ep_size != ep:
                raise InvalidWindowError(
                    "shape_mismatch", f"snapshot ep_size changed from {prev.ep_size} to {ep}"
                )
            if cur.sequence <= prev.sequence:
                raise InvalidWindowError(
                    "stale_snapshot",
                    f"sequence {cur.sequence} is not newer than the previous {prev.sequence}",
                )
        for snap in (prev, cur):
            if snap is not None and np.any(snap.counters < 0):
                dst, col = np.argwhere(snap.counters < 0)[0]
                raise InvalidWindowError(
                    "counter_wraparound",
                    f"rank {dst} counter[{col}] = {snap.counters[dst, col]} is negative",
                )
        delta = cur.counters if prev is None else cur.counters - prev.counters
        if np.any(delta < 0):
            dst, col = np.argwhere(delta < 0)[0]
            raise InvalidWindowError(
                "counter_reset", f"rank {dst} counter[{col}] went down by {-delta[dst, col]}"
            )
        slots = counter_slots(ep)
        notify = {
            p: (delta[:, slots[(p, "duration_ns")].offset], delta[:, slots[(p, "count")].offset])
            for p in NOTIFY_PROBES
        }
        completion = {}
        for p in COMPLETION_PROBES:
            # Rows of the gathered block are destinations; transpose to [src, dst].
            mats = [
                delta[:, slots[(p, f)].offset : slots[(p, f)].stop].T
                for f in ("cost", "sample", "token")
            ]
            completion[p] = (mats[0], mats[1], mats[2])
        if not any(np.any(c > 0) for _, c in notify.values()) and not any(
            np.any(s > 0) for _, s, _ in completion.values()
        ):
            never_moved = prev is None or not np.any(prev.counters)
            if isinstance(ranks_per_node, int) and ranks_per_node >= ep and never_moved:
                # Not idle but blind: DeepEP's intranode kernels record no normal-mode counters
                # (cumulative counters that have never moved on a one-node group).
                raise InvalidWindowError(
                    "intranode_path",
                    f"no normal-mode counters on the intranode path (EP {ep} on one node): "
                    "DeepEP records them only in its internode kernels",
                )
            raise InvalidWindowError("empty_window", "no Notify launch and no Completion sample")
        return cls(
            ep_size=ep,
            ranks_per_node=ranks_per_node,
            notify=notify,
            completion=completion,
            window_index=window_index,
            instance_id=instance_id,
            start_time_s=prev.taken_at_s if prev is not None else cur.taken_at_s,
            end_time_s=cur.taken_at_s,
        )


@dataclass(frozen=True)
class CounterSnapshot:
    """Cumulative counters gathered from every rank: int64 ``[EP (reporting rank), 6 + 9*EP]``."""

    counters: np.ndarray
    sequence: int = 0
    taken_at_s: float = 0.0

    def __post_init__(self) -> None:
        seq = self.sequence
        if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)):
            raise InvalidWindowError("bad_value", f"sequence: expected an int, got {seq!r}")
        object.__setattr__(self, "sequence", int(seq))
        taken = self.taken_at_s
        if (
            isinstance(taken, bool)
            or not isinstance(taken, numbers.Real)
            or not math.isfinite(taken)
        ):
            raise InvalidWindowError(
                "bad_value", f"taken_at_s: must be a finite unix time, got {taken!r}"
            )
        object.__setattr__(self, "taken_at_s", float(taken))
        arr = np.asarray(self.counters)
        if arr.dtype.kind not in "biuf":
            raise InvalidWindowError(
                "bad_value", f"counters: expected integer counts, got dtype {arr.dtype}"
            )
        if arr.ndim != 2 or arr.shape[0] < 1:
            raise InvalidWindowError(
                "shape_mismatch", f"counters: expected [EP, L], got shape {arr.shape}"
            )
        if not np.issubdtype(arr.dtype, np.integer):
            if not np.all(np.isfinite(arr)):
                raise InvalidWindowError("non_finite", "counters: contains NaN or inf")
            if np.any(arr != np.round(arr)):
                raise InvalidWindowError("bad_value", "counters: non-integer values")
        expected = counter_length(arr.shape[0])
        if arr.shape[1] != expected:
            raise InvalidWindowError(
                "shape_mismatch",
                f"counters: EP={arr.shape[0]} needs {expected} values per rank, got {arr.shape[1]}",
            )
        object.__setattr__(self, "counters", arr.astype(np.int64, copy=False))

    @property
    def ep_size(self) -> int:
        return int(self.counters.shape[0])


def snapshot_counters(window: NormalWindow) -> np.ndarray:
    """The gathered int64 ``[EP, L]`` block whose delta is ``window`` (inverse of from_snapshots).

    Used by the simulator and the tests to write counters the way DeepEP's kernels lay them out.
    """
    ep = window.ep_size
    slots = counter_slots(ep)
    out = np.zeros((ep, counter_length(ep)), dtype=np.int64)
    for p, (duration, count) in window.notify.items():
        out[:, slots[(p, "duration_ns")].offset] = np.rint(duration).astype(np.int64)
        out[:, slots[(p, "count")].offset] = np.rint(count).astype(np.int64)
    for p, mats in window.completion.items():
        for f, mat in zip(("cost", "sample", "token"), mats, strict=True):
            s = slots[(p, f)]
            out[:, s.offset : s.stop] = np.rint(mat.T).astype(np.int64)
    return out

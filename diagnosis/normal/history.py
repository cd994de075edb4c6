"""Global-slowdown history: the only state the normal-mode diagnoser keeps between windows.

Per Completion probe it remembers the topology-aggregated cost per sample of the last
``history_horizon`` (16) *accepted normal* windows. Until ``history_bootstrap`` (3) windows are
known the probe is ``bootstrapping``; after that the current aggregate over the median of the
remembered ones is the global factor, ``slow`` at ``>= global_slowdown`` (1.3x). The caller
decides which windows are normal; anomalous windows must never be learned, or a lasting
slowdown would slowly become the new normal.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from ..config import NormalConfig

__all__ = ["GlobalHistory", "GlobalVerdict"]

# Float rounding must not decide a factor that equals its threshold.
_REL_TOLERANCE = 1e-9

GlobalVerdict = tuple[float | None, str]


class GlobalHistory:
    """Bounded per-probe history of accepted normal aggregates (a class: it holds state)."""

    def __init__(self, config: NormalConfig | None = None) -> None:
        if config is None:
            config = NormalConfig()
        if not isinstance(config, NormalConfig):
            raise TypeError(f"config: expected a NormalConfig, got {type(config).__name__}")
        self.config = config
        self._values: dict[str, deque[float]] = {}
        self._layout: tuple[int, int] | None = None

    def check_layout(self, ep_size: int, ranks_per_node: int) -> bool:
        """Forget everything if the group layout changed (its costs are not comparable).

        Returns True when the history was reset.
        """
        layout = (int(ep_size), int(ranks_per_node))
        if self._layout is not None and self._layout != layout:
            self._values.clear()
            self._layout = layout
            return True
        self._layout = layout
        return False

    def values(self, probe: str) -> tuple[float, ...]:
        """The remembered aggregates of a probe, oldest first."""
        return tuple(self._values.get(probe, ()))

    def baseline(self, probe: str) -> float | None:
        """Median of the remembered aggregates, or None while bootstrapping."""
        known = self._values.get(probe)
        if known is None or len(known) < self.config.history_bootstrap:
            return None
        return float(np.median(np.fromiter(known, dtype=np.float64)))

    def assess(self, probe: str, aggregate: float) -> GlobalVerdict:
        """``(factor, status)`` of this window's aggregate against the history (not learned)."""
        if not isinstance(aggregate, (int, float)) or isinstance(aggregate, bool):
            raise TypeError(f"aggregate: expected a number, got {aggregate!r}")
        if not math.isfinite(aggregate) or aggregate <= 0:
            raise ValueError(f"aggregate: must be finite and > 0, got {aggregate!r}")
        base = self.baseline(probe)
        if base is None:
            return None, "bootstrapping"
        factor = aggregate / base
        slow = factor >= self.config.global_slowdown * (1.0 - _REL_TOLERANCE)
        return factor, "slow" if slow else "normal"

    def learn(self, probe: str, aggregate: float) -> None:
        """Remember an accepted normal window's aggregate (the oldest falls off past 16)."""
        if not isinstance(aggregate, (int, float)) or isinstance(aggregate, bool):
            raise TypeError(f"aggregate: expected a number, got {aggregate!r}")
        if not math.isfinite(aggregate) or aggregate <= 0:
            raise ValueError(f"aggregate: must be finite and > 0, got {aggregate!r}")
        known = self._values.setdefault(probe, deque(maxlen=self.config.history_horizon))
        known.append(float(aggregate))

    def reset(self) -> None:
        """Forget every probe's history."""
        self._values.clear()
        self._layout = None

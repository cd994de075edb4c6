"""Global-slowdown history: the only state the normal-mode diagnoser keeps between windows.

Per Completion probe *and link class* (intra-node, inter-node, gateway edges) it remembers the
class's aggregated cost per sample of the last ``history_horizon`` (16) *accepted normal*
windows. Until ``history_bootstrap`` (3) windows are known the class is ``bootstrapping``; after
that the current aggregate over the median of the remembered ones is the class's factor,
``slow`` at ``>= global_slowdown`` (1.3x). A class learns a window only when it is not slow and
its aggregate lies within ``history_band`` of the history (:meth:`GlobalHistory.accepts`), so a
lasting slowdown, even one under 1.3x, never becomes the new normal.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from rankwatch.diagnosis.config import NormalConfig, config_or_default

__all__ = ["GlobalHistory", "GlobalVerdict"]

# Float rounding must not decide a factor that equals its threshold.
_REL_TOLERANCE = 1e-9

GlobalVerdict = tuple[float | None, str]


class GlobalHistory:
    """Bounded per-probe history of accepted normal aggregates (a class: it holds state)."""

    def __init__(self, config: NormalConfig | None = None) -> None:
        self.config = config_or_default(config, NormalConfig)
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

    @staticmethod
    def key(probe: str, link_class: str | None) -> str:
        """The history's key: the probe alone, or ``probe/link_class``."""
        return probe if link_class is None else f"{probe}/{link_class}"

    def values(self, probe: str, link_class: str | None = None) -> tuple[float, ...]:
        """The remembered aggregates of a probe (or one of its link classes), oldest first.

        Without a class, the longest of the probe's class histories (the probe as a whole).
        """
        if link_class is None and probe not in self._values:
            mine = [tuple(v) for k, v in self._values.items() if k.startswith(probe + "/")]
            return max(mine, key=len) if mine else ()
        return tuple(self._values.get(self.key(probe, link_class), ()))

    def accepts(self, probe: str, aggregate: float, link_class: str | None = None) -> bool:
        """Whether ``aggregate`` may be learned: while bootstrapping always, then only within
        ``history_band`` of the history's median either way (the creep guard)."""
        base = self.baseline(probe, link_class)
        if base is None:
            return True
        band = self.config.history_band * (1.0 + _REL_TOLERANCE)
        return base / band <= aggregate <= base * band

    def baseline(self, probe: str, link_class: str | None = None) -> float | None:
        """Median of the remembered aggregates, or None while bootstrapping."""
        if link_class is None and probe not in self._values:
            known_t = self.values(probe)
            if len(known_t) < self.config.history_bootstrap:
                return None
            return float(np.median(known_t))
        known = self._values.get(self.key(probe, link_class))
        if known is None or len(known) < self.config.history_bootstrap:
            return None
        return float(np.median(np.fromiter(known, dtype=np.float64)))

    def assess(self, probe: str, aggregate: float, link_class: str | None = None) -> GlobalVerdict:
        """``(factor, status)`` of this window's aggregate against the history (not learned)."""
        if not isinstance(aggregate, (int, float)) or isinstance(aggregate, bool):
            raise TypeError(f"aggregate: expected a number, got {aggregate!r}")
        if not math.isfinite(aggregate) or aggregate <= 0:
            raise ValueError(f"aggregate: must be finite and > 0, got {aggregate!r}")
        base = self.baseline(probe, link_class)
        if base is None:
            return None, "bootstrapping"
        factor = aggregate / base
        slow = factor >= self.config.global_slowdown * (1.0 - _REL_TOLERANCE)
        return factor, "slow" if slow else "normal"

    def learn(self, probe: str, aggregate: float, link_class: str | None = None) -> None:
        """Remember an accepted normal window's aggregate (the oldest falls off past 16)."""
        if not isinstance(aggregate, (int, float)) or isinstance(aggregate, bool):
            raise TypeError(f"aggregate: expected a number, got {aggregate!r}")
        if not math.isfinite(aggregate) or aggregate <= 0:
            raise ValueError(f"aggregate: must be finite and > 0, got {aggregate!r}")
        known = self._values.setdefault(
            self.key(probe, link_class), deque(maxlen=self.config.history_horizon)
        )
        known.append(float(aggregate))

    def reset(self) -> None:
        """Forget every probe's history."""
        self._values.clear()
        self._layout = None

"""The Notify rule: a rank whose Notify kernel is much shorter than its peers' arrived late.

Notify kernels synchronise the whole EP group. Ranks that arrive on time sit inside the kernel
until the last one comes; the late rank finds everyone waiting and leaves almost at once. So a
rank's average kernel duration divided by the median of its peers' is *small* for a late rank:
a ratio at or below ``NormalConfig.notify_ratio`` (0.25) is late-arrival evidence.
"""

from __future__ import annotations

import numpy as np

from rankwatch.diagnosis.config import NormalConfig
from rankwatch.diagnosis.deepep.normal.report import Anomaly, ProbeResult
from rankwatch.diagnosis.deepep.normal.robust import median_excluding_self

__all__ = ["diagnose_notify", "notify_ratios"]


def notify_ratios(mean_duration_ns: np.ndarray) -> np.ndarray:
    """Each rank's mean duration over the median of the *other* ranks with launches.

    NaN for a rank without launches, and where the peer median is 0 (no ratio exists); inf
    where the quotient passes float range (:func:`diagnose_notify` states both reasons).
    """
    peers = median_excluding_self(mean_duration_ns)
    # A huge duration over a tiny peer median may overflow to inf: still "not late".
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        ratio = np.where(peers > 0, mean_duration_ns / np.where(peers > 0, peers, 1.0), np.nan)
    ratio[~np.isfinite(mean_duration_ns)] = np.nan
    return ratio


def diagnose_notify(mean_duration_ns: np.ndarray, probe: str, config: NormalConfig) -> ProbeResult:
    """Apply the Notify rule to one probe's per-rank mean durations (NaN = no launch).

    Fewer than two ranks with launches leave no peers to compare with: ``insufficient``.
    """
    durations = np.asarray(mean_duration_ns, dtype=np.float64)
    if durations.ndim != 1:
        raise ValueError(f"mean_duration_ns: expected a 1-D array, got shape {durations.shape}")
    n_valid = int(np.count_nonzero(np.isfinite(durations)))
    if n_valid < 2:
        return ProbeResult(
            probe=probe,
            kind="notify",
            status="insufficient",
            notify_ratio=np.full(durations.shape, np.nan),
            mean_duration_ns=durations,
            detail=f"{n_valid} rank(s) launched the kernel; at least 2 are needed",
        )
    ratio = notify_ratios(durations)
    with np.errstate(invalid="ignore"):
        late = np.flatnonzero(ratio <= config.notify_ratio)
    # Where no ratio exists the rank gets none (NaN, published as absent) and the detail says why.
    launched = np.isfinite(durations)
    zero_peers = launched & np.isnan(ratio)
    past_range = np.isinf(ratio)
    ratio[past_range] = np.nan
    detail = "; ".join(
        f"{_ranks_text(mask)}: no ratio, {why}"
        for mask, why in (
            (zero_peers, "the median of the peers' durations is 0 ns"),
            (past_range, "the duration over the peers' median passes float range (not late)"),
        )
        if mask.any()
    )
    anomalies = tuple(
        Anomaly(
            probe=probe, scope="rank", src=int(r), dst=None, factor=float(ratio[r]), ranks=(int(r),)
        )
        for r in late
    )
    return ProbeResult(
        probe=probe,
        kind="notify",
        status="anomalous" if anomalies else "ok",
        anomalies=anomalies,
        notify_ratio=ratio,
        mean_duration_ns=durations,
        detail=detail,
    )


def _ranks_text(mask: np.ndarray) -> str:
    ranks = np.flatnonzero(mask)
    return ("rank " if ranks.size == 1 else "ranks ") + ", ".join(str(int(r)) for r in ranks)

"""Builders of exact, noise-free normal-mode windows for rule tests (no tests in here).

Dense probes get ``base_intra`` / ``base_inter`` cycles per sample, the gateway probe
``base_rdma`` on its valid cells (as DeepEP's internode kernel writes them: sender and
receiver share a local GPU index, plus the diagonal local lane; only with more than one
node); every rank's Notify kernel lasts ``notify_ns`` per launch. Factor matrices multiply the
cost per sample, so a test says exactly how much slower a row, column, cell or block is.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from rankwatch.diagnosis.deepep.normal import COMPLETION_PROBES, NOTIFY_PROBES, NormalWindow

SAMPLES = 64.0


def gateway_mask(ep: int, rpn: int) -> np.ndarray:
    """Cells the RDMA receive probe records: ``src % rpn == dst % rpn`` (the inter-node edges of
    each rail and the diagonal local lane), only with more than one node."""
    local = np.arange(ep) % rpn
    if ep // rpn < 2:
        return np.zeros((ep, ep), dtype=bool)
    return local[:, None] == local[None, :]


def make_window(
    ep: int = 16,
    rpn: int = 8,
    *,
    factors: Mapping[str, np.ndarray | float] | None = None,
    notify_ns: Mapping[str, np.ndarray] | None = None,
    samples: Mapping[str, np.ndarray] | None = None,
    base_intra: float = 1000.0,
    base_inter: float = 3000.0,
    base_rdma: float = 2000.0,
    window_index: int = 0,
) -> NormalWindow:
    """A window whose cost per sample is the base path cost times ``factors[probe]``."""
    factors = factors or {}
    node = np.arange(ep) // rpn
    inter = node[:, None] != node[None, :]
    completion = {}
    for probe in COMPLETION_PROBES:
        if probe == "dispatch_rdma_recv":
            smp = np.where(gateway_mask(ep, rpn), SAMPLES, 0.0)
            base = np.full((ep, ep), base_rdma)
        else:
            smp = np.full((ep, ep), SAMPLES)
            base = np.where(inter, base_inter, base_intra)
        if samples is not None and probe in samples:
            smp = np.asarray(samples[probe], dtype=np.float64)
        cps = base * np.asarray(factors.get(probe, 1.0), dtype=np.float64)
        completion[probe] = (cps * smp, smp, 10.0 * smp)
    notify = {}
    for probe in NOTIFY_PROBES:
        per_launch = np.full(ep, 1000.0)
        if notify_ns is not None and probe in notify_ns:
            per_launch = np.asarray(notify_ns[probe], dtype=np.float64)
        notify[probe] = (per_launch * 4.0, np.full(ep, 4.0))
    return NormalWindow(
        ep_size=ep,
        ranks_per_node=rpn,
        notify=notify,
        completion=completion,
        window_index=window_index,
    )


def row_factor(ep: int, row: int, factor: float) -> np.ndarray:
    out = np.ones((ep, ep))
    out[row, :] = factor
    return out


def col_factor(ep: int, col: int, factor: float) -> np.ndarray:
    out = np.ones((ep, ep))
    out[:, col] = factor
    return out


def cell_factor(ep: int, src: int, dst: int, factor: float) -> np.ndarray:
    out = np.ones((ep, ep))
    out[src, dst] = factor
    return out


def block_factor(ep: int, rpn: int, a: int, b: int, factor: float) -> np.ndarray:
    out = np.ones((ep, ep))
    out[a * rpn : (a + 1) * rpn, b * rpn : (b + 1) * rpn] = factor
    return out


def scopes(result) -> list[tuple[str, int | None, int | None]]:
    """``(scope, src, dst)`` of every anomaly of a probe result, in report order."""
    return [(a.scope, a.src, a.dst) for a in result.anomalies]

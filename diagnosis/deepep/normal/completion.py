"""The Completion rule: localise slow sources, destinations, cells, node blocks and gateways.

One probe's window gives a cost-per-sample matrix ``[src, dst]`` (NaN where a cell had no
sample). The rule, all in log space so that factors multiply and effects add:

1. Reference. Dense probes (``dispatch_final``, ``combine_logical_recv``) use the median of
   each source-node x destination-node block, so intra-node cells are compared with intra-node
   cells and inter-node cells with inter-node cells. The sparse RDMA receive probe
   (``dispatch_rdma_recv``) uses the median of its valid inter-node edges. The kernel indexes it
   by source rank and records it on the receiving rank with the same local GPU index on each
   other node (an RDMA "rail"), plus its own local lane on the diagonal: the edges are
   ``src -> dst`` with ``src % 8 == dst % 8`` on different nodes. The local lane measures a copy
   that never leaves the GPU, so it is left out of the localisation.
2. ``L = log(cost / reference)``; then, in this order, the window-wide effect (median of
   ``L``), the source-row effects (row medians of what is left) and the destination-column
   effects (column medians of what is left) are removed. What remains is the point residual.
3. Rows and columns (source/destination gateways for the gateway probe) are flagged at
   ``>= axis_slowdown`` with a robust score ``>= robust_score`` among their peers; points (gateway
   edges) at ``>= point_slowdown`` with a score ``>= robust_score`` among all residuals. Points
   inside a flagged row or column are not reported again. Dense probes also compare each node
   block's median with the other blocks of its class (intra- or inter-node): ``>= axis_slowdown``.

A slow block never shows up as rows or points (the block reference absorbs it), and a slow row
or column never shows up as points (its effect is removed first and its cells are suppressed):
each shared slowdown is reported once, at its widest scope.

4. Robust scores: with a zero spread (MAD = 0), any real deviation is an infinite score, as in
   the specification, so it passes the score threshold; the factor thresholds still apply. The
   anomaly then carries no score, and says why (``Anomaly.score_note``).
5. For the global part, one aggregate per link class (``class_aggregates``): dense probes the
   median of the intra-node and of the inter-node block medians, leaving out flagged blocks;
   the gateway probe its median edge. Every anomaly carries its load context (``load_ratio``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from rankwatch.diagnosis.config import NormalConfig
from rankwatch.diagnosis.deepep.normal.report import Anomaly, ProbeResult
from rankwatch.diagnosis.deepep.normal.robust import (
    grouped_medians,
    lane_medians,
    median_excluding_self,
    modified_zscores,
    robust_location_scale,
    scores_from,
)

__all__ = [
    "GATEWAY_PROBES",
    "LOG_TOLERANCE",
    "MAX_POINT_ANOMALIES",
    "MIN_COST_PER_SAMPLE",
    "cost_per_sample",
    "diagnose_completion",
]

# Probes whose cells are RDMA edges between same-index GPUs of two nodes: sparse, one reference
# for all edges.
GATEWAY_PROBES: tuple[str, ...] = ("dispatch_rdma_recv",)
# Costs are integer cycle counts; below one cycle per sample the counter cannot resolve a
# difference, and a zero would have no logarithm. Such cells count as one cycle.
MIN_COST_PER_SAMPLE = 1.0
# Thresholds are compared in log space; a factor equal to its threshold up to float rounding
# (about 1e-7 here) still flags.
LOG_TOLERANCE = 1e-6
# Bound on point/edge anomalies per probe and window: a pathological window must not create
# an unbounded report. The total is still stated in ``ProbeResult.detail``.
MAX_POINT_ANOMALIES = 256


def cost_per_sample(cost: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """``cost / samples`` per cell, NaN where there was no sample (not a zero cost).

    A quotient beyond float64 (only possible with a fractional sample count far below one,
    e.g. 1 / 5e-324) is NaN too: it is no measurement, and an infinite cell would turn the
    window's aggregate into NaN.
    """
    # One division (0 / 0 and x / 0 give NaN / inf) and one pass to clear the non-finite.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        out = np.divide(cost, samples, dtype=np.float64)
    np.copyto(out, np.nan, where=~np.isfinite(out))
    return out


# exp() of a log factor above this overflows float64; such a factor (costs spanning the whole
# float range) is reported at the largest finite value instead.
_MAX_LOG_FACTOR = 709.0


def _factor(log_factor: float) -> float:
    return math.exp(min(float(log_factor), _MAX_LOG_FACTOR))


def _off_layout_note(cells: int) -> str:
    if not cells:
        return ""
    return (
        f"; {cells} cell(s) with samples outside the internode kernel's layout (sender and "
        "receiver with different GPU indices) were left out: counters from another DeepEP build?"
    )


def _flag(
    log_factor: np.ndarray, score: np.ndarray, threshold: float, config: NormalConfig
) -> np.ndarray:
    """Indices where both the factor and the robust score reach their thresholds."""
    with np.errstate(invalid="ignore"):
        hit = (log_factor >= math.log(threshold) - LOG_TOLERANCE) & (
            score >= config.robust_score - LOG_TOLERANCE
        )
    return np.flatnonzero(hit)


def _node_ranks(node: int, rpn: int) -> tuple[int, ...]:
    return tuple(range(node * rpn, (node + 1) * rpn))


def _block_anomalies(
    block_log: np.ndarray, probe: str, rpn: int, config: NormalConfig
) -> list[Anomaly]:
    """Compare each node block with the other blocks of its class (intra- vs inter-node)."""
    n = block_log.shape[0]
    intra = np.eye(n, dtype=bool)
    factor_log = np.full(block_log.shape, np.nan)
    for cls_mask in (intra, ~intra):
        values = block_log[cls_mask]
        factor_log[cls_mask] = values - median_excluding_self(values)
    with np.errstate(invalid="ignore"):
        hit = np.argwhere(factor_log >= math.log(config.axis_slowdown) - LOG_TOLERANCE)
    out = []
    for a, b in hit:
        ranks = tuple(sorted(set(_node_ranks(int(a), rpn)) | set(_node_ranks(int(b), rpn))))
        out.append(
            Anomaly(
                probe=probe,
                scope="block",
                src=int(a),
                dst=int(b),
                factor=float(np.exp(factor_log[a, b])),
                ranks=ranks,
            )
        )
    return out


def _class_aggregates(block_log: np.ndarray, flagged: set[tuple[int, int]]) -> dict[str, float]:
    """Per link class, the median of its blocks' medians, leaving out the blocks flagged local.

    A class is globally slow only when its paths are slower as a whole: a block that already
    stands out from its class is a local finding and must not carry the class along (on two
    nodes one slow inter-node block is half the class). The median keeps one odd block from
    moving the aggregate on larger topologies as well.
    """
    n = block_log.shape[0]
    usable = np.isfinite(block_log)
    for a, b in flagged:
        usable[a, b] = False
    intra = np.eye(n, dtype=bool)
    out: dict[str, float] = {}
    for name, mask in (("intra_node", intra), ("inter_node", ~intra)):
        values = block_log[mask & usable]
        if values.size:
            out[name] = math.exp(float(np.median(values)))
    return out


class _Load:
    """Load context of flagged scopes: tokens per sample inside over tokens per sample outside.

    Nothing is summed until a scope is flagged: a clean window pays nothing. Flagged rows or
    columns take every lane's sums in one contiguous pass per axis (gathering a few hundred
    strided columns costs several times more) and the total from them.
    """

    def __init__(self, tokens: np.ndarray | None, samples: np.ndarray) -> None:
        self.tokens = tokens
        self.samples = samples
        self._total: tuple[float, float] | None = None
        self._lane_sums: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _ratio(self, part_t: np.ndarray, part_s: np.ndarray) -> list[float | None]:
        if self._total is None:
            assert self.tokens is not None
            self._total = (float(self.tokens.sum()), float(self.samples.sum()))
        total_t, total_s = self._total
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = (part_t / part_s) / ((total_t - part_t) / (total_s - part_s))
        return [float(r) if math.isfinite(r) and r >= 0 else None for r in ratio]

    def lanes(self, idx: np.ndarray, axis: int) -> list[float | None]:
        """Rows (``axis=1``) or columns (``axis=0``) ``idx``."""
        if self.tokens is None or idx.size == 0:
            return [None] * idx.size
        sums = self._lane_sums.get(axis)
        if sums is None:
            sums = (self.tokens.sum(axis=axis), self.samples.sum(axis=axis))
            self._lane_sums[axis] = sums
            if self._total is None:
                self._total = (float(sums[0].sum()), float(sums[1].sum()))
        return self._ratio(sums[0][idx], sums[1][idx])

    def cells(self, src: np.ndarray, dst: np.ndarray) -> list[float | None]:
        if self.tokens is None or src.size == 0:
            return [None] * src.size
        return self._ratio(self.tokens[src, dst], self.samples[src, dst])

    def block(self, a: int, b: int, rpn: int) -> float | None:
        if self.tokens is None:
            return None
        rows, cols = slice(a * rpn, (a + 1) * rpn), slice(b * rpn, (b + 1) * rpn)
        part = (self.tokens[rows, cols].sum(), self.samples[rows, cols].sum())
        return self._ratio(np.array([part[0]]), np.array([part[1]]))[0]


def _remove_window_effect(row_med: np.ndarray) -> np.ndarray:
    """Row effects: row medians minus the window-wide effect, taken as their median.

    As in the first sweep of a median polish, the median of the row medians is a robust
    window-wide centre that costs no further pass over the cells; subtracting a constant does
    not move any row's median, so removing it first and then the rows gives the same result.
    """
    finite = row_med[np.isfinite(row_med)]
    return row_med - (float(np.median(finite)) if finite.size else 0.0)


def _dense_effects(
    cps: np.ndarray, rpn: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Block reference, row and column effects and point residuals of a dense matrix.

    Returns ``(block_log [nodes, nodes], row_log [EP], col_log [EP], resid [src, dst])``, all
    in natural-log units, NaN wherever there was no sample.
    """
    n = cps.shape[0] // rpn
    x = np.maximum(cps, MIN_COST_PER_SAMPLE)  # NaN stays NaN
    np.log(x, out=x)
    # Shifted by a typical value, log costs are small numbers near 0: float32 then keeps about
    # 1e-7 of precision at half the memory traffic of float64 (sorting dominates the cost).
    sample = x.ravel()[:: max(1, x.size // 1024)]
    sample = sample[np.isfinite(sample)]
    anchor = float(np.median(sample)) if sample.size else float(np.nanmedian(x))
    x32 = np.empty(x.shape, dtype=np.float32)
    np.subtract(x, anchor, out=x32, casting="same_kind")
    blocks = x32.reshape(n, rpn, n, rpn).transpose(0, 2, 1, 3).reshape(n * n, rpn * rpn)
    block_rel = lane_medians(blocks, axis=1).reshape(n, n)
    block_log = block_rel + anchor
    # Subtract each cell's block reference by broadcasting over the node layout (no copy).
    ref = block_rel.astype(np.float32)[:, None, :, None]
    resid = (x32.reshape(n, rpn, n, rpn) - ref).reshape(n * rpn, n * rpn)
    row_med = lane_medians(resid, axis=1)
    row_log = _remove_window_effect(row_med)
    resid -= row_med[:, None].astype(np.float32)  # window-wide + row effects
    col_log = lane_medians(resid, axis=0)
    resid -= col_log[None, :].astype(np.float32)
    return block_log, row_log, col_log, resid


def _gateway_effects(
    cps_valid: np.ndarray, src: np.ndarray, dst: np.ndarray, ep: int
) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
    """The same decomposition for the sparse gateway matrix, on its valid edges only.

    Returns ``(aggregate, row_log [EP], col_log [EP], resid [edges])``; the reference (and the
    aggregate) is the median valid edge.
    """
    x = np.log(np.maximum(cps_valid, MIN_COST_PER_SAMPLE))
    ref_log = float(np.median(x))
    resid = x - ref_log
    row_med = grouped_medians(resid, src, ep)
    row_log = _remove_window_effect(row_med)
    resid = resid - row_med[src]
    col_log = grouped_medians(resid, dst, ep)
    resid = resid - col_log[dst]
    return math.exp(ref_log), row_log, col_log, resid


def diagnose_completion(
    cost: np.ndarray,
    samples: np.ndarray,
    probe: str,
    ranks_per_node: int,
    config: NormalConfig,
    tokens: np.ndarray | None = None,
) -> ProbeResult:
    """Apply the Completion rule to one probe's ``[src, dst]`` window deltas.

    Returns a result without the global (history) part: ``global_factor`` and ``global_status``
    are left None for the diagnoser to fill. ``aggregate`` is the topology-aggregated cost per
    sample: the geometric mean of the node-block medians for dense probes (every block counts
    once, whatever its traffic), the median edge for the gateway probe.
    """
    cost = np.asarray(cost, dtype=np.float64)
    samples = np.asarray(samples, dtype=np.float64)
    if cost.ndim != 2 or cost.shape[0] != cost.shape[1] or samples.shape != cost.shape:
        raise ValueError(
            f"{probe}: cost and samples must be the same square matrix, got shapes "
            f"{cost.shape} and {samples.shape}"
        )
    ep = cost.shape[0]
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int):
        raise TypeError(f"ranks_per_node: expected an int, got {ranks_per_node!r}")
    if ranks_per_node < 1 or ep % ranks_per_node:
        raise ValueError(f"ranks_per_node: must divide ep_size={ep}, got {ranks_per_node!r}")
    rpn = ranks_per_node
    gateway = probe in GATEWAY_PROBES
    cps = cost_per_sample(cost, samples)
    tps = None if tokens is None else cost_per_sample(np.asarray(tokens, np.float64), samples)
    valid = np.isfinite(cps)  # a sample and a cost per sample float64 can hold
    off_layout = 0
    if gateway:
        # The diagonal is each rank's local lane (no RDMA): not an edge to compare. The kernel
        # only records edges between ranks with the same local GPU index; a sample elsewhere
        # comes from another layout (another DeepEP build) and would be misread, so it is left
        # out and counted in ``detail``.
        local = np.arange(ep) % rpn
        on_rail = local[:, None] == local[None, :]
        off_layout = int(np.count_nonzero(valid & ~on_rail))
        valid &= on_rail & ~np.eye(ep, dtype=bool)
    if not valid.any():
        what = "inter-node RDMA edge" if gateway else "cell"
        return ProbeResult(
            probe=probe,
            kind="completion",
            status="insufficient",
            cost_per_sample=cps,
            tokens_per_sample=tps,
            detail=f"no {what} carried a sample in this window" + _off_layout_note(off_layout),
        )

    anomalies: list[Anomaly] = []
    if gateway:
        src, dst = np.nonzero(valid)
        aggregate, row_log, col_log, resid = _gateway_effects(cps[src, dst], src, dst, ep)
        classes = {"gateway": aggregate}
        # On two nodes a rank has one edge out and one in: a slow row cannot be told from a
        # slow column or a slow edge, so it is reported as that edge (both ranks named).
        single_out = np.bincount(src, minlength=ep) == 1
        partner = np.full(ep, -1)
        partner[src] = dst
    else:
        block_log, row_log, col_log, resid_mat = _dense_effects(cps, rpn)
        aggregate = math.exp(float(np.mean(block_log[np.isfinite(block_log)])))
        if block_log.shape[0] > 1:
            anomalies.extend(_block_anomalies(block_log, probe, rpn, config))
        flagged = {(a.src, a.dst) for a in anomalies if a.src is not None and a.dst is not None}
        classes = _class_aggregates(block_log, flagged)

    row_scope, col_scope, point_scope = (
        ("src_gateway", "dst_gateway", "edge") if gateway else ("row", "column", "point")
    )
    row_scores = modified_zscores(row_log)
    col_scores = modified_zscores(col_log)
    rows = _flag(row_log, row_scores, config.axis_slowdown, config)
    cols = _flag(col_log, col_scores, config.axis_slowdown, config)
    load = _Load(None if tokens is None else np.asarray(tokens, np.float64), samples)
    anomalies = [
        dataclasses.replace(a, load_ratio=load.block(int(a.src or 0), int(a.dst or 0), rpn))
        for a in anomalies
    ]
    for r, ratio in zip(rows, load.lanes(rows, 1), strict=True):
        if gateway and single_out[r]:
            d = int(partner[r])
            anomalies.append(
                Anomaly(
                    probe,
                    "edge",
                    int(r),
                    d,
                    _factor(row_log[r]),
                    float(row_scores[r]),
                    (int(r), d),
                    load.cells(np.array([r]), np.array([d]))[0],
                )
            )
            continue
        anomalies.append(
            Anomaly(
                probe,
                row_scope,
                int(r),
                None,
                _factor(row_log[r]),
                float(row_scores[r]),
                (int(r),),
                ratio,
            )
        )
    for c, ratio in zip(cols, load.lanes(cols, 0), strict=True):
        anomalies.append(
            Anomaly(
                probe,
                col_scope,
                None,
                int(c),
                _factor(col_log[c]),
                float(col_scores[c]),
                (int(c),),
                ratio,
            )
        )

    detail = ""
    # Points: only candidates past the factor threshold need a score, so the (costly) spread of
    # all residuals is computed only when there is a candidate.
    point_log = np.float32(math.log(config.point_slowdown) - LOG_TOLERANCE)
    if gateway:
        cand = resid >= point_log
        cand &= ~np.isin(src, rows) & ~np.isin(dst, cols)
        src_idx, dst_idx, values = src[cand], dst[cand], resid[cand]
        all_resid = resid
    else:
        with np.errstate(invalid="ignore"):
            cand_mat = resid_mat >= point_log  # NaN (no sample) compares False
        if rows.size:
            cand_mat[rows, :] = False
        if cols.size:
            cand_mat[:, cols] = False
        # nonzero() on a large all-False mask still costs a pass; any() is cheaper to ask.
        src_idx, dst_idx = np.nonzero(cand_mat) if cand_mat.any() else (np.empty(0, int),) * 2
        values = resid_mat[src_idx, dst_idx]
        all_resid = resid_mat
    if src_idx.size:
        center, sigma = robust_location_scale(all_resid)
        values = values.astype(np.float64)
        scores = scores_from(values, center, sigma)
        keep = scores >= config.robust_score - LOG_TOLERANCE
        src_idx, dst_idx, values, scores = src_idx[keep], dst_idx[keep], values[keep], scores[keep]
        if src_idx.size > MAX_POINT_ANOMALIES:
            detail = (
                f"{src_idx.size} {point_scope} anomalies; the {MAX_POINT_ANOMALIES} slowest "
                "are listed"
            )
            top = np.argsort(-values, kind="stable")[:MAX_POINT_ANOMALIES]
            top.sort()
            src_idx, dst_idx, values, scores = src_idx[top], dst_idx[top], values[top], scores[top]
        ratios = load.cells(src_idx, dst_idx)
        for s, d, v, z, ratio in zip(src_idx, dst_idx, values, scores, ratios, strict=True):
            ranks = (int(s),) if s == d else (int(s), int(d))
            anomalies.append(
                Anomaly(probe, point_scope, int(s), int(d), _factor(v), float(z), ranks, ratio)
            )

    detail = "; ".join(d for d in (detail, _off_layout_note(off_layout).lstrip("; ")) if d)
    return ProbeResult(
        probe=probe,
        kind="completion",
        status="anomalous" if anomalies else "ok",
        anomalies=tuple(anomalies),
        cost_per_sample=cps,
        tokens_per_sample=tps,
        aggregate=aggregate,
        detail=detail,
        class_aggregates=classes,
    )

"""A report bounded for the training process: what crosses back from the aggregator.

The aggregator diagnoses every rank, but what it hands back to the root's training process
(and so what that process publishes on ``/metrics`` and OTLP, and what its publishers and
``on_incident`` see) holds the per-rank part of at most ``rank_budget`` ranks: every rank of a
group that small, and in a larger one the ranks a reader needs, in this order:

1. the root itself (its own series: no other process serves them);
2. the ranks the diagnosis names: the culprit and the victim, each finding's ranks, a slow
   pipeline replica's ranks, the ranks a hang names;
3. the slowest ranks by step time, then the ranks that waited least at the synchronisation
   (the likeliest next culprits), until the budget is full.

The rank lists that hold every rank (the window's ``ranks``, the straggler evidence's
``eligible_ranks``) are cut to those ranks too. Everything else about the window stays whole:
the verdict, the score, the ranks each finding names, the missing ranks and the group's size
(``group_size``). The other
ranks' series are served by each rank on its own ``/metrics`` (the aggregator answers each
rank with its own means: :mod:`.service`).
"""

from __future__ import annotations

from dataclasses import replace

from rankwatch.diagnosis.report import WindowReport
from rankwatch.diagnosis.step_time import StepTimeReport
from rankwatch.diagnosis.step_time.pace import PaceReport

__all__ = ["bounded_report", "notable_ranks"]


def _finite(value: float | None, default: float) -> float:
    return default if value is None or value != value else float(value)


def notable_ranks(report: WindowReport, root: int, budget: int) -> list[int]:
    """At most ``budget`` ranks of ``report``, in the order of the module docstring."""
    order: list[int] = [root]
    st = report.step_time
    if st is not None:
        for item in (st.straggler, *st.findings):
            if item is None:
                continue
            for rank in (item.culprit_rank, item.victim_rank):
                if rank is not None:
                    order.append(rank)
            order += list(getattr(item, "ranks", ()))[:budget]
            order += list(item.slow_group_ranks)[:budget]
    if report.hang is not None and report.hang.verdict is not None:
        order += list(report.hang.verdict.ranks)[:budget]
    if st is not None and len(order) < budget:
        means = st.rank_means
        slowest = sorted(means, key=lambda r: -_finite(means[r].get("step"), -1.0))
        least = sorted(means, key=lambda r: _finite(means[r].get("visible"), float("inf")))
        for a, b in zip(slowest, least, strict=True):
            order += (a, b)
            if len(order) >= 2 * budget:
                break
    seen: set[int] = set()
    out: list[int] = []
    for rank in order:
        if rank not in seen:
            seen.add(rank)
            out.append(rank)
            if len(out) == budget:
                break
    return out


def _bounded_step_time(st: StepTimeReport, keep: set[int]) -> StepTimeReport:
    straggler = st.straggler
    if straggler is not None:
        eligible = tuple(r for r in straggler.eligible_ranks if r in keep)
        straggler = replace(straggler, eligible_ranks=eligible)
    return replace(
        st,
        ranks=tuple(r for r in st.ranks if r in keep),
        straggler=straggler,
        rank_means={r: m for r, m in st.rank_means.items() if r in keep},
        missing_signals={r: s for r, s in st.missing_signals.items() if r in keep},
        outlier_steps_by_rank={r: n for r, n in st.outlier_steps_by_rank.items() if r in keep},
    )


def bounded_report(report: WindowReport, root: int, budget: int) -> WindowReport:
    """``report`` with the per-rank part of at most ``budget`` ranks (unchanged when the group
    is that small)."""
    size = report.size
    if size <= budget:
        return report
    keep = set(notable_ranks(report, root, budget))
    st = report.step_time
    return replace(
        report,
        ranks=tuple(info for info in report.ranks if info.rank in keep),
        step_time=None if st is None else _bounded_step_time(st, keep),
        pace=None if report.pace is None else _bounded_pace(report.pace, keep),
        group_size=size,
    )


def _bounded_pace(pace: PaceReport, keep: set[int]) -> PaceReport:
    return replace(pace, rank_ratios={r: v for r, v in pace.rank_ratios.items() if r in keep})

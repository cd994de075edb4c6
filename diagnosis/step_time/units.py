"""The fault's unit: one rank, or the host whose ranks are late together.

The straggler rule names the one rank that arrived last. When a whole node is slow (its NIC,
PCIe switch, power or cooling: every GPU behind it slows), each of its ranks arrives about as
late as the others, and the rule names whichever was last in this window: a different rank
from one window to the next, and never the node. The person on call drains a node, not a rank.

So after the rule, the culprit's host is looked at: a rank of that host (in the culprit's
comparison group) is *late with the culprit* when its own gap to the victim is at least
``slow_host_gap_fraction`` of the culprit's gap. When at least ``slow_host_rank_fraction`` of
the host's ranks, and at least two, are late together, the finding's unit is the host: it names
the host (``slow_host``) and its late ranks (``slow_host_ranks``, also ``ranks``); the culprit,
score and attribution stay those of the latest rank. A lone slow GPU on an otherwise healthy
node stays a rank: its neighbours wait like everyone else.

What it cannot tell: ranks whose work is coupled inside the step (a tensor-parallel group
synchronises every layer) arrive late together when one of them is slow; when such a group is
one host, the host is named. A host with one rank in the group is that rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from rankwatch.diagnosis.config import StepTimeConfig, config_or_default
from rankwatch.diagnosis.step_time.report import StepTimeReport

__all__ = ["late_with_culprit", "name_fault_unit"]

_SLACK = 1e-9


def late_with_culprit(
    report: StepTimeReport, ranks: tuple[int, ...], gap_fraction: float
) -> tuple[int, ...]:
    """Those of ``ranks`` whose gap to the victim is at least ``gap_fraction`` of the culprit's
    (their visible value measured); empty without straggler evidence or a positive gap."""
    ev = report.straggler
    if ev is None:
        return ()
    gap = ev.visible_victim_ms - ev.visible_culprit_ms
    if not (math.isfinite(gap) and gap > 0):
        return ()
    late: list[int] = []
    for rank in ranks:
        visible = (report.rank_means.get(rank) or {}).get("visible")
        if visible is None or not math.isfinite(visible):
            continue
        if ev.visible_victim_ms - visible >= gap_fraction * gap * (1 - _SLACK):
            late.append(rank)
    return tuple(late)


def name_fault_unit(
    report: StepTimeReport,
    hostnames: Mapping[int, str],
    config: StepTimeConfig | None = None,
) -> StepTimeReport:
    """``report`` with its straggler finding naming the culprit's host when the host's ranks
    are late together (see the module docstring); the same report otherwise.

    ``hostnames`` maps a global rank to its node's name (empty or absent: unknown, never a
    host unit).
    """
    if not isinstance(report, StepTimeReport):
        raise TypeError(f"report: expected StepTimeReport, got {type(report).__name__}")
    if not isinstance(hostnames, Mapping):
        raise TypeError(f"hostnames: expected a mapping of rank to host, got {hostnames!r}")
    cfg = config_or_default(config, StepTimeConfig)
    ev = report.straggler
    at = next((i for i, f in enumerate(report.findings) if f.is_straggler), None)
    if ev is None or at is None:
        return report
    finding = report.findings[at]
    if finding.slow_group or finding.culprit_rank is None:
        return report  # a pipeline replica is already a group of its own
    host = hostnames.get(finding.culprit_rank) or ""
    if not host:
        return report
    compared = ev.compared_ranks or ev.eligible_ranks
    on_host = tuple(r for r in compared if hostnames.get(r) == host)
    if len(on_host) < 2:
        return report
    late = late_with_culprit(report, on_host, cfg.slow_host_gap_fraction)
    needed = max(2, math.ceil(cfg.slow_host_rank_fraction * len(on_host) - _SLACK))
    if len(late) < needed:
        return report
    named = dataclasses.replace(
        finding, slow_host=host, slow_host_ranks=late, ranks=late, slow_host_size=len(on_host)
    )
    findings = (*report.findings[:at], named, *report.findings[at + 1 :])
    return dataclasses.replace(report, findings=findings)

"""The fleet dashboard: which hosts were the culprit, in how many runs, at what cost.

Every panel reads the exporter's own series over the dashboard's time range (seven days by
default, the ledger's window), so it needs no recording rule and shows any range; the
``RankwatchRepeatOffenderHost`` alert reads the same facts from the ledger's recording rules
(:mod:`.fleet_rules`). Only hosts a critical incident named appear: the panels are keyed by
culprit hosts, not by the fleet.
"""

from __future__ import annotations

import json

from rankwatch.diagnosis.config import DiagnosisConfig
from rankwatch.diagnosis.vocabulary import CULPRIT_CLASSES
from rankwatch.exporter.assets.grafana import (
    GREEN,
    ORANGE,
    RED,
    SEL,
    Dashboard,
    dashboard,
    organize,
    steps,
    table,
    target,
    timeseries,
    with_runbooks,
)
from rankwatch.exporter.assets.settings import Settings
from rankwatch.exporter.publish.catalogue import METRIC_NAMES as M

__all__ = ["LEDGER_ALERT", "build"]

LEDGER_ALERT = "RankwatchRepeatOffenderHost"


def _culprits() -> str:
    """Critical incidents of the classes that blame a host, over the time range."""
    classes = json.dumps("|".join(CULPRIT_CLASSES))
    selector = f'{{{SEL}, severity="critical", class=~{classes}, hostname!=""}}'
    return f"max_over_time({M.incident_active}{selector}[$__range])"


def build(s: Settings, config: DiagnosisConfig) -> Dashboard:
    """The fleet dashboard (``config`` is unused: its panels count, they draw no bands)."""
    del config
    n, m = s.repeat_offender_runs, s.repeat_offender_healthy_runs
    offender = steps((GREEN, None), (ORANGE, 2), (RED, n))
    culprits = _culprits()
    runs = f"count by (hostname) (count by (hostname, run) ({culprits}))"
    took_part = (
        f"count by (hostname) (count by (hostname, run) "
        f'(max_over_time({M.phase_seconds}{{{SEL}, hostname!=""}}[$__range])))'
        f" and on (hostname) {runs}"
    )
    panels = [
        table(
            "Hosts by runs affected",
            "Per host, the distinct runs in the time range in which a critical incident that "
            "blames a culprit (a straggler, a slow node, a hang, a DeepEP localized slowdown) "
            "named it, the attempts, and the runs it took part in (any rank on it publishing "
            f"phase times). RankwatchRepeatOffenderHost fires from {n} culprit runs with at "
            f"most {m} healthy ones over its window ({s.ledger_window}). Only culprit hosts "
            "are listed.",
            [
                target(f"sort_desc({runs})", instant=True),
                target(
                    f"count by (hostname) (count by (hostname, run, attempt) ({culprits}))",
                    instant=True,
                ),
                target(took_part, instant=True),
            ],
            (12, 9),
            "none",
            [
                {"id": "merge", "options": {}},
                organize(
                    ("Time",),
                    {
                        "Value #A": "culprit runs",
                        "Value #B": "culprit attempts",
                        "Value #C": "runs taken part in",
                    },
                ),
            ],
            "color-text",
            thresholds=offender,
        ),
        table(
            "Hosts by incidents",
            "Per host and incident class, the critical incidents that named it in the time "
            "range (one per run, attempt, rank and class): which kind of fault follows a host. "
            "A host with several classes (a straggler in one run, a hang in the next) points at "
            "the host itself.",
            [
                target(
                    "sort_desc(count by (hostname, class) "
                    f"(count by (hostname, class, run, attempt, culprit_rank) ({culprits})))",
                    instant=True,
                )
            ],
            (12, 9),
            "none",
            [organize(("Time",), {"Value": "incidents"})],
            "color-text",
            thresholds=steps((GREEN, None), (ORANGE, 1), (RED, n)),
        ),
        table(
            "Hosts by time lost",
            "Per culprit host, the rank-seconds its incidents cost the groups in the time "
            "range (rankwatch_time_lost_seconds_total: a culprit's gap on every rank each "
            "step, a hang's stalled seconds): where the fleet's hours go.",
            [
                target(
                    f"sort_desc(sum by (hostname) (increase({M.time_lost_seconds_total}"
                    f'{{{SEL}, hostname!=""}}[$__range])) > 0)',
                    instant=True,
                )
            ],
            (12, 9),
            "s",
            [organize(("Time",), {"Value": "time lost"})],
            decimals=0,
        ),
        table(
            "Runs each culprit host touched",
            "Every run and attempt in the time range in which a host was the culprit of a "
            "critical incident, with the class and rank: the evidence behind the counts, and "
            "the runs to look at first.",
            [
                target(
                    f"max by (hostname, run, attempt, class, culprit_rank) ({culprits})",
                    instant=True,
                )
            ],
            (12, 9),
            "none",
            [organize(("Time", "Value"), {"culprit_rank": "rank"})],
        ),
        timeseries(
            "Culprit hosts over time",
            "How many distinct hosts a critical incident names at each moment: a fleet whose "
            "count grows has more bad hosts than one job's incidents show.",
            [
                target(
                    "count(count by (hostname) "
                    f'({M.incident_active}{{{SEL}, severity="critical", '
                    f'class=~{json.dumps("|".join(CULPRIT_CLASSES))}, hostname!=""}})) '
                    "or vector(0)",
                    "culprit hosts",
                )
            ],
            (24, 7),
            "none",
            min=0,
        ),
    ]
    with_runbooks(panels, s, {"Hosts by runs affected": (LEDGER_ALERT,)})
    board = dashboard(
        "rankwatch-fleet",
        "rankwatch / Fleet",
        "Hosts that were the culprit of critical incidents across runs: how often, at what "
        "cost, in which runs. `rankwatch hosts` prints the same as a list to exclude.",
        panels,
        True,
    )
    # The ledger's window: a fleet's memory is days, not the last hour.
    board["time"] = {"from": f"now-{s.ledger_window}", "to": "now"}
    return board

"""The DeepEP normal-mode dashboard: late arrivals, slow paths, global slowdowns."""

from __future__ import annotations

from rankwatch.diagnosis.config import DiagnosisConfig
from rankwatch.diagnosis.deepep.normal.completion import GATEWAY_PROBES
from rankwatch.diagnosis.deepep.normal.schema import COMPLETION_PROBES, PROBES
from rankwatch.exporter.assets.grafana import (
    BLUE,
    DEEPEP_ALERTS,
    GREEN,
    OPEN_MAPPING,
    ORANGE,
    RED,
    SEL,
    SEVERITY_COLOURS,
    Dashboard,
    Panel,
    by_rank,
    dashboard,
    organize,
    pad,
    stat,
    state_timeline,
    steps,
    table,
    target,
    timeseries,
    with_runbooks,
)
from rankwatch.exporter.assets.prose import count_words, number
from rankwatch.exporter.assets.settings import Settings
from rankwatch.exporter.publish.catalogue import METRIC_NAMES as M

__all__ = ["build", "completion_matrix"]


def completion_matrix(probe: str) -> Panel:
    """One src x dst Completion cost matrix: instant query, grouping to matrix, coloured cells."""
    metric = f'{M.deepep_completion_cycles_per_sample}{{{SEL}, probe="{probe}"}}'
    cells = pad(pad(metric, "src_rank", "src"), "dst_rank", "dst")
    # "key" sorts rows by source, then destination: the matrix's rows and columns then appear
    # in numeric rank order.
    expr = f'label_join({cells}, "key", "-", "src", "dst")'
    return table(
        f"Completion cost {probe} (src x dst)",
        f"Completion cost per sample of every source -> destination cell of the {probe} probe "
        "in the latest window (cycles per sample), rows = source rank, columns = destination "
        "rank, both in numeric order. Colours run from the cheapest (green) to the most "
        "expensive (red) cell of this matrix. A red row is a slow sender, a red column a slow "
        "receiver, a red block a slow node pair. Above the cell budget only flagged cells are "
        "exported and the matrix has holes."
        + (
            " This probe is gateway-oriented (source gateway proxy -> destination): only the "
            "gateway edges that carried RDMA traffic have cells."
            if probe in GATEWAY_PROBES
            else ""
        ),
        [target(f"max by (src, dst, key) ({expr})", instant=True)],
        (8, 10),
        "none",
        [
            {"id": "sortBy", "options": {"fields": {}, "sort": [{"field": "key", "desc": False}]}},
            {
                "id": "groupingToMatrix",
                "options": {
                    "columnField": "dst",
                    "rowField": "src",
                    "valueField": "Value",
                    "emptyValue": "null",
                },
            },
        ],
        cell="color-background",
        color={"mode": "continuous-GrYlRd"},
        decimals=0,
        overrides=[
            {
                "matcher": {"id": "byName", "options": "src\\dst"},
                "properties": [
                    {"id": "custom.cellOptions", "value": {"type": "auto"}},
                    {"id": "displayName", "value": "src \\ dst"},
                ],
            }
        ],
    )


def build(s: Settings, config: DiagnosisConfig) -> Dashboard:
    """The DeepEP normal-mode dashboard, its bands and prose drawn from ``config``."""
    policy = config.normal
    notify, slowdown = number(policy.notify_ratio), number(policy.global_slowdown)
    axis, point = number(policy.axis_slowdown), number(policy.point_slowdown)
    probes = count_words(len(PROBES))
    panels = [
        stat(
            "Anomalous probes",
            f"Probes (of {probes}) reporting an anomaly in the latest window.",
            f"sum({M.deepep_probe_anomalous}{{{SEL}}})",
            "short",
            thresholds=steps((GREEN, None), (ORANGE, 1)),
        ),
        stat(
            "Open DeepEP incidents",
            "Open DeepEP incidents (pre-stage arrival skew, global or "
            "localized data-path slowdown, unclassified).",
            f'count({M.incident_active}{{{SEL}, class!~"step_time_.*"}}) or vector(0)',
            "short",
            thresholds=steps((GREEN, None), (RED, 1)),
        ),
        stat(
            "Worst global slowdown",
            "Largest global slowdown factor over the probes: "
            f"completion cost against the median of recent normal windows. Red from {slowdown}x.",
            f"max({M.deepep_global_slowdown_factor}{{{SEL}}})",
            "none",
            decimals=2,
            thresholds=steps((GREEN, None), (RED, policy.global_slowdown)),
        ),
        stat(
            "Lowest Notify ratio",
            "Smallest Notify duration / peer median over ranks and "
            f"probes. Red at or below {notify}: a rank arrives late at a Notify kernel.",
            f"min({M.deepep_notify_ratio}{{{SEL}}})",
            "none",
            decimals=3,
            # Grafana colours a value from the step it reaches: green starts just above the ratio.
            thresholds=steps((RED, None), (GREEN, round(policy.notify_ratio + 1e-4, 6))),
        ),
        stat(
            "Invalid windows",
            "Normal-mode windows rejected before diagnosis in the time "
            "range (counter reset, warm-up, ...).",
            f"sum(increase({M.deepep_window_invalid_total}{{{SEL}}}[$__range])) or vector(0)",
            "short",
            thresholds=steps((GREEN, None), (ORANGE, 1)),
        ),
        stat(
            "Ranks",
            "Ranks in the EP group; the completion matrices below have this many rows and columns.",
            f"max({M.group_ranks}{{{SEL}}})",
            "short",
            thresholds=steps((BLUE, None)),
        ),
        timeseries(
            "Notify ratio per rank and probe",
            "Notify kernel duration of each rank "
            "over the median of its peers, per probe (notify_dispatch, "
            "cached_notify_dispatch, cached_notify_combine). A rank at or below the red "
            f"{notify} line entered the kernel late and waited least: late-arrival evidence.",
            [
                target(
                    by_rank("probe", f"{M.deepep_notify_ratio}{{{SEL}}}"),
                    "{{probe}} rank {{rank}}",
                )
            ],
            (12, 9),
            "none",
            line_thresholds=True,
            thresholds=steps((RED, None), (GREEN, policy.notify_ratio)),
            min=0,
        ),
        timeseries(
            "Notify duration per rank",
            "Average Notify kernel duration per launch.",
            [
                target(
                    by_rank("probe", f"{M.deepep_notify_duration_seconds}{{{SEL}}}"),
                    "{{probe}} rank {{rank}}",
                )
            ],
            (12, 9),
            "s",
        ),
        *(completion_matrix(p) for p in COMPLETION_PROBES),
        table(
            "Residual slowdown factors by scope",
            "Flagged scopes of the latest window: "
            "row, column, point, node block, source/destination gateway, gateway edge, with "
            "src/dst ranks (or n<node>). Factors remain after removing the window-wide, row "
            f"and column effects; rows/columns/blocks are flagged from {axis}x, points and edges "
            f"from {point}x.",
            [
                target(
                    f"max by (probe, scope, src, dst) "
                    f"({M.deepep_residual_slowdown_factor}{{{SEL}}})",
                    instant=True,
                )
            ],
            (12, 9),
            "none",
            [organize(("Time",), {"Value": "factor"})],
            cell="color-text",
            thresholds=steps(
                (GREEN, None), (ORANGE, policy.axis_slowdown), (RED, policy.point_slowdown)
            ),
            decimals=2,
        ),
        timeseries(
            "Global slowdown factor per probe",
            "Topology-aggregated completion cost of "
            f"each window over the median of up to {policy.history_horizon} previous normal "
            f"windows. Absent until {count_words(policy.history_bootstrap)} normal windows have "
            f"been seen. At or above the red {slowdown}x line on "
            "both dispatch_final and combine_logical_recv means a global data-path "
            "slowdown.",
            [
                target(
                    f"max by (probe) ({M.deepep_global_slowdown_factor}{{{SEL}}})",
                    "{{probe}}",
                )
            ],
            (12, 9),
            "none",
            line_thresholds=True,
            thresholds=steps((GREEN, None), (RED, policy.global_slowdown)),
        ),
        state_timeline(
            "Probe anomalies",
            f"When each of the {probes} probes reported an anomaly "
            "(red). Anomalies are raw evidence; incidents below correlate them.",
            f"max by (probe) ({M.deepep_probe_anomalous}{{{SEL}}})",
            "{{probe}}",
            thresholds=steps((GREEN, None), (RED, 1)),
            mappings=[
                {
                    "type": "value",
                    "options": {
                        "0": {"text": "ok", "color": GREEN, "index": 0},
                        "1": {"text": "anomalous", "color": RED, "index": 1},
                    },
                }
            ],
        ),
        state_timeline(
            "Incidents by class",
            "Open DeepEP incidents by class "
            "(pre_stage_arrival_skew, global_data_path_slowdown, "
            "localized_data_path_slowdown, hang_suspect, unclassified), probe and culprit rank.",
            f"max by (class, severity, probe, culprit_rank) "
            f'({M.incident_active}{{{SEL}, class!~"step_time_.*"}})',
            "{{class}} {{probe}} rank {{culprit_rank}} ({{severity}})",
            mappings=OPEN_MAPPING,
            overrides=SEVERITY_COLOURS,
        ),
        timeseries(
            "Completion row and column medians",
            "Median completion cost per sample of "
            "each source row and destination column; above the cell budget these replace "
            "the full matrices.",
            [
                target(
                    f"max by (probe, src_rank) "
                    f"({M.deepep_completion_row_cycles_per_sample}{{{SEL}}})",
                    "{{probe}} row {{src_rank}}",
                ),
                target(
                    f"max by (probe, dst_rank) "
                    f"({M.deepep_completion_column_cycles_per_sample}{{{SEL}}})",
                    "{{probe}} column {{dst_rank}}",
                ),
            ],
            (12, 9),
            "none",
        ),
        timeseries(
            "Low-latency row and column ratios",
            "DeepEP low-latency receive wait: each "
            "receiver row's and peer column's mean over the mean of all rows/columns "
            "(1.0 = average). A rank far above 1 waits or is waited for abnormally.",
            [
                target(
                    by_rank("phase", f"{M.deepep_ll_row_ratio}{{{SEL}}}"),
                    "{{phase}} row {{rank}}",
                ),
                target(
                    by_rank("phase", f"{M.deepep_ll_column_ratio}{{{SEL}}}"),
                    "{{phase}} column {{rank}}",
                ),
            ],
            (12, 9),
            "none",
            thresholds=steps((GREEN, None), (ORANGE, 2.0)),
        ),
    ]
    with_runbooks(
        panels,
        s,
        {
            "Open DeepEP incidents": DEEPEP_ALERTS,
            "Worst global slowdown": ("RankwatchDeepEPGlobalDataPathSlowdown",),
            "Lowest Notify ratio": ("RankwatchDeepEPPreStageArrivalSkew",),
            "Residual slowdown factors by scope": ("RankwatchDeepEPLocalizedDataPathSlowdown",),
            "Global slowdown factor per probe": ("RankwatchDeepEPGlobalDataPathSlowdown",),
            "Incidents by class": DEEPEP_ALERTS,
        },
    )
    return dashboard(
        "rankwatch-deepep-normal",
        "rankwatch / DeepEP normal mode",
        "DeepEP dispatch/combine: late arrivals, slow paths, global slowdowns.",
        panels,
        False,
    )

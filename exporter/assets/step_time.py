"""The step-time straggler dashboard: which rank slows the group down, why, and since when."""

from __future__ import annotations

from typing import Any

from rankwatch.diagnosis.config import DiagnosisConfig
from rankwatch.exporter.assets.grafana import (
    BLUE,
    GREEN,
    OPEN_MAPPING,
    ORANGE,
    RED,
    SEL,
    SEVERITY_COLOURS,
    SEVERITY_MAPPINGS,
    SEVERITY_STEPS,
    STRAGGLER_ALERTS,
    Dashboard,
    by_rank,
    dashboard,
    organize,
    pad,
    panel,
    score_steps,
    stat,
    state_timeline,
    steps,
    table,
    target,
    timeseries,
    variable,
    window_age_steps,
    with_runbooks,
)
from rankwatch.exporter.assets.prose import duration_words, percent, straggler_percents
from rankwatch.exporter.assets.settings import Settings, duration_seconds
from rankwatch.exporter.publish.catalogue import METRIC_NAMES as M

__all__ = ["build"]


def _rank_rows(color: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """Options of a rank x time heatmap: the rows as given (ranks in numeric order), the
    ``color`` scheme's settings, and ``extra`` options."""
    return {
        "calculate": False,
        "cellGap": 1,
        "yAxis": {"axisPlacement": "left"},
        "rowsFrame": {"layout": "auto"},
        "showValue": "never",
        "color": {"mode": "scheme", "fill": "dark-orange", "steps": 64, **color},
        "legend": {"show": True},
        "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": True},
        **extra,
    }


def build(s: Settings, config: DiagnosisConfig) -> Dashboard:
    """The step-time straggler dashboard, its bands and prose drawn from ``config``."""
    policy = config.step_time
    warning, critical = straggler_percents(policy)
    score = score_steps(policy)
    stale = s.stale_window_seconds
    critical_for = duration_seconds(s.for_["RankwatchStepTimeStragglerCritical"])
    visible = pad(f'{M.phase_seconds}{{{SEL}, phase="visible"}}', "rank", "r")
    host_queries = [
        (f'max by (hostname) ({M.phase_seconds}{{{SEL}, phase="step"}})', "slowest step"),
        (f'min by (hostname) ({M.phase_seconds}{{{SEL}, phase="visible"}})', "least visible"),
        (
            f'max by (hostname) ({M.phase_seconds}{{{SEL}, phase="input_wait"}})',
            "most input wait",
        ),
        # A rank served by the root and by itself is one rank (docs/metrics.md).
        (
            f"count by (hostname) (max by (hostname, rank) "
            f'({M.phase_seconds}{{{SEL}, phase="step"}}))',
            "ranks",
        ),
    ]
    panels = [
        stat(
            "Straggler score",
            "Straggler score of the latest window: the visible-phase gap "
            "between the victim (upper median rank) and the culprit (fastest through the "
            "synchronising phase, i.e. the latest to arrive), over the victim's iteration cost. "
            f"Yellow from {warning} % (warning), red from {critical} % (critical).",
            f"max({M.straggler_score}{{{SEL}}})",
            "percentunit",
            thresholds=score,
        ),
        stat(
            "Severity",
            "Severity of the current step-time diagnosis. Critical is a straggler only, and "
            f"needs a score of {critical} % or more, at least {policy.min_steps_critical} steps "
            "in the window, and a DDP/default strategy; a bottleneck (input-bound, "
            "residual-heavy: a steady property of the job, which does not page) is a warning "
            "at most.",
            f"max({M.diagnosis_severity}{{{SEL}}})",
            "none",
            thresholds=SEVERITY_STEPS,
            mappings=SEVERITY_MAPPINGS,
        ),
        stat(
            "Window steps",
            "Steps aligned across all ranks in the latest window. Below "
            f"{policy.min_steps_warning} no straggler is reported; below "
            f"{policy.min_steps_critical} severity is capped at warning.",
            f"max({M.window_steps}{{{SEL}}})",
            "short",
            thresholds=steps(
                (RED, None), (ORANGE, policy.min_steps_warning), (GREEN, policy.min_steps_critical)
            ),
        ),
        stat(
            "Window age",
            f"Seconds since the latest window was diagnosed. Red after {duration_words(stale)} "
            "(the RankwatchNoFreshWindows alert): the panels below are stale.",
            f"max({M.window_age_seconds}{{{SEL}}})",
            "s",
            thresholds=window_age_steps(stale),
        ),
        stat(
            "Missing ranks",
            "Ranks expected but absent from the latest window. Anything but 0 "
            "means an incomplete window: rules abstain rather than guess.",
            f"max({M.window_missing_ranks}{{{SEL}}})",
            "short",
            thresholds=steps((GREEN, None), (RED, 1)),
        ),
        stat(
            "Ranks",
            "Ranks in the group; the heatmap below has one row per rank.",
            f"max({M.group_ranks}{{{SEL}}})",
            "short",
            thresholds=steps((BLUE, None)),
        ),
        table(
            "Current diagnosis",
            "The latest step-time diagnosis: kind (INPUT_STRAGGLER, "
            "H2D_STRAGGLER, COMPUTE_STRAGGLER, STRAGGLER, BALANCED, INCOMPLETE_DATA, ...), "
            "severity, culprit and victim rank, the component that explains the wait, the "
            "clock (gpu or cpu) and the training strategy.",
            [target(f"{M.diagnosis_info}{{{SEL}}}", instant=True)],
            (24, 4),
            "none",
            [
                organize(
                    ("Time", "Value", "__name__", "instance", "job"),
                    {"culprit_rank": "culprit", "victim_rank": "victim"},
                )
            ],
        ),
        timeseries(
            "Straggler score over time",
            f"Straggler score per window with its warning ({warning} %) and "
            f"critical ({critical} %) bands. A line that stays in the red band means an incident "
            f"and, after {duration_words(critical_for)}, a page.",
            [target(f"max by (run, group) ({M.straggler_score}{{{SEL}}})", "{{run}}/{{group}}")],
            (12, 8),
            "percentunit",
            line_thresholds=True,
            thresholds=score,
            min=0,
        ),
        panel(
            "bargauge",
            "Cause coverage by component",
            "Share of the culprit's visible wait "
            "explained by each measured component (input, h2d, compute) in the latest window. "
            f"A component reaching {percent(policy.cause_coverage_min)} % names the cause; below "
            "that the diagnosis stays STRAGGLER. An unmeasured component is absent, never zero.",
            [target(f"max by (component) ({M.cause_coverage_ratio}{{{SEL}}})", instant=True)],
            (6, 8),
            "percentunit",
            thresholds=steps((BLUE, None), (RED, policy.cause_coverage_min)),
            min=0,
            max=1,
            options={
                "orientation": "horizontal",
                "displayMode": "basic",
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "showUnfilled": True,
                "valueMode": "color",
            },
        ),
        timeseries(
            "Component excess (culprit - victim)",
            "Culprit minus victim window-mean "
            "time per component. The component whose excess covers the visible gap is "
            "the cause.",
            [
                target(
                    f"max by (component) ({M.component_excess_seconds}{{{SEL}}})",
                    "{{component}}",
                )
            ],
            (6, 8),
            "s",
        ),
        panel(
            "heatmap",
            "Visible phase per rank",
            "Rank x time heatmap of the visible "
            "(synchronising) phase: backward under DDP, forward+backward under FSDP. The "
            "straggler is the rank with the *shortest* visible phase: it arrives last and "
            "waits least, so look for the pale row. Rows are ranks in numeric order.",
            [target(f"max by (r) ({visible})", "{{r}}")],
            (24, 10),
            "s",
            options=_rank_rows(
                {"scheme": "Oranges", "scale": "exponential", "exponent": 0.5, "reverse": False},
                cellValues={"unit": "s"},
                exemplars={"color": "rgba(255,0,255,0.7)"},
                filterValues={"le": 1e-9},
            ),
        ),
        timeseries(
            "Per-rank phase times",
            "Window mean of the selected phases per rank on "
            "the selected clock. Pick phases with the Phase variable; an unmeasured phase "
            "has no line.",
            [
                target(
                    by_rank("phase", f'{M.phase_seconds}{{{SEL}, phase=~"$phase"}}'),
                    "rank {{rank}} {{phase}}",
                )
            ],
            (12, 9),
            "s",
        ),
        state_timeline(
            "Incident timeline",
            "Step-time straggler incidents as the exporter's "
            "tracker holds them open (k of n windows to open, m clean windows to "
            "close). Red rows are critical, orange warning.",
            f"max by (severity, culprit_rank, hostname, cause) "
            f'({M.incident_active}{{{SEL}, class="step_time_straggler"}})',
            "{{severity}} rank {{culprit_rank}} {{hostname}} {{cause}}",
            mappings=OPEN_MAPPING,
            overrides=SEVERITY_COLOURS,
        ),
        state_timeline(
            "Slow nodes",
            "Nodes whose ranks are late together (most or all of one host's ranks, which the "
            "others wait for): one incident per node, not one per rank. The row names the "
            "node, its late ranks and the cause of the latest window. Drain the node, not its "
            "GPUs one by one.",
            f"max by (severity, hostname, culprit_rank, cause) "
            f'({M.incident_active}{{{SEL}, class="step_time_slow_node"}})',
            "{{severity}} {{hostname}} ranks {{culprit_rank}} {{cause}}",
            mappings=OPEN_MAPPING,
            overrides=SEVERITY_COLOURS,
        ),
        timeseries(
            "Step time against the run's baseline",
            "The group's pace (median outer step over ranks, less a straggler's gap) over its "
            "own baseline, formed from its first windows after warm-up. 1 is the run's healthy "
            f"pace; a job_slowdown incident opens from {policy.job_slowdown_warning_ratio}x "
            f"(critical {policy.job_slowdown_critical_ratio}x) for "
            f"{policy.job_slowdown_windows} windows in a row. No rank is later than another "
            "when every rank slows: only this comparison shows it. The baseline itself is the "
            "second line (seconds, right axis).",
            [
                target(f"max({M.job_pace_ratio}{{{SEL}}})", "pace / baseline"),
                target(f"max({M.job_baseline_step_seconds}{{{SEL}}})", "baseline step (s)"),
            ],
            (12, 8),
            "none",
            overrides=[
                {
                    "matcher": {"id": "byName", "options": "baseline step (s)"},
                    "properties": [
                        {"id": "unit", "value": "s"},
                        {"id": "custom.axisPlacement", "value": "right"},
                    ],
                }
            ],
        ),
        timeseries(
            "Time lost by cause",
            "Rank-seconds lost per second of wall time to each incident (its class, cause, "
            "culprit ranks and host): how many GPUs' worth of time the fault costs right now. "
            "A straggler or slow node costs its gap on every rank, each step; a job slowdown "
            "its excess over the baseline; a hang its stalled seconds (docs/metrics.md).",
            [
                target(
                    f"sum by (class, cause, culprit_rank, hostname) "
                    f"(rate({M.time_lost_seconds_total}{{{SEL}}}[$__rate_interval]))",
                    "{{class}} {{cause}} rank {{culprit_rank}} {{hostname}}",
                )
            ],
            (12, 8),
            "short",
        ),
        panel(
            "heatmap",
            "Per-rank pace against its own baseline",
            "Rank x time heatmap of each rank's own work per step (its outer step less its "
            "synchronisation waits) over its own baseline: a rank (or a host's ranks) "
            "degrading shows as a warming row before it is a straggler. The root serves the "
            "ranks its report holds (the culprits and the slowest in a large group).",
            [target(f"max by (r) ({pad(f'{M.rank_pace_ratio}{{{SEL}}}', 'rank', 'r')})", "{{r}}")],
            (24, 8),
            "none",
            options=_rank_rows(
                {"scheme": "RdYlGn", "scale": "linear", "min": 0.8, "max": 1.6, "reverse": True}
            ),
        ),
        state_timeline(
            "Hangs",
            "The hang watcher's incidents: no rank progressed for the hang budget. One row per "
            "hang: its class, the named rank(s), their phase and the op the others wait in; "
            "the incident's evidence (log line, OTLP event) has the collective's sequence "
            "number and the named rank's top frames.",
            f"max by (hang_class, culprit_rank, phase, op) ({M.hang_active}{{{SEL}}})",
            "{{hang_class}} rank {{culprit_rank}} in {{phase}}, others in {{op}}",
            mappings=OPEN_MAPPING,
        ),
        table(
            "Per-host breakdown",
            "Per host: the slowest step, the least visible phase (the "
            "likeliest culprit on that host), the most input wait, and how many ranks it "
            "runs. If every rank of one host is slow, suspect the host, not the rank.",
            [target(q, instant=True) for q, _ in host_queries],
            (24, 7),
            "s",
            [
                {"id": "merge", "options": {}},
                organize(
                    ("Time",),
                    {f"Value #{chr(65 + i)}": name for i, (_, name) in enumerate(host_queries)},
                ),
            ],
            overrides=[
                {
                    "matcher": {"id": "byName", "options": "ranks"},
                    "properties": [{"id": "unit", "value": "short"}],
                }
            ],
        ),
    ]
    phase = variable("phase", "Phase", f"label_values({M.phase_seconds}{{{SEL}}}, phase)", True)
    phase["current"] = {"text": ["visible", "step"], "value": ["visible", "step"]}
    with_runbooks(
        panels,
        s,
        {
            "Straggler score": STRAGGLER_ALERTS,
            "Straggler score over time": STRAGGLER_ALERTS,
            "Window age": ("RankwatchNoFreshWindows",),
            "Incident timeline": STRAGGLER_ALERTS,
            "Slow nodes": ("RankwatchSlowNode",),
            "Step time against the run's baseline": ("RankwatchJobSlowdown",),
            "Hangs": ("RankwatchHang",),
        },
    )
    return dashboard(
        "rankwatch-step-time",
        "rankwatch / Step-time stragglers",
        "Which rank slows the group down, why, and since when.",
        panels,
        False,
        [phase],
    )

"""The overview dashboard: every run and group rankwatch watches, incidents, freshness."""

from __future__ import annotations

from rankwatch.diagnosis.config import DiagnosisConfig
from rankwatch.exporter.assets.grafana import (
    DEEPEP_ALERTS,
    GREEN,
    ORANGE,
    RED,
    SCOPE,
    SEL,
    STRAGGLER_ALERTS,
    VAR_PARAMS,
    Dashboard,
    dashboard,
    organize,
    score_steps,
    severity_legend,
    stat,
    steps,
    table,
    target,
    timeseries,
    window_age_steps,
    with_runbooks,
)
from rankwatch.exporter.assets.prose import duration_words, number, straggler_percents
from rankwatch.exporter.assets.settings import Settings
from rankwatch.exporter.publish.catalogue import METRIC_NAMES as M

__all__ = ["build"]


def build(s: Settings, config: DiagnosisConfig) -> Dashboard:
    """The overview of every run and group, its bands and prose drawn from ``config``."""
    policy = config.step_time
    warning, critical = straggler_percents(policy)
    score = score_steps(policy)
    slowdown = config.normal.global_slowdown
    stale = s.stale_window_seconds
    groups = [
        (f"max by (run, group) ({M.group_ranks}{{{SEL}}})", "ranks"),
        (f"max by (run, group) ({M.window_index}{{{SEL}}})", "window"),
        (f"max by (run, group) ({M.window_age_seconds}{{{SEL}}})", "age"),
        (f"max by (run, group) ({M.straggler_score}{{{SEL}}})", "straggler score"),
        (f"max by (run, group) ({M.diagnosis_severity}{{{SEL}}})", "severity"),
    ]
    panels = [
        stat(
            "Critical incidents",
            "Open critical incidents over the selected runs and groups; each pages within minutes. "
            "Only faults are critical (a straggler holding the others, a DeepEP incident class, "
            "a hang): a steady property of the job (input-bound, residual-heavy) is a warning "
            "at most and never counted here.",
            f'count({M.incident_active}{{{SEL}, severity="critical"}}) or vector(0)',
            "short",
            thresholds=steps((GREEN, None), (RED, 1)),
        ),
        stat(
            "All open incidents",
            "All open incidents of every class and severity over the selected runs and groups, "
            "properties of the job (step_time_bottleneck warnings, which do not page) included.",
            f"count({M.incident_active}{{{SEL}}}) or vector(0)",
            "short",
            thresholds=steps((GREEN, None), (ORANGE, 1)),
        ),
        stat(
            "Groups reporting",
            "Groups whose root rank currently publishes diagnosed windows.",
            f"count({M.window_index}{{{SEL}}}) or vector(0)",
            "short",
            thresholds=steps((RED, None), (GREEN, 1)),
        ),
        stat(
            "Oldest window",
            f"Age of the stalest group's latest window. Red after {duration_words(stale)}.",
            f"max({M.window_age_seconds}{{{SEL}}})",
            "s",
            thresholds=window_age_steps(stale),
        ),
        stat(
            "Endpoints down",
            "rankwatch scrape targets (one per rank) that Prometheus cannot reach right now.",
            f'count(up{{{SCOPE}, job=~"$job"}} == 0) or vector(0)',
            "short",
            thresholds=steps((GREEN, None), (RED, 1)),
        ),
        stat(
            "Export failures",
            "Failed OTLP metric and log exports in the time range; /metrics is unaffected.",
            f"sum(increase({M.export_failures_total}{{{SEL}}}[$__range])) or vector(0)",
            "short",
            thresholds=steps((GREEN, None), (ORANGE, 1)),
        ),
        table(
            "Open incidents",
            "Every open incident with its culprit rank, host, cause and "
            "score (straggler score, slowdown factor, or smallest Notify ratio). Follow the "
            "links above to the detailed dashboard of its class.",
            [target(f"{M.incident_score}{{{SEL}}}", instant=True)],
            (24, 7),
            "none",
            [
                organize(
                    ("Time", "__name__", "instance", "job"),
                    {"Value": "score", "culprit_rank": "culprit"},
                )
            ],
            decimals=3,
            links=[
                {
                    "title": "Step-time stragglers",
                    "url": "/d/rankwatch-step-time?" + VAR_PARAMS,
                },
                {
                    "title": "DeepEP normal mode",
                    "url": "/d/rankwatch-deepep-normal?" + VAR_PARAMS,
                },
            ],
        ),
        table(
            "Groups",
            "One row per run and group: size, latest window index and age, "
            f"straggler score and step-time severity ({severity_legend()}).",
            [target(q, instant=True) for q, _ in groups],
            (24, 7),
            "none",
            [
                {"id": "merge", "options": {}},
                organize(
                    ("Time",), {f"Value #{chr(65 + i)}": name for i, (_, name) in enumerate(groups)}
                ),
            ],
            overrides=[
                {
                    "matcher": {"id": "byName", "options": "age"},
                    "properties": [{"id": "unit", "value": "s"}],
                },
                {
                    "matcher": {"id": "byName", "options": "straggler score"},
                    "properties": [
                        {"id": "unit", "value": "percentunit"},
                        {"id": "thresholds", "value": score},
                        {"id": "custom.cellOptions", "value": {"type": "color-text"}},
                    ],
                },
            ],
        ),
        timeseries(
            "Straggler score by group",
            "Step-time straggler score of every selected "
            f"group; warning from {warning} %, critical from {critical} %.",
            [target(f"max by (run, group) ({M.straggler_score}{{{SEL}}})", "{{run}}/{{group}}")],
            (12, 8),
            "percentunit",
            line_thresholds=True,
            thresholds=score,
            min=0,
        ),
        timeseries(
            "Worst DeepEP global slowdown by group",
            "Largest global slowdown factor "
            f"over the DeepEP probes of every selected group; {number(slowdown)}x is a slowdown.",
            [
                target(
                    f"max by (run, group) ({M.deepep_global_slowdown_factor}{{{SEL}}})",
                    "{{run}}/{{group}}",
                )
            ],
            (12, 8),
            "none",
            line_thresholds=True,
            thresholds=steps((GREEN, None), (RED, slowdown)),
        ),
    ]
    with_runbooks(
        panels,
        s,
        {
            "Critical incidents": STRAGGLER_ALERTS[:1] + DEEPEP_ALERTS[:2],
            "All open incidents": STRAGGLER_ALERTS + DEEPEP_ALERTS,
            "Oldest window": ("RankwatchNoFreshWindows",),
            "Endpoints down": ("RankwatchExporterDown",),
            "Export failures": ("RankwatchExportFailing",),
            "Open incidents": STRAGGLER_ALERTS + DEEPEP_ALERTS,
        },
    )
    return dashboard(
        "rankwatch-overview",
        "rankwatch / Overview",
        "Every run and group rankwatch watches: incidents, freshness, exporters.",
        panels,
        True,
    )

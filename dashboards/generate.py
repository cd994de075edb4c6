"""Generate rankwatch's Grafana dashboards and the Kubernetes objects that carry them.

Run ``python dashboards/generate.py`` after editing this file; the JSON and YAML it writes are
committed, and a test fails when they differ from what this script produces. Outputs:

- ``dashboards/rankwatch-{overview,step-time,deepep-normal}.json``: importable dashboards
  (datasource as the ``DS_PROMETHEUS`` input, which is also a datasource variable of that name so
  that file provisioning, which does not resolve inputs, finds it too);
- ``deploy/kubernetes/dashboards.yaml``: one ConfigMap per dashboard for the Grafana sidecar;
- ``deploy/kubernetes/prometheusrule.yaml``: ``dashboards/rules/rankwatch.rules.yml`` as a
  PrometheusRule.

Every series also has ``run`` and ``group`` labels; panels filter on ``$job``, ``$run`` and
``$group``. Matrix cells and heatmap rows use zero-padded rank labels so that Grafana's string
ordering is the numeric rank order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SEL = 'job=~"$job", run=~"$run", group=~"$group"'
GRAFANA_SCHEMA_VERSION = 41
Panel = dict[str, Any]

# Query string a panel link carries to another dashboard: time range and the three variables.
VAR_PARAMS = "${__url_time_range}&${job:queryparam}&${run:queryparam}&${group:queryparam}"
GREEN, YELLOW, ORANGE, RED, BLUE = "green", "#EAB839", "orange", "red", "blue"
PROBES_COMPLETION = ("dispatch_final", "dispatch_rdma_recv", "combine_logical_recv")


# --- building blocks ----------------------------------------------------------------------------


def target(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> dict[str, Any]:
    """One Prometheus query; instant queries come back as a table (one row per series)."""
    t: dict[str, Any] = {"datasource": DS, "refId": ref, "expr": expr, "editorMode": "code"}
    if instant:
        t.update(instant=True, range=False, format="table")
    else:
        t.update(instant=False, range=True, format="time_series", legendFormat=legend or "__auto")
    return t


def steps(*pairs: tuple[str, float | None]) -> dict[str, Any]:
    """Absolute thresholds: the first colour is the base (value null)."""
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in pairs]}


def pad(expr: str, src: str, dst: str) -> str:
    """Copy label ``src`` into ``dst`` zero-padded to 3 digits (label_replace is anchored)."""
    expr = f'label_replace({expr}, "{dst}", "$1", "{src}", "(.*)")'
    expr = f'label_replace({expr}, "{dst}", "00$1", "{src}", "([0-9])")'
    return f'label_replace({expr}, "{dst}", "0$1", "{src}", "([0-9][0-9])")'


def panel(
    kind: str,
    title: str,
    description: str,
    targets: list[dict[str, Any]],
    size: tuple[int, int],
    unit: str,
    thresholds: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    custom: dict[str, Any] | None = None,
    **extra: Any,
) -> Panel:
    """A panel with the fields every rankwatch panel has; ``size`` is (width, height)."""
    defaults: dict[str, Any] = {"unit": unit, "color": {"mode": "thresholds"}}
    defaults["thresholds"] = thresholds or steps((GREEN, None))
    for key in ("min", "max", "decimals", "mappings"):
        if key in extra:
            defaults[key] = extra.pop(key)
    if "color" in extra:
        defaults["color"] = extra.pop("color")
    if custom:
        defaults["custom"] = custom
    p: Panel = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"w": size[0], "h": size[1]},
        "targets": [dict(t, refId=chr(ord("A") + i)) for i, t in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": extra.pop("overrides", [])},
        "options": options or {},
    }
    p.update(extra)
    return p


def stat(title: str, description: str, expr: str, unit: str, **kw: Any) -> Panel:
    options = {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "colorMode": "background",
        "graphMode": "none",
        "textMode": "auto",
        "justifyMode": "auto",
        "orientation": "auto",
    }
    return panel(
        "stat",
        title,
        description,
        [target(expr, instant=True)],
        (4, 4),
        unit,
        **kw,
        options=options,
    )


def timeseries(
    title: str,
    description: str,
    targets: list[dict[str, Any]],
    size: tuple[int, int],
    unit: str,
    line_thresholds: bool = False,
    **kw: Any,
) -> Panel:
    custom = {
        "drawStyle": "line",
        "lineWidth": 1,
        "fillOpacity": 0,
        "showPoints": "never",
        "spanNulls": False,
        "thresholdsStyle": {"mode": "line+area" if line_thresholds else "off"},
    }
    options = {
        "legend": {
            "displayMode": "table",
            "placement": "right",
            "showLegend": True,
            "calcs": ["lastNotNull", "max"],
        },
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return panel(
        "timeseries", title, description, targets, size, unit, custom=custom, options=options, **kw
    )


def table(
    title: str,
    description: str,
    targets: list[dict[str, Any]],
    size: tuple[int, int],
    unit: str,
    transformations: list[dict[str, Any]],
    cell: str = "auto",
    **kw: Any,
) -> Panel:
    custom = {"align": "auto", "cellOptions": {"type": cell}, "inspect": False}
    options = {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}}
    return panel(
        "table",
        title,
        description,
        targets,
        size,
        unit,
        custom=custom,
        options=options,
        transformations=transformations,
        **kw,
    )


def organize(exclude: tuple[str, ...], rename: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "id": "organize",
        "options": {
            "excludeByName": {name: True for name in exclude},
            "indexByName": {},
            "renameByName": rename or {},
        },
    }


def state_timeline(title: str, description: str, expr: str, legend: str, **kw: Any) -> Panel:
    options = {
        "mergeValues": True,
        "showValue": "never",
        "alignValue": "left",
        "rowHeight": 0.8,
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": False},
        "tooltip": {"mode": "single", "sort": "none"},
    }
    return panel(
        "state-timeline",
        title,
        description,
        [target(expr, legend)],
        (12, 8),
        "none",
        options=options,
        custom={"lineWidth": 0, "fillOpacity": 80},
        **kw,
    )


def completion_matrix(probe: str) -> Panel:
    """One src x dst Completion cost matrix: instant query, grouping to matrix, coloured cells."""
    metric = f'rankwatch_deepep_completion_cycles_per_sample{{{SEL}, probe="{probe}"}}'
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
            if probe == "dispatch_rdma_recv"
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


def layout(panels: list[Panel]) -> list[Panel]:
    """Flow panels left to right in 24-column rows; number them 1..n."""
    x = y = row_h = 0
    for i, p in enumerate(panels, start=1):
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if x + w > 24:
            x, y, row_h = 0, y + row_h, 0
        p["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
        p["id"] = i
        x, row_h = x + w, max(row_h, h)
    return panels


def variable(name: str, label: str, query: str, multi: bool) -> dict[str, Any]:
    """A query variable; with ``multi`` it also offers "All" (matching any value)."""
    v: dict[str, Any] = {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DS,
        "query": {"query": query, "refId": f"rankwatch-{name}"},
        "refresh": 2,
        "sort": 1,
        "multi": multi,
        "includeAll": multi,
        "current": {},
        "options": [],
        "hide": 0,
        "regex": "",
    }
    if multi:
        v["allValue"] = ".*"
    return v


def variables(multi: bool) -> list[dict[str, Any]]:
    return [
        {
            "type": "datasource",
            "name": "DS_PROMETHEUS",
            "label": "Data source",
            "query": "prometheus",
            "current": {},
            "options": [],
            "hide": 0,
            "refresh": 1,
            "regex": "",
            "multi": False,
            "includeAll": False,
        },
        variable("job", "Job", "label_values(rankwatch_window_index, job)", multi),
        variable("run", "Run", 'label_values(rankwatch_window_index{job=~"$job"}, run)', multi),
        variable(
            "group",
            "Group",
            'label_values(rankwatch_window_index{job=~"$job", run=~"$run"}, group)',
            multi,
        ),
    ]


def link(title: str, uid: str, tooltip: str) -> dict[str, Any]:
    return {
        "title": title,
        "type": "link",
        "url": f"/d/{uid}",
        "tooltip": tooltip,
        "icon": "dashboard",
        "includeVars": True,
        "keepTime": True,
        "targetBlank": False,
        "asDropdown": False,
        "tags": [],
    }


LINKS = [
    link("Overview", "rankwatch-overview", "All runs and groups, open incidents"),
    link("Step-time stragglers", "rankwatch-step-time", "Per-rank step phases and diagnosis"),
    link("DeepEP normal mode", "rankwatch-deepep-normal", "Dispatch/combine probes"),
]


def dashboard(
    uid: str, title: str, description: str, panels: list[Panel], multi: bool, extra_vars=()
) -> dict[str, Any]:
    kinds = sorted({p["type"] for p in panels})
    return {
        "__inputs": [
            {
                "name": "DS_PROMETHEUS",
                "label": "Prometheus",
                "type": "datasource",
                "pluginId": "prometheus",
                "pluginName": "Prometheus",
                "description": "Prometheus that scrapes the rankwatch exporters",
            }
        ],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "11.6.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
        ]
        + [{"type": "panel", "id": k, "name": k, "version": ""} for k in kinds],
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["rankwatch", "pytorch", "distributed-training"],
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "schemaVersion": GRAFANA_SCHEMA_VERSION,
        "version": 1,
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [lk for lk in LINKS if lk["url"] != f"/d/{uid}"],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {"list": variables(multi) + list(extra_vars)},
        "panels": layout(panels),
    }


SEVERITY_MAPPINGS = [
    {
        "type": "value",
        "options": {
            "0": {"text": "none", "color": GREEN, "index": 0},
            "1": {"text": "info", "color": BLUE, "index": 1},
            "2": {"text": "warning", "color": ORANGE, "index": 2},
            "3": {"text": "critical", "color": RED, "index": 3},
        },
    }
]
OPEN_MAPPING = [{"type": "value", "options": {"1": {"text": "open", "color": RED, "index": 0}}}]
SCORE = steps((GREEN, None), (YELLOW, 0.10), (RED, 0.20))
SEVERITY_COLOURS = [
    {
        "matcher": {"id": "byRegexp", "options": f".*{sev}.*"},
        "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": colour}}],
    }
    for sev, colour in (("critical", RED), ("warning", ORANGE))
]


# --- Step-time stragglers -------------------------------------------------------------------


def step_time() -> dict[str, Any]:
    visible = pad(f'rankwatch_phase_seconds{{{SEL}, phase="visible"}}', "rank", "r")
    host_queries = [
        (f'max by (hostname) (rankwatch_phase_seconds{{{SEL}, phase="step"}})', "slowest step"),
        (f'min by (hostname) (rankwatch_phase_seconds{{{SEL}, phase="visible"}})', "least visible"),
        (
            f'max by (hostname) (rankwatch_phase_seconds{{{SEL}, phase="input_wait"}})',
            "most input wait",
        ),
        (f'count by (hostname) (rankwatch_phase_seconds{{{SEL}, phase="step"}})', "ranks"),
    ]
    panels = [
        stat(
            "Straggler score",
            "Straggler score of the latest window: the visible-phase gap "
            "between the victim (upper median rank) and the culprit (fastest through the "
            "synchronising phase, i.e. the latest to arrive), over the victim's iteration cost. "
            "Yellow from 10 % (warning), red from 20 % (critical).",
            f"max(rankwatch_straggler_score{{{SEL}}})",
            "percentunit",
            thresholds=SCORE,
        ),
        stat(
            "Severity",
            "Severity of the current step-time diagnosis. Critical needs a score "
            "of 20 % or more, at least 20 steps in the window, and a DDP/default strategy.",
            f"max(rankwatch_diagnosis_severity{{{SEL}}})",
            "none",
            thresholds=steps((GREEN, None), (BLUE, 1), (ORANGE, 2), (RED, 3)),
            mappings=SEVERITY_MAPPINGS,
        ),
        stat(
            "Window steps",
            "Steps aligned across all ranks in the latest window. Below 2 no "
            "straggler is reported; below 20 severity is capped at warning.",
            f"max(rankwatch_window_steps{{{SEL}}})",
            "short",
            thresholds=steps((RED, None), (ORANGE, 2), (GREEN, 20)),
        ),
        stat(
            "Window age",
            "Seconds since the latest window was diagnosed. Red after 3 minutes "
            "(the RankwatchNoFreshWindows alert): the panels below are stale.",
            f"max(rankwatch_window_age_seconds{{{SEL}}})",
            "s",
            thresholds=steps((GREEN, None), (YELLOW, 60), (RED, 180)),
        ),
        stat(
            "Missing ranks",
            "Ranks expected but absent from the latest window. Anything but 0 "
            "means an incomplete window: rules abstain rather than guess.",
            f"max(rankwatch_window_missing_ranks{{{SEL}}})",
            "short",
            thresholds=steps((GREEN, None), (RED, 1)),
        ),
        stat(
            "Ranks",
            "Ranks in the group; the heatmap below has one row per rank.",
            f"max(rankwatch_group_ranks{{{SEL}}})",
            "short",
            thresholds=steps((BLUE, None)),
        ),
        table(
            "Current diagnosis",
            "The latest step-time diagnosis: kind (INPUT_STRAGGLER, "
            "H2D_STRAGGLER, COMPUTE_STRAGGLER, STRAGGLER, BALANCED, INCOMPLETE_DATA, ...), "
            "severity, culprit and victim rank, the component that explains the wait, the "
            "clock (gpu or cpu) and the training strategy.",
            [target(f"rankwatch_diagnosis_info{{{SEL}}}", instant=True)],
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
            "Straggler score per window with its warning (10 %) and "
            "critical (20 %) bands. A line that stays in the red band means an incident "
            "and, after a minute, a page.",
            [
                target(
                    f"max by (run, group) (rankwatch_straggler_score{{{SEL}}})", "{{run}}/{{group}}"
                )
            ],
            (12, 8),
            "percentunit",
            line_thresholds=True,
            thresholds=SCORE,
            min=0,
        ),
        panel(
            "bargauge",
            "Cause coverage by component",
            "Share of the culprit's visible wait "
            "explained by each measured component (input, h2d, compute) in the latest window. "
            "A component reaching 80 % names the cause; below that the diagnosis stays "
            "STRAGGLER. An unmeasured component is absent, never zero.",
            [target(f"max by (component) (rankwatch_cause_coverage_ratio{{{SEL}}})", instant=True)],
            (6, 8),
            "percentunit",
            thresholds=steps((BLUE, None), (RED, 0.8)),
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
                    f"max by (component) (rankwatch_component_excess_seconds{{{SEL}}})",
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
            options={
                "calculate": False,
                "cellGap": 1,
                "yAxis": {"axisPlacement": "left"},
                "rowsFrame": {"layout": "auto"},
                "showValue": "never",
                "color": {
                    "mode": "scheme",
                    "scheme": "Oranges",
                    "fill": "dark-orange",
                    "scale": "exponential",
                    "exponent": 0.5,
                    "steps": 64,
                    "reverse": False,
                },
                "cellValues": {"unit": "s"},
                "legend": {"show": True},
                "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": True},
                "exemplars": {"color": "rgba(255,0,255,0.7)"},
                "filterValues": {"le": 1e-9},
            },
        ),
        timeseries(
            "Per-rank phase times",
            "Window mean of the selected phases per rank on "
            "the selected clock. Pick phases with the Phase variable; an unmeasured phase "
            "has no line.",
            [
                target(
                    f'max by (rank, phase) (rankwatch_phase_seconds{{{SEL}, phase=~"$phase"}})',
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
            f'(rankwatch_incident_active{{{SEL}, class="step_time_straggler"}})',
            "{{severity}} rank {{culprit_rank}} {{hostname}} {{cause}}",
            mappings=OPEN_MAPPING,
            overrides=SEVERITY_COLOURS,
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
    phase = variable(
        "phase", "Phase", f"label_values(rankwatch_phase_seconds{{{SEL}}}, phase)", True
    )
    phase["current"] = {"text": ["visible", "step"], "value": ["visible", "step"]}
    return dashboard(
        "rankwatch-step-time",
        "rankwatch / Step-time stragglers",
        "Which rank slows the group down, why, and since when.",
        panels,
        False,
        [phase],
    )


# --- DeepEP normal mode ---------------------------------------------------------------------


def deepep_normal() -> dict[str, Any]:
    panels = [
        stat(
            "Anomalous probes",
            "Probes (of six) reporting an anomaly in the latest window.",
            f"sum(rankwatch_deepep_probe_anomalous{{{SEL}}})",
            "short",
            thresholds=steps((GREEN, None), (ORANGE, 1)),
        ),
        stat(
            "Open DeepEP incidents",
            "Open DeepEP incidents (pre-stage arrival skew, global or "
            "localized data-path slowdown, unclassified).",
            f'count(rankwatch_incident_active{{{SEL}, class!~"step_time_.*"}}) or vector(0)',
            "short",
            thresholds=steps((GREEN, None), (RED, 1)),
        ),
        stat(
            "Worst global slowdown",
            "Largest global slowdown factor over the probes: "
            "completion cost against the median of recent normal windows. Red from 1.3x.",
            f"max(rankwatch_deepep_global_slowdown_factor{{{SEL}}})",
            "none",
            decimals=2,
            thresholds=steps((GREEN, None), (RED, 1.3)),
        ),
        stat(
            "Lowest Notify ratio",
            "Smallest Notify duration / peer median over ranks and "
            "probes. Red at or below 0.25: a rank arrives late at a Notify kernel.",
            f"min(rankwatch_deepep_notify_ratio{{{SEL}}})",
            "none",
            decimals=3,
            thresholds=steps((RED, None), (GREEN, 0.2501)),
        ),
        stat(
            "Invalid windows",
            "Normal-mode windows rejected before diagnosis in the time "
            "range (counter reset, warm-up, ...).",
            f"sum(increase(rankwatch_deepep_window_invalid_total{{{SEL}}}[$__range])) or vector(0)",
            "short",
            thresholds=steps((GREEN, None), (ORANGE, 1)),
        ),
        stat(
            "Ranks",
            "Ranks in the EP group; the completion matrices below have this many rows and columns.",
            f"max(rankwatch_group_ranks{{{SEL}}})",
            "short",
            thresholds=steps((BLUE, None)),
        ),
        timeseries(
            "Notify ratio per rank and probe",
            "Notify kernel duration of each rank "
            "over the median of its peers, per probe (notify_dispatch, "
            "cached_notify_dispatch, cached_notify_combine). A rank at or below the red "
            "0.25 line entered the kernel late and waited least: late-arrival evidence.",
            [
                target(
                    f"max by (probe, rank) (rankwatch_deepep_notify_ratio{{{SEL}}})",
                    "{{probe}} rank {{rank}}",
                )
            ],
            (12, 9),
            "none",
            line_thresholds=True,
            thresholds=steps((RED, None), (GREEN, 0.25)),
            min=0,
        ),
        timeseries(
            "Notify duration per rank",
            "Average Notify kernel duration per launch.",
            [
                target(
                    f"max by (probe, rank) (rankwatch_deepep_notify_duration_seconds{{{SEL}}})",
                    "{{probe}} rank {{rank}}",
                )
            ],
            (12, 9),
            "s",
        ),
        *(completion_matrix(p) for p in PROBES_COMPLETION),
        table(
            "Residual slowdown factors by scope",
            "Flagged scopes of the latest window: "
            "row, column, point, node block, source/destination gateway, gateway edge, with "
            "src/dst ranks (or n<node>). Factors remain after removing the window-wide, row "
            "and column effects; rows/columns/blocks are flagged from 1.25x, points and edges "
            "from 2x.",
            [
                target(
                    f"max by (probe, scope, src, dst) "
                    f"(rankwatch_deepep_residual_slowdown_factor{{{SEL}}})",
                    instant=True,
                )
            ],
            (12, 9),
            "none",
            [organize(("Time",), {"Value": "factor"})],
            cell="color-text",
            thresholds=steps((GREEN, None), (ORANGE, 1.25), (RED, 2.0)),
            decimals=2,
        ),
        timeseries(
            "Global slowdown factor per probe",
            "Topology-aggregated completion cost of "
            "each window over the median of up to 16 previous normal windows. Absent "
            "until three normal windows have been seen. At or above the red 1.3x line on "
            "both dispatch_final and combine_logical_recv means a global data-path "
            "slowdown.",
            [
                target(
                    f"max by (probe) (rankwatch_deepep_global_slowdown_factor{{{SEL}}})",
                    "{{probe}}",
                )
            ],
            (12, 9),
            "none",
            line_thresholds=True,
            thresholds=steps((GREEN, None), (RED, 1.3)),
        ),
        state_timeline(
            "Probe anomalies",
            "When each of the six probes reported an anomaly "
            "(red). Anomalies are raw evidence; incidents below correlate them.",
            f"max by (probe) (rankwatch_deepep_probe_anomalous{{{SEL}}})",
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
            "localized_data_path_slowdown, unclassified), probe and culprit rank.",
            f"max by (class, severity, probe, culprit_rank) "
            f'(rankwatch_incident_active{{{SEL}, class!~"step_time_.*"}})',
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
                    f"(rankwatch_deepep_completion_row_cycles_per_sample{{{SEL}}})",
                    "{{probe}} row {{src_rank}}",
                ),
                target(
                    f"max by (probe, dst_rank) "
                    f"(rankwatch_deepep_completion_column_cycles_per_sample{{{SEL}}})",
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
                    f"max by (phase, rank) (rankwatch_deepep_ll_row_ratio{{{SEL}}})",
                    "{{phase}} row {{rank}}",
                ),
                target(
                    f"max by (phase, rank) (rankwatch_deepep_ll_column_ratio{{{SEL}}})",
                    "{{phase}} column {{rank}}",
                ),
            ],
            (12, 9),
            "none",
            thresholds=steps((GREEN, None), (ORANGE, 2.0)),
        ),
    ]
    return dashboard(
        "rankwatch-deepep-normal",
        "rankwatch / DeepEP normal mode",
        "DeepEP dispatch/combine: late arrivals, slow paths, global slowdowns.",
        panels,
        False,
    )


# --- Overview -------------------------------------------------------------------------------


def overview() -> dict[str, Any]:
    groups = [
        (f"max by (run, group) (rankwatch_group_ranks{{{SEL}}})", "ranks"),
        (f"max by (run, group) (rankwatch_window_index{{{SEL}}})", "window"),
        (f"max by (run, group) (rankwatch_window_age_seconds{{{SEL}}})", "age"),
        (f"max by (run, group) (rankwatch_straggler_score{{{SEL}}})", "straggler score"),
        (f"max by (run, group) (rankwatch_diagnosis_severity{{{SEL}}})", "severity"),
    ]
    panels = [
        stat(
            "Critical incidents",
            "Open critical incidents over the selected runs and groups; each pages within minutes.",
            f'count(rankwatch_incident_active{{{SEL}, severity="critical"}}) or vector(0)',
            "short",
            thresholds=steps((GREEN, None), (RED, 1)),
        ),
        stat(
            "All open incidents",
            "All open incidents of every class and severity over the selected runs and groups.",
            f"count(rankwatch_incident_active{{{SEL}}}) or vector(0)",
            "short",
            thresholds=steps((GREEN, None), (ORANGE, 1)),
        ),
        stat(
            "Groups reporting",
            "Groups whose root rank currently publishes diagnosed windows.",
            f"count(rankwatch_window_index{{{SEL}}}) or vector(0)",
            "short",
            thresholds=steps((RED, None), (GREEN, 1)),
        ),
        stat(
            "Oldest window",
            "Age of the stalest group's latest window. Red after 3 minutes.",
            f"max(rankwatch_window_age_seconds{{{SEL}}})",
            "s",
            thresholds=steps((GREEN, None), (YELLOW, 60), (RED, 180)),
        ),
        stat(
            "Endpoints down",
            "rankwatch scrape targets (one per rank) that Prometheus cannot reach right now.",
            'count(up{job=~"$job"} == 0) or vector(0)',
            "short",
            thresholds=steps((GREEN, None), (RED, 1)),
        ),
        stat(
            "Export failures",
            "Failed OTLP metric and log exports in the time range; /metrics is unaffected.",
            f"sum(increase(rankwatch_export_failures_total{{{SEL}}}[$__range])) or vector(0)",
            "short",
            thresholds=steps((GREEN, None), (ORANGE, 1)),
        ),
        table(
            "Open incidents",
            "Every open incident with its culprit rank, host, cause and "
            "score (straggler score, slowdown factor, or smallest Notify ratio). Follow the "
            "links above to the detailed dashboard of its class.",
            [target(f"rankwatch_incident_score{{{SEL}}}", instant=True)],
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
            "straggler score and step-time severity (0 none, 1 info, 2 warning, 3 critical).",
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
                        {"id": "thresholds", "value": SCORE},
                        {"id": "custom.cellOptions", "value": {"type": "color-text"}},
                    ],
                },
            ],
        ),
        timeseries(
            "Straggler score by group",
            "Step-time straggler score of every selected "
            "group; warning from 10 %, critical from 20 %.",
            [
                target(
                    f"max by (run, group) (rankwatch_straggler_score{{{SEL}}})", "{{run}}/{{group}}"
                )
            ],
            (12, 8),
            "percentunit",
            line_thresholds=True,
            thresholds=SCORE,
            min=0,
        ),
        timeseries(
            "Worst DeepEP global slowdown by group",
            "Largest global slowdown factor "
            "over the DeepEP probes of every selected group; 1.3x is a slowdown.",
            [
                target(
                    f"max by (run, group) (rankwatch_deepep_global_slowdown_factor{{{SEL}}})",
                    "{{run}}/{{group}}",
                )
            ],
            (12, 8),
            "none",
            line_thresholds=True,
            thresholds=steps((GREEN, None), (RED, 1.3)),
        ),
    ]
    return dashboard(
        "rankwatch-overview",
        "rankwatch / Overview",
        "Every run and group rankwatch watches: incidents, freshness, exporters.",
        panels,
        True,
    )


# --- Kubernetes objects -----------------------------------------------------------------------

DASHBOARDS = {
    "rankwatch-overview.json": overview,
    "rankwatch-step-time.json": step_time,
    "rankwatch-deepep-normal.json": deepep_normal,
}
HEADER = "# Generated by dashboards/generate.py; edit that script, not this file.\n"


class _BlockDumper(yaml.SafeDumper):
    """Dumps multi-line strings as literal blocks, so the ConfigMaps stay readable diffs."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str)


def configmaps(rendered: dict[str, str]) -> str:
    """One ConfigMap per dashboard, labelled for the Grafana dashboard sidecar."""
    docs = []
    for name, text in rendered.items():
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": f"{name.removesuffix('.json')}-dashboard",
                    "labels": {
                        "grafana_dashboard": "1",
                        "app.kubernetes.io/name": "rankwatch",
                        "app.kubernetes.io/component": "dashboards",
                    },
                    "annotations": {"grafana_folder": "rankwatch"},
                },
                "data": {name: text},
            }
        )
    return HEADER + yaml.dump_all(docs, Dumper=_BlockDumper, sort_keys=False, width=100)


def prometheus_rule() -> str:
    """The shipped rule file as a PrometheusRule kube-prometheus-stack picks up."""
    rules = yaml.safe_load((ROOT / "dashboards/rules/rankwatch.rules.yml").read_text())
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "rankwatch",
            "labels": {
                "release": "kube-prometheus-stack",
                "app.kubernetes.io/name": "rankwatch",
                "app.kubernetes.io/component": "alerting",
            },
        },
        "spec": rules,
    }
    return HEADER + yaml.safe_dump(doc, sort_keys=False, width=100)


def render() -> dict[Path, str]:
    """Every generated file and its content."""
    out: dict[Path, str] = {}
    rendered = {}
    for name, build in DASHBOARDS.items():
        rendered[name] = json.dumps(build(), indent=2, ensure_ascii=False) + "\n"
        out[ROOT / "dashboards" / name] = rendered[name]
    out[ROOT / "deploy/kubernetes/dashboards.yaml"] = configmaps(rendered)
    out[ROOT / "deploy/kubernetes/prometheusrule.yaml"] = prometheus_rule()
    return out


def main() -> None:
    for path, text in render().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

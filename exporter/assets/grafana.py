"""Grafana building blocks the three dashboards share: queries, panels, variables, layout.

Every panel and query reads its data source from the ``datasource`` variable, never from a
fixed uid: a UI import replaces the ``${DS_PROMETHEUS}`` input wherever it occurs, which is only
the variable's initial value, so the data source stays switchable after an import (file
provisioning resolves no inputs: Grafana then starts the variable on a Prometheus it lists).

Every series also has ``run`` and ``group`` labels; panels filter on ``$cluster``,
``$namespace``, ``$job``, ``$run`` and ``$group``. ``cluster`` and ``namespace`` are optional
labels (added by the scrape configuration or Prometheus' external labels): their "All" is the
regex ``.*``, which also matches a series without the label, so the dashboards work with and
without them. Matrix cells and heatmap rows use rank labels zero-padded to ``RANK_DIGITS`` so
that Grafana's string ordering is the numeric rank order up to 99,999 ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rankwatch.diagnosis.config import StepTimeConfig
from rankwatch.diagnosis.vocabulary import SEVERITY_LEVELS
from rankwatch.exporter.assets.settings import ALERT_TIMING, Settings
from rankwatch.exporter.publish.catalogue import METRIC_NAMES as M

DS = {"type": "prometheus", "uid": "${datasource}"}
# Optional labels first: ``=~".*"`` (their All) matches series that do not have them.
SCOPE = 'cluster=~"$cluster", namespace=~"$namespace"'
SEL = SCOPE + ', job=~"$job", run=~"$run", group=~"$group"'
RANK_DIGITS = 5
# The Grafana release whose dashboard schema the JSON is tested against (the oldest claimed).
OLDEST_GRAFANA = "10.4.0"
GRAFANA_SCHEMA_VERSION = 41
Panel = dict[str, Any]
Dashboard = dict[str, Any]

# Query string a panel link carries to another dashboard: time range and the three variables.
VAR_PARAMS = (
    "${__url_time_range}&${datasource:queryparam}&${cluster:queryparam}&${namespace:queryparam}"
    "&${job:queryparam}&${run:queryparam}&${group:queryparam}"
)
GREEN, YELLOW, ORANGE, RED, BLUE = "green", "#EAB839", "orange", "red", "blue"


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


def pad(expr: str, src: str, dst: str, digits: int = RANK_DIGITS) -> str:
    """Copy label ``src`` into ``dst`` zero-padded to ``digits`` digits, so that Grafana's string
    sort is the numeric order (label_replace regexes are anchored: one step per length)."""
    expr = f'label_replace({expr}, "{dst}", "$1", "{src}", "(.*)")'
    for n in range(1, digits):
        zeros = "0" * (digits - n)
        expr = f'label_replace({expr}, "{dst}", "{zeros}$1", "{src}", "([0-9]{{{n}}})")'
    return expr


def by_rank(labels: str, selector: str) -> str:
    """``max by (labels, rank, r)`` of ``selector`` with ``r`` the zero-padded rank.

    Prometheus returns a range query's series sorted by their labels (in label-name order), so
    the extra ``r`` puts the series, and with them the legend, in numeric rank order; the legend
    still shows the plain ``rank``.
    """
    return f"max by ({labels}, r, rank) ({pad(selector, 'rank', 'r')})"


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
    """A 4 x 4 single-value panel of an instant query, coloured by its thresholds."""
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
    """A time series panel with a table legend; ``line_thresholds`` draws the threshold bands."""
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
    """A table panel; ``transformations`` shape the query results, ``cell`` is the cell type."""
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
    """The table transformation that hides ``exclude`` columns and renames others."""
    return {
        "id": "organize",
        "options": {
            "excludeByName": {name: True for name in exclude},
            "indexByName": {},
            "renameByName": rename or {},
        },
    }


def state_timeline(title: str, description: str, expr: str, legend: str, **kw: Any) -> Panel:
    """A 12 x 8 state timeline: one row per series, coloured by its value mappings."""
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


def variable(
    name: str, label: str, query: str, multi: bool, include_all: bool | None = None
) -> dict[str, Any]:
    """A query variable; with ``multi`` (or ``include_all``) it also offers "All", whose value is
    the regex ``.*``: it matches every value and also series without the label."""
    include_all = multi if include_all is None else include_all
    v: dict[str, Any] = {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DS,
        "query": {"query": query, "refId": f"rankwatch-{name}"},
        "refresh": 2,
        "sort": 1,
        "multi": multi,
        "includeAll": include_all,
        "current": {},
        "options": [],
        "hide": 0,
        "regex": "",
    }
    if include_all:
        v["allValue"] = ".*"
    return v


def variables(multi: bool) -> list[dict[str, Any]]:
    """The data source and scope variables every dashboard starts with (cluster, namespace,
    job, run, group); ``multi`` lets the scope variables select several values."""
    optional = {"selected": True, "text": "All", "value": "$__all"}
    cluster = variable(
        "cluster", "Cluster", f"label_values({M.window_index}, cluster)", multi, True
    )
    namespace = variable(
        "namespace",
        "Namespace",
        f'label_values({M.window_index}{{cluster=~"$cluster"}}, namespace)',
        multi,
        True,
    )
    for v in (cluster, namespace):
        # Absent on most setups: start on All, which then matches the series without the label.
        v["current"] = dict(optional)
    return [
        {
            # The import input is only this variable's initial value: a UI import writes the
            # chosen data source here, and every panel keeps following the variable.
            "type": "datasource",
            "name": "datasource",
            "label": "Data source",
            "query": "prometheus",
            "current": {"selected": False, "text": "${DS_PROMETHEUS}", "value": "${DS_PROMETHEUS}"},
            "options": [],
            "hide": 0,
            "refresh": 1,
            "regex": "",
            "multi": False,
            "includeAll": False,
        },
        cluster,
        namespace,
        variable("job", "Job", f"label_values({M.window_index}{{{SCOPE}}}, job)", multi),
        variable(
            "run",
            "Run",
            f'label_values({M.window_index}{{{SCOPE}, job=~"$job"}}, run)',
            multi,
        ),
        variable(
            "group",
            "Group",
            f'label_values({M.window_index}{{{SCOPE}, job=~"$job", run=~"$run"}}, group)',
            multi,
        ),
    ]


def with_runbooks(
    panels: list[Panel], s: Settings, alerts_by_title: Mapping[str, Sequence[str]]
) -> list[Panel]:
    """Add a panel link to the runbook of each alert that fires on what a panel shows."""
    by_title = {p["title"]: p for p in panels}
    for title, alerts in alerts_by_title.items():
        unknown = [alert for alert in alerts if alert not in ALERT_TIMING]
        if unknown:  # a renamed alert must not leave a dead runbook link behind
            raise ValueError(f"panel {title!r}: runbook of unknown alert(s) {unknown}")
        by_title[title].setdefault("links", []).extend(
            {"title": f"Runbook: {alert}", "url": s.runbook(alert), "targetBlank": True}
            for alert in alerts
        )
    return panels


STRAGGLER_ALERTS = ("RankwatchStepTimeStragglerCritical", "RankwatchStepTimeStragglerWarning")
DEEPEP_ALERTS = (
    "RankwatchDeepEPGlobalDataPathSlowdown",
    "RankwatchDeepEPLocalizedDataPathSlowdown",
    "RankwatchDeepEPPreStageArrivalSkew",
    "RankwatchDeepEPHangSuspect",
)


def link(title: str, uid: str, tooltip: str) -> dict[str, Any]:
    """A dashboard link to ``uid`` that carries the time range and the variables."""
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
    uid: str,
    title: str,
    description: str,
    panels: list[Panel],
    multi: bool,
    extra_vars: Iterable[dict[str, Any]] = (),
) -> Dashboard:
    """A complete dashboard: import envelope, links to the other two, variables, laid-out
    panels; ``multi`` lets the scope variables select several values."""
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
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": OLDEST_GRAFANA},
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


# The step-time severity as a number (diagnosis_severity) and as words and colours.
SEVERITY_COLOURS_BY_NAME: dict[str | None, str] = {
    None: GREEN,
    "info": BLUE,
    "warning": ORANGE,
    "critical": RED,
}
SEVERITY_MAPPINGS = [
    {
        "type": "value",
        "options": {
            str(level): {
                "text": severity or "none",
                "color": SEVERITY_COLOURS_BY_NAME[severity],
                "index": level,
            }
            for severity, level in sorted(SEVERITY_LEVELS.items(), key=lambda item: item[1])
        },
    }
]
SEVERITY_STEPS = steps(
    *(
        (SEVERITY_COLOURS_BY_NAME[severity], None if level == 0 else level)
        for severity, level in sorted(SEVERITY_LEVELS.items(), key=lambda item: item[1])
    )
)
OPEN_MAPPING = [{"type": "value", "options": {"1": {"text": "open", "color": RED, "index": 0}}}]


def severity_legend() -> str:
    """The numbers of the severity series in words: ``0 none, 1 info, 2 warning, 3 critical``."""
    levels = sorted(SEVERITY_LEVELS.items(), key=lambda item: item[1])
    return ", ".join(f"{level} {severity or 'none'}" for severity, level in levels)


def score_steps(policy: StepTimeConfig) -> dict[str, Any]:
    """The straggler score's bands: yellow from the warning score, red from the critical."""
    return steps(
        (GREEN, None),
        (YELLOW, policy.straggler_warning_score),
        (RED, policy.straggler_critical_score),
    )


SEVERITY_COLOURS = [
    {
        "matcher": {"id": "byRegexp", "options": f".*{sev}.*"},
        "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": colour}}],
    }
    for sev, colour in (("critical", RED), ("warning", ORANGE))
]


# Yellow on the window-age panels: a window is overdue (they normally come every few seconds);
# red is the stale-window alert's threshold.
WINDOW_AGE_NOTICE_SECONDS = 60


def window_age_steps(stale_window_seconds: int) -> dict[str, Any]:
    """Window age bands: yellow when overdue, red from the RankwatchNoFreshWindows threshold."""
    return steps(
        (GREEN, None),
        (YELLOW, min(WINDOW_AGE_NOTICE_SECONDS, stale_window_seconds)),
        (RED, stale_window_seconds),
    )

"""Generate rankwatch's Grafana dashboards and the Kubernetes objects that carry them.

Run ``make generate`` (or ``python dashboards/generate.py``) after editing this file; the JSON and
YAML it writes are committed, and a test fails when they differ from what this script produces.
Outputs:

- ``dashboards/rankwatch-{overview,step-time,deepep-normal}.json``: importable dashboards. Every
  panel and query reads its data source from the ``datasource`` variable, never from a fixed uid:
  a UI import replaces the ``${DS_PROMETHEUS}`` input wherever it occurs, which is only the
  variable's initial value, so the data source stays switchable after an import (file
  provisioning resolves no inputs: Grafana then starts the variable on a Prometheus it lists);
- ``deploy/kubernetes/dashboards.yaml``: one ConfigMap per dashboard for the Grafana sidecar;
- ``deploy/kubernetes/prometheusrule.yaml``: ``dashboards/rules/rankwatch.rules.yml`` as a
  PrometheusRule.

- ``dashboards/rules/rankwatch.rules.yml``: the alerting rules.

Every series also has ``run`` and ``group`` labels; panels filter on ``$cluster``, ``$namespace``,
``$job``, ``$run`` and ``$group``. ``cluster`` and ``namespace`` are optional labels (added by the
scrape configuration or Prometheus' external labels): their "All" is the regex ``.*``, which also
matches a series without the label, so the dashboards work with and without them. Matrix cells
and heatmap rows use rank labels zero-padded to ``RANK_DIGITS`` so that Grafana's string
ordering is the numeric rank order up to 99,999 ranks.

What differs between installations is a setting (:class:`Settings`, mixin style): the runbook
link base, the job selector of the rules, each alert's ``for:`` and ``keep_firing_for:``. The
committed files use the defaults; to render your own copy::

    python dashboards/generate.py --out /tmp/rankwatch \
        --runbook-url https://wiki.example.com/rankwatch/runbooks.md \
        --job-selector 'job="training"' --for RankwatchStepTimeStragglerWarning=10m

or put the same keys in a JSON/YAML file and pass ``--settings FILE`` (flags win over the file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent

# --- settings -------------------------------------------------------------------------------

# Where the runbooks are read; each alert links to the heading named after it (lower case).
DEFAULT_RUNBOOK_URL = "https://github.com/rankwatch/rankwatch/blob/main/docs/runbooks.md"
# for: (pending) and keep_firing_for: (hold over a scrape gap or a briefly closed incident).
DEFAULT_FOR = {
    "RankwatchStepTimeStragglerCritical": "1m",
    "RankwatchStepTimeStragglerWarning": "5m",
    "RankwatchDeepEPGlobalDataPathSlowdown": "2m",
    "RankwatchDeepEPLocalizedDataPathSlowdown": "5m",
    "RankwatchDeepEPPreStageArrivalSkew": "5m",
    "RankwatchExporterDown": "5m",
    "RankwatchNoFreshWindows": "2m",
    "RankwatchExportFailing": "10m",
}
DEFAULT_KEEP_FIRING_FOR = {
    "RankwatchStepTimeStragglerCritical": "1m",
    "RankwatchStepTimeStragglerWarning": "2m",
    "RankwatchDeepEPGlobalDataPathSlowdown": "2m",
    "RankwatchDeepEPLocalizedDataPathSlowdown": "2m",
    "RankwatchDeepEPPreStageArrivalSkew": "2m",
    "RankwatchExporterDown": "1m",
    "RankwatchNoFreshWindows": "1m",
    "RankwatchExportFailing": "5m",
}
_DURATION = re.compile(r"(\d+(ms|s|m|h|d|w|y))+")


@dataclass(frozen=True)
class Settings:
    """What an installation may change in the rules and dashboards (mixin-style config).

    ``runbook_url``: the runbooks page; alerts and dashboard panels link to
    ``runbook_url#<alert name in lower case>``. ``job_selector``: the PromQL label matcher every
    rule's selectors carry (the scrape job(s) of the training ranks). ``for_`` and
    ``keep_firing_for``: per alert, overriding the defaults above. ``stale_window_seconds``: the
    age of the latest window from which RankwatchNoFreshWindows counts.
    """

    runbook_url: str = DEFAULT_RUNBOOK_URL
    job_selector: str = 'job=~".*rankwatch.*"'
    for_: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_FOR))
    keep_firing_for: Mapping[str, str] = field(
        default_factory=lambda: dict(DEFAULT_KEEP_FIRING_FOR)
    )
    stale_window_seconds: int = 180

    def __post_init__(self) -> None:
        url, selector = self.runbook_url, self.job_selector
        if not re.fullmatch(r"https?://\S+|[\w./-]+", url) or "#" in url:
            raise ValueError(f"runbook_url: expected a URL without a fragment, got {url!r}")
        if not re.fullmatch(r'\w+\s*(=|!=|=~|!~)\s*"[^"]*"', selector.strip()):
            raise ValueError(
                f'job_selector: expected one label matcher such as job="x", got {selector!r}'
            )
        for name, table in (("for", self.for_), ("keep_firing_for", self.keep_firing_for)):
            unknown = set(table) - set(DEFAULT_FOR)
            if unknown:
                raise ValueError(f"{name}: unknown alert(s) {sorted(unknown)}")
            for alert, value in table.items():
                if not isinstance(value, str) or not _DURATION.fullmatch(value):
                    raise ValueError(
                        f"{name}.{alert}: expected a Prometheus duration, got {value!r}"
                    )
        if isinstance(self.stale_window_seconds, bool) or not (
            isinstance(self.stale_window_seconds, int) and self.stale_window_seconds > 0
        ):
            raise ValueError(
                f"stale_window_seconds: expected a positive int, got {self.stale_window_seconds!r}"
            )

    @classmethod
    def load(cls, overrides: Mapping[str, Any]) -> Settings:
        """Defaults updated with ``overrides`` (keys as in a settings file: ``for`` is ``for_``);
        per-alert tables are merged into the defaults, unknown keys raise ValueError."""
        known = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in overrides.items():
            name = "for_" if key == "for" else key
            if name not in known:
                raise ValueError(f"settings: unknown key {key!r} (known: {sorted(known)})")
            if name in ("for_", "keep_firing_for"):
                if not isinstance(value, Mapping):
                    raise ValueError(f"{key}: expected a mapping of alert name to duration")
                base = DEFAULT_FOR if name == "for_" else DEFAULT_KEEP_FIRING_FOR
                value = {**base, **values.get(name, {}), **value}
            values[name] = value
        return cls(**values)

    def runbook(self, alert: str) -> str:
        """The runbook link of ``alert`` (its heading in docs/runbooks.md)."""
        return f"{self.runbook_url}#{alert.lower()}"


SETTINGS = Settings()
DS = {"type": "prometheus", "uid": "${datasource}"}
# Optional labels first: ``=~".*"`` (their All) matches series that do not have them.
SCOPE = 'cluster=~"$cluster", namespace=~"$namespace"'
SEL = SCOPE + ', job=~"$job", run=~"$run", group=~"$group"'
RANK_DIGITS = 5
# The Grafana release whose dashboard schema the JSON is tested against (the oldest claimed).
OLDEST_GRAFANA = "10.4.0"
GRAFANA_SCHEMA_VERSION = 41
Panel = dict[str, Any]

# Query string a panel link carries to another dashboard: time range and the three variables.
VAR_PARAMS = (
    "${__url_time_range}&${datasource:queryparam}&${cluster:queryparam}&${namespace:queryparam}"
    "&${job:queryparam}&${run:queryparam}&${group:queryparam}"
)
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
    optional = {"selected": True, "text": "All", "value": "$__all"}
    cluster = variable(
        "cluster", "Cluster", "label_values(rankwatch_window_index, cluster)", multi, True
    )
    namespace = variable(
        "namespace",
        "Namespace",
        'label_values(rankwatch_window_index{cluster=~"$cluster"}, namespace)',
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
        variable("job", "Job", f"label_values(rankwatch_window_index{{{SCOPE}}}, job)", multi),
        variable(
            "run",
            "Run",
            f'label_values(rankwatch_window_index{{{SCOPE}, job=~"$job"}}, run)',
            multi,
        ),
        variable(
            "group",
            "Group",
            f'label_values(rankwatch_window_index{{{SCOPE}, job=~"$job", run=~"$run"}}, group)',
            multi,
        ),
    ]


def with_runbooks(
    panels: list[Panel], s: Settings, alerts_by_title: Mapping[str, Sequence[str]]
) -> list[Panel]:
    """Add a panel link to the runbook of each alert that fires on what a panel shows."""
    by_title = {p["title"]: p for p in panels}
    for title, alerts in alerts_by_title.items():
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
)


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


def step_time(s: Settings) -> dict[str, Any]:
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
                    by_rank("phase", f'rankwatch_phase_seconds{{{SEL}, phase=~"$phase"}}'),
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
    with_runbooks(
        panels,
        s,
        {
            "Straggler score": STRAGGLER_ALERTS,
            "Straggler score over time": STRAGGLER_ALERTS,
            "Window age": ("RankwatchNoFreshWindows",),
            "Incident timeline": STRAGGLER_ALERTS,
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


# --- DeepEP normal mode ---------------------------------------------------------------------


def deepep_normal(s: Settings) -> dict[str, Any]:
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
                    by_rank("probe", f"rankwatch_deepep_notify_ratio{{{SEL}}}"),
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
                    by_rank("probe", f"rankwatch_deepep_notify_duration_seconds{{{SEL}}}"),
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
                    by_rank("phase", f"rankwatch_deepep_ll_row_ratio{{{SEL}}}"),
                    "{{phase}} row {{rank}}",
                ),
                target(
                    by_rank("phase", f"rankwatch_deepep_ll_column_ratio{{{SEL}}}"),
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


# --- Overview -------------------------------------------------------------------------------


def overview(s: Settings) -> dict[str, Any]:
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
            f'count(up{{{SCOPE}, job=~"$job"}} == 0) or vector(0)',
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


# --- alerting rules -------------------------------------------------------------------------

RULES_HEADER = """\
# rankwatch alerting rules. Generated by dashboards/generate.py (edit that script, or render
# your own copy with its settings: runbook links, job selector, for: durations).
#
# The diagnosis alerts read the exporter's incident series (rankwatch_incident_active /
# rankwatch_incident_score). Those exist only while the exporter's k-of-n incident tracker holds
# an incident open, so one noisy window never reaches these rules: the tracker already debounces
# opening (k of the last n windows) and closing (m clean windows). On top of that:
#   for:             the incident must stay open across several scrapes before anyone is paged;
#   keep_firing_for: a single failed scrape (which marks every series of the target stale) or a
#                    briefly closed incident does not resolve and re-fire the alert.
# An alert's labels are its identity, and they must not change while the incident lasts, or
# for: starts again: the incident's cause (which follows the latest window and may flip between,
# say, straggler and input_straggler near the 80 % coverage line) is aggregated away and read
# into the annotations instead. The incident's severity only escalates while it is open; the
# DeepEP alerts carry it, so an escalation is a new alert at the higher severity.
# Aggregations keep job/run/group plus the incident's identity labels and drop instance/pod, so
# the same incident seen through two scrape paths pages once per job.
"""


def _sel(s: Settings, *matchers: str) -> str:
    """``{job selector, matchers...}``."""
    return "{" + ", ".join((s.job_selector.strip(), *matchers)) + "}"


def _incident_cause(cls: str, by: Sequence[str]) -> str:
    """Template text that looks up the incident's current cause (it is not an alert label).

    Runs at every evaluation that finds the alert's series, so the annotation follows the cause
    while the alert's identity stays put (keep_firing_for keeps the last annotations).
    """
    # The alert's own label values select the incident (job included: no job selector needed).
    matchers = ", ".join((f"class={json.dumps(cls)}", *(f"{label}=%q" for label in by)))
    query = f"max by (cause) (rankwatch_incident_active{{{matchers}}})"
    args = " ".join(f"$labels.{label}" for label in by)
    return (
        f'{{{{ range printf `{query}` {args} | query | sortByLabel "cause" }}}}'
        "{{ .Labels.cause }} {{ else }}unknown {{ end }}"
    )


def _alert(
    s: Settings,
    name: str,
    expr: str,
    labels: dict[str, str],
    summary: str,
    description: str,
) -> dict[str, Any]:
    rule: dict[str, Any] = {
        "alert": name,
        "expr": expr,
        "for": s.for_[name],
        "keep_firing_for": s.keep_firing_for[name],
    }
    if labels:
        rule["labels"] = labels
    rule["annotations"] = {
        "summary": summary,
        "description": description,
        "runbook_url": s.runbook(name),
    }
    return rule


STRAGGLER_BY = ("job", "run", "group", "culprit_rank", "hostname")
DEEPEP_BY = ("job", "run", "group", "probe", "culprit_rank", "hostname")


def _straggler(s: Settings, severity: str) -> dict[str, Any]:
    cls = 'class="step_time_straggler"'
    by = ", ".join(STRAGGLER_BY)
    expr = (
        f"max by ({by}) (\n"
        f"  rankwatch_incident_score{_sel(s, cls, f'severity={json.dumps(severity)}')}\n)\n"
    )
    cause = _incident_cause("step_time_straggler", STRAGGLER_BY)
    if severity == "critical":
        return _alert(
            s,
            "RankwatchStepTimeStragglerCritical",
            expr,
            {"severity": "critical"},
            "Rank {{ $labels.culprit_rank }} on {{ $labels.hostname }} is a critical step-time "
            "straggler ({{ $labels.run }}/{{ $labels.group }})",
            "Run {{ $labels.run }}, group {{ $labels.group }}: rank {{ $labels.culprit_rank }} "
            "on host {{ $labels.hostname }} reaches the synchronising phase late and every other "
            f"rank waits for it. Cause {cause}(latest window); straggler score "
            "{{ $value | humanizePercentage }} of the victim's iteration time (critical from 20%).",
        )
    critical = _sel(s, cls, 'severity="critical"')
    expr += (
        "unless on (job, run, group)\n"
        f"max by (job, run, group) (\n  rankwatch_incident_active{critical}\n)\n"
    )
    return _alert(
        s,
        "RankwatchStepTimeStragglerWarning",
        expr,
        {"severity": "warning"},
        "Rank {{ $labels.culprit_rank }} on {{ $labels.hostname }} is a step-time straggler "
        "({{ $labels.run }}/{{ $labels.group }})",
        "Run {{ $labels.run }}, group {{ $labels.group }}: rank {{ $labels.culprit_rank }} "
        "on host {{ $labels.hostname }} has delayed the group for "
        f"{s.for_['RankwatchStepTimeStragglerWarning']}. Cause {cause}(latest window); "
        "straggler score {{ $value | humanizePercentage }} (warning from 10%, critical from 20%).",
    )


def _deepep(s: Settings, name: str, cls: str, summary: str, description: str) -> dict[str, Any]:
    """A DeepEP incident class; its severity is the incident's (an alert label, so it routes)."""
    by = ", ".join((*DEEPEP_BY, "severity"))
    expr = f"max by ({by}) (\n  rankwatch_incident_score{_sel(s, f'class={json.dumps(cls)}')}\n)\n"
    cause = _incident_cause(cls, DEEPEP_BY)
    return _alert(s, name, expr, {}, summary, description.replace("CAUSE", cause))


def diagnosis_rules(s: Settings) -> list[dict[str, Any]]:
    return [
        _straggler(s, "critical"),
        _straggler(s, "warning"),
        _deepep(
            s,
            "RankwatchDeepEPGlobalDataPathSlowdown",
            "global_data_path_slowdown",
            "DeepEP dispatch and combine are both globally slower than usual "
            "({{ $labels.run }}/{{ $labels.group }})",
            "Run {{ $labels.run }}, group {{ $labels.group }}: the completion cost of DeepEP "
            'dispatch and combine is {{ $value | printf "%.2f" }}x the median of recent normal '
            "windows (alert from 1.3x) on every path at once, which points at the shared fabric "
            "rather than one rank. Probe {{ $labels.probe }}, cause CAUSE(latest window), "
            "severity {{ $labels.severity }}.",
        ),
        _deepep(
            s,
            "RankwatchDeepEPLocalizedDataPathSlowdown",
            "localized_data_path_slowdown",
            "DeepEP data path slow around rank {{ $labels.culprit_rank }} on "
            "{{ $labels.hostname }} ({{ $labels.run }}/{{ $labels.group }})",
            "Run {{ $labels.run }}, group {{ $labels.group }}: dispatch and combine agree on a "
            "slow local scope around rank {{ $labels.culprit_rank }} (host "
            '{{ $labels.hostname }}): slowdown factor {{ $value | printf "%.2f" }}x after '
            "removing window-wide, row and column effects. Probe {{ $labels.probe }}, cause "
            "CAUSE(latest window), severity {{ $labels.severity }}.",
        ),
        _deepep(
            s,
            "RankwatchDeepEPPreStageArrivalSkew",
            "pre_stage_arrival_skew",
            "Rank {{ $labels.culprit_rank }} on {{ $labels.hostname }} arrives late at DeepEP "
            "{{ $labels.probe }} ({{ $labels.run }}/{{ $labels.group }})",
            "Run {{ $labels.run }}, group {{ $labels.group }}: rank {{ $labels.culprit_rank }} "
            "on host {{ $labels.hostname }} enters the {{ $labels.probe }} Notify kernel late "
            "while the completion paths downstream are normal, so the delay is in the work "
            'before the collective. Its Notify time is {{ $value | printf "%.3f" }} of the peer '
            "median (late from 0.25 down); cause CAUSE(latest window), severity "
            "{{ $labels.severity }}.",
        ),
    ]


# The run a scrape target served, kept while the target is down: a down target's own series
# are stale at once, so the alert could not say which run lost a rank otherwise (and
# Alertmanager could not inhibit that run's stale-window alert). The rule reads its own previous
# sample for targets that are down now, so the run stays for as long as the target stays down.
TARGET_RUN = "rankwatch:scrape_target_run:info"


def exporter_rules(s: Settings) -> list[dict[str, Any]]:
    up = f"up{_sel(s)}"
    stale = s.stale_window_seconds
    return [
        {
            "record": TARGET_RUN,
            "expr": (
                f"group by (job, instance, run) (rankwatch_exporter_up{_sel(s)})\n"
                f"or on (job, instance)\n"
                f"({TARGET_RUN} and on (job, instance) ({up} == 0))\n"
            ),
        },
        _alert(
            s,
            "RankwatchExporterDown",
            # A target that was never up has no run: it fires without one.
            f"({up} == 0)\n"
            f"  * on (job, instance) group_left (run)\n"
            f"  topk by (job, instance) (1, {TARGET_RUN})\n"
            f"or on (job, instance)\n"
            f"({up} == 0)\n",
            {"severity": "warning"},
            "rankwatch endpoint {{ $labels.instance }} cannot be scraped",
            "Prometheus has failed to scrape {{ $labels.instance }} (job {{ $labels.job }}"
            "{{ with $labels.run }}, run {{ . }}{{ end }}) for "
            f"{s.for_['RankwatchExporterDown']}. Either the training process on it exited or "
            "hung, or its /metrics port is unreachable. No diagnosis of that rank's group can "
            "be trusted meanwhile.",
        ),
        _alert(
            s,
            "RankwatchNoFreshWindows",
            # The window's own timestamp, not the exporter's age gauge: the age is computed by
            # the process being judged, the timestamp is checked against Prometheus' clock.
            f"time() - max by (job, run, group, instance) "
            f"(rankwatch_window_timestamp_seconds{_sel(s)}) > {stale}\n",
            {"severity": "warning"},
            "No new rankwatch window for {{ $labels.run }}/{{ $labels.group }} in "
            "{{ $value | humanizeDuration }}",
            "The root of group {{ $labels.group }} in run {{ $labels.run }} "
            "({{ $labels.instance }}) is alive but its latest diagnosed window is "
            "{{ $value | humanizeDuration }} old (alert from "
            f"{stale} s). Training is stalled, a rank stopped contributing to the gather, or "
            "windows are rejected; the dashboards show stale data.",
        ),
        _alert(
            s,
            "RankwatchExportFailing",
            "sum by (job, run, group, instance, exporter) (\n"
            f"  rate(rankwatch_export_failures_total{_sel(s)}[5m])\n) > 0\n",
            {"severity": "warning"},
            "rankwatch {{ $labels.exporter }} export keeps failing on {{ $labels.instance }}",
            "The {{ $labels.exporter }} export of run {{ $labels.run }}, group "
            "{{ $labels.group }} ({{ $labels.instance }}) has failed for "
            f"{s.for_['RankwatchExportFailing']}, at "
            '{{ $value | printf "%.3f" }} failures per second. OTLP metrics or incident events '
            "are not reaching the collector; the Prometheus /metrics path is unaffected.",
        ),
    ]


def rules(s: Settings) -> dict[str, Any]:
    """The rule groups (the content of rankwatch.rules.yml and of the PrometheusRule spec)."""
    return {
        "groups": [
            {"name": "rankwatch-diagnosis", "rules": diagnosis_rules(s)},
            {"name": "rankwatch-exporter", "rules": exporter_rules(s)},
        ]
    }


def rules_yaml(s: Settings) -> str:
    return RULES_HEADER + yaml.dump(rules(s), Dumper=_BlockDumper, sort_keys=False, width=100)


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


def prometheus_rule(s: Settings) -> str:
    """The rule file as a PrometheusRule kube-prometheus-stack picks up."""
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
        "spec": rules(s),
    }
    return HEADER + yaml.dump(doc, Dumper=_BlockDumper, sort_keys=False, width=100)


def render(s: Settings = SETTINGS, root: Path = ROOT) -> dict[Path, str]:
    """Every generated file (under ``root``) and its content."""
    out: dict[Path, str] = {}
    rendered = {}
    for name, build in DASHBOARDS.items():
        rendered[name] = json.dumps(build(s), indent=2, ensure_ascii=False) + "\n"
        out[root / "dashboards" / name] = rendered[name]
    out[root / "dashboards/rules/rankwatch.rules.yml"] = rules_yaml(s)
    out[root / "deploy/kubernetes/dashboards.yaml"] = configmaps(rendered)
    out[root / "deploy/kubernetes/prometheusrule.yaml"] = prometheus_rule(s)
    return out


def settings_from_args(argv: Sequence[str] | None = None) -> tuple[Settings, Path]:
    """Settings from ``--settings FILE`` (JSON or YAML) and flags (which win); output root."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", type=Path, help="JSON or YAML file of Settings keys")
    parser.add_argument("--runbook-url", help=f"runbooks page (default {DEFAULT_RUNBOOK_URL})")
    parser.add_argument("--job-selector", help="label matcher of the rules, e.g. 'job=\"x\"'")
    parser.add_argument(
        "--for",
        dest="for_",
        action="append",
        default=[],
        metavar="ALERT=DURATION",
        help="an alert's for: duration (repeatable)",
    )
    parser.add_argument("--keep-firing-for", action="append", default=[], metavar="ALERT=DURATION")
    parser.add_argument("--stale-window-seconds", type=int)
    parser.add_argument(
        "--out", type=Path, default=ROOT, help="root to write under (default: this repository)"
    )
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {}
    if args.settings is not None:
        loaded = yaml.safe_load(args.settings.read_text()) or {}  # YAML is a superset of JSON
        if not isinstance(loaded, dict):
            parser.error(f"--settings {args.settings}: expected a mapping of settings")
        overrides.update(loaded)
    for key in ("runbook_url", "job_selector", "stale_window_seconds"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    for key, pairs in (("for", args.for_), ("keep_firing_for", args.keep_firing_for)):
        if pairs:
            table = dict(overrides.get(key) or {})
            for pair in pairs:
                alert, sep, duration = pair.partition("=")
                if not sep:
                    parser.error(f"--{key.replace('_', '-')} {pair!r}: expected ALERT=DURATION")
                table[alert] = duration
            overrides[key] = table
    try:
        return Settings.load(overrides), args.out
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: error() exits


def main(argv: Sequence[str] | None = None) -> None:
    settings, root = settings_from_args(argv)
    for path, text in render(settings, root).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

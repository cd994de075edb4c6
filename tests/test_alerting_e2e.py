"""End to end: workload -> real Prometheus (shipped rules) -> real Alertmanager -> webhook.

One module-scoped stack serves three tests, in order:

1. a critical straggler pages: the webhook receives ``RankwatchStepTimeStragglerCritical``
   naming the culprit rank;
2. every PromQL expression of every dashboard panel and every alert rule, with the dashboard
   variables substituted, runs against that Prometheus and returns data of the shape its panel
   expects (matrix panels: N x N cells in numeric rank order; heatmap: one row per rank);
3. after the straggler goes away, the alert resolves and the webhook receives the resolution.

The rules are the shipped file, unchanged (``for: 1m`` and ``keep_firing_for: 1m`` on the critical
straggler, so the run takes about three minutes); Prometheus scrapes and evaluates every second.
Alertmanager runs the shipped routing (``deploy/compose/alertmanager.yml``) with its receivers
pointed at the test's webhook and its grouping waits shortened.

The workload is a stand-in ``/metrics`` endpoint serving catalogue-shaped series from
prometheus-client, switched between "straggler" and "recovered" by the test.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from tests.servers import (
    REPO,
    Server,
    alertmanager,
    free_port,
    http_get,
    prom_query,
    prometheus,
    wait_until,
)

pytestmark = pytest.mark.servers

RUN, GROUP, N, CULPRIT = "e2e", "world", 4, 2
HOSTS = {r: f"node-{r // 2}" for r in range(N)}  # two ranks per host
RULES = REPO / "dashboards" / "rules" / "rankwatch.rules.yml"
DASHBOARDS = sorted((REPO / "dashboards").glob("rankwatch-*.json"))
NOTIFY_PROBES = ("notify_dispatch", "cached_notify_dispatch", "cached_notify_combine")
COMPLETION_PROBES = ("dispatch_final", "dispatch_rdma_recv", "combine_logical_recv")
PHASES = ("input_wait", "h2d", "forward", "backward", "optimizer", "step", "residual", "visible")


# --- the stand-in workload ------------------------------------------------------------------------


class StandIn(Collector):
    """Catalogue-shaped series of a 4-rank group with a scripted straggler on rank 2."""

    def __init__(self) -> None:
        self.straggler = True
        self.window = 0
        self.started = time.time()

    def collect(self) -> Iterator[Any]:
        self.window += 1
        common = ["run", "group"]
        c = [RUN, GROUP]
        slow = self.straggler

        def gauge(name: str, labels: list[str], rows: list[tuple[list[str], float]]) -> Any:
            g = GaugeMetricFamily(f"rankwatch_{name}", name, labels=common + labels)
            for values, v in rows:
                g.add_metric(c + values, v)
            return g

        def counter(name: str, labels: list[str], rows: list[tuple[list[str], float]]) -> Any:
            g = CounterMetricFamily(f"rankwatch_{name}", name, labels=common + labels)
            for values, v in rows:
                g.add_metric(c + values, v)
            return g

        rank = [str(r) for r in range(N)]
        visible = {r: (0.02 if (slow and r == CULPRIT) else 0.09) for r in range(N)}
        phases = {
            "input_wait": 0.01,
            "h2d": 0.002,
            "forward": 0.05,
            "backward": 0.09,
            "optimizer": 0.01,
            "step": 0.2,
            "residual": 0.005,
        }
        rows = []
        for r in range(N):
            for ph in PHASES:
                v = visible[r] if ph == "visible" else phases[ph]
                if ph == "input_wait" and slow and r == CULPRIT:
                    v = 0.08
                rows.append(([str(r), str(r % 2), HOSTS[r], ph], v))
        yield gauge("phase_seconds", ["rank", "local_rank", "hostname", "phase"], rows)
        yield gauge("straggler_score", [], [([], 0.3 if slow else 0.02)])
        yield gauge(
            "cause_coverage_ratio",
            ["component"],
            [(["input"], 0.95 if slow else 0.0), (["h2d"], 0.0), (["compute"], 0.0)],
        )
        yield gauge(
            "component_excess_seconds",
            ["component"],
            [(["input"], 0.07 if slow else 0.0), (["h2d"], 0.0), (["compute"], 0.0)],
        )
        info = InfoMetricFamily("rankwatch_diagnosis", "diagnosis", labels=common)
        info.add_metric(
            c,
            {
                "kind": "INPUT_STRAGGLER" if slow else "BALANCED",
                "severity": "critical" if slow else "none",
                "culprit_rank": str(CULPRIT) if slow else "",
                "victim_rank": "1" if slow else "",
                "component": "input",
                "clock": "cpu",
                "strategy": "ddp",
            },
        )
        yield info
        yield gauge("diagnosis_severity", [], [([], 3 if slow else 0)])
        yield gauge("window_steps", [], [([], 40)])
        yield gauge("window_index", [], [([], self.window)])
        yield gauge("window_timestamp_seconds", [], [([], time.time())])
        yield gauge("window_age_seconds", [], [([], 0.5)])
        yield gauge("window_missing_ranks", [], [([], 0)])
        yield gauge("group_ranks", [], [([], N)])
        yield gauge(
            "diagnosis_duration_seconds",
            ["engine"],
            [([e], 0.001) for e in ("step_time", "normal", "low_latency")],
        )
        # DeepEP normal mode.
        yield gauge(
            "deepep_notify_ratio",
            ["probe", "rank"],
            [([p, r], 0.05 if r == "3" else 1.0) for p in NOTIFY_PROBES for r in rank],
        )
        yield gauge(
            "deepep_notify_duration_seconds",
            ["probe", "rank"],
            [([p, r], 1e-4) for p in NOTIFY_PROBES for r in rank],
        )
        yield gauge(
            "deepep_completion_cycles_per_sample",
            ["probe", "src_rank", "dst_rank"],
            [
                ([p, s, d], 1000 + 100 * int(s) + int(d))
                for p in COMPLETION_PROBES
                for s in rank
                for d in rank
                # RDMA receive is gateway-oriented: only inter-node edges carry traffic.
                if p != "dispatch_rdma_recv" or HOSTS[int(s)] != HOSTS[int(d)]
            ],
        )
        yield gauge(
            "deepep_completion_row_cycles_per_sample",
            ["probe", "src_rank"],
            [([p, s], 1000.0) for p in COMPLETION_PROBES for s in rank],
        )
        yield gauge(
            "deepep_completion_column_cycles_per_sample",
            ["probe", "dst_rank"],
            [([p, d], 1000.0) for p in COMPLETION_PROBES for d in rank],
        )
        yield gauge(
            "deepep_residual_slowdown_factor",
            ["probe", "scope", "src", "dst"],
            [
                (["dispatch_final", "row", "1", ""], 1.4),
                (["combine_logical_recv", "point", "1", "3"], 2.5),
            ],
        )
        yield gauge(
            "deepep_global_slowdown_factor", ["probe"], [([p], 1.45) for p in COMPLETION_PROBES]
        )
        yield gauge(
            "deepep_probe_anomalous",
            ["probe"],
            [([p], 1.0) for p in NOTIFY_PROBES + COMPLETION_PROBES],
        )
        yield counter("deepep_window_invalid", ["reason"], [(["counter_reset"], 1)])
        yield gauge(
            "deepep_ll_row_ratio",
            ["phase", "rank"],
            [([ph, r], 1.0) for ph in ("dispatch", "combine") for r in rank],
        )
        yield gauge(
            "deepep_ll_column_ratio",
            ["phase", "rank"],
            [([ph, r], 1.0) for ph in ("dispatch", "combine") for r in rank],
        )
        # Incidents: the exporter keeps these series only while an incident is open.
        labels = ["class", "severity", "probe", "culprit_rank", "hostname", "cause"]
        open_ = [
            [
                "global_data_path_slowdown",
                "critical",
                "combine_logical_recv,dispatch_final",
                "",
                "",
                "global",
            ],
            ["localized_data_path_slowdown", "warning", "dispatch_final", "1", "node-0", "row"],
            ["pre_stage_arrival_skew", "warning", "notify_dispatch", "3", "node-1", "late_arrival"],
        ]
        if slow:
            open_.append(
                [
                    "step_time_straggler",
                    "critical",
                    "",
                    str(CULPRIT),
                    HOSTS[CULPRIT],
                    "input_straggler",
                ]
            )
        yield gauge("incident_active", labels, [(v, 1.0) for v in open_])
        yield gauge(
            "incident_score",
            labels,
            [
                (v, {"step_time_straggler": 0.3, "pre_stage_arrival_skew": 0.05}.get(v[0], 1.45))
                for v in open_
            ],
        )
        yield counter("incidents", ["class", "severity"], [([v[0], v[1]], 1) for v in open_])
        yield counter("collection_errors", ["reason"], [(["gather_timeout"], 0)])
        yield counter("export_failures", ["exporter"], [(["otlp_metrics"], 0), (["otlp_logs"], 0)])
        yield gauge("exporter_up", [], [([], 1)])
        yield gauge("exporter_start_time_seconds", [], [([], self.started)])


# --- webhook receiver -------------------------------------------------------------------------


@dataclass
class Webhook:
    """Collects Alertmanager's webhook notifications."""

    port: int
    payloads: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alerts(self, name: str, status: str) -> list[dict[str, Any]]:
        return [
            {**a, "receiver": p["receiver"]}
            for p in list(self.payloads)
            for a in p["alerts"]
            if a["labels"].get("alertname") == name and a["status"] == status
        ]


def start_webhook() -> tuple[Webhook, ThreadingHTTPServer]:
    hook = Webhook(free_port())

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            hook.payloads.append(json.loads(body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", hook.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return hook, server


def alertmanager_config(webhook_url: str) -> str:
    """The shipped Alertmanager config, receivers pointed at the test, waits shortened."""
    config = yaml.safe_load((REPO / "deploy/compose/alertmanager.yml").read_text())
    for receiver in config["receivers"]:
        for hook in receiver["webhook_configs"]:
            hook["url"] = f"{webhook_url}/{receiver['name']}"
    config["route"].update(group_wait="1s", group_interval="1s")
    return yaml.safe_dump(config)


# --- the stack ----------------------------------------------------------------------------------


@dataclass
class Stack:
    workload: StandIn
    prom: Server
    am: Server
    webhook: Webhook
    target: str


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    registry = CollectorRegistry()
    workload = StandIn()
    registry.register(workload)
    port = free_port()
    metrics_server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    webhook, webhook_server = start_webhook()
    try:
        with alertmanager(alertmanager_config(webhook.url)) as am:
            config = {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": ["rankwatch.rules.yml"],
                "alerting": {
                    "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am.port}"]}]}]
                },
                "scrape_configs": [
                    {
                        "job_name": "rankwatch",
                        "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
                    }
                ],
            }
            files = {"rankwatch.rules.yml": RULES.read_text()}
            with prometheus(yaml.safe_dump(config), files) as prom:
                yield Stack(workload, prom, am, webhook, f"127.0.0.1:{port}")
    finally:
        metrics_server.shutdown()
        webhook_server.shutdown()


def _firing(stack: Stack) -> list[dict[str, Any]]:
    return stack.webhook.alerts("RankwatchStepTimeStragglerCritical", "firing")


# --- 1: the page -----------------------------------------------------------------------------


def test_critical_straggler_pages_the_webhook(stack: Stack) -> None:
    wait_until(lambda: prom_query(stack.prom, 'up{job="rankwatch"} == 1'), 30, what="first scrape")
    opened = time.monotonic()
    # Not before the rule's for: 1m.
    time.sleep(45)
    assert _firing(stack) == []
    alerts = wait_until(lambda: _firing(stack), 90, interval=1, what="the critical page")
    assert time.monotonic() - opened >= 55
    alert = alerts[0]
    assert alert["receiver"] == "pager"
    assert alert["labels"]["severity"] == "critical"
    assert alert["labels"]["culprit_rank"] == str(CULPRIT)
    assert alert["labels"]["hostname"] == HOSTS[CULPRIT]
    assert alert["labels"]["run"] == RUN and alert["labels"]["group"] == GROUP
    assert f"Rank {CULPRIT} on {HOSTS[CULPRIT]}" in alert["annotations"]["summary"]
    assert alert["annotations"]["runbook_url"].startswith("docs/runbooks.md#")


# --- 2: every panel and rule query ------------------------------------------------------------


VARIABLES = {
    "$job": "rankwatch",
    "$run": RUN,
    "$group": GROUP,
    "$phase": "visible|step",
    "$__range": "5m",
    "$__rate_interval": "1m",
    "$__interval": "15s",
}


def substitute(expr: str) -> str:
    for var, value in sorted(VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    assert "$" not in expr.replace('"$1"', "").replace('"00$1"', "").replace('"0$1"', ""), expr
    return expr


def query_range(server: Server, expr: str, seconds: int = 30) -> list[dict[str, Any]]:
    end = time.time()
    params = {"query": expr, "start": str(end - seconds), "end": str(end), "step": "1"}
    body = http_get(f"{server.url}/api/v1/query_range?{urllib.parse.urlencode(params)}")
    payload = json.loads(body)
    assert payload["status"] == "success", payload
    result: list[dict[str, Any]] = payload["data"]["result"]
    return result


def check_panel(stack: Stack, dashboard: str, panel: dict[str, Any]) -> None:
    """Run the panel's queries as Grafana would and check the shape the panel needs."""
    title, kind = panel["title"], panel["type"]
    results = []
    for target in panel["targets"]:
        expr = substitute(target["expr"])
        if target.get("instant"):
            result = prom_query(stack.prom, expr)
        else:
            result = query_range(stack.prom, expr)
        assert result, f"{dashboard} / {title}: no data for {expr}"
        results.append(result)
    if kind == "stat":
        assert all(len(r) == 1 for r in results), f"{title}: a stat needs one value"
    if "(src x dst)" in title:
        (cells,) = results
        pairs = {(c["metric"]["src"], c["metric"]["dst"]) for c in cells}
        assert len(pairs) == len(cells), f"{title}: duplicate cells"
        padded = sorted(f"{r:03d}" for r in range(N))
        if "dispatch_rdma_recv" in title:
            # Gateway-oriented and sparse: only edges that carried traffic have cells.
            assert 1 <= len(cells) <= N * N and pairs <= {(s, d) for s in padded for d in padded}
        else:
            assert len(cells) == N * N, f"{title}: {len(cells)} cells, want {N * N}"
            assert {s for s, _ in pairs} == set(padded) == {d for _, d in pairs}
        # Sorting by "key" (what the sortBy transformation does) gives row-major numeric order.
        keys = sorted(c["metric"]["key"] for c in cells)
        assert keys == [f"{s}-{d}" for s, d in sorted(pairs, key=lambda p: (int(p[0]), int(p[1])))]
    if kind == "heatmap":
        (rows,) = results
        assert sorted(r["metric"]["r"] for r in rows) == [f"{r:03d}" for r in range(N)]
    if title == "Per-host breakdown":
        for r in results:
            assert sorted(x["metric"]["hostname"] for x in r) == sorted(set(HOSTS.values()))
    if title in ("Notify ratio per rank and probe", "Notify duration per rank"):
        (series,) = results
        assert len(series) == N * len(NOTIFY_PROBES)
    if title == "Per-rank phase times":
        (series,) = results
        assert len(series) == 2 * N  # visible and step per rank
    if title == "Incident timeline":
        (series,) = results
        assert [s["metric"]["culprit_rank"] for s in series] == [str(CULPRIT)]


def test_every_panel_and_rule_query_returns_the_expected_shape(stack: Stack) -> None:
    wait_until(
        lambda: prom_query(stack.prom, 'rankwatch_incident_active{class="step_time_straggler"}'),
        30,
        what="the straggler incident in Prometheus",
    )
    checked = 0
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        # Template variables: label_values(selector, label) must offer the value used.
        for var in dashboard["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
            assert m, var
            selector, label = substitute(m.group(1)), m.group(2)
            url = f"{stack.prom.url}/api/v1/label/{label}/values?" + urllib.parse.urlencode(
                {"match[]": selector}
            )
            values = json.loads(http_get(url))["data"]
            wanted = {"job": "rankwatch", "run": RUN, "group": GROUP, "phase": "visible"}
            assert wanted[label] in values, (path.name, var["name"], values)
        for panel in dashboard["panels"]:
            check_panel(stack, path.name, panel)
            checked += 1
    assert checked >= 40
    # Rules: every selector matches the workload's series, and each expression evaluates.
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            expr = rule["expr"]
            prom_query(stack.prom, expr)
            for selector in re.findall(r"\b(?:rankwatch_\w+|up)\{[^}]*\}", expr):
                if 'severity="warning"' in selector and "step_time" in selector:
                    continue  # the stand-in has no warning straggler
                assert prom_query(stack.prom, selector), f"{rule['alert']}: {selector} is empty"
    critical = prom_query(stack.prom, doc["groups"][0]["rules"][0]["expr"])
    assert [s["metric"]["culprit_rank"] for s in critical] == [str(CULPRIT)]


# --- 3: recovery ------------------------------------------------------------------------------


def test_critical_straggler_alert_resolves_after_recovery(stack: Stack) -> None:
    wait_until(lambda: _firing(stack), 150, interval=1, what="the critical page")
    stack.workload.straggler = False
    recovered = time.monotonic()
    resolved = wait_until(
        lambda: stack.webhook.alerts("RankwatchStepTimeStragglerCritical", "resolved"),
        120,
        interval=1,
        what="the resolution",
    )
    # keep_firing_for: 1m holds the alert that long after the incident closed.
    assert time.monotonic() - recovered >= 55
    assert resolved[0]["labels"]["culprit_rank"] == str(CULPRIT)
    assert resolved[0]["receiver"] == "pager"

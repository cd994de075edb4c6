"""End to end: workload -> real Prometheus (shipped rules) -> real Alertmanager -> webhook.

One module-scoped stack serves four tests, in order:

1. a critical straggler pages: the webhook receives ``RankwatchStepTimeStragglerCritical``
   naming the culprit rank, no sooner than the rule's ``for:``;
2. every PromQL expression of every dashboard panel (and every template variable), with the
   dashboard variables substituted, runs against that Prometheus and returns data of the shape
   its panel expects (matrix panels: N x N cells in numeric rank order; heatmap: one row per
   rank; stats: one value). The demo's series have no ``cluster``/``namespace`` label, so the
   optional variables are on All (``.*``); the stand-in test below selects them by value;
3. after the straggler goes away, the alert resolves (no sooner than ``keep_firing_for``) and
   the webhook receives the resolution;
4. every selector of every alert rule matched series of the run.

The rules are the shipped file rendered the supported way with the critical straggler's
``for:`` and ``keep_firing_for:`` shortened from 1m to 10s (:func:`render_rules`; promtool's
unit tests hold the shipped durations), so the run takes about a minute; Prometheus
scrapes and evaluates every second. Alertmanager runs the shipped routing
(``deploy/compose/alertmanager.yml``) with its receivers pointed at the test's webhook and its
grouping waits shortened.

The workload is the real demo job (``rankwatch demo``: a Gloo world of 4 ranks on CPU, rank 2
slowed in its data loading, the real collectors, diagnosis, incident tracker and /metrics
endpoint, with the DeepEP simulator's windows published through the same hub). It has no
low-latency mode: those panels are only run for errors here, and a last test checks every panel
with data against a stand-in ``/metrics`` endpoint that serves catalogue-shaped series of every
family from prometheus-client.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from rankwatch.exporter.cli.demo_plan import SIM_EP_SIZE
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
PAGE = "RankwatchStepTimeStragglerCritical"
# The page's for: and keep_firing_for:, shortened from the shipped 1m each (promtool's unit
# tests hold those); the demo's timeline below is sized from them.
PAGE_FOR_S = 10
PAGE_KEEP_FIRING_FOR_S = 10
NOTIFY_PROBES = ("notify_dispatch", "cached_notify_dispatch", "cached_notify_combine")
COMPLETION_PROBES = ("dispatch_final", "dispatch_rdma_recv", "combine_logical_recv")
PHASES = ("input_wait", "h2d", "forward", "backward", "optimizer", "step", "residual", "visible")


# --- the stand-in workload ------------------------------------------------------------------------


class StandIn(Collector):
    """Catalogue-shaped series of a 4-rank group with a scripted straggler on rank 2."""

    def __init__(self) -> None:
        self.straggler = True
        self.slow_node = False
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
        # A hang incident as the root publishes it while one is open (rankwatch.diagnosis.hang).
        yield gauge(
            "hang_active",
            ["hang_class", "culprit_rank", "phase", "op"],
            [(["stuck_alive", str(CULPRIT), "input", "allreduce"], 1.0)],
        )
        yield gauge("hang_stalled_seconds", ["hang_class"], [(["stuck_alive"], 16.0)])
        yield gauge(
            "hang_collective_seq",
            ["hang_class", "collective_group", "op"],
            [(["stuck_alive", "0", "allreduce"], 42.0)],
        )
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
            ["hang_suspect", "critical", "notify_dispatch", "5", "node-1", "rank"],
        ]
        if self.slow_node:  # and, with it, the job slower than its own baseline
            open_.append(
                ["step_time_slow_node", "critical", "", "0,1", HOSTS[0], "compute_straggler"]
            )
            open_.append(["job_slowdown", "warning", "", "", "", "forward"])
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
        # A hang names ranks and has no score: the exporter writes no score series for it.
        yield gauge(
            "incident_score",
            labels,
            [
                (v, {"step_time_straggler": 0.3, "pre_stage_arrival_skew": 0.05}.get(v[0], 1.45))
                for v in open_
                if v[0] != "hang_suspect"
            ],
        )
        yield counter("incidents", ["class", "severity"], [([v[0], v[1]], 1) for v in open_])
        # The run against its own baseline, and the time its incidents cost.
        yield gauge("job_pace_ratio", [], [([], 1.02)])
        yield gauge("job_baseline_step_seconds", [], [([], 0.21)])
        yield gauge(
            "rank_pace_ratio",
            ["rank", "local_rank", "hostname"],
            [([str(r), str(r % 2), HOSTS[r]], 1.0 + 0.01 * r) for r in range(N)],
        )
        yield counter(
            "time_lost_seconds",
            ["class", "cause", "culprit_rank", "hostname"],
            [
                (
                    ["step_time_straggler", "input_straggler", str(CULPRIT), HOSTS[CULPRIT]],
                    12.0 * self.window,
                )
            ],
        )
        yield gauge("goodput_ratio", [], [([], 0.9)])
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
            {**a, "receiver": p["receiver"], "received": p["received"]}
            for p in list(self.payloads)
            for a in p["alerts"]
            if a["labels"].get("alertname") == name and a["status"] == status
        ]


def start_webhook() -> tuple[Webhook, ThreadingHTTPServer]:
    hook = Webhook(free_port())

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            payload = json.loads(body)
            payload["received"] = time.monotonic()
            hook.payloads.append(payload)
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", hook.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return hook, server


def render_rules(for_: dict[str, str], keep_firing_for: dict[str, str]) -> str:
    """The shipped alert rules with some ``for:`` / ``keep_firing_for:`` durations replaced.

    Rendered the supported way, as a user of the installed package would:
    ``rankwatch assets export DIR --for ALERT=DURATION``.
    """
    with tempfile.TemporaryDirectory(prefix="rw-rules-") as tmp:
        argv = [sys.executable, "-m", "rankwatch.exporter.cli", "assets", "export", tmp]
        argv += [f"--for={alert}={d}" for alert, d in for_.items()]
        argv += [f"--keep-firing-for={alert}={d}" for alert, d in keep_firing_for.items()]
        subprocess.run(argv, check=True, capture_output=True, timeout=120)
        return (Path(tmp) / "dashboards" / "rules" / "rankwatch.rules.yml").read_text()


def alertmanager_config(webhook_url: str) -> str:
    """The shipped Alertmanager config, receivers pointed at the test, waits shortened."""
    config = yaml.safe_load((REPO / "deploy/compose/alertmanager.yml").read_text())
    for receiver in config["receivers"]:
        for hook in receiver["webhook_configs"]:
            hook["url"] = f"{webhook_url}/{receiver['name']}"
    config["route"].update(group_wait="1s", group_interval="1s")
    return yaml.safe_dump(config)


def prometheus_config(alertmanager_port: int, target_port: int) -> str:
    """prometheus.yml: scrape the target and evaluate ``rankwatch.rules.yml`` every second,
    alerts to the Alertmanager on ``alertmanager_port``."""
    am = f"127.0.0.1:{alertmanager_port}"
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rankwatch.rules.yml"],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [am]}]}]},
        "scrape_configs": [
            {
                "job_name": "rankwatch",  # what the shipped rules' job selector matches
                "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}],
            }
        ],
    }
    return yaml.safe_dump(config)


# --- the workloads ----------------------------------------------------------------------------


class Workload:
    """What the tests need to know about the job Prometheus scrapes."""

    run: str = RUN
    group: str = GROUP  # the step-time group
    deepep_group: str = GROUP  # the DeepEP EP group (the demo runs it as its own group)
    n: int = N
    ep_size: int = N  # ranks of the DeepEP group (the demo simulates its own)
    culprit: int = CULPRIT
    hosts: dict[int, str] = HOSTS
    deepep_classes: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.port = free_port()
        self.started_at = time.time()
        # Panels whose data this workload does not produce, with the reason; their queries
        # must still evaluate, and any data they return must have the right shape.
        self.no_data_panels: dict[str, str] = {
            "Hangs": "the workload does not hang",
            "Slow nodes": "no node of the workload is slow",
            # The demo's windows may end before a baseline of its own pace is formed, or
            # before an incident has cost time.
            "Step time against the run's baseline": "no baseline formed yet",
            "Per-rank pace against its own baseline": "no baseline formed yet",
            "Time lost by cause": "no incident has cost time yet",
        }
        # Whether the workload hangs (its rankwatch_hang_* series exist): only the stand-in's.
        self.hangs = False
        # Labels the scrape configuration adds to every series (cluster, namespace); the
        # dashboards are queried with these values selected, or with All when there are none.
        self.target_labels: dict[str, str] = {}

    def start(self) -> None:
        raise NotImplementedError

    def recover(self) -> None:
        """Remove the straggler (the demo's own timeline does it)."""

    def stop(self) -> None:
        raise NotImplementedError


class StandInWorkload(Workload):
    """prometheus-client serving :class:`StandIn`."""

    deepep_classes = (
        "global_data_path_slowdown",
        "localized_data_path_slowdown",
        "pre_stage_arrival_skew",
        "hang_suspect",
    )

    # Whether the stand-in also serves an open slow-node and job-slowdown incident (their
    # alerts would fire).
    slow_node = False

    def start(self) -> None:
        # The stand-in serves an open hang incident, the pace series and the time lost.
        for title in (
            "Hangs",
            "Step time against the run's baseline",
            "Per-rank pace against its own baseline",
            "Time lost by cause",
        ):
            self.no_data_panels.pop(title, None)
        if self.slow_node:
            self.no_data_panels.pop("Slow nodes", None)
        self.hangs = True
        registry = CollectorRegistry()
        self.collector = StandIn()
        self.collector.slow_node = self.slow_node
        registry.register(self.collector)
        self.server, _ = start_http_server(self.port, addr="127.0.0.1", registry=registry)

    def recover(self) -> None:
        self.collector.straggler = False

    def stop(self) -> None:
        self.server.shutdown()


class DemoWorkload(Workload):
    """``rankwatch demo``: a real Gloo world with the straggler scripted on rank 2.

    Timeline: 5 s balanced, 35 s with rank 2 slowed in its data loading, 30 s balanced. The
    straggler phase outlasts the page's 10 s for: (the incident opens a couple of windows into
    it) plus the query checks, with about 10 s to spare; the balanced tail outlasts the 10 s
    keep_firing_for with about 15 s to spare for the incident to close. The simulated DeepEP
    group (EP 16 over two nodes, whatever --ranks is) runs its five phases across the same
    70 s, so pre-stage arrival skew (from 14 s) happens while the straggler is still there.
    """

    deepep_classes = ("pre_stage_arrival_skew",)
    ep_size = SIM_EP_SIZE  # simulated at EP 16 over two nodes, whatever --ranks is

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.no_data_panels["Low-latency row and column ratios"] = "the demo has no LL mode"

    def start(self) -> None:
        argv = [
            str(Path(sys.executable).with_name("rankwatch")),
            "demo",
            "--ranks",
            str(N),
            "--port",
            str(self.port),
            "--out",
            str(self.out),
            "--timeline",
            "balanced:5,input:35,balanced:30",
            "--straggler-rank",
            str(CULPRIT),
            "--interval",
            "1",
            "--plain",
        ]
        self.log_path = self.out.with_suffix(".log")
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def discover(self, prom: Server) -> None:
        """Run id and hosts as the demo reports them."""
        series = wait_until(
            lambda: prom_query(prom, 'rankwatch_phase_seconds{phase="step"}'),
            90,
            what="the demo's first step-time window",
        )
        self.run = series[0]["metric"]["run"]
        self.group = series[0]["metric"]["group"]
        self.hosts = {int(s["metric"]["rank"]): s["metric"]["hostname"] for s in series}
        assert sorted(self.hosts) == list(range(N))
        # The demo's DeepEP windows share the publisher hub with its step-time windows, as a
        # user's MoE job would: both engines' series must be on the same /metrics.
        ep = wait_until(
            lambda: prom_query(prom, "last_over_time(rankwatch_deepep_notify_ratio[1m])"),
            90,
            what="the demo's first DeepEP window on /metrics",
        )
        self.deepep_group = ep[0]["metric"]["group"]
        self.deepep_classes = ("pre_stage_arrival_skew",)
        # Only scopes a window flags carry a residual factor, and the simulator's data-path
        # phases come after this test's queries; the stand-in test checks that panel's shape.
        self.no_data_panels["Residual slowdown factors by scope"] = "no data-path phase yet"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


def use_demo() -> bool:
    """The e2e runs the real demo job; ``RANKWATCH_E2E_WORKLOAD=standin`` swaps in the stand-in
    (a quick way to check the harness itself)."""
    forced = os.environ.get("RANKWATCH_E2E_WORKLOAD", "demo")
    assert forced in ("demo", "standin"), forced
    return forced == "demo"


# --- the stack ----------------------------------------------------------------------------------


@dataclass
class Stack:
    workload: Workload
    prom: Server
    am: Server | None = None
    webhook: Webhook | None = None


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if use_demo():
        workload: Workload = DemoWorkload(tmp_path_factory.mktemp("demo") / "out")
    else:
        workload = StandInWorkload()
    webhook, webhook_server = start_webhook()
    try:
        with alertmanager(alertmanager_config(webhook.url)) as am:
            short = {PAGE: f"{PAGE_FOR_S}s"}
            rules = render_rules(short, {PAGE: f"{PAGE_KEEP_FIRING_FOR_S}s"})
            files = {"rankwatch.rules.yml": rules}
            with prometheus(prometheus_config(am.port, workload.port), files) as prom:
                workload.start()
                try:
                    if isinstance(workload, DemoWorkload):
                        workload.discover(prom)
                    yield Stack(workload, prom, am, webhook)
                finally:
                    workload.stop()
    finally:
        webhook_server.shutdown()


def diagnostics(stack: Stack) -> str:
    """What each stage holds, for a failure message."""
    parts = []
    for expr in ("ALERTS", STRAGGLER, "up"):
        try:
            result = prom_query(stack.prom, expr)
            parts.append(f"{expr}: {[(r['metric'], r['value'][1]) for r in result]}")
        except Exception as exc:
            parts.append(f"{expr}: {exc!r}")
    if stack.am is not None:
        alerts = http_get(stack.am.url + "/api/v2/alerts").decode()
        parts.append(f"alertmanager: {alerts[:1500]}")
        parts.append(f"alertmanager log: {stack.am.log()[-1500:]}")
    if stack.webhook is not None:
        parts.append(f"webhook payloads: {len(stack.webhook.payloads)}")
    parts.append(f"prometheus log: {stack.prom.log()[-1500:]}")
    log = getattr(stack.workload, "log_path", None)
    if log is not None and log.exists():
        parts.append(f"workload log: {log.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)


def wait_for(stack: Stack, predicate: Any, timeout: float, what: str) -> Any:
    """wait_until, with the state of every stage in the failure message."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout}s waiting for {what}\n{diagnostics(stack)}")


STRAGGLER = 'rankwatch_incident_active{class="step_time_straggler", severity="critical"}'


def series_span(stack: Stack, selector: str) -> tuple[float, float]:
    """Unix times of the first and last sample of ``selector`` in the last 10 minutes."""
    times = [float(t) for r in query_range(stack.prom, selector, 600) for t, _ in r["values"]]
    assert times, f"{selector} never had a sample"
    return min(times), max(times)


def unix_time(rfc3339: str) -> float:
    """Alertmanager's timestamps (nanosecond fractions) as Unix time."""
    trimmed = re.sub(r"(\.\d{6})\d*", r"\1", rfc3339).replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(trimmed).timestamp()


def _firing(stack: Stack) -> list[dict[str, Any]]:
    return stack.webhook.alerts(PAGE, "firing")


# --- 1: the page -----------------------------------------------------------------------------


def test_critical_straggler_pages_the_webhook(stack: Stack) -> None:
    w = stack.workload
    wait_for(stack, lambda: prom_query(stack.prom, STRAGGLER), 60, "the straggler incident")
    alerts = wait_for(stack, lambda: _firing(stack), 120, "the critical page")
    alert = alerts[0]
    # Not before the rule's for: after the incident series first appeared (2 s: one scrape and
    # one evaluation of slack).
    first_seen, _ = series_span(stack, STRAGGLER)
    assert unix_time(alert["startsAt"]) - first_seen >= PAGE_FOR_S - 2
    assert alert["receiver"] == "pager"
    labels = alert["labels"]
    assert labels["severity"] == "critical"
    assert labels["culprit_rank"] == str(w.culprit)
    assert labels["hostname"] == w.hosts[w.culprit]
    assert (labels["run"], labels["group"]) == (w.run, w.group)
    assert f"Rank {w.culprit} on {w.hosts[w.culprit]}" in alert["annotations"]["summary"]
    assert alert["annotations"]["runbook_url"].endswith(
        "/docs/runbooks.md#rankwatchsteptimestragglercritical"
    )
    # The cause is in the description (read from the incident), not in the alert's identity.
    assert "cause" not in labels
    assert "Cause input_straggler" in alert["annotations"]["description"]


# --- 2: every panel and rule query ------------------------------------------------------------


def group_for(dashboard: str, w: Workload) -> str:
    """The Group variable each dashboard is looked at with ("All" on the overview)."""
    return {"rankwatch-overview.json": ".*", "rankwatch-deepep-normal.json": w.deepep_group}.get(
        dashboard, w.group
    )


def substitute(expr: str, w: Workload, dashboard: str = "") -> str:
    """The expression as Grafana sends it with the test's variable values."""
    values = {
        # The optional labels on "All": ".*" also matches the series without them (the demo's).
        "$cluster": w.target_labels.get("cluster", ".*"),
        "$namespace": w.target_labels.get("namespace", ".*"),
        "$job": "rankwatch",
        "$run": w.run,
        "$group": group_for(dashboard, w),
        "$phase": "visible|step",
        "$__range": "5m",
        "$__rate_interval": "1m",
        "$__interval": "15s",
    }
    for var, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    assert "$" not in re.sub(r'"0*\$1"', "", expr), expr
    return expr


def query_range(server: Server, expr: str, seconds: int = 30) -> list[dict[str, Any]]:
    end = time.time()
    params = {"query": expr, "start": str(end - seconds), "end": str(end), "step": "1"}
    body = http_get(f"{server.url}/api/v1/query_range?{urllib.parse.urlencode(params)}")
    payload = json.loads(body)
    assert payload["status"] == "success", payload
    result: list[dict[str, Any]] = payload["data"]["result"]
    return result


def run_target(
    stack: Stack, dashboard: str, target: dict[str, Any], retry: bool = True
) -> list[dict[str, Any]]:
    """A panel query, instant or range as the panel asks; [] after a few tries means no data."""
    expr = substitute(target["expr"], stack.workload, dashboard)

    # Range panels look back over the whole run, as a dashboard opened on it would: a panel of
    # flagged scopes (residual slowdowns) only has data in the phases that flag something.
    lookback = max(30, min(900, int(time.time() - stack.workload.started_at) + 5))

    def once() -> list[dict[str, Any]]:
        if target.get("instant"):
            return prom_query(stack.prom, expr)
        return query_range(stack.prom, expr, lookback)

    # A series missing from one scrape is stale for that instant; retry briefly.
    deadline = time.monotonic() + (5 if retry else 0)
    result = once()
    while not result and time.monotonic() < deadline:
        time.sleep(0.5)
        result = once()
    return result


def check_panel(stack: Stack, dashboard: str, panel: dict[str, Any]) -> None:
    """Run the panel's queries as Grafana would and check the shape the panel needs."""
    w = stack.workload
    title, kind = panel["title"], panel["type"]
    results = []
    for target in panel["targets"]:
        result = run_target(stack, dashboard, target, retry=title not in w.no_data_panels)
        if not result and title in w.no_data_panels:
            return
        assert result, f"{dashboard} / {title}: no data for {target['expr']}"
        results.append(result)
    if kind == "stat":
        assert all(len(r) == 1 for r in results), f"{title}: a stat needs one value"
    if "(src x dst)" in title:
        (cells,) = results
        pairs = {(c["metric"]["src"], c["metric"]["dst"]) for c in cells}
        assert len(pairs) == len(cells), f"{title}: duplicate cells"
        ep = w.ep_size
        padded = sorted(f"{r:05d}" for r in range(ep))
        if "dispatch_rdma_recv" in title:
            # Gateway-oriented and sparse: only edges that carried traffic have cells.
            assert pairs <= {(s, d) for s in padded for d in padded}
        else:
            assert len(cells) == ep * ep, f"{title}: {len(cells)} cells, want {ep * ep}"
            assert {s for s, _ in pairs} == set(padded) == {d for _, d in pairs}
        # Sorting by "key" (what the sortBy transformation does) gives row-major numeric order.
        keys = sorted(c["metric"]["key"] for c in cells)
        assert keys == [f"{s}-{d}" for s, d in sorted(pairs, key=lambda p: (int(p[0]), int(p[1])))]
    if kind == "heatmap":
        (rows,) = results
        assert sorted(r["metric"]["r"] for r in rows) == [f"{r:05d}" for r in range(w.n)]
    if title == "Per-host breakdown":
        for r in results:
            assert sorted(x["metric"]["hostname"] for x in r) == sorted(set(w.hosts.values()))
    if title in ("Notify ratio per rank and probe", "Notify duration per rank"):
        (series,) = results
        assert len(series) == w.ep_size * len(NOTIFY_PROBES)
    if title == "Per-rank phase times":
        (series,) = results
        assert len(series) == 2 * w.n  # visible and step per rank
    if title == "Incident timeline":
        (series,) = results
        assert str(w.culprit) in {s["metric"]["culprit_rank"] for s in series}


def test_every_panel_and_rule_query_returns_the_expected_shape(stack: Stack) -> None:
    wait_for(stack, lambda: prom_query(stack.prom, STRAGGLER), 60, "the straggler incident")
    check_dashboards(stack)


def check_dashboards(stack: Stack) -> None:
    """Every template variable and panel query of every dashboard, against ``stack.prom``."""
    w = stack.workload
    checked = 0
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        # Template variables: label_values(selector, label) must offer the value used.
        for var in dashboard["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
            assert m, var
            selector, label = substitute(m.group(1), w, path.name), m.group(2)
            url = f"{stack.prom.url}/api/v1/label/{label}/values?" + urllib.parse.urlencode(
                {"match[]": selector}
            )
            values = json.loads(http_get(url))["data"]
            if label in ("cluster", "namespace") and label not in w.target_labels:
                # Optional: no series has it, the variable offers only All.
                assert values == [], (path.name, var["name"], values)
                continue
            wanted = {
                **w.target_labels,
                "job": "rankwatch",
                "run": w.run,
                "group": w.deepep_group if "deepep" in path.name else w.group,
                "phase": "visible",
            }
            assert wanted[label] in values, (path.name, var["name"], values)
        for panel in dashboard["panels"]:
            check_panel(stack, path.name, panel)
            checked += 1
    assert checked >= 40
    # The critical straggler rule's expression names the culprit.
    critical = prom_query(stack.prom, rule_exprs()["RankwatchStepTimeStragglerCritical"])
    assert [s["metric"]["culprit_rank"] for s in critical] == [str(w.culprit)]


def rule_exprs() -> dict[str, str]:
    doc = yaml.safe_load(RULES.read_text())
    return {r.get("alert") or r["record"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


# --- 3: recovery ------------------------------------------------------------------------------


def test_critical_straggler_alert_resolves_after_recovery(stack: Stack) -> None:
    w = stack.workload
    wait_for(stack, lambda: _firing(stack), 150, "the critical page")
    w.recover()
    wait_for(stack, lambda: not prom_query(stack.prom, STRAGGLER), 150, "the incident to close")
    resolved = wait_for(
        stack,
        lambda: stack.webhook.alerts(PAGE, "resolved"),
        120,
        "the resolution",
    )
    # keep_firing_for holds the alert that long after its incident's series went away. Only
    # that culprit's series counts: on a loaded machine the demo's balanced tail can briefly
    # open an incident of another rank, which is another alert (pending, never paging).
    assert resolved[0]["labels"]["culprit_rank"] == str(w.culprit)
    culprit = STRAGGLER.replace("}", f', culprit_rank="{w.culprit}"}}')
    _, last_seen = series_span(stack, culprit)
    assert unix_time(resolved[0]["endsAt"]) - last_seen >= PAGE_KEEP_FIRING_FOR_S - 2
    assert resolved[0]["receiver"] == "pager"


def test_every_rule_selector_matched_the_run(stack: Stack) -> None:
    """Each selector of each rule matched series of this run at some point (names, labels)."""
    w = stack.workload
    expected_classes = {"step_time_straggler", *w.deepep_classes}
    for name, expr in rule_exprs().items():
        prom_query(stack.prom, expr)  # evaluates without error now
        for selector in re.findall(r"\b(?:rankwatch_\w+|up)\{[^}]*\}", expr):
            klass = re.search(r'class="(\w+)"', selector)
            if klass and klass.group(1) not in expected_classes:
                continue
            if 'severity="warning"' in selector and "step_time" in selector:
                continue  # the straggler of this run is critical throughout
            if selector.startswith("rankwatch_hang_") and not w.hangs:
                continue  # a job that does not hang has no hang series (the stand-in does)
            seen = prom_query(stack.prom, f"count_over_time({selector}[15m])")
            assert seen, f"{name}: {selector} never matched the run"


# --- the stand-in: every panel with data ----------------------------------------------------


# Shapes and counts of its own Prometheus's answers, no timing: it shares the machine (the
# module's stack, and so its timed page, is not started for it).
@pytest.mark.parallel_safe
def test_every_panel_query_against_the_catalogue_shaped_stand_in() -> None:
    """All panels, DeepEP and low-latency included, on series shaped as the catalogue says.

    The real workload may not produce every family (the demo has no low-latency mode); the
    stand-in does, so every panel's query is held to its shape at least here.
    """
    workload = StandInWorkload()
    workload.slow_node = True
    # Here the target carries the optional labels, and the dashboards select them by value.
    workload.target_labels = {"cluster": "c1", "namespace": "training"}
    workload.start()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rankwatch.rules.yml"],
        "scrape_configs": [
            {
                "job_name": "rankwatch",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{workload.port}"],
                        "labels": workload.target_labels,
                    }
                ],
            }
        ],
    }
    try:
        with prometheus(yaml.safe_dump(config), {"rankwatch.rules.yml": RULES.read_text()}) as p:
            stack = Stack(workload, p)
            wait_for(stack, lambda: prom_query(p, STRAGGLER), 30, "the stand-in's first scrape")
            time.sleep(3)  # a few samples for the range queries
            check_dashboards(stack)
            # The optional labels: All (".*") and the target's value match, another value does
            # not, and "" would match only series without the label (none here).
            overview = json.loads((REPO / "dashboards/rankwatch-overview.json").read_text())
            (reporting,) = [p for p in overview["panels"] if p["title"] == "Groups reporting"]
            expr = reporting["targets"][0]["expr"].replace(" or vector(0)", "")
            for cluster, matches in ((".*", True), ("c1", True), ("c2", False), ("", False)):
                workload.target_labels["cluster"] = cluster
                got = prom_query(p, substitute(expr, workload, "rankwatch-overview.json"))
                assert bool(got) is matches, (cluster, got)
            for name, expr in rule_exprs().items():
                prom_query(p, expr)
                for selector in re.findall(r"\b(?:rankwatch_\w+|up)\{[^}]*\}", expr):
                    if 'severity="warning"' in selector and "step_time" in selector:
                        continue  # the stand-in's straggler is critical
                    assert prom_query(p, selector), f"{name}: {selector} is empty"
    finally:
        workload.stop()


# --- numeric rank order beyond 1,000 ranks ------------------------------------------------------


@pytest.mark.parallel_safe  # rank order only, its own Prometheus
def test_rank_order_of_a_1100_rank_group_in_a_real_prometheus() -> None:
    """The heatmap's rows, a per-rank time series panel's series and a completion matrix's
    cells, queried as the dashboards do, come in numeric rank order for a group of 1,100 ranks
    (a string sort of plain ranks would put 1000 before 2)."""
    n = 1100

    class Big(Collector):
        def collect(self) -> Iterator[Any]:
            g = GaugeMetricFamily(
                "rankwatch_phase_seconds",
                "phase",
                labels=["run", "group", "rank", "local_rank", "hostname", "phase"],
            )
            for r in range(n):
                g.add_metric([RUN, GROUP, str(r), str(r % 8), f"node-{r // 8}", "visible"], 0.1)
            yield g
            c = GaugeMetricFamily(
                "rankwatch_deepep_completion_cycles_per_sample",
                "cells",
                labels=["run", "group", "probe", "src_rank", "dst_rank"],
            )
            for src in (0, 2, 999, 1000, 1099):
                for dst in (1, 10, 1001):
                    c.add_metric([RUN, GROUP, "dispatch_final", str(src), str(dst)], 1.0)
            yield c

    registry = CollectorRegistry()
    registry.register(Big())
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {"job_name": "rankwatch", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
        ],
    }
    w = Workload()
    try:
        with prometheus(yaml.safe_dump(config)) as prom:
            wait_until(
                lambda: prom_query(prom, "rankwatch_phase_seconds"), 30, what="the first scrape"
            )
            step = json.loads((REPO / "dashboards/rankwatch-step-time.json").read_text())
            hm = next(p for p in step["panels"] if p["title"] == "Visible phase per rank")
            rows = prom_query(prom, substitute(hm["targets"][0]["expr"], w))
            names = sorted(r["metric"]["r"] for r in rows)  # Grafana's string order
            assert [int(x) for x in names] == list(range(n))
            # Per-rank time series come back (and so fill the legend) in numeric rank order.
            (per_rank,) = [p for p in step["panels"] if p["title"] == "Per-rank phase times"]
            series = query_range(prom, substitute(per_rank["targets"][0]["expr"], w), 10)
            assert [int(x["metric"]["rank"]) for x in series] == list(range(n))
            deepep = json.loads((REPO / "dashboards/rankwatch-deepep-normal.json").read_text())
            matrix = next(p for p in deepep["panels"] if p["title"].endswith("(src x dst)"))
            expr = substitute(matrix["targets"][0]["expr"], w, "rankwatch-deepep-normal.json")
            cells = prom_query(prom, expr)
            keys = sorted(c["metric"]["key"] for c in cells)  # the sortBy transformation
            pairs = [tuple(int(x) for x in k.split("-")) for k in keys]
            assert pairs == sorted(pairs) and len(pairs) == 15
    finally:
        server.shutdown()

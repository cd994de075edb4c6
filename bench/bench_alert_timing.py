"""How long a critical straggler takes to page, and to resolve, with the shipped settings.

A real Prometheus (the compose stack's 15 s scrape and evaluation intervals, the shipped rule
file) scrapes a stand-in ``/metrics`` that serves the incident series a rank's exporter serves
while its incident tracker holds a critical step-time straggler open; a real Alertmanager with
the shipped routing (``group_wait: 30s``, ``group_interval: 5m``) sends to a local webhook. Each
group holds its incident open for a different time, all at once (Alertmanager groups by
run and group, so they do not share notifications):

- ``open_to_page_s``: from the incident series appearing on /metrics to the page;
- ``close_to_resolved_s``: from the series disappearing to the resolved notification;
- a group whose incident is shorter than the rule's ``for:`` (plus an evaluation) never pages.

What is measured starts at the incident: the tracker opens it after ``incident_open_k`` of
``incident_open_n`` windows of ``interval_seconds`` (computed, not measured here) and closes it
after ``incident_close_m`` clean windows. Takes about 7 minutes (the resolved notification
waits for ``group_interval``). Run: ``python -m bench.bench_alert_timing [SECONDS ...]`` (how
long each incident stays open; default 45 80 150).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rankwatch.exporter.config import RankwatchConfig
from tests.servers import REPO, alertmanager, free_port, prometheus

ALERT = "RankwatchStepTimeStragglerCritical"
# How long each group's incident stays open (seconds), unless given on the command line.
DEFAULT_OPEN_SECONDS = (45.0, 80.0, 150.0)
# After the longest incident closes: long enough for keep_firing_for and group_interval.
TAIL_SECONDS = 330.0


def _compose_prometheus(metrics_port: int, am_port: int) -> str:
    """The compose stack's intervals and rule file, the stand-in as the only target."""
    return json.dumps(
        {
            "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
            "rule_files": ["rankwatch.rules.yml"],
            "alerting": {
                "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]
            },
            "scrape_configs": [
                {
                    "job_name": "rankwatch",
                    "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
                }
            ],
        }
    )


def _shipped_alertmanager(webhook_url: str) -> str:
    """deploy/compose/alertmanager.yml with its webhook URLs pointed here, nothing else changed."""
    text = (REPO / "deploy/compose/alertmanager.yml").read_text()
    return text.replace("http://host.docker.internal:5001/rankwatch", webhook_url)


class _Clock:
    """Which incidents are open now: group -> (opened, closed) in time.time()."""

    def __init__(self, start: float, open_seconds: tuple[float, ...]) -> None:
        self.windows = {f"open-{s:g}s": (start, start + s) for s in open_seconds}
        self.first_scraped: dict[str, float] = {}
        self.last_scraped: dict[str, float] = {}

    def exposition(self) -> str:
        now = time.time()
        lines = [
            "# TYPE rankwatch_incident_active gauge",
            "# TYPE rankwatch_incident_score gauge",
        ]
        for group, (opened, closed) in self.windows.items():
            if opened <= now < closed:
                self.first_scraped.setdefault(group, now)
                self.last_scraped[group] = now
                labels = (
                    f'run="timing",group="{group}",class="step_time_straggler",'
                    f'severity="critical",probe="",culprit_rank="2",hostname="node-a",'
                    f'cause="input_straggler"'
                )
                lines.append(f"rankwatch_incident_active{{{labels}}} 1")
                lines.append(f"rankwatch_incident_score{{{labels}}} 0.35")
        return "\n".join(lines) + "\n"


def _serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, int]:
    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, port


def run(open_seconds: tuple[float, ...] = DEFAULT_OPEN_SECONDS) -> dict[str, Any]:
    """Run the incidents through Prometheus and Alertmanager; the timings by group."""
    received: list[tuple[float, dict[str, Any]]] = []
    clock = _Clock(time.time() + 20.0, open_seconds)  # the servers start first

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = clock.exposition().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    class Webhook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append((time.time(), payload))
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    metrics, metrics_port = _serve(Metrics)
    hook, hook_port = _serve(Webhook)
    rules = (REPO / "dashboards/rules/rankwatch.rules.yml").read_text()
    try:
        with alertmanager(_shipped_alertmanager(f"http://127.0.0.1:{hook_port}")) as am:
            am_port = int(am.url.rsplit(":", 1)[1])
            config = _compose_prometheus(metrics_port, am_port)
            with prometheus(config, {"rankwatch.rules.yml": rules}):
                end = max(closed for _, closed in clock.windows.values()) + TAIL_SECONDS
                while time.time() < end:
                    time.sleep(1.0)
    finally:
        metrics.shutdown()
        hook.shutdown()
    out: dict[str, Any] = {}
    for group, (opened, closed) in clock.windows.items():
        seen = [
            (at, alert["status"])
            for at, payload in received
            for alert in payload["alerts"]
            if alert["labels"].get("alertname") == ALERT and alert["labels"]["group"] == group
        ]
        firing = [at for at, status in seen if status == "firing"]
        resolved = [at for at, status in seen if status == "resolved"]
        out[group] = {
            "open_seconds": round(closed - opened, 1),
            "scraped_from_s": round(clock.first_scraped.get(group, float("nan")) - opened, 1),
            "open_to_page_s": round(firing[0] - opened, 1) if firing else None,
            "close_to_resolved_s": round(resolved[0] - closed, 1) if resolved else None,
        }
    return out


def main() -> None:
    cfg = RankwatchConfig()
    opening = cfg.incident_open_k * cfg.interval_seconds
    closing = cfg.incident_close_m * cfg.interval_seconds
    print(
        f"computed: the tracker opens an incident ~{opening:g} s into a fault "
        f"(k={cfg.incident_open_k} of n={cfg.incident_open_n} windows of "
        f"{cfg.interval_seconds:g} s) and closes it ~{closing:g} s after it ends "
        f"(m={cfg.incident_close_m})"
    )
    open_seconds = tuple(float(a) for a in sys.argv[1:]) or DEFAULT_OPEN_SECONDS
    results = run(open_seconds)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

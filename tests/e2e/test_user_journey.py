"""The person on call, end to end: one fault in a real 2-rank Gloo job pages once and resolves.

Rank 1's input pipeline is slow until the page arrives, then healthy. The job runs ``init()``
as the README shows (its ``/metrics`` on the root, the run named by torchrun's run id), a real
Prometheus scrapes it with the shipped alert rules (``for:`` durations shortened, rendered by
:func:`render_rules`) and a real Alertmanager routes to this test's webhook with the shipped
routing. What must happen: exactly one critical incident, one page (one critical alert, naming
rank 1 and the run), an opening and a closing line on ``rankwatch.incidents`` at WARNING with
the same id, one resolved notice, and the run's name on every series.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_alerting_e2e import (
    alertmanager_config,
    prometheus_config,
    render_rules,
    start_webhook,
)
from tests.framework_world import SLEEP_S, LogLines, incident_fields, run_world
from tests.servers import alertmanager, free_port, prom_query, prometheus

pytestmark = [pytest.mark.servers, pytest.mark.multiproc]

SLOW_RANK = 1
PAGE = "RankwatchStepTimeStragglerCritical"
# The shipped durations divided by about 30, so the journey takes a minute, not half an hour.
SHORT_FOR = {PAGE: "2s", "RankwatchStepTimeStragglerWarning": "10s"}
SHORT_KEEP_FIRING_FOR = {PAGE: "2s", "RankwatchStepTimeStragglerWarning": "4s"}
JOURNEY_TIMEOUT_S = 180.0
COMPUTE_S = 0.005


def scenario_journey(rank: int, world: int, out: str) -> dict[str, Any]:
    """Train until the test says ``done``; rank 1 is slow until the test says ``fault-off``."""
    import torch
    import torch.distributed as dist

    from rankwatch.exporter import init
    from rankwatch.exporter.publish.incidents import IncidentEvent

    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())  # the same weights and batches on every run
    lines = LogLines("rankwatch.incidents")  # the logger left at its default level
    events: list[dict[str, Any]] = []

    def on_incident(event: IncidentEvent) -> None:
        events.append(incident_fields(event))

    port = int(Path(out, "metrics_port").read_text())
    rw = init(
        on_incident=on_incident,
        interval_seconds=1.5,  # windows of about 30 steps: past the 20-step warning cap
        gather_timeout_seconds=20.0,
        metrics_enabled=rank == 0,
        metrics_port=port,
    )
    inner = torch.nn.Linear(32, 1)
    inner.register_forward_pre_hook(lambda module, args: time.sleep(COMPUTE_S))
    model = torch.nn.parallel.DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    done = torch.zeros(1)
    fault_off, stop = Path(out, "fault-off"), Path(out, "done")
    deadline = time.monotonic() + JOURNEY_TIMEOUT_S

    def batches() -> Any:
        while True:
            if rank == SLOW_RANK and not fault_off.exists():
                time.sleep(SLEEP_S)
            yield torch.randn(16, 32), torch.randn(16, 1)

    steps = 0
    for x, y in rw.watch(model, opt, batches()):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        steps += 1
        done[0] = float(rank == 0 and (stop.exists() or time.monotonic() > deadline))
        with rw.sync_wait():  # every rank stops at the same step
            dist.all_reduce(done, op=dist.ReduceOp.MAX)
        if done[0]:
            break
    rw.close(10.0)
    dist.destroy_process_group()
    return {"events": events, "lines": lines.lines, "steps": steps, "run": rw.config.run_id}


def test_one_fault_pages_once_closes_once_and_resolves_once(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "metrics_port").write_text(str(port))
    rules = render_rules(SHORT_FOR, SHORT_KEEP_FIRING_FOR)
    webhook, webhook_server = start_webhook()
    result: dict[str, Any] = {}

    def job() -> None:
        try:
            result.update(run_world(f"{__name__}:scenario_journey", 2, tmp_path))
        except BaseException as exc:  # reported by the main thread
            result["error"] = exc

    try:
        with (
            alertmanager(alertmanager_config(webhook.url)) as am,
            prometheus(prometheus_config(am.port, port), {"rankwatch.rules.yml": rules}) as prom,
        ):
            runner = threading.Thread(target=job, daemon=True)
            runner.start()

            def wait(what: str, predicate: Any, timeout: float = 120.0) -> Any:
                end = time.monotonic() + timeout
                while time.monotonic() < end:
                    value = predicate()
                    if value or "error" in result:
                        return value
                    time.sleep(0.5)
                alerts = json.dumps(webhook.payloads)[-3000:]
                seen = {
                    q: prom_query(prom, q) for q in ("up", "ALERTS", "rankwatch_incident_active")
                }
                pytest.fail(f"timed out waiting for {what}; webhook: {alerts}; prometheus: {seen}")

            wait("the page", lambda: webhook.alerts(PAGE, "firing"))
            (tmp_path / "fault-off").touch()  # the on-call engineer fixes rank 1's loader
            wait("the resolved notice", lambda: webhook.alerts(PAGE, "resolved"))
            runs = prom_query(prom, 'count by (run) ({__name__=~"rankwatch_.+"})')
            (tmp_path / "done").touch()
            runner.join(JOURNEY_TIMEOUT_S)
    finally:
        webhook_server.shutdown()
    assert "error" not in result, result.get("error")
    root = result[0]
    # One fault, one incident: it is the straggler, and it closed on clean windows.
    events = root["events"]
    assert [(e["action"], e["cls"]) for e in events] == [
        ("open", "step_time_straggler"),
        ("close", "step_time_straggler"),
    ], events
    assert events[1]["severity"] == "critical" and events[1]["reason"] == "clean windows"
    incident_id = events[0]["id"]
    # One opening line, one closing line, the same level, the same id.
    lines = [(lvl, msg) for lvl, msg in root["lines"] if incident_id in msg]
    assert [lvl for lvl, _ in lines] == ["WARNING", "WARNING"], root["lines"]
    assert '"incident.action":"open"' in lines[0][1] and '"incident.action":"close"' in lines[1][1]
    # One page: one critical alert, to the pager, naming rank 1 and the run; one resolution.
    paged = {
        json.dumps(a["labels"], sort_keys=True)
        for p in webhook.payloads
        for a in p["alerts"]
        if a["labels"].get("severity") == "critical"
    }
    assert len(paged) == 1, paged
    (page,) = (json.loads(labels) for labels in paged)
    run = root["run"]
    assert run and run == result[1]["run"]  # torchrun's run id, the same on both ranks
    assert (page["alertname"], page["culprit_rank"], page["run"]) == (PAGE, str(SLOW_RANK), run)
    assert {a["receiver"] for a in webhook.alerts(PAGE, "firing")} == {"pager"}
    assert len({a["fingerprint"] for a in webhook.alerts(PAGE, "resolved")}) == 1
    assert (
        f"Run {run}, group world" in webhook.alerts(PAGE, "firing")[0]["annotations"]["description"]
    )
    # The run's name is on every series Prometheus holds.
    assert [r["metric"].get("run") for r in runs] == [run], runs

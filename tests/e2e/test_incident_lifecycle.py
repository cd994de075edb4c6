"""One fault on a real run of two Gloo ranks, followed as the person on call sees it.

Rank 1's input pipeline is slow for the whole run (the job ends with the fault still there),
and every rank does about 10 ms of host work between steps (outside any timed phase: the
residual-heavy job of a real training script, a steady property, not a fault). What must come
out: exactly one critical incident, live on ``/metrics`` and in the end-of-run block (the input
straggler; the input-bound share it causes in a 2-rank group is folded into it, and the
residual share is at most a warning that does not page), an opening and a closing log line at
the same level with the same incident id, the closing at job end with reason ``run ended``
(also to ``on_incident``), and the root's end-of-run block on stderr.
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rankwatch.exporter.publish.recorder import incident_counts
from tests.framework_world import SLEEP_S, LogLines, incident_fields, run_world

pytestmark = pytest.mark.multiproc

SLOW_RANK = 1
MAX_STEPS = 1500  # a bound only: the run ends a few steps after the incident is critical
STEPS_AFTER_OPEN = 20
COMPUTE_S = 0.005
HOST_WORK_S = 0.010  # untimed host work between steps on every rank: residual


def critical_series(url: str) -> list[str]:
    """The ``rankwatch_incident_active`` series with ``severity="critical"`` on ``/metrics``."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return [
        line
        for line in text.splitlines()
        if line.startswith("rankwatch_incident_active{") and 'severity="critical"' in line
    ]


def scenario_fault_to_the_end(rank: int, world: int, out: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from rankwatch.exporter import init
    from rankwatch.exporter.publish.incidents import IncidentEvent

    dist.init_process_group("gloo")  # from torchrun's environment
    torch.manual_seed(dist.get_rank())  # the same weights and batches on every run
    # The logger as a user leaves it: no level set, so only what reaches WARNING is shown.
    lines = LogLines("rankwatch.incidents")
    events: list[dict[str, Any]] = []
    opened = threading.Event()

    def on_incident(event: IncidentEvent) -> None:
        events.append(incident_fields(event))
        if event.action == "open":
            opened.set()

    rw = init(
        on_incident=on_incident,
        interval_seconds=0.5,
        gather_timeout_seconds=20.0,
        run_id="lifecycle-run",
        artifact_dir=str(Path(out, "artifacts")),
        metrics_enabled=True,  # the root scrapes its own /metrics below,
        metrics_port=0,  # on an ephemeral port
    )
    hub = rw.publishers[0] if rw.is_root else None  # /metrics starts with the first window
    live: list[str] = []  # the critical series the root's /metrics showed, once it had one
    torch.manual_seed(0)
    inner = torch.nn.Linear(32, 1)
    inner.register_forward_pre_hook(lambda module, args: time.sleep(COMPUTE_S))
    model = torch.nn.parallel.DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    flag = torch.zeros(1)  # the root heard an opening: every rank learns it at the same step

    def batches() -> Any:
        for _ in range(MAX_STEPS):
            if rank == SLOW_RANK:
                time.sleep(SLEEP_S)
            yield torch.randn(16, 32), torch.randn(16, 1)

    steps, stop_at = 0, MAX_STEPS
    for x, y in rw.watch(model, opt, batches()):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        time.sleep(HOST_WORK_S)  # logging, metrics, bookkeeping: time in no phase
        steps += 1
        # The incident may open at warning (short windows are capped) and escalate: the root
        # watches its own /metrics, as an alert would, until a critical series shows.
        if hub is not None and opened.is_set() and not live and steps % 5 == 0:
            live = critical_series(hub.metrics_url)
        flag[0] = max(float(flag[0]), float(bool(live)))
        with rw.sync_wait():  # a collective outside the model: its wait is timed, not residual
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag[0] and stop_at == MAX_STEPS:
            stop_at = steps + STEPS_AFTER_OPEN
        if steps >= stop_at:
            break
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rw.close(10.0)
    dist.destroy_process_group()
    return {
        "events": events,
        "lines": lines.lines,
        "end_block": err.getvalue(),
        "steps": steps,
        "is_root": rw.is_root,
        "live_critical": live,
        "summary": json.loads(Path(out, "artifacts", "summary.json").read_text())
        if rw.is_root
        else None,
    }


def test_one_fault_one_critical_incident_opened_and_closed_at_job_end(tmp_path: Path) -> None:
    res = run_world(f"{__name__}:scenario_fault_to_the_end", 2, tmp_path)
    root, other = res[0], res[1]
    assert root["is_root"] and not other["is_root"]
    assert other["events"] == [] and other["lines"] == [] and other["end_block"] == ""
    assert root["steps"] < MAX_STEPS
    events = root["events"]
    # One fault, one page: exactly one incident is (or escalates to) critical, the straggler,
    # and the input-bound share it causes in a group of two is part of it, not a second page.
    # (It may open at warning: windows of fewer than 20 steps are capped there.)
    critical = [e for e in events if e["action"] == "close" and e["severity"] == "critical"]
    assert [(e["cls"], e["ranks"]) for e in critical] == [("step_time_straggler", [SLOW_RANK])], (
        events
    )
    assert "step_time_bottleneck" not in {e["cls"] for e in events if e["severity"] == "critical"}
    # Live: one critical series on /metrics, the straggler's, while the job still ran (the
    # residual share of every rank, open as a warning at most, is not among them).
    (series,) = root["live_critical"]
    assert 'class="step_time_straggler"' in series and f'culprit_rank="{SLOW_RANK}"' in series
    # The residual share of the host work is a property of the job: at most a warning, and
    # its incident, if the run had one, says it does not page.
    summary = root["summary"]
    report = summary["step_time"]["report"]
    for rank in (0, 1):  # the host work is seen, as residual, on every rank
        assert report["rank_means"][str(rank)]["residual"] >= 0.8 * HOST_WORK_S * 1e3, report
    for finding in report["findings"]:
        if finding["kind"] in ("RESIDUAL_HEAVY", "INPUT_BOUND", "COMPUTE_BOUND"):
            assert finding["severity"] in ("warning", "info"), finding
    paging = [i for i in summary["incidents"] if i["pages"]]
    assert [(i["class"], i["ranks"]) for i in paging] == [("step_time_straggler", [SLOW_RANK])]
    properties = [i for i in summary["incidents"] if i["nature"] == "property"]
    assert all(i["severity"] == "warning" and not i["pages"] for i in properties), properties
    # Every opening has its closing; the fault lasted to the end, so the run end closed it.
    opens = {e["id"] for e in events if e["action"] == "open"}
    closes = {e["id"]: e for e in events if e["action"] == "close"}
    assert set(closes) == opens, events
    straggler_id = critical[0]["id"]
    assert closes[straggler_id]["reason"] == "run ended"
    assert {e["run"] for e in events} == {"lifecycle-run"}
    # The log lines: the same level, each naming the incident.
    lines = [msg for _, msg in root["lines"] if straggler_id in msg]
    assert [lvl for lvl, msg in root["lines"] if straggler_id in msg] == ["WARNING", "WARNING"]
    assert '"event":"rankwatch.incident.open"' in lines[0]
    assert '"event":"rankwatch.incident.close"' in lines[1]
    assert '"incident.close_reason":"run ended"' in lines[1]
    # The end-of-run block: the verdict names rank 1, the incident is listed as run ended.
    block = root["end_block"]
    assert block.startswith("rankwatch: run lifecycle-run ended\n"), block
    assert "  Verdict: " in block and f"rank {SLOW_RANK}" in block, block
    assert "  Incidents: " in block and "(run ended)" in block, block
    counted = incident_counts(summary["incidents"])
    assert counted.startswith(f"{len(summary['incidents'])} (1 critical fault"), counted
    assert f"  Incidents: {counted}\n" in block, block
    assert f"  Summary: {tmp_path / 'artifacts' / 'summary.txt'}" in block, block

"""One fault on a real run of two Gloo ranks, followed as the person on call sees it.

Rank 1's input pipeline is slow for the whole run (the job ends with the fault still there).
What must come out: one critical incident (the input straggler; the input-bound share it causes
in a 2-rank group is folded into it), an opening and a closing log line at the same level with
the same incident id, the closing at job end with reason ``run ended`` (also to
``on_incident``), and the root's end-of-run block on stderr.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.framework_world import SLEEP_S, LogLines, incident_fields, run_world

pytestmark = pytest.mark.multiproc

SLOW_RANK = 1
MAX_STEPS = 3000  # a bound only: the run ends a few steps after the incident opened
STEPS_AFTER_OPEN = 20
COMPUTE_S = 0.005


def scenario_fault_to_the_end(rank: int, world: int, out: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from rankwatch.exporter import init
    from rankwatch.exporter.publish.incidents import IncidentEvent

    dist.init_process_group("gloo")  # from torchrun's environment
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
    )
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
        steps += 1
        flag[0] = max(float(flag[0]), float(opened.is_set()))
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
    assert f"  Summary: {tmp_path / 'artifacts' / 'summary.txt'}" in block, block

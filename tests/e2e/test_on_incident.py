"""Acting on a verdict: ``init(on_incident=...)`` on a real run of two Gloo ranks.

Rank 1's input is slow until the root's callback hears that an incident opened; the root tells
every rank through a flag they all-reduce each step (the pattern the integration docs give),
the straggler goes away, and the root hears the incident close; then every rank stops at the
same step.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.framework_world import SLEEP_S, run_world

pytestmark = pytest.mark.multiproc

SLOW_RANK = 1
MAX_STEPS = 3000  # a bound only: the run stops on the incident's close long before
COMPUTE_S = 0.005


def scenario_react(rank: int, world: int, out: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from rankwatch.exporter import init
    from rankwatch.exporter.publish.incidents import IncidentEvent

    dist.init_process_group("gloo")  # from torchrun's environment
    torch.manual_seed(dist.get_rank())  # the same weights and batches on every run
    events: list[dict[str, Any]] = []
    seen = {"open": threading.Event(), "close": threading.Event()}
    threads: set[str] = set()

    def on_incident(event: IncidentEvent) -> None:  # the root's publishing thread
        threads.add(threading.current_thread().name)
        inc = event.incident
        events.append(
            {"action": event.action, "cls": inc.cls, "cause": inc.cause, "ranks": inc.ranks}
        )
        if inc.cls == "step_time_straggler":
            seen[event.action].set()

    rw = init(on_incident=on_incident, interval_seconds=0.5, gather_timeout_seconds=20.0)
    torch.manual_seed(0)
    inner = torch.nn.Linear(32, 1)
    # A balanced few milliseconds of "compute" on every rank: a loaded machine's jitter stays
    # small against the step, so the windows after the straggler is gone are clean.
    inner.register_forward_pre_hook(lambda module, args: time.sleep(COMPUTE_S))
    model = torch.nn.parallel.DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # [a straggler incident opened, it closed]: set on the root, read by every rank
    flags = torch.zeros(2)

    def batches() -> Any:
        for _ in range(MAX_STEPS):
            if rank == SLOW_RANK and not flags[0]:
                time.sleep(SLEEP_S)
            yield torch.randn(16, 32), torch.randn(16, 1)

    steps = 0
    heard_open_at = -1
    for x, y in rw.watch(model, opt, batches()):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        steps += 1
        # Every rank, every step, the same collective: all learn at the same step.
        flags[0] = max(float(flags[0]), float(seen["open"].is_set()))
        flags[1] = max(float(flags[1]), float(seen["close"].is_set()))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] and heard_open_at < 0:
            heard_open_at = steps
        if flags[1]:
            break
    rw.close(5.0)
    dist.destroy_process_group()
    return {
        "events": events,
        "steps": steps,
        "heard_open_at": heard_open_at,
        "is_root": rw.is_root,
        "threads": sorted(threads),
    }


def test_on_incident_hears_the_straggler_open_and_close_and_every_rank_stops_together(
    tmp_path: Path,
) -> None:
    res = run_world(f"{__name__}:scenario_react", 2, tmp_path)
    root, other = res[0], res[1]
    assert root["is_root"] and not other["is_root"]
    assert other["events"] == []  # only the root diagnoses, so only it is called
    assert root["threads"] == ["rankwatch-publish"]  # off the training thread
    # Other incidents may open beside it (the slow rank is input-bound too): the straggler's
    # own events are one open, then one close.
    straggler = [e for e in root["events"] if e["cls"] == "step_time_straggler"]
    assert [(e["action"], e["ranks"]) for e in straggler] == [
        ("open", [SLOW_RANK]),
        ("close", [SLOW_RANK]),
    ], root["events"]
    assert straggler[0]["cause"] == "input_straggler", root["events"]
    # The flag reached every rank at the same step, and they stopped together, early.
    assert root["heard_open_at"] == other["heard_open_at"] > 0
    assert root["steps"] == other["steps"] < MAX_STEPS

"""One rank of the storage-fault matrix's training job (``bench/reliability_matrix.py``).

A two-rank DDP job on Gloo, set up as a user would: ``rankwatch.exporter.init()`` from the
environment (step windows and the run summary under ``RANKWATCH_ARTIFACT_DIR``, ``/metrics`` on
the root), the DeepEP collector in synchronous mode (NPZ windows and its log file under
``DEEPEP_DIAGNOSE_LOG_PATH``) with DeepXTrace's log file as one of its publishers. Rank 1 is slow
in its forward, so incidents open. Logging is left unconfigured, so what rankwatch says reaches
stderr exactly as a plain script would show it.

The job trains until rank 0 sees ``fault-applied`` in the control folder, then at least
``AFTER_FAULT_S`` and ``STEPS_AFTER_FAULT`` steps more (rank 0 broadcasts the decision each
step, so both ranks take the same steps), scrapes its own ``/metrics`` into the control folder,
closes, and writes ``rank<r>.json`` there.

Run as ``python -m bench.reliability_job`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``,
``RELIABILITY_CONTROL`` (the control folder) and the settings above in the environment.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rankwatch.diagnosis.deepep.normal import NormalSimulator
from rankwatch.exporter import init
from rankwatch.exporter.deepep.deepxtrace import DeepXTraceLog
from rankwatch.exporter.deepep.diagnose import Diagnose
from rankwatch.exporter.publish.hub import PublisherHub
from tests.e2e.test_deepep_gloo import write_normal

# Training after the fault: several step windows and DeepEP rounds, however loaded the machine.
AFTER_FAULT_S = 1.5
STEPS_AFTER_FAULT = 30
MAX_RUN_S = 60.0  # a job whose fault never came ends anyway
SLOW_RANK = 1
SLOW_FORWARD_S = 0.012
DEEPEP_EVERY = 4  # steps between DeepEP rounds (one window each)


class SlowOnOneRank(torch.nn.Module):
    """A small MLP whose forward sleeps on the slow rank (a compute straggler)."""

    def __init__(self, slow: bool) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
        )
        self.slow = slow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow:
            time.sleep(SLOW_FORWARD_S)
        return self.net(x)


def _write_deepep_round(diag: Diagnose, sim: NormalSimulator, k: int, rank: int) -> None:
    """DeepEP's kernels' part: this rank's counts of window ``k`` (normal and low latency)."""
    write_normal(diag, sim.window("baseline" if k % 3 else "pre_dispatch_delay", k), rank)
    dispatch, combine = diag.get_stats_ll_stats_tensor()
    waits = torch.full_like(dispatch, 1_000 + 10 * k)
    waits[SLOW_RANK] *= 20  # every rank waits long for the slow one
    dispatch += waits
    combine += waits


def _scrape(rw: Any) -> str:
    hub = next((p for p in rw.publishers if isinstance(p, PublisherHub)), None)
    if hub is None or hub.metrics_server is None:
        return ""
    with urllib.request.urlopen(hub.metrics_server.url, timeout=10) as answer:
        return str(answer.read().decode())


def main() -> None:
    began = time.monotonic()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    control = Path(os.environ["RELIABILITY_CONTROL"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(SlowOnOneRank(rank == SLOW_RANK))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rw = init()
    rw.watch(model, opt)
    xtrace = None
    if rank == 0:
        log_path = os.environ["DEEPEP_DIAGNOSE_LOG_PATH"]
        xtrace = DeepXTraceLog(
            log_path, rank, ep_size=world, instance_id=uuid.uuid4(), details=True
        )
    diag = Diagnose.create_from_env(
        group=dist.group.WORLD,
        enable_normal_diagnose=True,
        enable_ll_diagnose=True,
        publishers=[xtrace] if xtrace is not None else [],
    )
    assert diag is not None
    diag.start()
    sim = NormalSimulator(
        ep_size=world, ranks_per_node=1, seed=3, slow_rank=SLOW_RANK, pressured_local_ranks=(0,)
    )
    gen = torch.Generator().manual_seed(rank)
    started = time.monotonic()
    fault_seen: float | None = None
    steps = 0
    steps_after_fault = 0
    slowest_s = 0.0
    while True:
        t0 = time.perf_counter()
        x = torch.randn(16, 32, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        steps += 1
        if steps % DEEPEP_EVERY == 0:
            _write_deepep_round(diag, sim, steps // DEEPEP_EVERY, rank)
            diag.diagnose_normal_sync()
            diag.diagnose_ll_sync()
        slowest_s = max(slowest_s, time.perf_counter() - t0)
        now = time.monotonic()
        if rank == 0 and fault_seen is None and (control / "fault-applied").exists():
            fault_seen = now
        done = (
            fault_seen is not None
            and now - fault_seen > AFTER_FAULT_S
            and steps_after_fault >= STEPS_AFTER_FAULT
        )
        stop = torch.tensor([int(done)], dtype=torch.int64)
        if rank == 0 and now - started > MAX_RUN_S:
            stop[0] = 1
        dist.broadcast(stop, 0)
        applied = torch.tensor([int(fault_seen is not None)], dtype=torch.int64)
        dist.broadcast(applied, 0)
        steps_after_fault += int(applied.item())
        if stop.item():
            break
    trained = time.monotonic()
    metrics = _scrape(rw) if rank == 0 else ""
    diag.stop()
    rw.close()
    if xtrace is not None:
        xtrace.close(1.0)
    closed = time.monotonic()
    result = {
        "rank": rank,
        "steps": steps,
        "steps_after_fault": steps_after_fault,
        "slowest_step_s": slowest_s,
        "timed_out": time.monotonic() - started > MAX_RUN_S,
        "seconds": {
            "start": started - began,
            "train": trained - started,
            "close": closed - trained,
        },
    }
    if rank == 0:
        (control / "metrics.txt").write_text(metrics)
    (control / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

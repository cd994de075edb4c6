"""A real job of two Gloo ranks under torchrun, requeued as Slurm does: attempt 0 finds its
slow rank and fails; the same batch script runs again with ``SLURM_RESTART_COUNT=1`` (the
same job id, so the same run name), publishes ``attempt="1"``, and its end block says what
attempt 0 found, read from the summary attempt 0 left in the artifact folder (kept beside
attempt 1's).

torchrun's own ``--max-restarts`` is not the restart here: on the machine this was written on,
the script below restarted by torchrun itself failed in attempt 1's ``init_process_group``
(Gloo's full-mesh connect refused), with ``RANKWATCH_ENABLE=0`` as well, while a smaller DDP
script restarted fine; not investigated further. torchrun's count is read as the Slurm count
is (``tests/exporter/test_attempt.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.servers import free_port

pytestmark = pytest.mark.multiproc

JOB_NAME, JOB_ID = "train", "4711"
RUN = f"{JOB_NAME}-{JOB_ID}"  # Slurm's run name: the job id stays over a requeue
SLOW_RANK = 1
STEPS = 40  # about 1.6 s at the slow rank's 40 ms a step: three windows of 0.5 s or more

# Each rank's node is its own (NODE_NAME, as a pod's downward API would give it), so the end
# block can say which host the culprit was on.
SCRIPT = (
    textwrap.dedent(
        """
    import os, sys, time
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    os.environ["NODE_NAME"] = f"node-{rank}"
    from rankwatch.exporter import init

    dist.init_process_group("gloo")
    rw = init(interval_seconds=0.5, gather_timeout_seconds=20.0, warmup_steps=2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def batches():  # the same number of steps on every rank (DDP's all-reduce needs both)
        for _ in range(STEPS):
            if rank == SLOW_RANK:
                time.sleep(0.04)
            yield torch.randn(8, 16), torch.randn(8, 1)

    for x, y in rw.watch(model, opt, batches()):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    attempt = rw.config.attempt
    rw.close(5.0)
    dist.barrier()
    dist.destroy_process_group()
    print(f"ATTEMPT {rank} {attempt}", flush=True)
    # Attempt 0 fails after its run, as a job does when a node misbehaves: it is requeued.
    sys.exit(1 if os.environ["SLURM_RESTART_COUNT"] == "0" else 0)
    """
    )
    .replace("SLOW_RANK", str(SLOW_RANK))
    .replace("STEPS", str(STEPS))
)


def launch(script: Path, artifacts: Path, restarts: int) -> subprocess.CompletedProcess[str]:
    """One start of the job: torchrun on two ranks, in the environment a Slurm requeue gives."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANKWATCH_", "DEEPEP_", "TORCHELASTIC_", "SLURM_", "OTEL_"))
    }
    env.update(
        SLURM_JOB_ID=JOB_ID,
        SLURM_JOB_NAME=JOB_NAME,
        SLURM_RESTART_COUNT=str(restarts),
        RANKWATCH_ARTIFACT_DIR=str(artifacts),
        RANKWATCH_METRICS_PORT="0",
        OMP_NUM_THREADS="1",
    )
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(script),
    ]
    return subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=90, cwd=script.parent, check=False
    )


def test_attempt_1_of_a_requeued_job_sees_what_attempt_0_found(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    artifacts = tmp_path / "artifacts"
    first = launch(script, artifacts, 0)
    assert first.returncode != 0 and "ATTEMPT 0 0" in first.stdout, first.stderr[-4000:]
    assert f"rankwatch: run {RUN} ended" in first.stderr, first.stderr[-4000:]  # as before
    done = launch(script, artifacts, 1)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    assert "ATTEMPT 0 1" in done.stdout and "ATTEMPT 1 1" in done.stdout, log[-4000:]
    # Attempt 0 wrote its summary; attempt 1 kept it and wrote its own.
    names = sorted(p.name for p in artifacts.iterdir() if p.name.startswith("summary"))
    assert names == [
        "summary-attempt-0.json",
        "summary-attempt-0.txt",
        "summary.json",
        "summary.txt",
    ], names
    before = json.loads((artifacts / "summary-attempt-0.json").read_text())
    after = json.loads((artifacts / "summary.json").read_text())
    assert (before["run"]["run_id"], before["run"]["attempt"]) == (RUN, 0)
    assert (after["run"]["run_id"], after["run"]["attempt"]) == (RUN, 1)
    # The end block of attempt 1: same run, its attempt, and what attempt 0 found.
    assert f"rankwatch: run {RUN} attempt 1 ended" in done.stderr, log[-6000:]
    line = next(ln for ln in done.stderr.splitlines() if ln.strip().startswith("attempt 1: "))
    assert line.strip().startswith(
        f"attempt 1: rank {SLOW_RANK} on node-{SLOW_RANK} was the culprit (step_time_straggler)"
        " in attempt 0"
    ), line
    assert "the same rank on the same host again in this attempt" in line, line

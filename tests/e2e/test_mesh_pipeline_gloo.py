"""A hand-written 2-stage pipeline x 2-way data parallel job on a real 4-rank Gloo world.

Stage 0 does three times the work of stage 1 by design. Every wait at a collective (the
pipeline's send/recv, the data-parallel gradient all-reduce) is timed with ``rw.sync_wait()``.
Every rank passes its data-parallel submesh of ``init_device_mesh("cpu", (2, 2),
mesh_dim_names=("pp", "dp"))`` to ``watch(mesh=...)``, which reads the root mesh. With it the
unequal stages open no straggler; a rank made slow
(rank 3: stage 1, replica dp 1) is named with its mesh position. The same rows diagnosed
without the mesh name a stage-0 rank instead: what the mesh is for.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.framework_world import Recorder, run_world

pytestmark = pytest.mark.multiproc

WORLD = 4
MESH = {"pp": 2, "dp": 2}
PHASE_STEPS = 60  # control steps, then as many with rank 3 slow
WINDOW = 20  # sync_step and live window
STAGE_WORK_S = (0.015, 0.005)  # per pass: stage 0 three times stage 1
FAULT_RANK, FAULT_S = 3, 0.02


def scenario(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """One rank of the job (torchrun's environment: Gloo initialised here)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return _train(rank)
    finally:
        dist.destroy_process_group()


def _train(rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from rankwatch.diagnosis.config import DiagnosisConfig, StepTimeConfig
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.step_time.device_mesh import model_mesh
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    stage = rank // 2  # row-major over {"pp": 2, "dp": 2}
    world_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    my_dp = world_mesh["dp"].get_group()
    # A model whose parameter is a DTensor on the dp submesh: its root mesh is the world mesh.
    part = torch.nn.Linear(4, 4)
    part.weight = torch.nn.Parameter(
        distribute_tensor(part.weight.data, world_mesh["dp"], [Replicate()])
    )
    found = model_mesh(part, range(WORLD))
    result: dict[str, Any] = {"model_mesh": None if found is None else found.to_dict()}
    rec = Recorder()
    cfg = RankwatchConfig.from_env(
        env={},
        diagnosis=DiagnosisConfig(step_time=StepTimeConfig(live_window_steps=WINDOW)),
        async_mode=False,
        sync_step=WINDOW,
        gather_timeout_seconds=60.0,
    )
    rw = RankWatch(config=cfg, publishers=[rec])
    rw.watch(mesh=world_mesh["dp"])
    work = STAGE_WORK_S[stage]
    act, grad = torch.zeros(64), torch.zeros(64)
    for step in range(2 * PHASE_STEPS):
        slow = FAULT_S if rank == FAULT_RANK and step >= PHASE_STEPS else 0.0
        with rw.step():
            with rw.phase("input_wait"):
                pass
            with rw.phase("forward"):
                if stage == 1:
                    with rw.sync_wait():
                        dist.recv(act, rank - 2)
                time.sleep(work + slow)
                if stage == 0:
                    with rw.sync_wait():
                        dist.send(act, rank + 2)
            with rw.phase("backward"):
                if stage == 0:
                    with rw.sync_wait():
                        dist.recv(grad, rank + 2)
                time.sleep(work)
                if stage == 1:
                    with rw.sync_wait():
                        dist.send(grad, rank - 2)
                with rw.sync_wait():
                    dist.all_reduce(grad, group=my_dp)
            with rw.phase("optimizer"):
                pass
        rw.collect()
    rw.close(60.0)
    timer = rw.timer
    assert timer is not None
    rows = timer.ring[: timer.written].tolist()
    result["rows"] = [[None if math.isnan(v) else v for v in r] for r in rows]
    result["reports"] = rec.reports
    return result


def test_unequal_stages_open_no_straggler_and_a_slow_rank_is_named_with_its_position(
    tmp_path: Path,
) -> None:
    from rankwatch.diagnosis.step_time import diagnose_arrays
    from rankwatch.diagnosis.step_time.mesh import MeshLayout

    res = run_world(f"{__name__}:scenario", WORLD, tmp_path)
    world_mesh = {"dim_names": ["pp", "dp"], "shape": [2, 2], "ranks": [0, 1, 2, 3]}
    assert all(res[r]["model_mesh"] == world_mesh for r in range(WORLD))
    reports = res[0]["reports"]
    assert all(not res[r]["reports"] for r in (1, 2, 3))  # only the root publishes
    live = [r["step_time"] for r in reports if r["window_kind"] == "live"]
    assert live, reports
    # The warm-up: the first 5 steps of each rank were never shipped.
    assert min(st["step_range"][0] for st in live if st["step_range"]) == 5
    control = [st for st in live if st["step_range"] and st["step_range"][1] < PHASE_STEPS]
    faulty = [st for st in live if st["step_range"] and st["step_range"][0] >= PHASE_STEPS]
    assert control and faulty, [st["step_range"] for st in live]
    for st in control:
        assert st["mesh"] == world_mesh
        stragglers = [f for f in st["findings"] if f.get("culprit_rank") is not None]
        assert not stragglers, st["findings"]
    for st in faulty:
        top = st["findings"][0]
        assert top["culprit_rank"] == FAULT_RANK, st["findings"]
        assert top["culprit_position"] == "rank 3: pp 1, dp 1"
        assert top["compared_group"] == "pipeline stage 1 (ranks 2, 3)"
    # The same control rows without the mesh: the heavier stage looks like a straggler.
    per_rank = {
        r: np.array([[math.nan if v is None else v for v in row] for row in res[r]["rows"]])[
            20:PHASE_STEPS
        ]
        for r in range(WORLD)
    }
    plain = diagnose_arrays(per_rank, window=PHASE_STEPS)
    assert plain.findings[0].is_straggler and plain.findings[0].culprit_rank in (0, 1)
    meshed = diagnose_arrays(
        per_rank, window=PHASE_STEPS, mesh=MeshLayout.from_sizes(MESH, range(WORLD))
    )
    assert not any(f.is_straggler for f in meshed.findings), meshed.findings

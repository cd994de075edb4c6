"""A window saved with its mesh replays to the same mesh-aware report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rankwatch.diagnosis.step_time import diagnose_arrays
from rankwatch.diagnosis.step_time.artifact import ArtifactError, load_window, save_window
from rankwatch.diagnosis.step_time.mesh import MeshLayout
from rankwatch.diagnosis.step_time.table import column
from tests.diagnosis.step_time.test_step_time_outliers import rank_rows

PP_DP = MeshLayout.from_sizes({"pp": 2, "dp": 2}, [0, 1, 2, 3])


def _world() -> dict[int, np.ndarray]:
    world = {r: rank_rows() for r in range(4)}
    world[3][:, column("cpu", "forward")] += 20.0  # rank 3 slow on every step
    world[3][:, column("cpu", "step")] += 20.0
    world[2][:, column("cpu", "backward_wait")] += 20.0  # its stage peer waits for it
    world[2][:, column("cpu", "backward")] += 20.0
    world[2][:, column("cpu", "step")] += 20.0
    return world


def test_the_mesh_travels_with_the_window(tmp_path: Path) -> None:
    world = _world()
    live = diagnose_arrays(world, mesh=PP_DP)
    assert live.findings[0].culprit_position == "rank 3: pp 1, dp 1"
    path = save_window(tmp_path / "w.json", world, report=live, mesh=PP_DP)
    loaded = load_window(path)
    assert loaded.mesh == PP_DP
    assert loaded.diagnose().to_dict() == live.to_dict() == loaded.report


@pytest.mark.parametrize(
    ("mesh", "words"),
    [
        ({"dim_names": ["pp"], "shape": [2], "ranks": [0, 0]}, "mesh: field ranks: value 0"),
        ({"dim_names": ["dp"], "shape": [3], "ranks": [0, 1, 2]}, "does not hold rank 3"),
        ([0, 1], "mesh: field mesh"),
    ],
)
def test_a_bad_mesh_in_a_file_is_refused_naming_mesh(
    tmp_path: Path, mesh: object, words: str
) -> None:
    path = save_window(tmp_path / "w.json", _world())
    doc = json.loads(path.read_text())
    doc["mesh"] = mesh
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError) as info:
        load_window(path)
    assert words in str(info.value)

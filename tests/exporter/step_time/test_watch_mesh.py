"""``watch(mesh=...)``: the mesh argument read, checked against the group, handed to the root."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rankwatch.diagnosis.step_time.mesh import MeshLayout
from rankwatch.exporter.step_time.device_mesh import mesh_layout, model_mesh
from rankwatch.exporter.step_time.rank_watch import RankWatch
from tests.exporter.step_time.test_timer import single_config


def test_sizes_fill_the_group_s_ranks_row_major() -> None:
    layout = mesh_layout({"pp": 2, "dp": 2, "tp": 1}, (4, 5, 6, 7))
    assert layout == MeshLayout(("pp", "dp", "tp"), (2, 2, 1), (4, 5, 6, 7))
    assert layout.position_text(6) == "rank 6: pp 1, dp 0, tp 0"
    assert mesh_layout(None, (0, 1)) is None
    bigger = MeshLayout.from_sizes({"dp": 4}, range(4))
    assert mesh_layout(bigger, (1, 2)) is bigger  # a mesh may hold more than the group


@pytest.mark.parametrize(
    ("mesh", "error", "words"),
    [
        ({"pp": 2, "dp": 2}, ValueError, "holds 4 ranks, but the group has 2"),
        ({"pp": 0, "dp": 2}, ValueError, "size of 'pp'"),
        ({"pp": "2"}, ValueError, "size of 'pp'"),
        ({"": 2}, ValueError, "dim_names"),
        (MeshLayout(("dp",), (2,), (0, 5)), ValueError, "does not hold rank 1"),
        ([2, 2], TypeError, "expected a DeviceMesh"),
        ("pp", TypeError, "expected a DeviceMesh"),
    ],
)
def test_bad_meshes_are_refused_naming_mesh_and_the_value(
    mesh: Any, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match="watch: field mesh") as info:
        mesh_layout(mesh, (0, 1))
    assert words in str(info.value)


def test_a_model_without_dtensors_has_no_mesh() -> None:
    assert model_mesh(torch.nn.Linear(2, 2), (0,)) is None


def test_watch_hands_the_mesh_to_the_root_and_refuses_a_bad_one() -> None:
    rw = RankWatch(config=single_config())
    try:
        with pytest.raises(ValueError, match="watch: field mesh"):
            rw.watch(mesh={"pp": 2})  # a group of one rank
        with pytest.raises(TypeError, match="watch: field mesh"):
            rw.watch(mesh=3)
        rw.watch(torch.nn.Linear(2, 2), mesh={"pp": 1})
        assert rw._aggregator is not None
        assert rw._aggregator.mesh == MeshLayout(("pp",), (1,), (0,))
    finally:
        rw.close(5.0)
    off = RankWatch(config=single_config(enabled=False))
    assert off.watch(mesh={"pp": 2}) is None  # a rank that does not time ignores it

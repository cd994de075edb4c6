"""The mesh layout and the straggler rule per comparison group (pure, no torch)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwatch.diagnosis.step_time import diagnose_arrays, diagnose_means
from rankwatch.diagnosis.step_time.mesh import MeshLayout

PP_DP = MeshLayout.from_sizes({"pp": 2, "dp": 2}, [0, 1, 2, 3])  # stage 0: ranks 0, 1


def test_layout_reads_like_device_mesh_row_major() -> None:
    mesh = MeshLayout.from_sizes({"pp": 2, "dp": 2, "tp": 2}, list(range(8)))
    assert mesh.shape == (2, 2, 2) and mesh.pipeline_dim == 0
    assert mesh.coordinates(5) == (1, 0, 1)
    assert mesh.position_text(5) == "rank 5: pp 1, dp 0, tp 1"
    groups = mesh.comparison_groups()
    assert [(g.stage, g.ranks) for g in groups] == [(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))]
    assert groups[1].text == "pipeline stage 1 (ranks 4, 5, 6, 7)"
    assert mesh.pipeline_replica(5) == (1, 5)
    assert mesh.replica_text(5) == "pipeline replica dp 0, tp 1 (ranks 1, 5)"
    nested = MeshLayout.from_nested(("pp", "dp", "tp"), np.arange(8).reshape(2, 2, 2))
    assert nested == mesh
    assert MeshLayout.from_dict(mesh.to_dict()) == mesh


def test_pipeline_is_also_a_pipeline_dimension_and_no_pipeline_is_one_group() -> None:
    mesh = MeshLayout.from_nested(["dp", "pipeline"], [[4, 6], [5, 7]])
    assert [g.ranks for g in mesh.comparison_groups()] == [(4, 5), (6, 7)]
    flat = MeshLayout.from_nested(["dp", "tp"], [[0, 1], [2, 3]])
    (group,) = flat.comparison_groups()
    assert group.stage is None and group.ranks == (0, 1, 2, 3)
    assert group.text == "all ranks (ranks 0, 1, 2, 3)"


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: MeshLayout((), (), ()), "dim_names"),
        (lambda: MeshLayout(("dp", "dp"), (1, 2), (0, 1)), "repeats"),
        (lambda: MeshLayout(("",), (1,), (0,)), "dim_names"),
        (lambda: MeshLayout(("dp",), (2,), (0, 0)), "value 0 appears more than once"),
        (lambda: MeshLayout(("dp",), (3,), (0, 1)), "do not fill the shape"),
        (lambda: MeshLayout(("dp",), (0,), ()), "field shape"),
        (lambda: MeshLayout(("dp",), (2,), (0, -1)), "negative"),
        (lambda: MeshLayout(("dp",), (2,), (0, True)), "field ranks: value True"),
        (lambda: MeshLayout.from_nested(("dp", "tp"), [0, 1]), "1 dimension(s)"),
        (lambda: MeshLayout.from_nested(("dp",), [0, 1.5]), "value 1.5"),
        (lambda: MeshLayout.from_nested("dp", [0, 1]), "dim_names"),
        (lambda: MeshLayout.from_sizes({"pp": 0}, []), "size of 'pp'"),
        (lambda: MeshLayout.from_sizes({"pp": 2, "dp": 2}, [0, 1]), "holds 4 ranks"),
        (lambda: MeshLayout.from_sizes({}, [0]), "field mesh"),
        (lambda: MeshLayout.from_dict({"dim_names": ["dp"]}), "field mesh"),
        (lambda: PP_DP.coordinates(9), "field rank: value 9"),
    ],
)
def test_bad_layouts_are_refused_by_name(build: Any, words: str) -> None:
    with pytest.raises(ValueError, match="field") as info:
        build()
    assert words in str(info.value)


def sync_means(work_ms: dict[int, float]) -> dict[int, dict[str, float]]:
    """Ranks coupled through collectives every step: each step lasts as long as the slowest
    rank's work, and every other rank waits out the difference (timed as a sync wait)."""
    step = max(work_ms.values()) + 10.0
    return {
        r: {
            "input_wait": 1.0,
            "h2d": 0.0,
            "forward": 10.0,
            "backward": step - 15.0,
            "optimizer": 5.0,
            "step": step,
            "forward_wait": 0.0,
            "backward_wait": step - w,
        }
        for r, w in work_ms.items()
    }


def test_unequal_pipeline_stages_by_design_are_no_straggler_with_the_mesh() -> None:
    means = sync_means({0: 60.0, 1: 60.0, 2: 30.0, 3: 30.0})  # stage 0 does twice the work
    without = diagnose_means(means, steps=100)
    assert without.findings[0].is_straggler and without.straggler is not None
    assert without.straggler.culprit_rank == 0  # the heavier stage looks late
    with_mesh = diagnose_means(means, steps=100, mesh=PP_DP)
    assert not any(f.is_straggler for f in with_mesh.findings), with_mesh.findings
    ev = with_mesh.straggler
    assert ev is not None and ev.score == 0.0
    assert ev.compared_group == "pipeline stage 0 (ranks 0, 1)"  # ties: the lowest stage
    assert with_mesh.to_dict()["mesh"] == PP_DP.to_dict()


def test_a_slow_rank_is_named_in_its_stage_with_its_position() -> None:
    # Rank 1 (stage 0, replica dp 1) does 20 ms more: every rank waits for it, in the pipeline
    # (stage 1 waits on its activations) or at the gradient all-reduce (its dp peer).
    means = sync_means({0: 60.0, 1: 80.0, 2: 30.0, 3: 30.0})
    report = diagnose_means(means, steps=100, mesh=PP_DP)
    top = report.findings[0]
    assert top.is_straggler and top.culprit_rank == 1 and top.victim_rank == 0
    assert top.score == pytest.approx(20.0 / 91.0)
    assert top.culprit_position == "rank 1: pp 0, dp 1"
    assert top.compared_group == "pipeline stage 0 (ranks 0, 1)"
    assert top.compared_ranks == (0, 1) and top.slow_group == ""
    d = top.to_dict()
    assert d["culprit_position"] == "rank 1: pp 0, dp 1" and d["compared_ranks"] == [0, 1]


def test_a_whole_slow_pipeline_replica_is_named_as_a_group() -> None:
    # Replica dp 1 (ranks 1 and 3) is slow at every stage: each stage names its member.
    means = sync_means({0: 60.0, 1: 80.0, 2: 30.0, 3: 50.0})
    report = diagnose_means(means, steps=100, mesh=PP_DP)
    top = report.findings[0]
    assert top.is_straggler and top.culprit_rank == 1  # equal scores: the lowest stage
    assert top.slow_group == "pipeline replica dp 1 (ranks 1, 3)"
    assert top.slow_group_ranks == (1, 3)
    # One stage only slow: no group.
    one = diagnose_means(sync_means({0: 60.0, 1: 80.0, 2: 30.0, 3: 30.0}), steps=100, mesh=PP_DP)
    assert one.findings[0].slow_group == ""


def test_tp_x_dp_without_a_pipeline_is_today_s_rule() -> None:
    means = sync_means({0: 50.0, 1: 50.0, 2: 50.0, 3: 70.0})
    mesh = MeshLayout.from_sizes({"dp": 2, "tp": 2}, [0, 1, 2, 3])
    plain, meshed = diagnose_means(means, steps=100), diagnose_means(means, steps=100, mesh=mesh)
    a, b = plain.findings[0], meshed.findings[0]
    assert (a.kind, a.culprit_rank, a.victim_rank, a.score) == (
        b.kind,
        b.culprit_rank,
        b.victim_rank,
        b.score,
    )
    assert b.culprit_position == "rank 3: dp 1, tp 1"
    assert "compared_group" not in a.to_dict()  # no mesh: the keys of before


def test_mesh_must_be_a_layout_holding_every_rank_of_the_window() -> None:
    means = sync_means({0: 50.0, 1: 50.0, 5: 50.0})
    with pytest.raises(ValueError, match=r"field mesh: .*rank 5"):
        diagnose_means(means, steps=10, mesh=MeshLayout.from_sizes({"dp": 2}, [0, 1]))
    with pytest.raises(ValueError, match="field mesh: value of type dict"):
        diagnose_means(means, steps=10, mesh={"dp": 3})
    with pytest.raises(ValueError, match="field mesh"):
        diagnose_arrays({0: None}, mesh="pp")


def test_a_pipeline_alone_has_nothing_to_compare() -> None:
    mesh = MeshLayout.from_sizes({"pp": 4}, [0, 1, 2, 3])
    report = diagnose_means(sync_means({0: 80.0, 1: 30.0, 2: 30.0, 3: 30.0}), steps=100, mesh=mesh)
    assert report.straggler is None
    assert not any(f.is_straggler for f in report.findings)


def test_tp_x_pp_x_dp_names_a_slow_tp_rank_against_its_stage() -> None:
    mesh = MeshLayout.from_sizes({"pp": 2, "dp": 2, "tp": 2}, list(range(8)))
    work = {r: (60.0 if r < 4 else 30.0) for r in range(8)}  # stage 0 heavier by design
    quiet = diagnose_means(sync_means(work), steps=100, mesh=mesh)
    assert not any(f.is_straggler for f in quiet.findings)
    work[6] += 20.0  # pp 1, dp 1, tp 0: its TP peer (7) and replicas (4, 5) wait for it
    report = diagnose_means(sync_means(work), steps=100, mesh=mesh)
    top = report.findings[0]
    assert top.is_straggler and top.culprit_rank == 6
    assert top.culprit_position == "rank 6: pp 1, dp 1, tp 0"
    assert top.compared_group == "pipeline stage 1 (ranks 4, 5, 6, 7)"
    assert top.slow_group == ""
    # Replica dp 1, tp 0 slow at both stages (ranks 2 and 6): named as the replica.
    work[2] += 20.0
    both = diagnose_means(sync_means(work), steps=100, mesh=mesh).findings[0]
    assert both.slow_group == "pipeline replica dp 1, tp 0 (ranks 2, 6)"


@settings(max_examples=100, deadline=None)
@given(
    work=st.lists(st.floats(10.0, 500.0), min_size=4, max_size=4),
    extra=st.floats(0.0, 300.0),
    layout=st.sampled_from([{"dp": 4}, {"dp": 2, "tp": 2}, {"tp": 4}]),
)
def test_a_mesh_without_a_pipeline_never_moves_the_verdict(
    work: list[float], extra: float, layout: dict[str, int]
) -> None:
    means = sync_means(dict(enumerate(work)))
    means[1]["input_wait"] += extra
    mesh = MeshLayout.from_sizes(layout, range(4))
    a = diagnose_means(means, steps=50).findings
    b = diagnose_means(means, steps=50, mesh=mesh).findings
    assert [(f.kind, f.severity, f.culprit_rank, f.victim_rank, f.score) for f in a] == [
        (f.kind, f.severity, f.culprit_rank, f.victim_rank, f.score) for f in b
    ]


@settings(max_examples=100, deadline=None)
@given(work=st.lists(st.floats(10.0, 500.0), min_size=8, max_size=8))
def test_with_a_pipeline_the_culprit_is_always_in_the_group_compared(work: list[float]) -> None:
    mesh = MeshLayout.from_sizes({"pp": 2, "dp": 2, "tp": 2}, range(8))
    report = diagnose_means(sync_means(dict(enumerate(work))), steps=50, mesh=mesh)
    ev = report.straggler
    assert ev is not None
    assert ev.culprit_rank in ev.compared_ranks and ev.victim_rank in ev.compared_ranks
    assert ev.compared_ranks in {g.ranks for g in mesh.comparison_groups()}
    assert ev.culprit_position.startswith(f"rank {ev.culprit_rank}: pp ")

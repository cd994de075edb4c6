"""Who hung: a stalled rank or a silent source is a hang suspect; an idle window is nothing;
a one-node group without counters is on DeepEP's intranode path, which records none."""

from __future__ import annotations

import numpy as np
import pytest

from rankwatch.diagnosis.config import NormalConfig
from rankwatch.diagnosis.deepep.normal import (
    InvalidWindowError,
    NormalDiagnoser,
    NormalSimulator,
    NormalWindow,
    find_stall,
)
from rankwatch.diagnosis.deepep.normal.schema import internode_ranks_per_node
from rankwatch.diagnosis.vocabulary import HANG_SUSPECT

from .normal_support import make_window


def _hung(ep: int = 16, rank: int = 9, seed: int = 0) -> NormalWindow:
    return NormalSimulator(ep, 8, seed=seed, hang_rank=rank).window("rank_hang")


@pytest.mark.parametrize("ep", [16, 32, 64])
def test_the_simulated_hang_names_the_rank_and_where_it_stopped(ep):
    rank = ep - 3
    report = NormalDiagnoser().diagnose(_hung(ep, rank))
    hang = report.incidents[0]
    assert hang.cls == HANG_SUSPECT and hang.severity == "critical"
    assert hang.ranks == (rank,)
    assert hang.evidence["stalled_ranks"] == [rank]
    assert hang.evidence["stage"] == "notify_dispatch" and hang.probes == ("notify_dispatch",)
    # The peers' launches are the evidence that the group went on without it.
    launches = hang.evidence["launches"]["notify_dispatch"]
    assert launches[rank] == 0 and min(c for r, c in enumerate(launches) if r != rank) > 0
    # Nobody received from the hung rank either: a silent source of every Completion probe.
    assert set(hang.evidence["silent_sources"]) == {
        "dispatch_final",
        "dispatch_rdma_recv",
        "combine_logical_recv",
    }


def test_healthy_windows_name_no_one():
    sim = NormalSimulator(32, 8, seed=4)
    diagnoser = NormalDiagnoser()
    for phase in ("baseline", "single_hca_pressure", "hot_expert", "pre_dispatch_delay"):
        window = sim.window(phase)
        assert find_stall(window) is None
        assert HANG_SUSPECT not in {i.cls for i in diagnoser.diagnose(window).incidents}


def test_an_idle_window_is_rejected_as_empty_not_a_hang():
    sim = NormalSimulator(16, 8, seed=1)
    first = sim.advance("baseline")
    same = type(first)(first.counters.copy(), sequence=first.sequence + 1, taken_at_s=2.0)
    with pytest.raises(InvalidWindowError) as info:
        NormalWindow.from_snapshots(first, same, 8)
    assert info.value.reason == "empty_window"


def test_a_hang_between_snapshots_is_found_in_the_first_window():
    sim = NormalSimulator(16, 8, seed=2, hang_rank=5)
    diagnoser = NormalDiagnoser()
    prev = sim.zero_snapshot()
    classes = []
    for phase in ("baseline", "baseline", "rank_hang"):
        cur = sim.advance(phase)
        report = diagnoser.diagnose(NormalWindow.from_snapshots(prev, cur, 8))
        classes.append([(i.cls, i.ranks) for i in report.incidents if i.cls == HANG_SUSPECT])
        prev = cur
    assert classes == [[], [], [(HANG_SUSPECT, (5,))]]


def test_a_source_nobody_receives_from_is_named_with_the_probe():
    # Rank 3 still finishes its Notify launches but its dispatch tokens stopped arriving.
    samples = np.full((16, 16), 64.0)
    samples[3, :] = 0.0
    window = make_window(samples={"dispatch_final": samples})
    finding = find_stall(window)
    assert finding is not None
    assert finding.stalled_ranks == ()
    assert finding.silent_sources == {"dispatch_final": (3,)}
    assert finding.stage == "dispatch_final" and finding.ranks == (3,)


def test_too_little_peer_progress_names_no_one():
    window = _hung()
    low = NormalConfig(hang_min_progress=10**9)
    assert find_stall(window, low) is None
    assert find_stall(window, NormalConfig()) is not None


def test_bad_inputs_are_refused_naming_them():
    with pytest.raises(TypeError, match="window: expected a NormalWindow"):
        find_stall("nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hang_rank"):
        NormalSimulator(16, 8, hang_rank=16)
    with pytest.raises(ValueError, match="RANKWATCH_NORMAL_HANG_MIN_PROGRESS"):
        NormalConfig.from_env({"RANKWATCH_NORMAL_HANG_MIN_PROGRESS": "0"})


def test_the_finding_is_json_ready():
    import json

    finding = find_stall(_hung())
    assert finding is not None
    json.dumps(finding.to_dict(), allow_nan=False)


# --- one node: no counters is not idleness -------------------------------------------------------


def test_a_one_node_group_whose_counters_never_moved_is_on_the_intranode_path():
    zero = NormalSimulator(8, 8, seed=0, slow_rank=1).zero_snapshot()
    later = type(zero)(zero.counters.copy(), sequence=1, taken_at_s=5.0)
    with pytest.raises(InvalidWindowError) as info:
        NormalWindow.from_snapshots(zero, later, 8)
    assert info.value.reason == "intranode_path"
    assert "no normal-mode counters on the intranode path" in str(info.value)
    with pytest.raises(InvalidWindowError) as first:
        NormalWindow.from_snapshots(None, zero, 8)
    assert first.value.reason == "intranode_path"


def test_a_one_node_group_that_had_counts_and_pauses_is_idle():
    sim = NormalSimulator(8, 8, seed=0, slow_rank=1)
    moved = sim.advance("baseline")
    same = type(moved)(moved.counters.copy(), sequence=moved.sequence + 1, taken_at_s=9.0)
    with pytest.raises(InvalidWindowError) as info:
        NormalWindow.from_snapshots(moved, same, 8)
    assert info.value.reason == "empty_window"


@pytest.mark.parametrize(
    ("ep", "rpn", "want"),
    [(4, None, None), (8, 4, None), (16, None, 8), (144, 8, 8), (160, None, 8)],
)
def test_deepep_fixes_8_gpus_per_node_for_internode_groups(ep, rpn, want):
    assert internode_ranks_per_node(ep, rpn) == want


@pytest.mark.parametrize(
    ("ep", "rpn", "match"),
    [
        (12, None, r"multiples of 8 ranks up to 160 .*, got 12"),
        (168, None, r"multiples of 8 ranks up to 160 .*, got 168"),
        (40, None, r"up to 160 \(16, 24, 32, 48, 64, 96, 128, 144, 160\), got 40"),
        (16, 4, "fixes 8 GPUs per NVLink domain, got 4 for EP size 16"),
        (0, None, "ep_size: must be a positive int, got 0"),
        (True, None, "ep_size: must be a positive int, got True"),
    ],
)
def test_ep_sizes_the_internode_kernels_cannot_run_are_refused(ep, rpn, match):
    with pytest.raises(ValueError, match=match):
        internode_ranks_per_node(ep, rpn)

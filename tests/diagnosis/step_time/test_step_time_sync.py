"""Rankwatch's extension of the straggler policy: the wait at the synchronisation points.

Means in ms. A normal rank: input wait 5, forward 40, backward 50, optimizer 5, step 100. The
ranks that wait for a late rank wait where the job synchronises: in forward under DDP's buffer
broadcast (BatchNorm), at the end of backward for the gradient reduction. The seed's visible
``backward`` sees the second only; the sync wait sees both.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from rankwatch.diagnosis.step_time import ROW_WIDTH, diagnose_arrays, diagnose_means
from rankwatch.diagnosis.step_time.table import BASE_WIDTH, EXTRA_COLUMNS, column

Means = dict[str, float | None]


def rank(**kw: float | None) -> Means:
    out: Means = {
        "input_wait": 5.0,
        "forward": 40.0,
        "backward": 50.0,
        "optimizer": 5.0,
        "step": 100.0,
        "forward_wait": 0.0,
        "backward_wait": 5.0,
    }
    out.update(kw)
    return out


def seed_only(m: Means) -> Means:
    return {k: v for k, v in m.items() if k not in ("forward_wait", "backward_wait")}


def input_straggler_with_buffers() -> dict[int, Means | None]:
    """Rank 0 fetches 30 ms late; the others wait 30 ms in the buffer broadcast (forward)."""
    victim = rank(forward=70.0, forward_wait=30.0, step=130.0)
    culprit = rank(input_wait=35.0)
    return {0: culprit, 1: victim, 2: dict(victim)}


def backward_straggler() -> dict[int, Means | None]:
    """Rank 2's backward computes 30 ms longer; the others wait 30 ms more for the reduction."""
    victim = rank(backward_wait=35.0)
    culprit = rank(backward_wait=5.0)  # same backward: 45 compute + 5 wait vs 15 + 35
    return {0: victim, 1: dict(victim), 2: culprit}


def test_buffer_broadcast_wait_names_the_input_straggler() -> None:
    means = input_straggler_with_buffers()
    seed = diagnose_means({r: seed_only(m) for r, m in means.items() if m}, steps=100)
    assert seed.visible_definition == "backward"
    assert not seed.findings[0].is_straggler  # the seed cannot see a wait in forward
    r = diagnose_means(means, steps=100)
    assert r.visible_definition == "sync_wait"
    top = r.findings[0]
    assert (top.kind, top.culprit_rank, top.severity) == ("INPUT_STRAGGLER", 0, "critical")
    assert top.score == pytest.approx(30.0 / 135.0)
    assert r.straggler is not None and r.straggler.visible_definition == "sync_wait"
    assert r.rank_means[1]["visible"] == 35.0 and r.rank_means[0]["visible"] == 5.0


@pytest.mark.parametrize("n", [4, 8])
def test_buffer_broadcast_wait_with_more_ranks(n: int) -> None:
    victim = rank(forward=70.0, forward_wait=30.0, step=130.0)
    means: dict[int, Means | None] = {r: dict(victim) for r in range(n)}
    means[0] = rank(input_wait=35.0)
    r = diagnose_means(means, steps=100)
    top = r.findings[0]
    assert (top.kind, top.culprit_rank) == ("INPUT_STRAGGLER", 0)
    # The seed's visible backward is equal everywhere: no straggler is named.
    seed = diagnose_means({k: seed_only(m) for k, m in means.items() if m}, steps=100)
    assert not any(f.is_straggler for f in seed.findings)


def test_backward_straggler_is_a_compute_straggler() -> None:
    means = backward_straggler()
    seed = diagnose_means({r: seed_only(m) for r, m in means.items() if m}, steps=100)
    assert seed.straggler is not None and seed.straggler.score == 0.0
    r = diagnose_means(means, steps=100)
    top = r.findings[0]
    assert (top.kind, top.culprit_rank) == ("COMPUTE_STRAGGLER", 2)
    assert top.component_excesses_ms["compute"] == pytest.approx(30.0)
    assert top.component_coverage["compute"] == pytest.approx(1.0)


def test_seed_definitions_stay_the_fallback() -> None:
    means = backward_straggler()
    means[1] = seed_only(means[1] or {})  # one rank without the waits: seed definition
    assert diagnose_means(means, steps=100).visible_definition == "backward"
    fsdp = diagnose_means(means, steps=100, strategy="fsdp")
    assert fsdp.visible_definition == "forward+backward"


def fsdp_compute_straggler() -> dict[int, Means | None]:
    """FSDP: rank 2's forward computes 30 ms longer; the others wait 30 ms for it in the next
    collective (an all-gather or reduce-scatter inside forward or backward)."""
    victim = rank(backward=80.0, backward_wait=35.0, step=130.0)
    culprit = rank(forward=70.0, step=130.0)
    return {0: victim, 1: dict(victim), 2: culprit}


def test_fsdp_compute_straggler_is_seen_in_the_waits_not_in_forward_plus_backward() -> None:
    means = fsdp_compute_straggler()
    # The seed's FSDP visible value holds the culprit's extra compute and the victims' wait
    # alike: 110 ms on every rank, no straggler.
    seed = diagnose_means(
        {r: seed_only(m) for r, m in means.items() if m}, steps=100, strategy="fsdp"
    )
    assert seed.visible_definition == "forward+backward"
    assert not seed.findings[0].is_straggler
    r = diagnose_means(means, steps=100, strategy="fsdp")
    assert r.visible_definition == "sync_wait"
    top = r.findings[0]
    # Named from the waits; compute is never attributed under FSDP, and FSDP caps at warning.
    assert (top.kind, top.culprit_rank, top.severity) == ("STRAGGLER", 2, "warning")
    assert top.component_excesses_ms["compute"] == 0.0
    assert r.straggler is not None and r.straggler.score == pytest.approx(30.0 / 135.0)


def test_unmeasured_input_wait_still_names_the_culprit_with_sync_waits() -> None:
    # A prefetching loader: the training thread's wait for its batch is not timed.
    means = {r: {**m, "input_wait": None} for r, m in input_straggler_with_buffers().items() if m}
    means[0]["step"] = 135.0  # the unseen wait is in the culprit's step
    r = diagnose_means(means, steps=100)
    top = r.findings[0]
    assert (top.kind, top.culprit_rank) == ("STRAGGLER", 0)
    assert "input" not in top.component_excesses_ms
    assert "input_wait" in top.missing_signals


ASYNC_COL = BASE_WIDTH + EXTRA_COLUMNS.index("async_collectives")


def rows(
    n: int, forward_wait: float, backward_wait: float, gpu: bool = False, gpu_waits: bool = False
) -> np.ndarray:
    arr = np.full((n, ROW_WIDTH), math.nan)
    arr[:, 0] = np.arange(n)
    for clock in ("cpu", "gpu") if gpu else ("cpu",):
        for s, v in (
            ("input_wait", 5.0),
            ("h2d", 1.0),
            ("forward", 40.0),
            ("backward", 50.0),
            ("optimizer", 5.0),
            ("step", 100.0),
        ):
            arr[:, column(clock, s)] = v
    for clock in ("cpu", "gpu") if gpu_waits else ("cpu",):
        arr[:, column(clock, "forward_wait")] = forward_wait
        arr[:, column(clock, "backward_wait")] = backward_wait
    return arr


def test_row_layout_appends_the_extra_columns_once() -> None:
    assert EXTRA_COLUMNS == (
        "cpu.forward_wait",
        "cpu.backward_wait",
        "gpu.forward_wait",
        "gpu.backward_wait",
        "async_collectives",
    )
    assert BASE_WIDTH + len(EXTRA_COLUMNS) == ROW_WIDTH
    waits = [column(c, s) for c in ("cpu", "gpu") for s in ("forward_wait", "backward_wait")]
    assert waits == list(range(BASE_WIDTH, ROW_WIDTH - 1)) and ASYNC_COL == ROW_WIDTH - 1


def test_sync_waits_from_arrays_on_either_clock() -> None:
    per_rank = {0: rows(30, 0.0, 5.0), 1: rows(30, 30.0, 5.0), 2: rows(30, 30.0, 5.0)}
    r = diagnose_arrays(per_rank, window=30)
    assert r.visible_definition == "sync_wait" and r.straggler is not None
    assert r.straggler.culprit_rank == 0
    # A wait missing on one aligned step is not a measurement: the seed definition applies.
    per_rank[1][3, column("cpu", "backward_wait")] = math.nan
    assert diagnose_arrays(per_rank, window=30).visible_definition == "backward"
    # On the GPU clock the CPU waits are not comparable: without the GPU clock's own waits the
    # seed definition applies.
    gpu = {r: rows(30, 0.0 if r == 0 else 30.0, 5.0, gpu=True) for r in range(3)}
    g = diagnose_arrays(gpu, window=30)
    assert g.clock == "gpu" and g.visible_definition == "backward"
    # With them (every rank, every aligned step), the sync-wait definition on the GPU clock.
    gpu = {r: rows(30, 0.0 if r == 0 else 30.0, 5.0, gpu=True, gpu_waits=True) for r in range(3)}
    g = diagnose_arrays(gpu, window=30)
    assert g.clock == "gpu" and g.visible_definition == "sync_wait"
    assert g.straggler is not None and g.straggler.culprit_rank == 0
    assert g.rank_means[1]["forward_wait"] == 30.0
    # A step whose device wait could not be timed (graph capture, no event left): fallback.
    gpu[2][7, column("gpu", "forward_wait")] = math.nan
    g = diagnose_arrays(gpu, window=30)
    assert g.clock == "gpu" and g.visible_definition == "backward"


def test_gpu_waits_never_pick_the_clock() -> None:
    # GPU waits without the GPU clock's phases: the window is a CPU one, with its own waits.
    per_rank = {r: rows(30, 0.0 if r == 0 else 30.0, 5.0) for r in range(3)}
    for arr in per_rank.values():
        arr[:, column("gpu", "forward_wait")] = 99.0
    r = diagnose_arrays(per_rank, window=30)
    assert r.clock == "cpu" and r.rank_means[1]["forward_wait"] == 30.0


def test_gpu_clock_of_async_collectives_uses_the_device_waits() -> None:
    # NCCL-style ranks (the CPU clock blind) with the waits timed on the compute stream.
    per_rank = {
        r: rows(30, 0.0 if r == 0 else 30.0, 5.0, gpu=True, gpu_waits=True) for r in range(3)
    }
    for arr in per_rank.values():
        arr[:, ASYNC_COL] = 1.0
    r = diagnose_arrays(per_rank, window=30)
    assert r.clock == "gpu" and r.visible_definition == "sync_wait"
    assert r.straggler is not None and r.straggler.culprit_rank == 0


def test_cpu_clock_of_host_async_collectives_abstains() -> None:
    per_rank = {r: rows(30, 0.0 if r == 0 else 30.0, 5.0) for r in range(3)}
    per_rank[1][:, ASYNC_COL] = 1.0  # rank 1's collectives do not block its host
    r = diagnose_arrays(per_rank, window=30)
    assert r.straggler is None and r.visible_definition == "none"
    assert not any(f.is_straggler for f in r.findings)
    incomplete = [f for f in r.findings if f.kind == "INCOMPLETE_DATA"]
    assert incomplete and "gpu_timing" in incomplete[0].missing_signals
    assert incomplete[0].ranks == (0, 1, 2)


def test_compute_bound_gate_ignores_h2d_on_the_cpu_clock() -> None:
    means = {r: rank(input_wait=0.0, h2d=10.0, forward=45.0, backward=45.0, optimizer=0.0)
             for r in range(3)}  # fmt: skip
    cpu = diagnose_means(means, steps=100, clock="cpu")
    assert cpu.kind == "COMPUTE_BOUND"
    gpu = diagnose_means(means, steps=100, clock="gpu")
    assert gpu.kind == "H2D_BOUND"
    assert "COMPUTE_BOUND" not in [f.kind for f in gpu.findings]


def test_zero_forward_is_no_compute_excess() -> None:
    # The victim's forward is 0 (not a measurement of compute): no compute excess.
    means = {r: seed_only(rank(forward=0.0)) for r in range(3)}
    means[0] = seed_only(rank(forward=30.0, backward=20.0))
    ev = diagnose_means(means, steps=100).straggler
    assert ev is not None and ev.culprit_rank == 0
    assert ev.component_excesses_ms["compute"] == 0.0 and ev.component != "compute"


def test_a_saved_window_keeps_the_sync_waits_and_the_flag(tmp_path: Any) -> None:
    from rankwatch.diagnosis.step_time.artifact import load_window, save_window

    per_rank = {r: rows(30, 0.0 if r == 0 else 30.0, 5.0) for r in range(3)}
    live = diagnose_arrays(per_rank, window=30)
    path = save_window(tmp_path / "w.json", per_rank, window=30)
    assert load_window(path).diagnose() == live and live.visible_definition == "sync_wait"
    per_rank[2][:, ASYNC_COL] = 1.0
    path = save_window(tmp_path / "f.json", per_rank, window=30)
    assert load_window(path).diagnose().visible_definition == "none"


def test_row_dictionaries_carry_each_clocks_waits() -> None:
    from rankwatch.diagnosis.step_time import diagnose_steps
    from rankwatch.diagnosis.step_time.row_dicts import rows_to_array

    arrays = {r: rows(30, 0.0 if r == 0 else 30.0, 5.0, gpu=True, gpu_waits=True) for r in range(3)}
    names = ("input_wait", "h2d", "forward", "backward", "optimizer", "step")
    per_rank = {
        r: [
            {
                "step_id": int(row[0]),
                **{
                    clock: {
                        s: float(row[column(clock, s)])
                        for s in (*names, "forward_wait", "backward_wait")
                    }
                    for clock in ("cpu", "gpu")
                },
            }
            for row in arr
        ]
        for r, arr in arrays.items()
    }
    np.testing.assert_array_equal(rows_to_array(per_rank[1], rank=1), arrays[1])
    r = diagnose_steps(per_rank, window=30)
    assert r == diagnose_arrays(arrays, window=30)
    assert r.clock == "gpu" and r.visible_definition == "sync_wait"
    per_rank[2][4]["gpu"]["backward_wait"] = -1.0
    with pytest.raises(ValueError, match=r"rank 2: row 4 \(step_id 4\): field gpu.backward_wait"):
        diagnose_steps(per_rank, window=30)
    per_rank[2][4]["gpu"]["backward_wait"] = 1.0
    per_rank[2][4]["gpu"]["idle_wait"] = 1.0
    with pytest.raises(ValueError, match=r"field gpu.idle_wait: unknown signal"):
        diagnose_steps(per_rank, window=30)

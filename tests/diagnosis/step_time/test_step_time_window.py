"""Rows and arrays in: conversion, alignment, clock selection, window means, bad input."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from rankwatch.diagnosis.config import StepTimeConfig
from rankwatch.diagnosis.step_time import (
    ROW_WIDTH,
    SIGNALS,
    diagnose_arrays,
    diagnose_means,
    diagnose_steps,
    rows_to_array,
)
from rankwatch.diagnosis.step_time.table import column, reduce_window

PHASES = {"input_wait": 5.0, "h2d": 1.0, "forward": 40.0, "backward": 50.0, "optimizer": 4.0}


def clock_values(**changes: float | None) -> dict[str, float | None]:
    out: dict[str, float | None] = dict(PHASES)
    out["step"] = 95.0
    out.update(changes)
    return {k: v for k, v in out.items() if v is not None}


def rows(
    steps: range | list[int],
    *,
    cpu: dict[str, float | None] | None = None,
    gpu: dict[str, float | None] | bool | None = True,
) -> list[dict[str, Any]]:
    """Rows with the same values every step; ``gpu=True`` copies the CPU values."""
    c = clock_values() if cpu is None else cpu
    out = []
    for s in steps:
        row: dict[str, Any] = {"step_id": s, "cpu": dict(c)}
        if gpu is True:
            row["gpu"] = dict(c)
        elif isinstance(gpu, dict):
            row["gpu"] = dict(gpu)
        out.append(row)
    return out


def late_cpu(gap: float) -> dict[str, float | None]:
    return clock_values(input_wait=5.0 + gap, backward=50.0 - gap, step=95.0 - gap)


# --- rows_to_array -------------------------------------------------------------------------


def test_rows_to_array_layout() -> None:
    arr = rows_to_array(
        [
            {"step_id": 3, "cpu": {"forward": 1.5, "step": 4.0}, "gpu": {"h2d": 0.0}},
            {"step_id": 4, "cpu": {"forward": 2.5, "input_wait": None}},
        ]
    )
    assert arr.shape == (2, ROW_WIDTH) and arr.dtype == np.float64
    assert arr[0, 0] == 3 and arr[1, 0] == 4
    assert arr[0, column("cpu", "forward")] == 1.5
    assert arr[0, column("cpu", "step")] == 4.0
    assert arr[0, column("gpu", "h2d")] == 0.0  # a measured zero stays zero
    assert math.isnan(arr[0, column("gpu", "step")])
    assert np.isnan(arr[1, 7:]).all()
    assert math.isnan(arr[1, column("cpu", "input_wait")])


def test_column_order_is_step_id_cpu_then_gpu_in_signal_order() -> None:
    assert [column("cpu", s) for s in SIGNALS] == list(range(1, 7))
    assert [column("gpu", s) for s in SIGNALS] == list(range(7, 13))


def test_fast_and_careful_readers_agree() -> None:
    plain = rows(range(5))
    odd = [dict(r, cpu={**r["cpu"]}) for r in plain]
    odd[2]["gpu"] = None  # forces the mixed reader
    a, b = rows_to_array(plain), rows_to_array(odd)
    assert np.array_equal(a[[0, 1, 3, 4]], b[[0, 1, 3, 4]], equal_nan=True)
    assert np.isnan(b[2, 7:]).all()


def test_layouts_mix_across_ranks() -> None:
    per_rank = {
        0: rows(range(4)),
        1: rows(range(4), gpu=None),
        2: [{"step_id": s, "gpu": clock_values()} for s in range(4)],
        3: [{"step_id": s} for s in range(4)],
    }
    r = diagnose_steps(per_rank)
    assert r.clock == "cpu"
    assert r.missing_signals[3] == SIGNALS
    assert r.missing_signals.get(0) is None and r.missing_signals.get(1) is None
    assert r.missing_signals[2] == SIGNALS  # its CPU clock was never timed
    assert r.rank_means[1]["forward"] == 40.0


# --- alignment and windows -----------------------------------------------------------------


def test_alignment_on_common_step_ids() -> None:
    per_rank = {0: rows(range(0, 50)), 1: rows(range(10, 60)), 2: rows(range(5, 45))}
    r = diagnose_steps(per_rank)
    assert r.steps == 35 and r.step_range == (10, 44)


def test_window_keeps_the_last_steps() -> None:
    per_rank = {0: rows(range(150)), 1: rows(range(150))}
    assert diagnose_steps(per_rank, window=100).step_range == (50, 149)
    assert diagnose_steps(per_rank, window=1000).steps == 150


def test_live_and_summary_windows_share_the_policy() -> None:
    cfg = StepTimeConfig()
    # Early steps balanced, the last 100 with an input straggler on rank 1.
    per_rank = {0: rows(range(300)), 2: rows(range(300))}
    per_rank[1] = rows(range(200)) + rows(range(200, 300), cpu=late_cpu(30.0), gpu=True)
    live = diagnose_steps(per_rank, window=cfg.live_window_steps)
    summary = diagnose_steps(per_rank, window=cfg.summary_window_steps)
    assert live.kind == "INPUT_STRAGGLER" and live.severity == "critical"
    assert live.straggler is not None and live.straggler.score == pytest.approx(0.30)
    assert summary.steps == 300
    assert summary.straggler is not None and summary.straggler.score == pytest.approx(0.10)
    assert summary.kind == "INPUT_STRAGGLER" and summary.severity == "warning"


def test_unsorted_rows_are_aligned_by_step_id() -> None:
    a = rows(range(30))
    b = list(reversed(rows(range(30))))
    b[0]["cpu"]["forward"] = b[0]["gpu"]["forward"] = 100.0  # step 29
    r = diagnose_steps({0: a, 1: b}, window=1)
    assert r.step_range == (29, 29)
    assert r.rank_means[1]["forward"] == 100.0


@pytest.mark.parametrize(
    ("n_steps", "kind"), [(0, "INCOMPLETE_DATA"), (1, "WARMUP"), (2, "BALANCED")]
)
def test_warmup_from_rows(n_steps: int, kind: str) -> None:
    # No rows at all: both ranks are missing, which is incomplete data rather than warm-up.
    c = clock_values(forward=34.0)
    r = diagnose_steps({0: rows(range(n_steps), cpu=c), 1: rows(range(n_steps), cpu=c)})
    assert r.kind == kind and r.steps == n_steps


def test_disjoint_ranks_have_no_aligned_steps() -> None:
    r = diagnose_steps({0: rows(range(10)), 1: rows(range(20, 30))})
    assert r.kind == "WARMUP" and r.steps == 0 and r.step_range is None


@pytest.mark.parametrize(("n_steps", "severity"), [(19, "warning"), (20, "critical")])
def test_critical_needs_twenty_aligned_steps(n_steps: int, severity: str) -> None:
    per_rank = {0: rows(range(n_steps)), 1: rows(range(n_steps), cpu=late_cpu(25.0))}
    per_rank[2] = rows(range(n_steps))
    assert diagnose_steps(per_rank).severity == severity


# --- clock selection -----------------------------------------------------------------------


def test_gpu_clock_when_everything_is_gpu_timed() -> None:
    r = diagnose_steps({0: rows(range(5)), 1: rows(range(5))})
    assert r.clock == "gpu"


def test_cpu_clock_when_one_step_lacks_gpu_step_time() -> None:
    per_rank = {0: rows(range(5)), 1: rows(range(5))}
    del per_rank[1][3]["gpu"]["step"]
    assert diagnose_steps(per_rank).clock == "cpu"


def test_cpu_clock_when_gpu_lacks_input_wait() -> None:
    per_rank = {0: rows(range(5), gpu=clock_values(input_wait=None)), 1: rows(range(5))}
    assert diagnose_steps(per_rank).clock == "cpu"


def test_cpu_clock_when_a_present_phase_lacks_gpu_timing() -> None:
    per_rank = {0: rows(range(5)), 1: rows(range(5))}
    del per_rank[0][0]["gpu"]["optimizer"]
    assert diagnose_steps(per_rank).clock == "cpu"


def test_gpu_clock_when_a_phase_is_absent_on_both_clocks() -> None:
    c = clock_values(optimizer=None)
    r = diagnose_steps({0: rows(range(5), cpu=c), 1: rows(range(5), cpu=c)})
    assert r.clock == "gpu"
    assert r.rank_means[0]["optimizer"] is None


def test_clock_values_come_from_the_selected_clock() -> None:
    gpu = clock_values(forward=30.0)
    r = diagnose_steps({0: rows(range(5), gpu=gpu), 1: rows(range(5), gpu=gpu)})
    assert r.clock == "gpu" and r.rank_means[0]["forward"] == 30.0
    r = diagnose_steps({0: rows(range(5), gpu=None), 1: rows(range(5), gpu=gpu)})
    assert r.clock == "cpu" and r.rank_means[1]["forward"] == 40.0


def test_a_missing_rank_does_not_force_the_cpu_clock() -> None:
    r = diagnose_steps({0: rows(range(5)), 1: rows(range(5)), 2: []})
    assert r.clock == "gpu" and r.missing_ranks == (2,)


# --- window means --------------------------------------------------------------------------


def test_every_step_signals_need_every_step() -> None:
    per_rank = {0: rows(range(4), gpu=None), 1: rows(range(4), gpu=None)}
    del per_rank[1][2]["cpu"]["forward"]
    r = diagnose_steps(per_rank)
    assert r.clock == "cpu"
    assert r.rank_means[1]["forward"] is None
    assert r.rank_means[1]["residual"] is None
    assert r.missing_signals[1] == ("forward",)


def test_any_step_signals_count_missing_steps_as_zero() -> None:
    c = clock_values(optimizer=None, h2d=None)
    per_rank = {0: rows(range(4), cpu=c, gpu=None), 1: rows(range(4), cpu=c, gpu=None)}
    per_rank[0][0]["cpu"]["optimizer"] = 8.0  # one optimizer step in four
    per_rank[0][1]["cpu"]["h2d"] = 0.0  # a measured zero
    r = diagnose_steps(per_rank)
    assert r.rank_means[0]["optimizer"] == 2.0
    assert r.rank_means[0]["h2d"] == 0.0
    assert r.rank_means[1]["optimizer"] is None and r.rank_means[1]["h2d"] is None
    assert r.missing_signals[1] == ("h2d", "optimizer")


def test_residual_is_clamped_per_step_then_averaged() -> None:
    c1 = clock_values(step=80.0)  # phases 95 > step: residual 0 on these steps
    c2 = clock_values(step=115.0)  # residual 20
    per_rank = {
        0: rows([0, 2], cpu=c1, gpu=None) + rows([1, 3], cpu=c2, gpu=None),
        1: rows(range(4), gpu=None),
    }
    r = diagnose_steps(per_rank)
    assert r.rank_means[0]["residual"] == pytest.approx(10.0)
    assert r.rank_means[0]["step"] == pytest.approx(97.5)


def test_rows_and_means_give_the_same_report() -> None:
    per_rank = {r: rows(range(64), gpu=None) for r in range(4)}
    per_rank[2] = rows(range(64), cpu=late_cpu(18.0), gpu=None)
    from_rows = diagnose_steps(per_rank, strategy="ddp")
    means = {r: clock_values() for r in range(4)}
    means[2] = late_cpu(18.0)
    from_means = diagnose_means(means, steps=64, strategy="ddp", clock="cpu")
    a, b = from_rows.to_dict(), from_means.to_dict()
    assert a.pop("step_range") == [0, 63] and b.pop("step_range") is None
    assert a == b


def test_arrays_and_rows_give_the_same_report() -> None:
    per_rank = {r: rows(range(40)) for r in range(5)}
    per_rank[3] = rows(range(40), cpu=late_cpu(12.0))
    arrays = {r: rows_to_array(v) for r, v in per_rank.items()}
    assert diagnose_arrays(arrays).to_dict() == diagnose_steps(per_rank).to_dict()


def test_arrays_none_and_empty_mean_missing() -> None:
    arrays: dict[int, Any] = {0: rows_to_array(rows(range(5))), 1: None}
    arrays[2] = np.empty((0, ROW_WIDTH))
    arrays[3] = rows_to_array(rows(range(5)))
    r = diagnose_arrays(arrays)
    assert r.missing_ranks == (1, 2)
    assert r.ranks == (0, 1, 2, 3)


def test_reduce_window_exposes_means() -> None:
    wm = reduce_window({0: rows_to_array(rows(range(3)))}, window=2)
    assert wm.steps == 2 and wm.clock == "gpu" and wm.step_range == (1, 2)
    assert wm.means[0, SIGNALS.index("forward")] == 40.0


# --- bad input -----------------------------------------------------------------------------


def _bad_rows(field: str, value: object, clock: str = "cpu") -> dict[int, list[dict[str, Any]]]:
    per_rank = {0: rows(range(3)), 3: rows(range(3))}
    per_rank[3][1][clock][field] = value
    return per_rank


@pytest.mark.parametrize(
    ("value", "what"),
    [
        (-1.0, "negative"),
        (-0.001, "negative"),
        (math.nan, "not finite"),
        (math.inf, "not finite"),
        (-math.inf, "not finite"),
        ("fast", "not a number"),
        ([1.0], "not a number"),
    ],
)
@pytest.mark.parametrize("clock", ["cpu", "gpu"])
def test_bad_time_in_rows_names_rank_field_value(value: object, what: str, clock: str) -> None:
    with pytest.raises(ValueError) as info:
        diagnose_steps(_bad_rows("forward", value, clock))
    msg = str(info.value)
    assert "rank 3" in msg and f"{clock}.forward" in msg and repr(value) in msg and what in msg
    assert "step_id 1" in msg


def test_bad_time_in_a_partial_row() -> None:
    per_rank = {0: [{"step_id": 0, "cpu": {"step": 1.0}}, {"step_id": 1, "cpu": {"step": -2}}]}
    with pytest.raises(ValueError, match=r"rank 0: row 1 \(step_id 1\): field cpu.step: value -2"):
        diagnose_steps(per_rank)


def test_bad_time_in_means_names_rank_field_value() -> None:
    for value in (-1.0, math.nan, math.inf, "1", True):
        with pytest.raises(ValueError) as info:
            diagnose_means({0: {"step": 1.0}, 7: {"forward": value}}, steps=5)
        msg = str(info.value)
        assert "rank 7" in msg and "forward" in msg and repr(value) in msg


@pytest.mark.parametrize("value", [-1.0, math.inf])
def test_bad_time_in_arrays_names_rank_field_value(value: float) -> None:
    arr = rows_to_array(rows(range(3)))
    arr[2, column("gpu", "backward")] = value
    with pytest.raises(ValueError) as info:
        diagnose_arrays({0: rows_to_array(rows(range(3))), 5: arr})
    msg = str(info.value)
    assert "rank 5" in msg and "gpu.backward" in msg and repr(value) in msg


@pytest.mark.parametrize("step_id", [-1, 1.5, math.nan, "1", None, True])
def test_bad_step_id(step_id: object) -> None:
    per_rank = {0: rows(range(3)), 2: rows(range(3))}
    per_rank[2][1]["step_id"] = step_id
    with pytest.raises(ValueError, match=r"rank 2: .*step_id"):
        diagnose_steps(per_rank)


def test_duplicate_step_id() -> None:
    per_rank = {0: rows(range(3)), 4: rows([0, 1, 1])}
    with pytest.raises(ValueError, match=r"rank 4: field step_id: value 1 appears more than once"):
        diagnose_steps(per_rank)


@pytest.mark.parametrize("rank", ["0", 1.0, True, None, (1,)])
def test_rank_ids_must_be_ints(rank: object) -> None:
    with pytest.raises(ValueError, match=r"rank_id.*not an int"):
        diagnose_steps({rank: rows(range(3))})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"rank_id.*not an int"):
        diagnose_means({rank: {"step": 1.0}}, steps=3)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"rank_id.*not an int"):
        diagnose_arrays({rank: rows_to_array(rows(range(3)))})  # type: ignore[dict-item]


def test_numpy_int_rank_ids_are_fine() -> None:
    r = diagnose_steps({np.int64(1): rows(range(3)), np.int32(0): rows(range(3))})
    assert r.ranks == (0, 1) and all(type(x) is int for x in r.ranks)


def test_negative_rank_id() -> None:
    with pytest.raises(ValueError, match=r"rank -1: field rank_id: value -1 is negative"):
        diagnose_steps({-1: rows(range(3))})


@pytest.mark.parametrize(
    "empty",
    [{}],
)
def test_empty_input(empty: dict[int, Any]) -> None:
    for call in (
        lambda: diagnose_steps(empty),
        lambda: diagnose_arrays(empty),
        lambda: diagnose_means(empty, steps=3),
    ):
        with pytest.raises(ValueError, match="empty"):
            call()


@pytest.mark.parametrize("window", [0, -5, 1.5, "100", True, None])
def test_bad_window(window: object) -> None:
    with pytest.raises(ValueError, match=r"window.*" + repr(window).replace("(", r"\(")):
        diagnose_steps({0: rows(range(3))}, window=window)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window"):
        diagnose_arrays({0: rows_to_array(rows(range(3)))}, window=window)  # type: ignore[arg-type]


@pytest.mark.parametrize("steps", [-1, 2.0, True, None])
def test_bad_steps_for_means(steps: object) -> None:
    with pytest.raises(ValueError, match="steps"):
        diagnose_means({0: {"step": 1.0}}, steps=steps)  # type: ignore[arg-type]


def test_bad_clock_for_means() -> None:
    with pytest.raises(ValueError, match=r"clock.*'tpu'"):
        diagnose_means({0: {"step": 1.0}}, steps=3, clock="tpu")


def test_unknown_keys_are_named() -> None:
    with pytest.raises(ValueError, match=r"rank 1: field fwd: unknown signal"):
        diagnose_means({1: {"fwd": 1.0}}, steps=3)
    bad = {0: rows(range(3))}
    bad[0][1]["cpu"]["fwd"] = 1.0
    with pytest.raises(ValueError, match=r"rank 0: row 1 \(step_id 1\): field cpu.fwd"):
        diagnose_steps(bad)
    bad = {0: rows(range(3))}
    bad[0][2]["tpu"] = {}
    with pytest.raises(ValueError, match=r"rank 0: row 2 \(step_id 2\): field tpu: unknown key"):
        diagnose_steps(bad)


def test_rows_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match=r"rank 0: row 0: field row"):
        diagnose_steps({0: [[0, 1, 2]]})  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"rank 0: field rows"):
        diagnose_steps({0: "rows"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"rank 0: .*field cpu: value 3"):
        diagnose_steps({0: [{"step_id": 0, "cpu": 3}]})
    with pytest.raises(ValueError, match=r"rank 2: field rows: value has shape \(3, 5\)"):
        diagnose_arrays({2: np.zeros((3, 5))})


def test_strategy_checked_before_work() -> None:
    with pytest.raises(ValueError, match="strategy"):
        diagnose_steps({0: rows(range(3))}, strategy="megatron")
    with pytest.raises(ValueError, match="strategy"):
        diagnose_arrays({0: rows_to_array(rows(range(3)))}, strategy="megatron")


def test_gpu_clock_when_only_the_gpu_timed_a_phase() -> None:
    per_rank = {0: rows(range(5)), 1: rows(range(5))}
    del per_rank[1][2]["cpu"]["h2d"]  # the GPU clock has it: nothing is missing there
    r = diagnose_steps(per_rank)
    assert r.clock == "gpu" and r.rank_means[1]["h2d"] == 1.0


def test_rows_to_array_names_the_rank_when_given() -> None:
    bad = rows(range(2))
    bad[1]["gpu"]["step"] = -4
    with pytest.raises(ValueError, match=r"rank 9: row 1 \(step_id 1\): field gpu.step: value -4"):
        rows_to_array(bad, rank=9)
    with pytest.raises(ValueError, match=r"^row 1 \(step_id 1\): field gpu.step"):
        rows_to_array(bad)


def test_a_rank_id_given_twice_is_an_error() -> None:
    class Pairs(dict):  # a mapping whose keys collide once converted to int
        def items(self):  # type: ignore[override]
            return [(np.int64(2), rows(range(3))), (2, rows(range(3)))]

    with pytest.raises(ValueError, match=r"rank 2: field rank_id: value 2 is given more than once"):
        diagnose_steps(Pairs({2: []}))


@pytest.mark.parametrize(
    ("col", "value", "what"),
    [
        (0, math.nan, "is not a non-negative integer"),
        (0, -1.0, "is not a non-negative integer"),
        (0, 1.5, "is not a non-negative integer"),
        (0, math.inf, "is not a non-negative integer"),
        (4, -0.5, "is negative"),
        (4, math.inf, "is not finite"),
        (9, -math.inf, "is not finite"),
        (14, -2.0, "is negative"),
    ],
)
def test_bad_value_in_rank_arrays_names_rank_row_field(col: int, value: float, what: str) -> None:
    # Arrays go through the quick whole-table check first; a bad cell anywhere still gets
    # the careful check's message, naming the rank, the row and the field.
    good = np.full((5, ROW_WIDTH), np.nan)
    good[:, 0] = np.arange(5)
    good[:, 1:7] = 1.0
    bad = good.copy()
    bad[3, col] = value
    reduce_window({0: good, 2: good}, window=5)  # all-NaN columns are no error
    with pytest.raises(ValueError, match=what) as info:
        reduce_window({0: good, 2: bad}, window=5)
    assert str(info.value).startswith("rank 2: row 3")

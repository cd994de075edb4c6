"""Step-time window artifacts: save, load, validate, replay to the same report."""

from __future__ import annotations

import json
import math
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rankwatch.diagnosis.config import StepTimeConfig
from rankwatch.diagnosis.step_time import ROW_WIDTH, diagnose_arrays
from rankwatch.diagnosis.step_time.artifact import (
    FORMAT,
    VERSION,
    diagnose_file,
    example_window,
    is_step_time_artifact,
    load_window,
    main,
    save_window,
    window_from_dict,
    window_to_dict,
)
from rankwatch.diagnosis.step_time.table import column


def test_example_window_is_a_critical_input_straggler() -> None:
    ex = example_window()
    report = ex.diagnose()
    assert (report.kind, report.severity) == ("INPUT_STRAGGLER", "critical")
    assert report.clock == "gpu" and report.steps == 100
    assert report.findings[0].culprit_rank == 5


def test_round_trip_gives_the_same_report(tmp_path: Path) -> None:
    ex = example_window(ranks=6, steps=40, slow_rank=2, seed=3)
    per_rank: dict[int, Any] = dict(ex.per_rank)
    per_rank[6] = None  # an expected rank that sent nothing
    per_rank[1] = per_rank[1].copy()
    per_rank[1][::3, column("cpu", "optimizer")] = np.nan  # absent on some steps
    per_rank[1][:, column("gpu", "h2d")] = np.nan  # never timed on the GPU clock
    live = diagnose_arrays(per_rank, strategy="fsdp", window=30)
    path = save_window(
        tmp_path / "w.json",
        per_rank,
        strategy="fsdp",
        window=30,
        meta={"run": "r1", "window_index": 7},
        report=live,
    )
    loaded = load_window(path)
    assert loaded.strategy == "fsdp" and loaded.window == 30
    assert loaded.meta == {"run": "r1", "window_index": 7}
    assert loaded.report == json.loads(json.dumps(live.to_dict()))
    assert loaded.per_rank[6] is None
    for rank, arr in per_rank.items():
        if arr is not None:
            got = loaded.per_rank[rank]
            assert got is not None
            np.testing.assert_array_equal(got, arr)
    assert loaded.diagnose() == live
    assert diagnose_file(path) == live
    assert live.missing_ranks == (6,)


def test_saved_file_is_valid_json_readable_by_others(tmp_path: Path) -> None:
    ex = example_window(ranks=2, steps=3)
    path = save_window(tmp_path / "w.json", ex.per_rank, window=3)
    doc = json.loads(path.read_text())
    assert doc["format"] == FORMAT and doc["version"] == VERSION
    assert is_step_time_artifact(doc)
    assert set(doc["ranks"]) == {"0", "1"}
    assert doc["ranks"]["0"]["step_id"] == [0, 1, 2]
    assert set(doc["ranks"]["0"]["cpu"]) == {
        "input_wait",
        "h2d",
        "forward",
        "backward",
        "optimizer",
        "step",
    }
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert not list(tmp_path.glob(".w.json.*"))  # no temporary file left behind


def test_recorded_config_is_used_on_replay(tmp_path: Path) -> None:
    ex = example_window()
    strict = StepTimeConfig(straggler_critical_score=0.5)
    path = save_window(tmp_path / "w.json", ex.per_rank, strategy="ddp", config=strict)
    assert load_window(path).config == strict
    assert diagnose_file(path).severity == "warning"
    assert diagnose_file(path, config=StepTimeConfig()).severity == "critical"


def test_absent_signals_and_clocks_are_left_out() -> None:
    arr = np.full((2, ROW_WIDTH), np.nan)
    arr[:, 0] = [4, 5]
    arr[:, column("cpu", "step")] = [1.0, 2.0]
    arr[1, column("cpu", "forward")] = 0.0
    doc = window_to_dict({3: arr})
    assert doc["ranks"]["3"] == {
        "step_id": [4, 5],
        "cpu": {"forward": [None, 0.0], "step": [1.0, 2.0]},
    }
    back = window_from_dict(doc).per_rank[3]
    assert back is not None
    np.testing.assert_array_equal(back, arr)


def _doc() -> dict[str, Any]:
    return window_to_dict(example_window(ranks=2, steps=3).per_rank, window=3)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format="other"), r"format: value 'other'"),
        (
            lambda d: d.update(version=3),
            r"version: value 3 is not supported \(this reader knows 1, 2\)",
        ),
        (lambda d: d.update(version="1"), r"version: value '1' is not an int"),
        (lambda d: d.update(extra=1), r"extra: unknown key"),
        (lambda d: d.update(strategy="zero3"), r"strategy: value 'zero3'"),
        (lambda d: d.update(window=0), r"window: value 0"),
        (lambda d: d.update(ranks={}), r"ranks: value \{\}"),
        (lambda d: d["ranks"].update(x=None), r"ranks.x: rank id 'x' is not an int"),
        (lambda d: d["ranks"].update({"-1": None}), r"ranks.-1: rank id"),
        (lambda d: d["ranks"]["1"].update(tpu={}), r"ranks.1.tpu: unknown key"),
        (
            lambda d: d["ranks"]["1"]["cpu"].update(fwd=[1, 2, 3]),
            r"ranks.1.cpu.fwd: unknown signal",
        ),
        (
            lambda d: d["ranks"]["1"]["gpu"]["forward"].__setitem__(2, -1.5),
            r"ranks.1.gpu.forward\[2\]: value -1.5 is negative",
        ),
        (
            lambda d: d["ranks"]["1"]["gpu"]["forward"].__setitem__(0, "7"),
            r"ranks.1.gpu.forward\[0\]: value '7' is not a number",
        ),
        (
            lambda d: d["ranks"]["1"]["gpu"]["forward"].pop(),
            r"ranks.1.gpu.forward: has 2 values, step_id has 3",
        ),
        (
            lambda d: d["ranks"]["0"]["step_id"].__setitem__(1, 1.5),
            r"ranks.0.step_id\[1\]: value 1.5",
        ),
        (lambda d: d.update(config={"bogus": 1}), r"config.bogus: unknown StepTimeConfig field"),
        (
            lambda d: d.update(config={"straggler_warning_score": -1}),
            r"config: .*straggler_warning_score",
        ),
        (lambda d: d.update(meta=[1]), r"meta: value \[1\]"),
    ],
)
def test_invalid_artifacts_name_the_field(mutate: Any, message: str) -> None:
    doc = _doc()
    mutate(doc)
    with pytest.raises(ValueError, match=message):
        window_from_dict(doc)


def test_load_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.json: document: not valid JSON"):
        load_window(path)
    path.write_text(json.dumps({"format": FORMAT, "version": 9}))
    with pytest.raises(ValueError, match=r"bad.json: version: value 9"):
        load_window(path)


def test_save_rejects_bad_windows(tmp_path: Path) -> None:
    arr = np.zeros((2, ROW_WIDTH))
    arr[1, column("cpu", "step")] = -3.0
    with pytest.raises(ValueError, match=r"rank 4: row 1: field cpu.step: value -3.0"):
        save_window(tmp_path / "w.json", {4: arr})
    with pytest.raises(ValueError, match="strategy"):
        save_window(tmp_path / "w.json", {4: np.zeros((2, ROW_WIDTH))}, strategy="x")
    assert not list(tmp_path.iterdir())


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "example.json"
    assert main(["--example", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "INPUT_STRAGGLER" and out["findings"][0]["culprit_rank"] == 5
    assert main([str(path), "--strategy", "fsdp"]) == 0
    assert json.loads(capsys.readouterr().out)["severity"] == "warning"
    assert main([str(tmp_path / "missing.json")]) == 2
    assert "error:" in capsys.readouterr().err


def test_benchmark_module_rows() -> None:
    from bench.bench_step_time import run

    rows = run(sizes=(4,), steps=10, summary_steps=50)
    assert [r["name"] for r in rows] == [
        "step_time diagnose_steps, 4 ranks x 10 steps, from row dicts",
        "step_time diagnose_arrays, 4 ranks x 10 steps, from [n, ROW_WIDTH] arrays",
        "step_time diagnose_means, 4 ranks",
        "step_time read rows only, 4 ranks x 10 steps",
        "step_time bare read of the row dicts (no checks, floor), 4 ranks x 10 steps",
        "step_time diagnose_arrays, 8 ranks x 50 steps (summary)",
    ]
    for r in rows:
        assert set(r) == {"name", "target", "median", "spread", "unit", "baseline", "ratio"}
        assert r["median"] > 0 and r["unit"] == "ms"


def test_a_file_that_is_not_utf8_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"format": "caf\xe9"}')
    with pytest.raises(ValueError, match=r"latin1\.json: not UTF-8"):
        load_window(bad)


def test_scale_benchmark_runs_on_a_small_group() -> None:
    # The summary figure drives the aggregator's windows with the ranks' block records; a
    # change of the row layout or of the records must not leave it broken until the next run.
    from bench.bench_scale import summary_cost

    rows = summary_cost(ranks=8, steps=600)
    assert [r["name"].split(" (")[0] for r in rows] == [
        "summary window, 8 ranks x 600 steps, from the ranks' block records",
    ]
    assert all(r["median"] > 0 for r in rows)


@pytest.mark.slow
def test_aggregator_benchmark_runs_on_a_small_group() -> None:
    # The scale benchmark's harness (a simulated group over real sockets, the real aggregator,
    # the root's publishers, a scraper) and the code before's figures must keep running
    # between the long runs that write their figures.
    from bench.baseline import before_figures
    from bench.bench_aggregator import measure_size
    from bench.training_loop import Training

    training = Training()
    root = measure_size(16, 8, True, training, rounds=2, interval=0.5)
    rank = measure_size(16, 8, False, training, rounds=2, interval=0.5)
    assert root["connections"] == 2 and len(root["lost_ms"]) == 2
    assert all(0 < s < 60 for s in root["latency_s"]) and root["memory_mib"] > 0
    assert all(math.isfinite(x) for x in root["lost_ms"] + rank["lost_ms"] + root["scrape_ms"])
    before = before_figures((8,))
    assert set(before[8]) >= {"root_lost_ms", "rank_lost_ms", "latency_s", "memory_mib"}


def test_hot_path_benchmark_runs_in_small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # The per-step cost benchmark and its two floors (torch's no-op hooks, clock-only context
    # managers) must keep running between the long runs that write their figures.
    import bench.bench_hot_path as hot

    for name, value in (("REPEATS", 2), ("MARKS", 200), ("STEPS", 50), ("HOOK_STEPS", 40)):
        monkeypatch.setattr(hot, name, value)
    rows = hot.run()
    assert [r["name"].split(" per ")[0] for r in rows] == [
        "phase mark (enter + exit), CPU clock",
        "step bookkeeping (step, 5 phases, collect)",
        "watch() hooks",
        "step() + 5 phase()",
        "no-op hooks of the same kinds",
        "six context managers that only read the clock",
    ]
    assert all(math.isfinite(r["median"]) and r["baseline"] > 0 for r in rows)


def _with_gpu_waits(steps: int = 3) -> dict[int, Any]:
    per_rank: dict[int, Any] = {}
    for rank, arr in example_window(ranks=2, steps=steps).per_rank.items():
        assert arr is not None
        arr = arr.copy()
        for clock in ("cpu", "gpu"):
            arr[:, column(clock, "forward_wait")] = 1.0 + rank
            arr[:, column(clock, "backward_wait")] = 2.0 + rank
        per_rank[rank] = arr
    return per_rank


def test_version_2_carries_the_gpu_clocks_sync_waits(tmp_path: Path) -> None:
    per_rank = _with_gpu_waits()
    path = save_window(tmp_path / "w.json", per_rank, window=3)
    doc = json.loads(path.read_text())
    assert doc["version"] == VERSION == 2
    assert doc["ranks"]["1"]["gpu"]["backward_wait"] == [3.0, 3.0, 3.0]
    loaded = load_window(path)
    for rank, arr in per_rank.items():
        np.testing.assert_array_equal(loaded.per_rank[rank], arr)
    assert loaded.diagnose().visible_definition == "sync_wait"


def test_a_version_1_file_is_still_read_and_may_not_name_gpu_waits() -> None:
    doc = window_to_dict(_with_gpu_waits(), window=3)
    doc["version"] = 1
    for rank in doc["ranks"].values():
        del rank["gpu"]["forward_wait"], rank["gpu"]["backward_wait"]
    old = window_from_dict(doc)  # written before the GPU clock timed the waits
    got = old.per_rank[0]
    assert got is not None
    assert np.isnan(got[:, column("gpu", "forward_wait")]).all()
    assert (got[:, column("cpu", "forward_wait")] == 1.0).all()
    doc["ranks"]["0"]["gpu"]["forward_wait"] = [1.0, 1.0, 1.0]
    with pytest.raises(
        ValueError, match=r"ranks.0.gpu.forward_wait: unknown signal in a version 1 artifact"
    ):
        window_from_dict(doc)

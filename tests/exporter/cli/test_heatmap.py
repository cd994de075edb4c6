"""Heatmaps of saved windows: real PNGs drawn with matplotlib's Agg canvas, checked by pixels."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from rankwatch.diagnosis.deepep.artifact import ArtifactError, save_window_artifact
from rankwatch.diagnosis.deepep.normal import (
    SIMULATOR_PHASES,
    NormalDiagnoser,
    NormalSimulator,
    NormalWindow,
)
from rankwatch.exporter.cli.heatmap import (
    CHARTS,
    DOCS_DPI,
    chart_paths,
    figure_size_px,
    main,
    render_all,
    render_phase_gallery,
)
from tests.servers import REPO

# matplotlib renders every chart: seconds, not in `make test-fast`.
pytestmark = pytest.mark.slow

FLAG_RGB = np.array([214, 39, 40]) / 255.0  # the outline / late-rank colour


def _red_pixels(path: Path) -> int:
    img = imread(path)[..., :3]
    return int(np.count_nonzero(np.abs(img - FLAG_RGB).max(axis=-1) < 0.06))


@pytest.fixture(scope="module")
def phase_artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One diagnosed EP16 window per phase, after a bootstrapped history."""
    folder = tmp_path_factory.mktemp("artifacts")
    sim = NormalSimulator(ep_size=16, ranks_per_node=8, seed=3)
    diagnoser = NormalDiagnoser()
    for index in range(4):
        diagnoser.diagnose(sim.window("baseline", index))
    out = {}
    for offset, phase in enumerate(("baseline", "pre_dispatch_delay", "single_hca_pressure")):
        window = sim.window(phase, 4 + offset)
        report = diagnoser.diagnose(window)
        out[phase] = save_window_artifact(folder / f"{phase}.npz", window, report)
    return out


def test_render_all_writes_four_charts_of_a_stable_size(
    phase_artifacts: dict[str, Path], tmp_path: Path
) -> None:
    paths = render_all(phase_artifacts["baseline"], tmp_path)
    assert [p.name for p in paths] == [f"baseline-{c}.png" for c in CHARTS]
    assert paths == list(chart_paths(phase_artifacts["baseline"], tmp_path).values())
    for chart, path in zip(CHARTS, paths, strict=True):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width = imread(path).shape[:2]
        assert (width, height) == figure_size_px(chart, 16)
    # A baseline window flags nothing: no red anywhere.
    assert all(_red_pixels(p) == 0 for p in paths)


def test_rendering_is_deterministic(phase_artifacts: dict[str, Path], tmp_path: Path) -> None:
    one = render_all(phase_artifacts["single_hca_pressure"], tmp_path / "a", charts=["notify"])
    two = render_all(phase_artifacts["single_hca_pressure"], tmp_path / "b", charts=["notify"])
    assert one[0].read_bytes() == two[0].read_bytes()


def _empty_window(ep: int = 16, rpn: int = 8) -> NormalWindow:
    zeros = np.zeros(ep)
    zz = np.zeros((ep, ep))
    return NormalWindow(
        ep_size=ep,
        ranks_per_node=rpn,
        notify={p: (zeros, zeros) for p in ("notify_dispatch", "cached_notify_combine")},
        completion={p: (zz, zz, zz) for p in ("dispatch_final", "combine_logical_recv")},
        window_index=1,
    )


def test_all_zero_window_renders(tmp_path: Path) -> None:
    npz = save_window_artifact(tmp_path / "zero.npz", _empty_window())
    paths = render_all(npz)  # default output folder: the artifact's
    assert [p.parent for p in paths] == [tmp_path] * 4
    for chart, path in zip(CHARTS, paths, strict=True):
        height, width = imread(path).shape[:2]
        assert (width, height) == figure_size_px(chart, 16)


def test_sparse_window_renders(tmp_path: Path) -> None:
    ep = 8
    samples = np.zeros((ep, ep))
    cost = np.zeros((ep, ep))
    samples[1, 2], cost[1, 2] = 4.0, 4.0e5  # one positive cell: a flat colour range
    samples[3, 3] = 2.0  # samples but zero cost: masked on a log scale, still annotated
    count = np.zeros(ep)
    count[5] = 3.0  # a single rank launched: no peer median
    window = NormalWindow(
        ep_size=ep,
        ranks_per_node=4,
        notify={"notify_dispatch": (count * 1e4, count)},
        completion={"dispatch_rdma_recv": (cost, samples, samples * 7)},
    )
    diagnosis = {
        "ep_size": ep,
        "probes": {
            "dispatch_rdma_recv": {
                "status": "anomalous",
                "anomalies": [
                    {"scope": "edge", "src": 1, "dst": 2, "factor": 3.0},
                    {"scope": "block", "src": 99, "dst": 0},  # out of range: ignored
                    {"scope": "global", "factor": 1.5},
                ],
            }
        },
    }
    npz = save_window_artifact(tmp_path / "sparse.npz", window, diagnosis)
    paths = render_all(npz, tmp_path / "out", dpi=60)
    assert len(paths) == 4
    assert _red_pixels(paths[2]) > 20  # the one flagged edge is outlined
    height, width = imread(paths[2]).shape[:2]
    assert (width, height) == figure_size_px("dispatch_rdma_recv", ep, 60)


def test_large_group_renders_without_cell_labels(tmp_path: Path) -> None:
    sim = NormalSimulator(ep_size=64, ranks_per_node=8, seed=1)
    npz = save_window_artifact(tmp_path / "ep64.npz", sim.window("baseline", 0))
    paths = render_all(npz, tmp_path, dpi=40, charts=["combine_logical_recv", "notify"])
    assert [p.name for p in paths] == ["ep64-notify.png", "ep64-combine_logical_recv.png"]
    height, width = imread(paths[1]).shape[:2]
    assert (width, height) == figure_size_px("combine_logical_recv", 64, 40)


@pytest.fixture(scope="module")
def gallery(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The five phases' pictures, rendered once for the tests below."""
    paths = render_phase_gallery(tmp_path_factory.mktemp("gallery"))
    return {p.name: p for p in paths}


def test_phase_gallery_draws_every_phase(gallery: dict[str, Path]) -> None:
    expected = {f"deepep-{phase}-{chart}.png" for phase in SIMULATOR_PHASES for chart in CHARTS}
    assert set(gallery) == expected
    for name, path in gallery.items():
        chart = name.rsplit("-", 1)[1][: -len(".png")]
        height, width = imread(path).shape[:2]
        assert (width, height) == figure_size_px(chart, 16, DOCS_DPI)


def test_anomalous_phases_look_different_and_show_their_flags(gallery: dict[str, Path]) -> None:
    def img(phase: str, chart: str) -> np.ndarray:
        return imread(gallery[f"deepep-{phase}-{chart}.png"])

    def red(phase: str, chart: str) -> int:
        return _red_pixels(gallery[f"deepep-{phase}-{chart}.png"])

    # The baseline flags nothing: no red anywhere.
    assert all(red("baseline", chart) == 0 for chart in CHARTS)
    # Rank 9's late Notify bars are red; its Completion heatmaps stay clean.
    for phase in ("pre_dispatch_delay", "pre_combine_delay"):
        assert red(phase, "notify") > 20
        assert not np.array_equal(img(phase, "notify"), img("baseline", "notify"))
        assert all(red(phase, chart) == 0 for chart in CHARTS[1:])
    # All-HCA pressure is a global slowdown: different values, nothing outlined.
    # Single-HCA pressure outlines the rows / columns of ranks 0, 1, 8, 9, and their four RDMA
    # edges (EP16: one edge per sender, four cells rather than four rows).
    for chart in CHARTS[1:]:
        for phase in ("all_hca_pressure", "single_hca_pressure"):
            assert not np.array_equal(img(phase, chart), img("baseline", chart))
        assert red("all_hca_pressure", chart) == 0
        assert red("single_hca_pressure", chart) > (50 if chart == "dispatch_rdma_recv" else 100)
    assert red("single_hca_pressure", "notify") == 0


def test_docs_gallery_is_committed_for_every_phase_and_chart() -> None:
    for phase in SIMULATOR_PHASES:
        for chart in CHARTS:
            path = REPO / "docs" / "img" / f"deepep-{phase}-{chart}.png"
            assert path.is_file(), path
            height, width = imread(path).shape[:2]
            assert (width, height) == figure_size_px(chart, 16, DOCS_DPI)


# --- the command ---------------------------------------------------------------------------


def test_cli_all(
    phase_artifacts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    npz = phase_artifacts["pre_dispatch_delay"]
    assert main(["--all", str(npz), "--out", str(tmp_path), "--dpi", "40"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / f"pre_dispatch_delay-{c}.png") for c in CHARTS]
    assert all(Path(p).is_file() for p in printed)


def test_cli_single_chart(
    phase_artifacts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    npz = phase_artifacts["baseline"]
    assert main(["--chart", "dispatch_rdma_recv", str(npz), "--out", str(tmp_path)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["baseline-dispatch_rdma_recv.png"]
    assert capsys.readouterr().out.strip().endswith("baseline-dispatch_rdma_recv.png")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["x.npz"], "one of the arguments --all --chart is required"),
        (["--all", "--chart", "notify", "x.npz"], "not allowed with argument"),
        (["--chart", "bogus", "x.npz"], "invalid choice: 'bogus'"),
        (["--all"], "the following arguments are required: WINDOW.npz"),
        (["--all", "x.npz", "--dpi", "many"], "invalid int value: 'many'"),
    ],
)
def test_cli_bad_arguments(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_cli_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--all", str(tmp_path / "absent.npz")]) == 2
    assert "no such file" in capsys.readouterr().err
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"PK\x03\x04 not really")
    assert main(["--all", str(junk)]) == 2
    assert "rankwatch heatmap: error:" in capsys.readouterr().err
    npz = save_window_artifact(tmp_path / "w.npz", _empty_window())
    assert main(["--all", str(npz), "--dpi", "5"]) == 2
    assert "dpi: must be an int in 20..600, got 5" in capsys.readouterr().err
    assert list(tmp_path.glob("*.png")) == []


@pytest.mark.parametrize("out", ["a file", "/dev/null"])
def test_cli_an_unusable_out_folder_is_one_line_with_the_errno(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], out: str
) -> None:
    npz = save_window_artifact(tmp_path / "w.npz", _empty_window())
    folder = tmp_path / "taken" if out == "a file" else Path(out)
    if out == "a file":
        folder.write_text("mine")
    assert main(["--all", str(npz), "--out", str(folder), "--dpi", "20"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"rankwatch heatmap: error: --out {str(folder)!r}: ENOTDIR (exists and is not a folder) "
        f"writing {folder / 'w-notify.png'}"
    ]
    if out == "a file":
        assert folder.read_text() == "mine"


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "usage: rankwatch heatmap" in capsys.readouterr().out


# --- bad input to the functions -------------------------------------------------------------


def test_render_all_rejects_bad_input(tmp_path: Path) -> None:
    npz = save_window_artifact(tmp_path / "w.npz", _empty_window())
    with pytest.raises(TypeError, match="npz_path: expected a path, got NoneType"):
        render_all(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="out_dir: expected a path or None, got int"):
        render_all(npz, 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dpi: must be an int in 20\.\.600, got 1000"):
        render_all(npz, dpi=1000)
    with pytest.raises(ValueError, match=r"chart: must be one of .*got 'pie'"):
        render_all(npz, charts=["pie"])
    bad = tmp_path / "bad.npz"
    bad.write_text("x")
    with pytest.raises(ArtifactError, match="not an NPZ"):
        render_all(bad)
    assert list(tmp_path.glob("*.png")) == []
    with pytest.raises(ValueError, match="ep_size: must be a positive int, got 0"):
        figure_size_px("notify", 0)
    with pytest.raises(ValueError, match="chart: must be one of"):
        figure_size_px("bar", 16)
    with pytest.raises(ValueError, match="phases: unknown phase 'calm'"):
        render_phase_gallery(tmp_path, phases=["calm"])
    with pytest.raises(ValueError, match="baseline_windows: must be >= 0, got -1"):
        render_phase_gallery(tmp_path, baseline_windows=-1)


def test_importing_the_module_does_not_import_matplotlib() -> None:
    code = "import sys, rankwatch.exporter.cli.heatmap; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

"""Pictures of one saved DeepEP normal-mode window: a Notify chart and three Completion heatmaps.

``rankwatch heatmap --all WINDOW.npz [--out DIR]`` reads an artifact written by
:mod:`rankwatch.diagnosis.deepep.artifact` and writes four PNG files next to each other:

* ``<stem>-notify.png``: three panels, one per Notify probe: each rank's mean kernel duration,
  its peer median (the median of the other ranks), flagged late ranks in red with their ratio;
* ``<stem>-dispatch_final.png``, ``<stem>-dispatch_rdma_recv.png``,
  ``<stem>-combine_logical_recv.png``: cost per sample, ``[source, destination]``, on a log
  colour scale with each cell's value written in it (up to EP 32), node-block separators, and
  the cells, rows, columns and blocks the stored diagnosis flagged outlined in red.

Each picture has its own colour scale: compare windows by the written values, not by colour.
Cells without samples (and zero costs, which a log scale cannot show) are grey. Sizes depend
only on the EP size and the DPI, so pictures of the same group line up. matplotlib is imported
inside the functions, and only its Agg canvas is used: importing this module stays cheap and
never changes the process's plotting backend.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rankwatch.diagnosis.deepep.artifact import (
    ArtifactMeta,
    load_window_artifact,
    save_window_artifact,
)
from rankwatch.diagnosis.deepep.normal.schema import COMPLETION_PROBES, NOTIFY_PROBES
from rankwatch.diagnosis.deepep.normal.window import NormalWindow
from rankwatch.exporter.storage import atomic_write, ensure_folder, errno_name

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "ANNOTATE_MAX_EP",
    "CHARTS",
    "DEFAULT_DPI",
    "DOCS_DPI",
    "PictureNotWritten",
    "chart_paths",
    "figure_size_px",
    "main",
    "render_all",
    "render_phase_gallery",
]

CHARTS: tuple[str, ...] = ("notify", *COMPLETION_PROBES)
DEFAULT_DPI = 100
DOCS_DPI = 56
# Above this EP size cell values would be unreadable: they are left out.
ANNOTATE_MAX_EP = 32

_FLAG = "#d62728"
_BAR = "#4c72b0"
_MISSING = "#d9d9d9"
_AXIS_LABELS = {
    "dispatch_final": ("destination rank", "source rank"),
    "dispatch_rdma_recv": ("destination rank", "RDMA sender rank (same GPU index)"),
    "combine_logical_recv": ("destination rank", "source rank"),
}

# --- layout: every size in inches, multiples of 1/4 so that inches x DPI is exact ----------


def _quarter(x: float) -> float:
    return math.ceil(x * 4.0) / 4.0


def _heatmap_side_in(ep: int) -> float:
    return _quarter(min(max(0.5 * ep, 6.0), 24.0))


def _figure_size_in(chart: str, ep: int) -> tuple[float, float]:
    if chart == "notify":
        return _quarter(min(max(0.5 * ep + 2.0, 10.0), 24.0)), 9.5
    side = _heatmap_side_in(ep)
    return side + 2.75, side + 1.75


def _check_chart(chart: object) -> str:
    if chart not in CHARTS:
        raise ValueError(f"chart: must be one of {list(CHARTS)}, got {chart!r}")
    return str(chart)


def _check_dpi(dpi: object) -> int:
    if isinstance(dpi, bool) or not isinstance(dpi, int) or not 20 <= dpi <= 600:
        raise ValueError(f"dpi: must be an int in 20..600, got {dpi!r}")
    return dpi


def figure_size_px(chart: str, ep_size: int, dpi: int = DEFAULT_DPI) -> tuple[int, int]:
    """``(width, height)`` in pixels of ``chart`` for an EP group of ``ep_size`` ranks."""
    _check_chart(chart)
    _check_dpi(dpi)
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size: must be a positive int, got {ep_size!r}")
    w, h = _figure_size_in(chart, ep_size)
    return round(w * dpi), round(h * dpi)


def chart_paths(
    npz_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]
) -> dict[str, Path]:
    """Where each chart of ``npz_path`` goes: ``<out_dir>/<stem>-<chart>.png``."""
    stem = Path(npz_path).stem
    return {chart: Path(out_dir) / f"{stem}-{chart}.png" for chart in CHARTS}


# --- reading the stored diagnosis ----------------------------------------------------------


def _probe_verdict(diagnosis: Mapping[str, Any] | None, probe: str) -> Mapping[str, Any]:
    if not diagnosis:
        return {}
    probes = diagnosis.get("probes")
    if not isinstance(probes, Mapping):
        return {}
    verdict = probes.get(probe)
    return verdict if isinstance(verdict, Mapping) else {}


def _anomalies(verdict: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    items = verdict.get("anomalies")
    if not isinstance(items, list):
        return []
    return [a for a in items if isinstance(a, Mapping)]


def _index(value: object, size: int) -> int | None:
    # Diagnoses are read from files: ignore indices that do not fit this window.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
        return None
    return value


def _compact(value: float) -> str:
    """A cell label of at most 5 characters: 71.8k, 133k, 1.21M, 950."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            v = value / scale
            return f"{v:.3g}{suffix}" if v < 100 else f"{v:.0f}{suffix}"
    return f"{value:.3g}"


# --- drawing -------------------------------------------------------------------------------


def _new_figure(chart: str, ep: int, dpi: int) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    w, h = _figure_size_in(chart, ep)
    fig = Figure(figsize=(w, h), dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


class PictureNotWritten(OSError):
    """A chart could not be written (full disk, read-only or unusable folder...): the
    ``OSError`` it came from, with the picture's path as its file name."""


def _save(fig: Figure, path: Path) -> Path:
    # No bbox_inches="tight": the pixel size must not depend on the content. No software tag:
    # the same window gives the same bytes, whatever matplotlib version drew it.
    png = io.BytesIO()
    fig.savefig(png, format="png", metadata={"Software": None})
    try:
        # Atomic: a failed write leaves the earlier picture of that name, never half a PNG.
        ensure_folder(path.parent)
        return atomic_write(path, png.getvalue())
    except OSError as exc:
        raise PictureNotWritten(exc.errno, exc.strerror or str(exc), str(path)) from exc


def _node_ticks(ax: Axes, ep: int, rpn: int, axis: str) -> None:
    step = 1 if ep <= 32 else rpn if ep // rpn <= 32 else ep // 16
    ticks = np.arange(0, ep, step)
    if axis in ("x", "both"):
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks], fontsize=8)
    if axis in ("y", "both"):
        ax.set_yticks(ticks)
        ax.set_yticklabels([str(t) for t in ticks], fontsize=8)


def _draw_notify_panel(
    ax: Axes,
    probe: str,
    window: NormalWindow,
    meta: ArtifactMeta,
    verdict: Mapping[str, Any],
) -> None:
    ep, rpn = window.ep_size, window.ranks_per_node
    ranks = np.arange(ep)
    ax.set_xlim(-0.6, ep - 0.4)
    _node_ticks(ax, ep, rpn, "x")
    for k in range(1, ep // rpn):
        ax.axvline(k * rpn - 0.5, color="0.5", linestyle=":", linewidth=1)
    if probe not in window.notify:
        ax.set_title(f"{probe}: not measured in this window", fontsize=10, loc="left")
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center")
        ax.set_yticks([])
        return
    avg_us = window.notify_avg_ns(probe) / 1e3
    ratio = np.asarray(meta.derived.get(f"notify.{probe}.ratio", np.full(ep, np.nan)))
    with np.errstate(divide="ignore", invalid="ignore"):
        peer_us = np.where(np.isfinite(ratio) & (ratio > 0), avg_us / ratio, np.nan)
    flagged = np.zeros(ep, dtype=bool)
    for a in _anomalies(verdict):
        r = _index(a.get("src"), ep)
        if r is not None:
            flagged[r] = True
    valid = np.isfinite(avg_us)
    colors = np.where(flagged, _FLAG, _BAR)
    ax.bar(ranks[valid], avg_us[valid], width=0.8, color=colors[valid].tolist())
    ax.hlines(
        peer_us,
        ranks - 0.45,
        ranks + 0.45,
        colors="black",
        linestyles="--",
        linewidth=1.2,
        label="peer median",
    )
    if (~valid).any():
        ax.plot(ranks[~valid], np.zeros((~valid).sum()), "x", color="0.4", label="no launch")
    heights = np.concatenate([avg_us[valid], peer_us[np.isfinite(peer_us)]])
    top = float(heights.max()) if heights.size else 0.0
    ax.set_ylim(0, top * 1.3 if top > 0 else 1.0)
    for rank in np.flatnonzero(flagged & valid):
        label = f"ratio {ratio[rank]:.3f}" if np.isfinite(ratio[rank]) else "late"
        ax.annotate(
            label,
            (int(rank), float(avg_us[rank])),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
            color=_FLAG,
        )
    status = verdict.get("status", "no diagnosis stored")
    late = [str(r) for r in np.flatnonzero(flagged)]
    noun = "rank" if len(late) == 1 else "ranks"
    suffix = f"; late {noun} {', '.join(late)}" if late else ""
    ax.set_title(f"{probe}: {status}{suffix}", fontsize=10, loc="left")
    ax.set_ylabel("mean duration [µs]", fontsize=9)
    ax.tick_params(axis="y", labelsize=8)
    ax.legend(loc="upper right", fontsize=8, frameon=False)


def _render_notify(
    window: NormalWindow,
    meta: ArtifactMeta,
    diagnosis: Mapping[str, Any] | None,
    path: Path,
    dpi: int = DEFAULT_DPI,
) -> Path:
    """The three-panel Notify chart of one window."""
    ep = window.ep_size
    fig = _new_figure("notify", ep, dpi)
    w_in, h_in = _figure_size_in("notify", ep)
    # Inches: side margins, title band, panel height, gap for each panel's title.
    left, right, top, panel, gap = 0.9, 0.3, 0.75, 2.35, 0.55
    for i, probe in enumerate(NOTIFY_PROBES):
        y = h_in - top - (i + 1) * panel - i * gap
        ax = fig.add_axes(
            (left / w_in, y / h_in, (w_in - left - right) / w_in, panel / h_in),
        )
        _draw_notify_panel(ax, probe, window, meta, _probe_verdict(diagnosis, probe))
        if i == len(NOTIFY_PROBES) - 1:
            ax.set_xlabel("rank", fontsize=9)
    fig.suptitle(
        f"Notify mean kernel duration per rank: window {window.window_index}, EP {ep}",
        x=left / w_in,
        y=1 - 0.2 / h_in,
        ha="left",
        va="top",
        fontsize=11,
    )
    return _save(fig, path)


def _outline(ax: Axes, a: Mapping[str, Any], ep: int, rpn: int) -> bool:
    from matplotlib.patches import Rectangle

    scope = a.get("scope")
    src, dst = a.get("src"), a.get("dst")
    rect: tuple[float, float, float, float] | None = None  # x, y, width, height
    if scope in ("point", "edge"):
        s, d = _index(src, ep), _index(dst, ep)
        if s is not None and d is not None:
            rect = (d - 0.5, s - 0.5, 1, 1)
    elif scope in ("row", "src_gateway"):
        s = _index(src, ep)
        if s is not None:
            rect = (-0.5, s - 0.5, ep, 1)
    elif scope in ("column", "dst_gateway"):
        d = _index(dst, ep)
        if d is not None:
            rect = (d - 0.5, -0.5, 1, ep)
    elif scope == "block":
        s, d = _index(src, ep // rpn), _index(dst, ep // rpn)
        if s is not None and d is not None:
            rect = (d * rpn - 0.5, s * rpn - 0.5, rpn, rpn)
    if rect is None:
        return False
    x, y, w, h = rect
    ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor=_FLAG, linewidth=2.2, zorder=4))
    return True


def _render_completion(
    window: NormalWindow,
    probe: str,
    diagnosis: Mapping[str, Any] | None,
    path: Path,
    dpi: int = DEFAULT_DPI,
) -> Path:
    """The cost-per-sample heatmap of one Completion probe of one window."""
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm

    if probe not in COMPLETION_PROBES:
        raise ValueError(f"probe: must be one of {list(COMPLETION_PROBES)}, got {probe!r}")
    ep, rpn = window.ep_size, window.ranks_per_node
    fig = _new_figure(probe, ep, dpi)
    w_in, h_in = _figure_size_in(probe, ep)
    side = _heatmap_side_in(ep)
    left, bottom = 1.0, 0.75
    ax = fig.add_axes((left / w_in, bottom / h_in, side / w_in, side / h_in))
    cax = fig.add_axes(((left + side + 0.2) / w_in, bottom / h_in, 0.25 / w_in, side / h_in))

    missing = np.full((ep, ep), np.nan)
    cps = window.cost_per_sample(probe) if probe in window.completion else missing
    shown = np.isfinite(cps) & (cps > 0)
    if shown.any():
        lo, hi = float(cps[shown].min()), float(cps[shown].max())
        if lo == hi:  # a flat matrix still needs a non-empty colour range
            lo, hi = lo / 1.05, hi * 1.05
    else:
        lo, hi = 1.0, 10.0
    norm = LogNorm(vmin=lo, vmax=hi)
    cmap = colormaps["viridis"].with_extremes(bad=_MISSING)
    data = np.ma.masked_array(np.where(shown, cps, lo), mask=~shown)
    image = ax.imshow(data, cmap=cmap, norm=norm, interpolation="nearest", aspect="equal")
    cbar = fig.colorbar(image, cax=cax)
    cbar.set_label("cycles per sample (log scale)", fontsize=9)
    cbar.ax.tick_params(labelsize=8)

    for k in range(1, ep // rpn):
        ax.axhline(k * rpn - 0.5, color="white", linewidth=2.0, zorder=3)
        ax.axvline(k * rpn - 0.5, color="white", linewidth=2.0, zorder=3)
    _node_ticks(ax, ep, rpn, "both")
    xlabel, ylabel = _AXIS_LABELS[probe]
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)

    if ep <= ANNOTATE_MAX_EP:
        cell_pt = side / ep * 72.0
        size = min(9.0, max(4.0, cell_pt * 0.26))
        finite = np.isfinite(cps)
        for s, d in zip(*np.nonzero(finite), strict=True):
            v = float(cps[s, d])
            # White on the dark end of viridis, black on its light end and on grey cells.
            dark = bool(shown[s, d]) and float(norm(v)) < 0.55
            ax.text(
                d,
                s,
                _compact(v),
                ha="center",
                va="center",
                fontsize=size,
                color="white" if dark else "black",
                zorder=5,
            )

    verdict = _probe_verdict(diagnosis, probe)
    anomalies = _anomalies(verdict)
    outlined = sum(_outline(ax, a, ep, rpn) for a in anomalies)
    notes = []
    for a in anomalies:
        factor = a.get("factor")
        if a.get("scope") == "global" and isinstance(factor, (int, float)):
            notes.append(f"global slowdown x{factor:.2f} vs recent windows")
    if outlined:
        notes.append(f"{outlined} flagged scope(s) outlined")
    if probe not in window.completion:
        notes.append("not measured in this window")
    elif not shown.any():
        notes.append("no positive cost in this window")
    status = verdict.get("status", "no diagnosis stored")
    ax.set_title(
        f"{probe}: cost per sample, window {window.window_index}, EP {ep}\n"
        f"status: {status}" + "".join(f"; {n}" for n in notes),
        fontsize=10,
        loc="left",
    )
    return _save(fig, path)


# --- entry points ---------------------------------------------------------------------------


def render_all(
    npz_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    *,
    dpi: int = DEFAULT_DPI,
    charts: Iterable[str] = CHARTS,
) -> list[Path]:
    """Render ``charts`` (default: all four) of one artifact; return the written paths.

    ``out_dir`` defaults to the artifact's folder. Raises the artifact loader's errors
    (``ArtifactError``, a ``ValueError``, or ``FileNotFoundError``) for a bad file.
    """
    if not isinstance(npz_path, (str, os.PathLike)):
        raise TypeError(f"npz_path: expected a path, got {type(npz_path).__name__}")
    if out_dir is not None and not isinstance(out_dir, (str, os.PathLike)):
        raise TypeError(f"out_dir: expected a path or None, got {type(out_dir).__name__}")
    _check_dpi(dpi)
    wanted = [_check_chart(c) for c in charts]
    window, diagnosis, meta = load_window_artifact(npz_path)
    folder = Path(npz_path).parent if out_dir is None else Path(out_dir)
    paths = chart_paths(npz_path, folder)
    written = []
    for chart in CHARTS:
        if chart not in wanted:
            continue
        if chart == "notify":
            written.append(_render_notify(window, meta, diagnosis, paths[chart], dpi))
        else:
            written.append(_render_completion(window, chart, diagnosis, paths[chart], dpi))
    return written


def render_phase_gallery(
    out_dir: str | os.PathLike[str],
    *,
    ep_size: int = 16,
    ranks_per_node: int = 8,
    seed: int = 0,
    baseline_windows: int = 4,
    phases: Sequence[str] | None = None,
    dpi: int = DOCS_DPI,
    palette: bool = True,
) -> list[Path]:
    """The simulator's validation phases, diagnosed and drawn: ``deepep-<phase>-<chart>.png``.

    A few baseline windows go through the diagnoser first so its global-slowdown history is
    bootstrapped, then one window per phase (default: all five) is diagnosed, saved as an
    artifact in a temporary folder and rendered into ``out_dir``. ``palette`` stores the
    pictures with 256 colours (about a quarter of the size), for pictures kept in a repository.
    """
    from rankwatch.diagnosis.deepep.normal import SIMULATOR_PHASES, NormalDiagnoser, NormalSimulator

    chosen = tuple(SIMULATOR_PHASES if phases is None else phases)
    for phase in chosen:
        if phase not in SIMULATOR_PHASES:
            raise ValueError(f"phases: unknown phase {phase!r}, expected {list(SIMULATOR_PHASES)}")
    if isinstance(baseline_windows, bool) or not isinstance(baseline_windows, int):
        raise TypeError(f"baseline_windows: expected an int, got {baseline_windows!r}")
    if baseline_windows < 0:
        raise ValueError(f"baseline_windows: must be >= 0, got {baseline_windows}")
    sim = NormalSimulator(ep_size=ep_size, ranks_per_node=ranks_per_node, seed=seed)
    diagnoser = NormalDiagnoser()
    for index in range(baseline_windows):
        diagnoser.diagnose(sim.window("baseline", index))
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="rankwatch-gallery-") as tmp:
        for offset, phase in enumerate(chosen):
            window = sim.window(phase, baseline_windows + offset)
            report = diagnoser.diagnose(window)
            npz = save_window_artifact(Path(tmp) / f"deepep-{phase}.npz", window, report)
            written += render_all(npz, out_dir, dpi=dpi)
    if palette:
        for path in written:
            _to_palette(path)
    return written


def _to_palette(path: Path) -> None:
    # Pillow comes with matplotlib; 256 colours keep the colour bar smooth.
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=256)
    small.save(path, format="PNG", optimize=True)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rankwatch heatmap",
        description="Render the Notify chart and the Completion heatmaps of a saved DeepEP "
        "normal-mode window (an NPZ artifact). Files are named <stem>-<chart>.png.",
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--all", action="store_true", help="render all four charts")
    which.add_argument(
        "--chart",
        action="append",
        choices=CHARTS,
        help="render this chart (repeatable)",
    )
    parser.add_argument("window", metavar="WINDOW.npz", help="the artifact to draw")
    parser.add_argument(
        "--out", metavar="DIR", default=None, help="output folder (default: the artifact's)"
    )
    parser.add_argument(
        "--dpi", type=int, default=DEFAULT_DPI, help=f"resolution (default {DEFAULT_DPI})"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """``rankwatch heatmap``: 0 on success, 2 for bad arguments or an unreadable artifact, 1
    when a picture cannot be written (one line naming the folder, the errno and the file)."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed the usage and the error (or the help)
        return int(exc.code) if isinstance(exc.code, int) else 2
    charts = CHARTS if args.all else tuple(args.chart)
    try:
        paths = render_all(args.window, args.out, dpi=args.dpi, charts=charts)
    except PictureNotWritten as exc:
        where = "--out" if args.out is not None else "the artifact's folder (no --out)"
        folder = args.out if args.out is not None else os.path.dirname(args.window) or "."
        print(
            f"rankwatch heatmap: error: {where} {folder!r}: {errno_name(exc)} ({exc.strerror}) "
            f"writing {exc.filename}",
            file=sys.stderr,
        )
        return 1
    except (ValueError, TypeError, OSError) as exc:
        print(f"rankwatch heatmap: error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0

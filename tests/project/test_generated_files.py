"""Every generated file in the repository is what its generator writes today.

``make generate`` runs the generators in place; each test here runs the same generator without
touching the checkout and names every committed file that differs, so CI (``make test``) fails
on a stale file. This is the only freshness check of these files:

- ``rankwatch.exporter.assets``: the dashboards, the alert rules and their Kubernetes objects;
- ``rankwatch.exporter.publish.catalogue``: the metric table in ``docs/metrics.md``;
- ``rankwatch.exporter.cli.heatmap.render_phase_gallery``: the pictures ``docs/img/deepep-*.png``.

``docs/accuracy.md``, the accuracy section of ``docs/diagnosis-deepep.md`` and
``docs/benchmarks.md`` are measurements with targets of their own (``make accuracy``,
``make accuracy-deepep``, ``make bench``), not generated files.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import PIL
import pytest
from PIL import Image

from rankwatch.exporter.assets import render
from rankwatch.exporter.cli.heatmap import render_phase_gallery
from rankwatch.exporter.publish.catalogue import render_doc
from tests.servers import REPO

FIX = "run `make generate`"
IMG = REPO / "docs" / "img"
GALLERY = "deepep-*.png"


def _fail_if_stale(stale: list[str]) -> None:
    assert not stale, f"stale generated file(s), {FIX}:\n  " + "\n  ".join(stale)


def test_dashboards_rules_and_manifests_are_current() -> None:
    stale = []
    for name, text in render().items():
        path = REPO / name
        if not path.exists():
            stale.append(f"{name}: missing")
        elif path.read_text() != text:
            stale.append(f"{name}: differs from rankwatch.exporter.assets' output")
    _fail_if_stale(stale)


def test_metric_catalogue_table_is_current() -> None:
    doc = REPO / "docs" / "metrics.md"
    text = doc.read_text()
    current = render_doc(text) == text
    _fail_if_stale([] if current else ["docs/metrics.md: the catalogue table differs"])


BLOCK = 4  # pixels a side of the blocks whose means are compared
BLOCK_LEVELS = 8.0  # of 255: how far a block's mean may move (antialiasing moves it by ~3)


def _block_change(new: np.ndarray, old: np.ndarray) -> float:
    """The largest change of any channel's mean over a BLOCK x BLOCK block of pixels."""

    def means(px: np.ndarray) -> np.ndarray:
        h, w = px.shape[0] // BLOCK * BLOCK, px.shape[1] // BLOCK * BLOCK
        tiles = px[:h, :w].astype(float).reshape(h // BLOCK, BLOCK, w // BLOCK, BLOCK, -1)
        return tiles.mean(axis=(1, 3))

    return float(np.abs(means(new) - means(old)).max())


def test_the_picture_check_tells_a_changed_glyph_from_antialiasing() -> None:
    # A digit drawn over a blank picture moves some block by far more than the allowance; a
    # scattered change of edge pixels by 23 levels (the most measured) does not.
    from PIL import ImageDraw

    blank = Image.new("RGB", (120, 60), "white")
    marked = blank.copy()
    ImageDraw.Draw(marked).text((50, 20), "7", fill="black")
    before, after = np.asarray(blank), np.asarray(marked)
    assert _block_change(after, before) > BLOCK_LEVELS
    jitter = before.astype(int)
    jitter[::7, ::5] -= 23
    assert _block_change(jitter.clip(0, 255).astype(np.uint8), before) <= BLOCK_LEVELS


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


@pytest.mark.slow
def test_doc_pictures_are_current(tmp_path: Path) -> None:
    # Pixels, not bytes: the bytes are reproducible on one machine (no Software tag, no
    # timestamp), but the PNG's compressed stream depends on the zlib Pillow was built with
    # (zlib or zlib-ng), so equal pictures can differ byte for byte on another machine.
    # Nor exact pixels: the same releases drew a few hundred edge pixels one to 23 levels
    # apart on another machine (antialiasing; the 4x4 blocks' means within 3.25 levels),
    # while a changed glyph or cell moves its blocks by tens of levels.
    rendered = {p.name: p for p in render_phase_gallery(tmp_path)}  # 20 charts, ~7 s
    committed = {p.name: p for p in IMG.glob(GALLERY)}
    stale = [f"docs/img/{name}: missing" for name in sorted(rendered.keys() - committed.keys())]
    stale += [
        f"docs/img/{name}: no longer generated" for name in sorted(committed.keys() - rendered)
    ]
    for name in sorted(rendered.keys() & committed.keys()):
        new, old = _pixels(rendered[name]), _pixels(committed[name])
        if new.shape != old.shape:
            stale.append(f"docs/img/{name}: size {old.shape[1::-1]} -> {new.shape[1::-1]}")
        elif (moved := _block_change(new, old)) > BLOCK_LEVELS:
            changed = int(np.any(new != old, axis=-1).sum())
            total = new.shape[0] * new.shape[1]
            stale.append(
                f"docs/img/{name}: {changed} of {total} pixels differ, a {BLOCK}x{BLOCK} "
                f"block's mean by {moved:.1f} levels (at most {BLOCK_LEVELS} allowed)"
            )
    if stale:
        # Pixels depend on the matplotlib and Pillow releases: say which ones drew them.
        versions = f"matplotlib {matplotlib.__version__}, Pillow {PIL.__version__}"
        stale.append(f"(rendered with {versions})")
    _fail_if_stale(stale)

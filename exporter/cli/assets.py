"""The operator's files that ship inside the package: dashboards, rules, deploy manifests.

A clone has them under ``dashboards/`` and ``deploy/``; a wheel carries the very same files as
package data under ``rankwatch/_assets/`` (``pyproject.toml`` maps the two folders there, so git
holds one copy). ``rankwatch assets export DIR`` writes them out with the layout of a clone, so a
``pip install`` user gets the dashboards and alert rules of exactly the metric names of the
installed version.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import rankwatch

__all__ = ["ASSET_FOLDERS", "Asset", "asset_root", "export_assets", "list_assets"]

# The repository folders that ship; their layout is kept as is.
ASSET_FOLDERS: tuple[str, ...] = ("dashboards", "deploy")
# Everything ships (the dashboard generator too: run in an exported folder, it regenerates that
# folder's dashboards and manifests); byte-code caches do not.
_SKIPPED_SUFFIXES = (".pyc",)
_SKIPPED_DIRS = ("__pycache__",)


@dataclass(frozen=True)
class Asset:
    """One shipped file: its path relative to the export folder and where it is read from."""

    relative: str
    source: Path


def asset_root() -> Path:
    """The folder holding ``dashboards/`` and ``deploy/``: the installed package data, or the
    source checkout of an editable install. ``FileNotFoundError`` when neither exists."""
    package = Path(rankwatch.__file__).resolve().parent
    for root in (package / "_assets", package.parent):
        if all((root / folder).is_dir() for folder in ASSET_FOLDERS):
            return root
    raise FileNotFoundError(
        f"rankwatch's assets are missing: neither {package / '_assets'} nor a source checkout "
        f"next to {package} has {' and '.join(ASSET_FOLDERS)}; reinstall rankwatch"
    )


def _walk(folder: Path) -> Iterator[Path]:
    for path in sorted(folder.rglob("*")):
        parts = path.relative_to(folder).parts
        if any(p in _SKIPPED_DIRS or p.startswith(".") for p in parts):
            continue
        if path.is_file() and path.suffix not in _SKIPPED_SUFFIXES:
            yield path


def list_assets(root: Path | None = None) -> list[Asset]:
    """Every shipped file, sorted by relative path (``dashboards/...``, ``deploy/...``)."""
    base = asset_root() if root is None else root
    return [
        Asset(path.relative_to(base).as_posix(), path)
        for folder in ASSET_FOLDERS
        for path in _walk(base / folder)
    ]


def export_assets(target: Path, *, force: bool = False) -> list[Path]:
    """Write every asset under ``target`` (created if needed); returns the paths written.

    A file already there with other content is an error (``FileExistsError`` naming it) unless
    ``force``: an export never silently replaces a dashboard an operator edited. Identical files
    are left alone. Nothing is written when any file would be refused.
    """
    assets = list_assets()
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"DIR {str(target)!r}: exists and is not a folder")
    writes: list[tuple[Path, bytes]] = []
    for asset in assets:
        data = asset.source.read_bytes()
        dest = target / asset.relative
        if dest.exists():
            if dest.is_dir():
                raise IsADirectoryError(f"{dest}: a folder is in the way of {asset.relative}")
            if dest.read_bytes() == data:
                continue
            if not force:
                raise FileExistsError(
                    f"{dest}: exists with other content; use --force to overwrite it"
                )
        writes.append((dest, data))
    for dest, data in writes:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    return [dest for dest, _ in writes]

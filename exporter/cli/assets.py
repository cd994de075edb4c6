"""The operator's files that ship inside the package: dashboards, rules, deploy manifests.

A clone has them under ``dashboards/`` and ``deploy/``; a wheel carries the very same files as
package data under ``rankwatch/_assets/`` (``pyproject.toml`` maps the two folders there, so git
holds one copy). ``rankwatch assets export DIR`` writes them out with the layout of a clone, so a
``pip install`` user gets the dashboards and alert rules of exactly the metric names of the
installed version.

The generated files among them (dashboards, rule file, their Kubernetes objects) are rendered at
export time rather than copied: from the installation's :class:`~rankwatch.exporter.assets.
Settings` (alert ``for:``, runbook links, job selector) and the diagnosis thresholds of the
environment, so a changed threshold or alert timing reaches the dashboards and rules without a
second copy. With the defaults they are byte for byte the shipped files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rankwatch
from rankwatch.diagnosis.config import DiagnosisConfig
from rankwatch.exporter.assets import GENERATED, Settings, render

__all__ = [
    "ASSET_FOLDERS",
    "Asset",
    "asset_root",
    "export_assets",
    "list_assets",
    "settings_from_options",
]

# The repository folders that ship; their layout is kept as is.
ASSET_FOLDERS: tuple[str, ...] = ("dashboards", "deploy")
# Everything ships; byte-code caches do not.
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


def settings_from_options(
    settings_file: Path | None = None,
    *,
    for_: Sequence[str] = (),
    keep_firing_for: Sequence[str] = (),
    runbook_url: str | None = None,
    job_selector: str | None = None,
    stale_window_seconds: int | None = None,
) -> Settings:
    """:class:`Settings` from a JSON settings file (its keys as Settings' fields, ``for`` for
    ``for_``) and options, which win; ``for_`` and ``keep_firing_for`` are ``ALERT=DURATION``
    strings. ``ValueError`` naming the option and the value for anything wrong."""
    overrides: dict[str, Any] = {}
    if settings_file is not None:
        try:
            loaded = json.loads(Path(settings_file).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--settings {str(settings_file)!r}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"--settings {str(settings_file)!r}: expected a JSON object")
        overrides.update(loaded)
    for key, value in (
        ("runbook_url", runbook_url),
        ("job_selector", job_selector),
        ("stale_window_seconds", stale_window_seconds),
    ):
        if value is not None:
            overrides[key] = value
    for key, option, pairs in (
        ("for", "--for", for_),
        ("keep_firing_for", "--keep-firing-for", keep_firing_for),
    ):
        if pairs:
            table = dict(overrides.get(key) or {})
            for pair in pairs:
                alert, sep, duration = pair.partition("=")
                if not sep or not alert:
                    raise ValueError(
                        f"{option} {pair!r}: expected ALERT=DURATION, e.g. "
                        "RankwatchStepTimeStragglerCritical=30s"
                    )
                try:  # checked one by one, so the error names the option the user typed
                    Settings.load({key: {alert: duration}})
                except ValueError as exc:
                    raise ValueError(f"{option} {pair!r}: {exc}") from None
                table[alert] = duration
            overrides[key] = table
    return Settings.load(overrides)


def _asset_bytes(assets: list[Asset], generated: Mapping[str, str]) -> list[tuple[str, bytes]]:
    """Every asset's path and content: generated files rendered, the others as shipped."""
    return [
        (
            asset.relative,
            generated[asset.relative].encode()
            if asset.relative in generated
            else asset.source.read_bytes(),
        )
        for asset in assets
    ]


def export_assets(
    target: Path,
    *,
    force: bool = False,
    settings: Settings | None = None,
    config: DiagnosisConfig | None = None,
) -> list[Path]:
    """Write every asset under ``target`` (created if needed); returns the paths written.

    The generated files (:data:`~rankwatch.exporter.assets.GENERATED`) are rendered with
    ``settings`` and ``config`` (defaults: ``Settings()``, ``DiagnosisConfig()``). A file already
    there with other content is an error (``FileExistsError`` naming it) unless ``force``: an
    export never silently replaces a dashboard an operator edited. Identical files are left
    alone. Nothing is written when any file would be refused.
    """
    assets = list_assets()
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"DIR {str(target)!r}: exists and is not a folder")
    shipped = {asset.relative for asset in assets}
    missing = [name for name in GENERATED if name not in shipped]
    if missing:
        raise FileNotFoundError(f"rankwatch's assets are incomplete: {missing} missing")
    writes: list[tuple[Path, bytes]] = []
    for relative, data in _asset_bytes(assets, render(settings, config)):
        dest = target / relative
        if dest.exists():
            if dest.is_dir():
                raise IsADirectoryError(f"{dest}: a folder is in the way of {relative}")
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

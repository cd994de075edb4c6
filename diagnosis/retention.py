"""Bounded folders of saved windows: the newest ``keep`` files of one name pattern stay.

Both engines' window files (step-time JSON, DeepEP NPZ) are pruned by these two functions, so
"newest" means the same everywhere: the latest modification time, ties broken by name. Only
regular files whose names match the pattern are counted or deleted; anything else in the folder
is left alone.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["files_oldest_first", "prune_oldest"]


def files_oldest_first(directory: Path, prefix: str, suffix: str) -> list[Path]:
    """The regular files of ``directory`` named ``prefix...suffix``, oldest first."""
    if not directory.is_dir():
        return []
    found: list[tuple[int, str, Path]] = []
    for entry in os.scandir(directory):
        if (
            entry.name.startswith(prefix)
            and entry.name.endswith(suffix)
            and entry.is_file(follow_symlinks=False)
        ):
            try:
                found.append((entry.stat().st_mtime_ns, entry.name, Path(entry.path)))
            except FileNotFoundError:  # removed meanwhile by someone else
                continue
    found.sort()
    return [path for _, _, path in found]


def prune_oldest(directory: Path, prefix: str, suffix: str, keep: int) -> list[Path]:
    """Delete the oldest matching files beyond the newest ``keep``; return what was deleted."""
    existing = files_oldest_first(directory, prefix, suffix)
    doomed = existing[: max(0, len(existing) - keep)]
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed

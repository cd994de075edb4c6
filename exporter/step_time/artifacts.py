"""Step-time window files written by the root, with bounded retention.

When ``RankwatchConfig.artifact_dir`` is set, the root saves every window it diagnoses as a
versioned step-window JSON (``rankwatch.diagnosis.step_time.artifact``), so ``rankwatch diagnose``
and ``rankwatch replay`` can re-diagnose it offline. Only the newest ``artifact_retention``
files of a group are kept. File names are built from a sanitised group name, so a group name
can never place a file outside the folder. A write that fails (full disk, read-only or removed
folder...) follows the storage-fault policy of :mod:`rankwatch.exporter.storage`: said once,
counted, retried on its schedule, never raised.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from rankwatch.diagnosis.config import option_env
from rankwatch.diagnosis.report import WindowReport
from rankwatch.diagnosis.retention import prune_oldest
from rankwatch.diagnosis.step_time.artifact import save_window
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.storage import GuardedWrites

__all__ = ["StepArtifactWriter", "safe_name"]

log = logging.getLogger(__name__)
_ARTIFACT_DIR_ENV = option_env(RankwatchConfig, "artifact_dir")


def safe_name(text: str) -> str:
    """``text`` reduced to letters, digits, ``_`` and ``-`` (never empty, no dots or slashes)."""
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "_", text).strip("_") or "group"
    return cleaned[:64]


class StepArtifactWriter:
    """Saves each step-time window of one group into a folder, keeping the newest N files."""

    def __init__(
        self, directory: str | Path, group: str, retention: int, guard: GuardedWrites | None = None
    ) -> None:
        if isinstance(retention, bool) or not isinstance(retention, int) or retention < 1:
            raise ValueError(f"retention: expected an int >= 1, got {retention!r}")
        self.directory = Path(directory)
        self.prefix = f"step-{safe_name(group)}-"
        self.retention = retention
        self.guard = guard or GuardedWrites(
            "step_windows", "step windows", _ARTIFACT_DIR_ENV, str(self.directory)
        )
        # A folder unusable from the start is said now, not at the first window (and retried
        # on the guard's schedule, like a failure later in the run).
        self.guard.check_folder(self.directory)

    @classmethod
    def from_config(cls, config: RankwatchConfig) -> StepArtifactWriter | None:
        """A writer when the config asks for artifacts (a folder and retention >= 1), else
        None. A folder that cannot be used is said once at once; training goes on."""
        if not config.artifact_dir or config.artifact_retention < 1:
            return None
        return cls(config.artifact_dir, config.group_name, config.artifact_retention)

    def save(
        self,
        report: WindowReport,
        per_rank: Mapping[int, np.ndarray | None],
        window: int,
    ) -> Path | None:
        """Write the window behind ``report`` (and prune); None when it was not written:
        storage faults follow :attr:`guard`, bad data is logged; never raised (bg thread)."""
        step = report.step_time
        if step is None:
            return None
        path = self.directory / (
            f"{self.prefix}{report.window_kind}-{report.window_index:08d}.json"
        )

        def write() -> Path:
            save_window(
                path,
                per_rank,
                strategy=step.strategy,
                window=window,
                meta={
                    "group": report.group,
                    "run": report.run,
                    "window_index": report.window_index,
                },
                report=step,
                mesh=step.mesh,
            )
            self.prune()
            return path

        try:
            return self.guard.run(path, write, folder=self.directory)
        except (ValueError, TypeError) as exc:
            log.warning("rankwatch: step window %d not written: %s", report.window_index, exc)
            return None

    def prune(self) -> None:
        """Delete this group's oldest files beyond the retention (newest: latest written)."""
        prune_oldest(self.directory, self.prefix, ".json", self.retention)

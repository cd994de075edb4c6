"""Step-time windows saved as versioned JSON, so a window can be diagnosed again offline.

An artifact holds exactly what :func:`~.rules.diagnose_arrays` needs (the per-rank rows,
the strategy, the window size and the thresholds in force) plus free-form metadata and,
optionally, the report given live. Replaying it gives the same report: the diagnosis is pure.

Layout (version 2)::

    {
      "format": "rankwatch.step_time_window",
      "version": 2,
      "strategy": "ddp" | "fsdp" | null,
      "window": 100,
      "ranks": {
        "0": {"step_id": [5, 6, ...],
              "cpu": {"input_wait": [1.5, null, ...], "forward": [...], ...,
                      "forward_wait": [...], "backward_wait": [...]},
              "gpu": {...},                         # the same keys, on the GPU clock
              "async_collectives": [1, 1, ...]},
        "3": null                                   # expected rank that sent nothing
      },
      "config": {"straggler_warning_score": 0.1, ...},   # optional: StepTimeConfig fields
      "mesh": {"dim_names": ["pp", "dp"], "shape": [2, 2],
               "ranks": [0, 1, 2, 3]},                   # optional: the job's device mesh
      "meta": {...},                                     # optional, free-form JSON object
      "report": {...}                                    # optional: StepTimeReport.to_dict()
    }

Times are milliseconds; ``null`` is an absent value, and a signal or clock absent on every
step may be left out. Version 1 files (written before the GPU clock timed the sync waits) are
still read: they are version 2 without ``gpu.forward_wait``/``gpu.backward_wait``, which a
version 1 file may not name. Loading validates everything and raises :class:`ArtifactError` (a
``ValueError``) naming the file, the path of the bad field (``ranks.3.cpu.forward[17]``) and
its value. A file is read only when it is a regular file of at most :data:`MAX_FILE_BYTES`;
its JSON may nest :data:`~rankwatch.diagnosis.untrusted_files.MAX_JSON_DEPTH` levels, hold
:data:`MAX_RANKS` ranks of ids up to ``MAX_RANK_ID`` and :data:`MAX_ROWS` step rows in all, with
step ids up to :data:`MAX_STEP_ID`.

``python -m rankwatch.diagnosis.step_time.artifact FILE.json`` prints the report of a saved window;
``--example FILE.json`` writes the built-in example window first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from rankwatch.diagnosis.config import StepTimeConfig
from rankwatch.diagnosis.step_time.mesh import MeshLayout
from rankwatch.diagnosis.step_time.rules import StepTimeReport, diagnose_arrays, normalize_strategy
from rankwatch.diagnosis.step_time.table import (
    CLOCKS,
    EXTRA_COLUMNS,
    MAX_RANK_ID,
    ROW_WIDTH,
    SIGNALS,
    SYNC_SIGNALS,
    column,
    rank_items,
    validate_window,
)
from rankwatch.diagnosis.untrusted_files import (
    ArtifactError,
    open_regular_file,
    parse_json,
    read_text_file,
)

__all__ = [
    "FORMAT",
    "MAX_FILE_BYTES",
    "MAX_RANKS",
    "MAX_ROWS",
    "MAX_STEP_ID",
    "VERSION",
    "ArtifactError",
    "StepTimeWindow",
    "diagnose_file",
    "example_window",
    "is_step_time_artifact",
    "is_step_time_file",
    "load_window",
    "main",
    "save_window",
    "window_from_dict",
    "window_to_dict",
]

FORMAT = "rankwatch.step_time_window"
VERSION = 2
# Versions this reader accepts; each maps to the signals a clock may carry in it.
_CLOCK_SIGNALS_BY_VERSION: dict[int, dict[str, tuple[str, ...]]] = {
    1: {"cpu": (*SIGNALS, *SYNC_SIGNALS), "gpu": SIGNALS},
    2: {clock: (*SIGNALS, *SYNC_SIGNALS) for clock in CLOCKS},
}
_TOP_KEYS = frozenset(
    ("format", "version", "strategy", "window", "ranks", "config", "mesh", "meta", "report")
)
# Per rank: the step ids, each clock's signals and sync waits, and the async-collectives flag
# (rankwatch's extension of the row layout, see table).
_ASYNC = EXTRA_COLUMNS[-1]
_ASYNC_COL = ROW_WIDTH - 1
_CLOCK_SIGNALS = _CLOCK_SIGNALS_BY_VERSION[VERSION]
_RANK_KEYS = frozenset(("step_id", *CLOCKS, _ASYNC))

# Bounds on what a file may declare, checked before anything is allocated for it. A window of
# 1,024 ranks x 100 steps with every signal on both clocks is 22 MiB of JSON; 64 MiB holds
# about 2,900 such ranks.
MAX_FILE_BYTES = 64 * 2**20
# Per rank about 35 objects, arrays and strings (the rank, its clocks, a list per signal, keys).
MAX_JSON_ITEMS = 1_000_000
MAX_RANKS = 65_536
# Rows become one float64 [n, ROW_WIDTH] array per rank: 2**20 rows are 144 MiB at 18 columns
# (4,096 ranks x 256 steps, or 1,024 ranks x 1,024 steps).
MAX_ROWS = 2**20
# Step ids travel as float64, exact for integers up to 2**53.
MAX_STEP_ID = 2**53
_SNIFF_BYTES = 4096


@dataclass(frozen=True)
class StepTimeWindow:
    """One saved step-time window: per-rank ``[n, ROW_WIDTH]`` arrays (None = missing rank)."""

    per_rank: dict[int, np.ndarray | None]
    strategy: str | None = None
    window: int = 100
    config: StepTimeConfig | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] | None = None
    mesh: MeshLayout | None = None

    def diagnose(self, config: StepTimeConfig | None = None) -> StepTimeReport:
        """The report of this window: with ``config``, else the recorded thresholds."""
        return diagnose_arrays(
            self.per_rank,
            strategy=self.strategy,
            window=self.window,
            config=config if config is not None else self.config,
            mesh=self.mesh,
        )

    def to_dict(self) -> dict[str, Any]:
        return window_to_dict(
            self.per_rank,
            strategy=self.strategy,
            window=self.window,
            config=self.config,
            meta=self.meta,
            report=self.report,
            mesh=self.mesh,
        )


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _column_list(values: np.ndarray) -> list[float | None]:
    out = values.astype(object)
    out[np.isnan(values)] = None
    values_list: list[float | None] = out.tolist()
    return values_list


def _rank_to_dict(rank: int, arr: np.ndarray | None) -> dict[str, Any] | None:
    if arr is None:
        return None
    arr = np.asarray(arr, dtype=np.float64)
    if arr.size == 0:
        return None
    if arr.ndim != 2 or arr.shape[1] != ROW_WIDTH:
        raise ValueError(
            f"rank {rank}: field rows: value has shape {arr.shape}, expected [n, {ROW_WIDTH}]"
        )
    ids = arr[:, 0]
    if not (np.isfinite(ids).all() and (ids >= 0).all() and (ids == np.floor(ids)).all()):
        raise ValueError(f"rank {rank}: field step_id: values must be non-negative integers")
    out: dict[str, Any] = {"step_id": [int(x) for x in ids.tolist()]}
    for clock in CLOCKS:
        signals = {}
        for signal in _CLOCK_SIGNALS[clock]:
            values = arr[:, column(clock, signal)]
            if np.isnan(values).all():
                continue
            bad = np.isinf(values) | (values < 0)
            if bad.any():
                at = int(np.flatnonzero(bad)[0])
                raise ValueError(
                    f"rank {rank}: row {at}: field {clock}.{signal}: value "
                    f"{float(values[at])!r} is not a finite time >= 0"
                )
            signals[signal] = _column_list(values)
        if signals:
            out[clock] = signals
    flags = arr[:, _ASYNC_COL]
    if not np.isnan(flags).all():
        out[_ASYNC] = _column_list(flags)
    return out


def window_to_dict(
    per_rank: Mapping[int, np.ndarray | None],
    *,
    strategy: str | None = None,
    window: int = 100,
    config: StepTimeConfig | None = None,
    meta: Mapping[str, Any] | None = None,
    report: StepTimeReport | Mapping[str, Any] | None = None,
    mesh: MeshLayout | None = None,
) -> dict[str, Any]:
    """The JSON-ready artifact of one window (validated on the way)."""
    if strategy is not None:
        normalize_strategy(strategy)
    validate_window(window)
    if not per_rank:
        raise ValueError("field per_rank: value {} is empty (no rank expected)")
    ranks = rank_items(per_rank)
    if isinstance(report, StepTimeReport):
        report = report.to_dict()
    out: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "strategy": strategy,
        "window": int(window),
        "ranks": {str(r): _rank_to_dict(r, a) for r, a in ranks},
    }
    if config is not None:
        out["config"] = asdict(config)
    if mesh is not None:
        out["mesh"] = mesh.to_dict()
    if meta:
        out["meta"] = dict(meta)
    if report is not None:
        out["report"] = dict(report)
    return out


def save_window(
    path: str | os.PathLike[str],
    per_rank: Mapping[int, np.ndarray | None],
    *,
    strategy: str | None = None,
    window: int = 100,
    config: StepTimeConfig | None = None,
    meta: Mapping[str, Any] | None = None,
    report: StepTimeReport | Mapping[str, Any] | None = None,
    mesh: MeshLayout | None = None,
) -> Path:
    """Write the artifact atomically (temporary file, then rename); returns the path."""
    doc = window_to_dict(
        per_rank,
        strategy=strategy,
        window=window,
        config=config,
        meta=meta,
        report=report,
        mesh=mesh,
    )
    text = json.dumps(doc, allow_nan=False, separators=(",", ":"))
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or Path("."))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _clip(text: str, limit: int = 80) -> str:
    """Text from a file (a key, a value's repr) cut short: a message stays one readable line."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(value: object) -> str:
    """``repr`` of a value from a file, cut short."""
    return _clip(repr(value))


def is_step_time_artifact(obj: object) -> bool:
    """Whether a parsed JSON document claims to be a step-time window artifact."""
    return isinstance(obj, Mapping) and obj.get("format") == FORMAT


def is_step_time_file(path: str | os.PathLike[str]) -> bool:
    """Whether a file names the step-time window format near its start (the writer puts
    ``format`` first); reads at most 4 KiB. :class:`ArtifactError` for anything but a regular
    file, so a FIFO or a device is refused without being read."""
    with open_regular_file(path, max_bytes=sys.maxsize) as fh:
        head = fh.read(_SNIFF_BYTES)
    return f'"{FORMAT}"'.encode() in head


def _number_list(path: str, values: object, n: int) -> np.ndarray:
    if not isinstance(values, list):
        raise ValueError(f"{path}: value of type {type(values).__name__} is not a list")
    if len(values) != n:
        raise ValueError(f"{path}: has {len(values)} values, step_id has {n}")
    out = np.empty(n)
    for i, v in enumerate(values):
        if v is None:
            out[i] = math.nan
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(
                f"{path}[{i}]: value {_short(v)} is not a number of milliseconds or null"
            )
        if not math.isfinite(v):
            raise ValueError(f"{path}[{i}]: value {_short(v)} is not finite")
        if v < 0:
            raise ValueError(f"{path}[{i}]: value {_short(v)} is negative")
        out[i] = v
    return out


def _rank_from_dict(key: str, obj: object, version: int = VERSION) -> tuple[int, np.ndarray | None]:
    if len(key) > len(str(MAX_RANK_ID)):
        raise ValueError(
            f"ranks.{_clip(key)}: rank id of {len(key)} characters is not an int in "
            f"0..{MAX_RANK_ID}"
        )
    try:
        rank = int(key)
    except ValueError:
        raise ValueError(f"ranks.{key}: rank id {_short(key)} is not an int") from None
    if str(rank) != key or rank < 0:
        raise ValueError(f"ranks.{key}: rank id {_short(key)} is not a non-negative int")
    if rank > MAX_RANK_ID:
        raise ValueError(f"ranks.{key}: rank id {rank} is above {MAX_RANK_ID}")
    if obj is None:
        return rank, None
    where = f"ranks.{key}"
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: value of type {type(obj).__name__} is not an object or null")
    unknown = set(obj) - _RANK_KEYS
    if unknown:
        bad = sorted(unknown)[0]
        raise ValueError(
            f"{where}.{_clip(bad)}: unknown key (expected step_id, cpu, gpu, {_ASYNC})"
        )
    ids = obj.get("step_id")
    if not isinstance(ids, list):
        raise ValueError(f"{where}.step_id: value {_short(ids)} is not a list of step ids")
    for i, s in enumerate(ids):
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"{where}.step_id[{i}]: value {_short(s)} is not a non-negative int")
        if s > MAX_STEP_ID:
            raise ValueError(f"{where}.step_id[{i}]: value {s} is above {MAX_STEP_ID}")
    n = len(ids)
    arr = np.full((n, ROW_WIDTH), np.nan)
    arr[:, 0] = ids
    known = _CLOCK_SIGNALS_BY_VERSION[version]
    for clock in CLOCKS:
        signals = obj.get(clock)
        if signals is None:
            continue
        if not isinstance(signals, Mapping):
            raise ValueError(f"{where}.{clock}: value {_short(signals)} is not an object")
        for signal, values in signals.items():
            if signal not in known[clock]:
                raise ValueError(
                    f"{where}.{clock}.{_clip(signal)}: unknown signal in a version {version} "
                    f"artifact (expected one of {', '.join(known[clock])})"
                )
            arr[:, column(clock, signal)] = _number_list(f"{where}.{clock}.{signal}", values, n)
    if obj.get(_ASYNC) is not None:
        arr[:, _ASYNC_COL] = _number_list(f"{where}.{_ASYNC}", obj[_ASYNC], n)
    return rank, (arr if n else None)


def _config_from_dict(obj: object) -> StepTimeConfig:
    if not isinstance(obj, Mapping):
        raise ValueError(f"config: value {_short(obj)} is not an object")
    known = {f.name for f in fields(StepTimeConfig)}
    unknown = set(obj) - known
    if unknown:
        raise ValueError(f"config.{_clip(sorted(unknown)[0])}: unknown StepTimeConfig field")
    try:
        return StepTimeConfig(**obj)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config: {exc}") from None


def window_from_dict(obj: object) -> StepTimeWindow:
    """Validate a parsed artifact and return its window; ``ValueError`` naming the bad field."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"artifact: value of type {type(obj).__name__} is not a JSON object")
    if obj.get("format") != FORMAT:
        raise ValueError(f"format: value {_short(obj.get('format'))} is not {FORMAT!r}")
    version = obj.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"version: value {_short(version)} is not an int")
    if version not in _CLOCK_SIGNALS_BY_VERSION:
        known = ", ".join(str(v) for v in _CLOCK_SIGNALS_BY_VERSION)
        raise ValueError(f"version: value {version} is not supported (this reader knows {known})")
    unknown = set(obj) - _TOP_KEYS
    if unknown:
        raise ValueError(
            f"{_clip(sorted(unknown)[0])}: unknown key in a version {version} artifact"
        )
    strategy = obj.get("strategy")
    try:
        if strategy is not None:
            normalize_strategy(strategy)
        window = validate_window(obj.get("window"))
    except ValueError as exc:
        raise ValueError(str(exc).replace("field ", "", 1)) from None
    ranks = obj.get("ranks")
    if not isinstance(ranks, Mapping) or not ranks:
        raise ValueError(f"ranks: value {_short(ranks)} is not a non-empty object of ranks")
    if len(ranks) > MAX_RANKS:
        raise ValueError(f"ranks: {len(ranks)} ranks, more than the {MAX_RANKS} allowed")
    rows = sum(
        len(r["step_id"])
        for r in ranks.values()
        if isinstance(r, Mapping) and isinstance(r.get("step_id"), list)
    )
    if rows > MAX_ROWS:
        raise ValueError(f"ranks: {rows} step rows in all, more than the {MAX_ROWS} allowed")
    per_rank = dict(_rank_from_dict(str(k), v, version) for k, v in ranks.items())
    config = _config_from_dict(obj["config"]) if obj.get("config") is not None else None
    mesh = None
    if obj.get("mesh") is not None:
        try:
            mesh = MeshLayout.from_dict(obj["mesh"])
        except ValueError as exc:
            raise ValueError(f"mesh: {_clip(str(exc), 200)}") from None
        outside = sorted(set(per_rank) - set(mesh.ranks))
        if outside:
            raise ValueError(f"mesh: does not hold rank {outside[0]} of the window")
    meta = obj.get("meta") or {}
    if not isinstance(meta, Mapping):
        raise ValueError(f"meta: value {_short(meta)} is not an object")
    report = obj.get("report")
    if report is not None and not isinstance(report, Mapping):
        raise ValueError(f"report: value {_short(report)} is not an object")
    return StepTimeWindow(
        per_rank=dict(sorted(per_rank.items())),
        strategy=strategy,
        window=window,
        config=config,
        meta=dict(meta),
        report=None if report is None else dict(report),
        mesh=mesh,
    )


def load_window(path: str | os.PathLike[str]) -> StepTimeWindow:
    """Read and validate an artifact file; :class:`ArtifactError` naming the file and field."""
    text = read_text_file(path, max_bytes=MAX_FILE_BYTES)
    obj = parse_json(path, "document", text, max_items=MAX_JSON_ITEMS)
    try:
        return window_from_dict(obj)
    except ValueError as exc:
        # Checks outside this module (the config's) may quote a value whole.
        raise ArtifactError(f"{path}: {_clip(str(exc), 400)}") from None


def diagnose_file(
    path: str | os.PathLike[str], config: StepTimeConfig | None = None
) -> StepTimeReport:
    """The report of a saved window (``config``, else the recorded thresholds)."""
    return load_window(path).diagnose(config)


# --------------------------------------------------------------------------------------------
# The built-in example and a small command line
# --------------------------------------------------------------------------------------------


def example_window(
    ranks: int = 8, steps: int = 100, *, slow_rank: int | None = 5, seed: int = 0
) -> StepTimeWindow:
    """A DDP window on the GPU clock where ``slow_rank`` waits 22 ms longer for its input.

    Every rank: input wait ~8 ms, H2D ~2 ms, forward ~30 ms, backward ~45 ms (of which the
    gradient all-reduce wait is part), optimizer ~6 ms, a few ms of residual. The slow rank's
    extra input wait arrives late at the all-reduce, so its backward is shorter by about the
    same amount: an ``INPUT_STRAGGLER``.
    """
    if ranks < 1 or steps < 0:
        raise ValueError(f"example_window: need ranks >= 1 and steps >= 0, got {ranks}, {steps}")
    rng = np.random.default_rng(seed)
    per_rank: dict[int, np.ndarray | None] = {}
    for rank in range(ranks):
        late = 22.0 if rank == slow_rank else 0.0
        arr = np.full((steps, ROW_WIDTH), np.nan)
        arr[:, 0] = np.arange(steps)
        base = {
            "input_wait": 8.0 + late,
            "h2d": 2.0,
            "forward": 30.0,
            "backward": 45.0 - late,
            "optimizer": 6.0,
        }
        for clock in CLOCKS:
            total = np.zeros(steps)
            for signal, mean in base.items():
                values = np.maximum(rng.normal(mean, 0.02 * mean + 0.05, steps), 0.0)
                arr[:, column(clock, signal)] = values
                if signal != "input_wait":
                    total += values
            arr[:, column(clock, "step")] = total + np.abs(rng.normal(3.0, 0.5, steps))
        per_rank[rank] = arr
    return StepTimeWindow(per_rank, strategy="ddp", window=100, meta={"example": True})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rankwatch.diagnosis.step_time.artifact",
        description="Diagnose a saved step-time window and print the report as JSON.",
    )
    parser.add_argument("file", help="a step-time window artifact (JSON)")
    parser.add_argument("--example", action="store_true", help="write the example window first")
    parser.add_argument("--strategy", default=None, help="override the recorded strategy")
    parser.add_argument("--window", type=int, default=None, help="override the window size")
    args = parser.parse_args(argv)
    try:
        if args.example:
            ex = example_window()
            save_window(
                args.file, ex.per_rank, strategy=ex.strategy, window=ex.window, meta=ex.meta
            )
        saved = load_window(args.file)
        report = diagnose_arrays(
            saved.per_rank,
            strategy=args.strategy if args.strategy is not None else saved.strategy,
            window=args.window if args.window is not None else saved.window,
            config=saved.config,
        )
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A rank's hang record file: what one rank knew about a hang, kept in the artifact folder.

``hang-rank<R>-<pid>.json``: ``format``, ``version``, ``rank``, ``host``, ``pid``, ``run``,
``group``, ``written_at_s``, ``reason`` (``suspect``: written while the rank did not progress;
``sigterm``: refreshed when the process was told to stop), ``records`` (this rank's own record
first; on the group's root, the other ranks' as it last saw them), ``stacks`` (thread name to
its top frames) and, on the root, ``verdict`` (the open hang's evidence, or null).

:func:`load_hang_file` reads one back the way every saved file is read (regular files only,
a byte budget, JSON bounded before it is parsed; :mod:`rankwatch.diagnosis.untrusted_files`);
:func:`classify_files` joins several ranks' files into one verdict, offline.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankwatch.diagnosis.hang.classify import HangVerdict, classify_hang
from rankwatch.diagnosis.hang.records import MAX_FRAMES, RankRecord, record_from_dict
from rankwatch.diagnosis.untrusted_files import ArtifactError, parse_json, read_text_file

__all__ = [
    "FORMAT",
    "HANG_FILE_PATTERN",
    "HangFile",
    "classify_files",
    "hang_file_name",
    "is_hang_file_name",
    "load_hang_file",
]

FORMAT = "rankwatch.hang_record"
VERSION = 1
HANG_FILE_PATTERN = re.compile(r"hang-rank(\d+)-(\d+)\.json")
MAX_BYTES = 4 * 1024 * 1024
MAX_ITEMS = 200_000
MAX_RECORDS = 4096
MAX_THREADS = 64


def hang_file_name(rank: int, pid: int) -> str:
    """``hang-rank<R>-<pid>.json``."""
    return f"hang-rank{rank}-{pid}.json"


def is_hang_file_name(name: str) -> bool:
    """Whether a file name is a hang record's."""
    return HANG_FILE_PATTERN.fullmatch(name) is not None


@dataclass(frozen=True)
class HangFile:
    """One rank's hang record file, read back."""

    path: str
    rank: int
    host: str
    pid: int
    run: str
    group: str
    written_at_s: float
    reason: str
    records: tuple[RankRecord, ...]
    stacks: Mapping[str, tuple[str, ...]]
    verdict: Mapping[str, Any] | None

    @property
    def own(self) -> RankRecord:
        """This rank's own record."""
        return self.records[0]


def _field(path: str, obj: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = obj.get(name)
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise ArtifactError(f"{path}: field {name}: value {str(value)[:80]!r} has the wrong type")
    return value


def load_hang_file(path: str | Path) -> HangFile:
    """Read one hang record file; ``ArtifactError`` naming the file, field and value."""
    p = str(path)
    text = read_text_file(p, max_bytes=MAX_BYTES)
    obj = parse_json(p, "document", text, max_items=MAX_ITEMS)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ArtifactError(f"{p}: field format: not a rankwatch hang record")
    if obj.get("version") != VERSION:
        raise ArtifactError(f"{p}: field version: value {obj.get('version')!r}, expected {VERSION}")
    rank = _field(p, obj, "rank", int)
    raw_records = _field(p, obj, "records", list)
    if not raw_records or len(raw_records) > MAX_RECORDS:
        raise ArtifactError(f"{p}: field records: expected 1..{MAX_RECORDS} records")
    records = []
    for i, item in enumerate(raw_records):
        try:
            records.append(record_from_dict(item, f"records[{i}]"))
        except ValueError as exc:
            raise ArtifactError(f"{p}: {exc}") from None
    if records[0].rank != rank:
        raise ArtifactError(f"{p}: field records[0].rank: value {records[0].rank}, expected {rank}")
    raw_stacks = _field(p, obj, "stacks", dict)
    if len(raw_stacks) > MAX_THREADS:
        raise ArtifactError(f"{p}: field stacks: more than {MAX_THREADS} threads")
    stacks: dict[str, tuple[str, ...]] = {}
    for name, frames in raw_stacks.items():
        if (
            not isinstance(frames, list)
            or len(frames) > MAX_FRAMES
            or not all(isinstance(f, str) and len(f) <= 512 for f in frames)
        ):
            raise ArtifactError(f"{p}: field stacks.{str(name)[:40]}: not a list of frames")
        stacks[str(name)[:128]] = tuple(frames)
    verdict = obj.get("verdict")
    if verdict is not None and not isinstance(verdict, dict):
        raise ArtifactError(f"{p}: field verdict: expected an object or null")
    written = _field(p, obj, "written_at_s", (int, float))
    return HangFile(
        path=p,
        rank=rank,
        host=str(_field(p, obj, "host", str))[:256],
        pid=_field(p, obj, "pid", int),
        run=str(_field(p, obj, "run", str))[:256],
        group=str(_field(p, obj, "group", str))[:256],
        written_at_s=float(written),
        reason=str(_field(p, obj, "reason", str))[:64],
        records=tuple(records),
        stacks=stacks,
        verdict=verdict,
    )


def classify_files(files: Sequence[HangFile]) -> HangVerdict | None:
    """One verdict from several ranks' files: each rank's own record, and for a rank without a
    file the record the root's file holds of it; None with fewer than two ranks (one rank
    alone says where it is, not who hung: see its record). The stall is the shortest any
    rank reported."""
    own: dict[int, RankRecord] = {}
    for f in sorted(files, key=lambda f: (f.rank, f.written_at_s)):
        for record in f.records[1:]:
            own.setdefault(record.rank, record)
    for f in sorted(files, key=lambda f: (f.rank, f.written_at_s)):
        own[f.rank] = f.own
    if len(own) < 2:
        return None
    records = list(own.values())
    stalled = min(r.stalled_seconds for r in records)
    return classify_hang(records, stalled_seconds=stalled)

"""Who a run's summary blames, and what earlier attempts of the same run found.

A critical incident of a class that names a culprit (:data:`CULPRIT_CLASSES`: a straggler, a
slow node, a hang, a DeepEP localized slowdown) blames ranks and their hosts. The summary files
of a run (``summary.json``, and ``summary-attempt-<n>.json`` for the attempts before a restart;
see :mod:`.recorder`) keep those incidents, so two readers share this module:

- the run recorder of a later attempt, whose end block says what the earlier attempts found
  and whether the culprit followed the host or the rank (:func:`earlier_attempts_lines`);
- ``rankwatch hosts``, which reads many runs' folders and names the hosts that fail again and
  again (``cli/hosts.py``).

Summary files are read as untrusted (:mod:`rankwatch.diagnosis.untrusted_files`): regular files
of a bounded size, JSON bounded in depth and size, and every field used is checked, so a
hostile file is refused with an error naming the file, the field and the value.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rankwatch.diagnosis.untrusted_files import ArtifactError, parse_json, read_text_file
from rankwatch.diagnosis.vocabulary import CULPRIT_CLASSES

__all__ = [
    "ATTEMPT_SUMMARY",
    "MAX_SUMMARY_BYTES",
    "RunCulprits",
    "attempt_summary_name",
    "earlier_attempts_lines",
    "keep_earlier_attempts",
    "read_run_culprits",
    "run_culprits",
    "summary_files",
]

log = logging.getLogger(__name__)

# A run's summary holds its incidents (bounded by the tracker) and one window's report.
MAX_SUMMARY_BYTES = 16 * 1024 * 1024
_MAX_JSON_ITEMS = 2_000_000
# An earlier attempt's summary, kept when a restart writes its own summary.json.
ATTEMPT_SUMMARY = re.compile(r"summary-attempt-(\d{1,7})\.json")
_MAX_LABEL_CHARS = 256


def attempt_summary_name(attempt: int) -> str:
    """The file an earlier attempt's ``summary.json`` is kept as: ``summary-attempt-<n>.json``."""
    return f"summary-attempt-{attempt}.json"


@dataclass(frozen=True)
class RunCulprits:
    """What one attempt of one run blamed: per culprit host, the classes, the ranks, the time
    of the last incident; and every host that took part (the run's ranks, as far as known)."""

    run: str
    attempt: int
    hosts: Mapping[str, tuple[str, ...]]  # culprit host -> classes, in order
    ranks: Mapping[str, tuple[int, ...]]  # culprit host -> ranks blamed on it
    last_seen_s: Mapping[str, float]  # culprit host -> latest opening of its incidents
    participants: tuple[str, ...]  # every host of the run's ranks the summary lists
    path: str = ""


def _field(path: str, name: str, value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ArtifactError(f"{path}: {name}: expected {what}, got {value!r:.80}")
    return value


def _label(path: str, name: str, value: Any) -> str:
    text = _field(path, name, value, str, "a string")
    if len(text) > _MAX_LABEL_CHARS or any(ord(c) < 32 for c in text):
        raise ArtifactError(
            f"{path}: {name}: expected at most {_MAX_LABEL_CHARS} printable characters, "
            f"got {text!r:.80}"
        )
    return str(text)


def run_culprits(summary: Mapping[str, Any], path: str = "summary") -> RunCulprits:
    """The culprits of one summary (the mapping ``RunRecorder.summary()`` returns, or read from
    a file named ``path``); ``ArtifactError`` naming the field and value when it is malformed."""
    _field(path, "summary", summary, Mapping, "a JSON object")
    run = _field(path, "run", summary.get("run", {}), Mapping, "an object")
    name = _label(path, "run.run_id", run.get("run_id", ""))
    attempt = _field(path, "run.attempt", run.get("attempt", 0), int, "an int >= 0")
    if attempt < 0:
        raise ArtifactError(f"{path}: run.attempt: expected an int >= 0, got {attempt!r}")
    incidents = _field(path, "incidents", summary.get("incidents", []), list, "a list")
    hosts: dict[str, list[str]] = {}
    ranks: dict[str, list[int]] = {}
    last: dict[str, float] = {}
    for i, inc in enumerate(incidents):
        where = f"incidents[{i}]"
        _field(path, where, inc, Mapping, "an object")
        cls = _label(path, f"{where}.class", inc.get("class", ""))
        severity = _label(path, f"{where}.severity", inc.get("severity", ""))
        names = _field(path, f"{where}.hostnames", inc.get("hostnames", []), list, "a list")
        blamed = _field(path, f"{where}.ranks", inc.get("ranks", []), list, "a list")
        opened = _field(
            path, f"{where}.opened_at_s", inc.get("opened_at_s", 0.0), (int, float), "a number"
        )
        for j, r in enumerate(blamed):
            if _field(path, f"{where}.ranks[{j}]", r, int, "a rank (int >= 0)") < 0:
                raise ArtifactError(f"{path}: {where}.ranks[{j}]: expected a rank, got {r!r}")
        if severity != "critical" or cls not in CULPRIT_CLASSES:
            continue
        for j, host in enumerate(names):
            host = _label(path, f"{where}.hostnames[{j}]", host).lower()
            if not host:
                continue
            if cls not in hosts.setdefault(host, []):
                hosts[host].append(cls)
            ranks.setdefault(host, [])
            ranks[host] += [r for r in blamed if r not in ranks[host]]
            last[host] = max(last.get(host, 0.0), float(opened))
    participants: list[str] = []
    step = summary.get("step_time")
    if isinstance(step, Mapping):
        for k, r in enumerate(
            _field(path, "step_time.ranks", step.get("ranks", []), list, "a list")
        ):
            _field(path, f"step_time.ranks[{k}]", r, Mapping, "an object")
            host = _label(path, f"step_time.ranks[{k}].hostname", r.get("hostname", "")).lower()
            if host and host not in participants:
                participants.append(host)
    participants += [h for h in hosts if h not in participants]
    return RunCulprits(
        run=name,
        attempt=attempt,
        hosts={h: tuple(c) for h, c in hosts.items()},
        ranks={h: tuple(r) for h, r in ranks.items()},
        last_seen_s=last,
        participants=tuple(participants),
        path=path,
    )


def read_run_culprits(path: str | os.PathLike[str]) -> RunCulprits:
    """The culprits of the summary file ``path`` (untrusted: see the module docstring)."""
    text = read_text_file(path, max_bytes=MAX_SUMMARY_BYTES)
    return run_culprits(parse_json(path, "summary", text, max_items=_MAX_JSON_ITEMS), str(path))


def summary_files(folder: str | os.PathLike[str]) -> list[Path]:
    """A run folder's summaries: the earlier attempts' (``summary-attempt-<n>.json``, by
    attempt) then ``summary.json``, those that exist."""
    root = Path(folder)
    kept = []
    for entry in os.scandir(root):
        match = ATTEMPT_SUMMARY.fullmatch(entry.name)
        if match:
            kept.append((int(match[1]), root / entry.name))
    files = [p for _, p in sorted(kept)]
    if (root / "summary.json").exists():
        files.append(root / "summary.json")
    return files


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _follow(host: str, ranks: set[int], current: RunCulprits) -> str:
    """Whether this attempt's culprit is the earlier one's host or rank, or neither."""
    if host in current.hosts:
        if ranks & set(current.ranks.get(host, ())):
            return "the same rank on the same host again in this attempt"
        return "another rank on the same host in this attempt: the culprit followed the host"
    moved = sorted(r for h in current.hosts for r in current.ranks.get(h, ()) if r in ranks)
    if moved:
        hosts = sorted(h for h in current.hosts if set(current.ranks.get(h, ())) & set(moved))
        return (
            f"rank{'s' if len(moved) > 1 else ''} {_and([str(r) for r in moved])} on "
            f"{_and(hosts)} in this attempt: the culprit followed the rank"
        )
    return ""


def earlier_attempts_lines(current: RunCulprits, earlier: Sequence[RunCulprits]) -> list[str]:
    """What the earlier attempts of ``current``'s run found, for the end block: one line per
    culprit host of an earlier attempt (``attempt 2: rank 5 on node-c was the culprit
    (step_time_straggler) in attempts 0 and 1``), ending with whether this attempt's culprit
    followed the host (another rank on it) or the rank (the same rank on another host). Empty
    without earlier attempts."""
    before = sorted((e for e in earlier if e.attempt < current.attempt), key=lambda e: e.attempt)
    if not before:
        return []
    head = f"attempt {current.attempt}"
    seen: dict[str, list[RunCulprits]] = {}
    for e in before:
        for host in e.hosts:
            seen.setdefault(host, []).append(e)
    if not seen:
        noun = "attempt" if len(before) == 1 else "attempts"
        return [f"{head}: no critical culprit in {noun} {_and([str(e.attempt) for e in before])}"]
    lines = []
    for host, found in seen.items():
        ranks = sorted({r for e in found for r in e.ranks.get(host, ())})
        classes = ", ".join(sorted({c for e in found for c in e.hosts[host]}))
        who = f"rank{'s' if len(ranks) > 1 else ''} {_and([str(r) for r in ranks])}"
        who = who if ranks else "a rank"
        noun = "attempt" if len(found) == 1 else "attempts"
        line = (
            f"{head}: {who} on {host} {'were' if len(ranks) > 1 else 'was'} the culprit "
            f"({classes}) in {noun} "
            f"{_and([str(e.attempt) for e in found])}"
        )
        follow = _follow(host, set(ranks), current)
        lines.append(f"{line}; {follow}" if follow else line)
    return lines


def keep_earlier_attempts(
    folder: str | os.PathLike[str], run: str, attempt: int
) -> list[RunCulprits]:
    """The summaries in ``folder`` of ``run``'s attempts before ``attempt``, read before this
    attempt writes its own; the ``summary.json`` (and ``summary.txt``) an earlier attempt left
    is kept as ``summary-attempt-<n>.json`` (``.txt``) first. A file that cannot be read is
    skipped with one warning naming it (the end of a run must not fail on an old file)."""
    root = Path(folder)
    found: dict[int, RunCulprits] = {}
    if not root.is_dir():
        return []
    for path in summary_files(root):
        try:
            culprits = read_run_culprits(path)
        except (ArtifactError, OSError) as exc:
            log.warning("rankwatch: an earlier attempt's summary is not read: %s", exc)
            continue
        if culprits.run != run or culprits.attempt >= attempt:
            continue
        found[culprits.attempt] = culprits
        if path.name == "summary.json":
            kept = root / attempt_summary_name(culprits.attempt)
            os.replace(path, kept)
            if (root / "summary.txt").is_file():
                os.replace(root / "summary.txt", kept.with_suffix(".txt"))
            found[culprits.attempt] = replace(culprits, path=str(kept))
    return [found[a] for a in sorted(found)]

"""``rankwatch hosts``: the hosts that fail job after job, and how to keep the next job off them.

It reads the fleet's memory, a Prometheus that scraped the runs (``--prometheus URL``) or the
artifact folders the runs wrote their summaries into, and prints, per host that was the culprit
of a critical incident in at least ``--min-runs`` distinct runs with at most
``--max-healthy-runs`` runs it took part in without being one (the thresholds of
``RankwatchRepeatOffenderHost``), the evidence: runs, attempts, classes, last seen. As plain
lines, as a Slurm ``--exclude=`` list, or as the ``kubectl cordon`` / ``kubectl taint`` commands
to run. It never acts itself: a restart hook or an Alertmanager webhook decides (docs/fleet.md).

Host names are printed into shell commands, so every one is checked to be a host name (letters,
digits, ``-`` and ``.``) before anything is printed; a label or file that carries anything else
is refused in one line naming it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rankwatch.diagnosis.untrusted_files import ArtifactError
from rankwatch.diagnosis.vocabulary import CULPRIT_CLASSES
from rankwatch.exporter.assets.settings import Settings, duration_seconds
from rankwatch.exporter.cli.exits import EXIT_OK, UsageError
from rankwatch.exporter.cli.prometheus_api import PrometheusReader, read_secret_file
from rankwatch.exporter.publish.catalogue import METRIC_NAMES as M
from rankwatch.exporter.publish.culprits import RunCulprits, read_run_culprits, summary_files

__all__ = ["HostRecord", "add_hosts_parser", "cmd_hosts", "ledger", "offenders"]

_DEFAULTS = Settings()
# A DNS name as Kubernetes and Slurm name nodes: what may go into a printed command.
_HOST = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?")
# A taint as kubectl takes it: key=value:effect.
_TAINT = re.compile(
    r"([a-z0-9]([a-z0-9.-]*[a-z0-9])?/)?[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?"
    r"=[A-Za-z0-9._-]{0,63}:(NoSchedule|PreferNoSchedule|NoExecute)"
)
DEFAULT_TAINT = "rankwatch.io/repeat-offender=true:NoSchedule"
# Subfolders looked into when a given folder holds no summary itself (a parent of run folders).
_MAX_SUBFOLDERS = 100_000


@dataclass
class HostRecord:
    """What the runs say about one host: the runs and attempts it was the culprit in, the
    classes, when it was last named, and the runs it took part in at all."""

    hostname: str
    runs: set[str] = field(default_factory=set)
    attempts: set[tuple[str, int]] = field(default_factory=set)
    classes: set[str] = field(default_factory=set)
    last_seen_s: float = 0.0
    took_part: set[str] = field(default_factory=set)

    @property
    def healthy_runs(self) -> int:
        """Runs it took part in without being the culprit in any of their attempts."""
        return len(self.took_part - self.runs)


def _host(name: str, where: str) -> str:
    host = name.strip().lower()
    if not _HOST.fullmatch(host):
        raise UsageError(f"{where}: hostname {name!r:.80} is not a host name")
    return host


def ledger(runs: Iterable[RunCulprits]) -> dict[str, HostRecord]:
    """Per culprit host, its record over ``runs`` (each attempt of each run one item)."""
    records: dict[str, HostRecord] = {}
    taking_part: dict[str, set[str]] = {}
    for run in runs:
        where = run.path or f"run {run.run!r}"
        for raw in run.participants:
            for name in raw.split(","):
                if name.strip():
                    taking_part.setdefault(_host(name, where), set()).add(run.run)
        for raw, classes in run.hosts.items():
            for name in raw.split(","):  # an incident that named several hosts
                if not name.strip():
                    continue
                rec = records.setdefault(_host(name, where), HostRecord(_host(name, where)))
                rec.runs.add(run.run)
                rec.attempts.add((run.run, run.attempt))
                rec.classes.update(classes)
                rec.last_seen_s = max(rec.last_seen_s, run.last_seen_s.get(raw, 0.0))
    for host, rec in records.items():
        rec.took_part = taking_part.get(host, set()) | rec.runs
    return records


def offenders(
    records: dict[str, HostRecord], min_runs: int, max_healthy_runs: int
) -> list[HostRecord]:
    """The hosts of ``records`` the alert would name, the worst first."""
    found = [
        r
        for r in records.values()
        if len(r.runs) >= min_runs and r.healthy_runs <= max_healthy_runs
    ]
    return sorted(found, key=lambda r: (-len(r.runs), -len(r.attempts), r.hostname))


# --- reading ----------------------------------------------------------------------------------


def _folder_runs(folders: Sequence[Path], window_s: float, now_s: float) -> list[RunCulprits]:
    """The summaries of ``folders`` (each a run's artifact folder, or a folder of them)."""
    runs = []
    for folder in folders:
        if not folder.is_dir():
            raise UsageError(f"{folder}: not a folder of run summaries")
        files = summary_files(folder)
        if not files:
            subfolders = sorted(p for p in folder.iterdir() if p.is_dir())[:_MAX_SUBFOLDERS]
            files = [f for sub in subfolders for f in summary_files(sub)]
        for path in files:
            try:
                run = read_run_culprits(path)
            except ArtifactError as exc:
                raise UsageError(str(exc)) from None
            except OSError as exc:
                raise UsageError(f"{path}: cannot be read ({exc.strerror or exc})") from None
            written = _written_at(path)
            if written is None or now_s - written <= window_s:
                runs.append(run)
    return runs


def _written_at(path: Path) -> float | None:
    # The file's own time: the summary is written once, when its attempt ends.
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _label(sample: object, name: str, url: str) -> str:
    metric = sample.get("metric") if isinstance(sample, dict) else None
    value = metric.get(name) if isinstance(metric, dict) else None
    if not isinstance(value, str):
        raise UsageError(f"--prometheus {url}: an answer without the label {name!r}")
    return value


def _value(sample: object, url: str) -> float:
    try:
        return float(sample["value"][1])  # type: ignore[index]
    except (TypeError, KeyError, IndexError, ValueError):
        raise UsageError(
            f"--prometheus {url}: an answer without a value ({sample!r:.80})"
        ) from None


def _time(sample: object, url: str) -> float:
    """The evaluation time of an instant query's sample (when it was seen: now)."""
    try:
        return float(sample["value"][0])  # type: ignore[index]
    except (TypeError, KeyError, IndexError, ValueError):
        raise UsageError(f"--prometheus {url}: an answer without a time ({sample!r:.80})") from None


def _prometheus_runs(reader: PrometheusReader, window: str, selector: str) -> list[RunCulprits]:
    """The culprit runs and the runs each culprit host took part in, from Prometheus."""
    classes = json.dumps("|".join(CULPRIT_CLASSES))
    matchers = ", ".join(
        m for m in (selector, f'severity="critical", class=~{classes}, hostname!=""') if m.strip()
    )
    incidents = f"{M.incident_active}{{{matchers}}}"
    by = "hostname, run, attempt, class"
    named = reader.query(f"max by ({by}) (max_over_time({incidents}[{window}]))")
    # When each was last open, on a 1-minute grid: a subquery's steps are aligned to the
    # minute, so one that opened after the last step is not in it (it is open now: the
    # answer's own time, below).
    last_open = {
        tuple(_label(s, k, reader.url) for k in ("hostname", "run", "attempt", "class")): s
        for s in reader.query(f"max by ({by}) (max_over_time(timestamp({incidents})[{window}:1m]))")
    }
    part = ", ".join(m for m in (selector, 'hostname!=""') if m.strip())
    hosts = f"group by (hostname) (max_over_time({incidents}[{window}]))"
    present = reader.query(
        f"group by (hostname, run) (max_over_time({M.phase_seconds}{{{part}}}[{window}])) "
        f"and on (hostname) {hosts}"
    )
    url = reader.url
    runs: dict[tuple[str, int], RunCulprits] = {}
    for sample in named:
        host, run, cls = (_label(sample, k, url) for k in ("hostname", "run", "class"))
        raw_attempt = _label(sample, "attempt", url) or "0"
        at = last_open.get((host, run, _label(sample, "attempt", url), cls))
        last_s = _value(at, url) if at is not None else _time(sample, url)
        if not raw_attempt.isdigit():
            raise UsageError(
                f"--prometheus {url}: label attempt={raw_attempt!r:.40} of run {run!r}"
            )
        key = (run, int(raw_attempt))
        known = runs.get(key) or RunCulprits(run, key[1], {}, {}, {}, ())
        hosts_of = {**known.hosts, host: tuple(sorted({*known.hosts.get(host, ()), cls}))}
        seen = {**known.last_seen_s, host: max(known.last_seen_s.get(host, 0.0), last_s)}
        runs[key] = RunCulprits(run, key[1], hosts_of, {}, seen, (), f"--prometheus {url}")
    took_part = [
        RunCulprits(
            _label(s, "run", url),
            0,
            {},
            {},
            {},
            (_label(s, "hostname", url),),
            f"--prometheus {url}",
        )
        for s in present
    ]
    return [*runs.values(), *took_part]


# --- printing ---------------------------------------------------------------------------------


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t > 0 else "unknown"


def _with_attempts(run: str, attempts: list[int]) -> str:
    """``r3`` for a run's first attempt alone, else ``r3 (attempts 0, 1)``."""
    if attempts == [0]:
        return run
    noun = "attempt" if len(attempts) == 1 else "attempts"
    return f"{run} ({noun} {', '.join(str(a) for a in attempts)})"


def _plain(found: Sequence[HostRecord]) -> list[str]:
    lines = []
    for r in found:
        runs = ", ".join(
            _with_attempts(run, [a for rr, a in sorted(r.attempts) if rr == run])
            for run in sorted(r.runs)
        )
        lines.append(
            f"{r.hostname}: culprit in {len(r.runs)} runs ({len(r.attempts)} attempts), healthy "
            f"in {r.healthy_runs}; classes {', '.join(sorted(r.classes))}; last seen "
            f"{_when(r.last_seen_s)}; runs {runs}"
        )
    return lines


def _commands(found: Sequence[HostRecord], fmt: str, taint: str) -> list[str]:
    hosts = [r.hostname for r in found]
    if fmt == "plain":
        return _plain(found)
    if fmt == "slurm":
        return [f"--exclude={','.join(hosts)}"] if hosts else []
    if taint:
        return [f"kubectl taint nodes {h} {taint}" for h in hosts]
    return [f"kubectl cordon {h}" for h in hosts]


def add_hosts_parser(sub: argparse._SubParsersAction) -> None:
    """The ``hosts`` subcommand's arguments."""
    hosts = sub.add_parser(
        "hosts",
        help="the hosts that fail run after run, and what to exclude next time",
        description="Print the hosts that were the culprit of a critical incident (a "
        "straggler, a slow node, a hang, a DeepEP localized slowdown) in at least --min-runs "
        "distinct runs, with at most --max-healthy-runs runs they took part in without being "
        "one, read from a Prometheus or from run artifact folders. Plain lines with the "
        "evidence, a Slurm --exclude= list, or the kubectl commands to run; nothing is done.",
    )
    hosts.add_argument(
        "folders",
        nargs="*",
        type=Path,
        metavar="DIR",
        help="artifact folders (RANKWATCH_ARTIFACT_DIR of each run, or folders of them)",
    )
    hosts.add_argument("--prometheus", metavar="URL", help="read the runs from this Prometheus")
    hosts.add_argument("--user", default="", help="basic auth user for --prometheus")
    hosts.add_argument("--password-file", type=Path, help="file holding the basic auth password")
    hosts.add_argument(
        "--bearer-token-file", type=Path, help="file holding a bearer token for --prometheus"
    )
    hosts.add_argument("--ca-file", default="", help="CA certificate file for an https URL")
    hosts.add_argument("--timeout-seconds", type=float, default=30.0, help="per query (default 30)")
    hosts.add_argument(
        "--selector",
        default="",
        help="label matchers every query carries, e.g. 'job=\"train\"' (default: none)",
    )
    hosts.add_argument(
        "--window",
        default=_DEFAULTS.ledger_window,
        help=f"how far back runs count (default {_DEFAULTS.ledger_window})",
    )
    hosts.add_argument(
        "--min-runs",
        type=int,
        default=_DEFAULTS.repeat_offender_runs,
        help=f"culprit runs from which a host is listed (default {_DEFAULTS.repeat_offender_runs})",
    )
    hosts.add_argument(
        "--max-healthy-runs",
        type=int,
        default=_DEFAULTS.repeat_offender_healthy_runs,
        help=f"most runs without being the culprit (default "
        f"{_DEFAULTS.repeat_offender_healthy_runs})",
    )
    hosts.add_argument(
        "--format", choices=("plain", "slurm", "kubectl"), default="plain", dest="fmt"
    )
    hosts.add_argument(
        "--taint",
        nargs="?",
        const=DEFAULT_TAINT,
        default="",
        metavar="KEY=VALUE:EFFECT",
        help=f"with --format kubectl: taint instead of cordon (default {DEFAULT_TAINT})",
    )
    hosts.set_defaults(handler=cmd_hosts)


def _reader(args: argparse.Namespace) -> PrometheusReader:
    password = token = ""
    if args.password_file is not None:
        if not args.user:
            raise UsageError("--password-file: needs --user")
        password = read_secret_file("--password-file", args.password_file)
    elif args.user:
        raise UsageError(f"--user {args.user!r}: needs --password-file")
    if args.bearer_token_file is not None:
        if args.user:
            raise UsageError("--bearer-token-file: not together with --user")
        token = read_secret_file("--bearer-token-file", args.bearer_token_file)
    if not 0 < args.timeout_seconds <= 3600:
        raise UsageError(f"--timeout-seconds: expected > 0 and <= 3600, got {args.timeout_seconds}")
    return PrometheusReader(
        args.prometheus, args.user, password, token, args.ca_file, args.timeout_seconds
    )


def cmd_hosts(args: argparse.Namespace) -> int:
    """``rankwatch hosts``: see the module docstring."""
    if bool(args.prometheus) == bool(args.folders):
        raise UsageError("give either --prometheus URL or artifact folders (DIR ...), not both")
    try:
        window_s = duration_seconds(args.window)
    except ValueError as exc:
        raise UsageError(f"--window: {exc}") from None
    for name, value, low in (
        ("--min-runs", args.min_runs, 1),
        ("--max-healthy-runs", args.max_healthy_runs, 0),
    ):
        if not low <= value <= 10_000:
            raise UsageError(f"{name}: expected {low} to 10000, got {value}")
    if args.taint and args.fmt != "kubectl":
        raise UsageError(f"--taint: only with --format kubectl, got --format {args.fmt}")
    if args.taint and not _TAINT.fullmatch(args.taint):
        raise UsageError(
            f"--taint: expected KEY=VALUE:EFFECT (NoSchedule, ...), got {args.taint!r}"
        )
    if args.selector and not re.fullmatch(r'\s*\w+\s*(=|!=|=~|!~)\s*"[^"{}]*"\s*', args.selector):
        raise UsageError(
            f'--selector: expected one label matcher such as job="x", got {args.selector!r}'
        )
    if args.prometheus:
        runs = _prometheus_runs(_reader(args), args.window, args.selector)
    else:
        runs = _folder_runs(args.folders, window_s, time.time())
    found = offenders(ledger(runs), args.min_runs, args.max_healthy_runs)
    for line in _commands(found, args.fmt, args.taint):
        print(line)
    if not found:
        print(
            f"rankwatch hosts: no host was the culprit in {args.min_runs} runs or more "
            f"(with at most {args.max_healthy_runs} healthy) within {args.window}",
            file=sys.stderr,
        )
    return EXIT_OK

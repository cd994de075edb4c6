"""The ``rankwatch`` command: demo, diagnose, heatmap, replay, config, assets.

Exit codes: 0 success, 1 a failure while running, 2 bad arguments or configuration (the message
names the option and the value), a refused window file (one line naming the file, the field and
the value; ``replay`` reports each and goes on) or a missing optional extra (the message names
the ``pip install`` that adds it), 130 the demo was interrupted with Ctrl-C (after writing its
summary). Heavy imports (torch, matplotlib) happen inside the subcommand that needs them, so
``rankwatch config`` and argument errors answer instantly.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import rankwatch

__all__ = ["format_value", "main"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


def _version() -> str:
    return rankwatch.__version__


# Optional extras: the import names each one provides (what a command needs to run).
EXTRAS: dict[str, tuple[str, ...]] = {
    "demo": ("rich", "matplotlib", "PIL"),
    "heatmap": ("matplotlib", "PIL"),
}
_DISTRIBUTIONS = {"PIL": "pillow"}


def require_extra(extra: str) -> None:
    """Raise :class:`UsageError` naming the ``pip install`` to run when ``extra`` is missing."""
    missing = [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        names = ", ".join(_DISTRIBUTIONS.get(m, m) for m in missing)
        raise UsageError(
            f"needs the optional packages of the {extra!r} extra ({names} not installed): "
            f"pip install 'rankwatch[{extra}]'"
        )


def format_value(value: Any) -> str:
    """A config value the way a user would write it in the environment (1/0, (empty))."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if value == "":
        return "(empty)"
    return str(value)


def _secret_shown(value: str) -> str:
    """What ``rankwatch config`` shows of a secret: whether it is set, never the value."""
    return "(hidden)" if value else ""


# --- argument types: each error names the option and the value --------------------------------


# argparse prefixes each message with "argument --option:", so they name only the problem.


def _number(raw: str, kind: Callable[[str], float]) -> float:
    try:
        value = kind(raw)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {noun}, got {raw!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {raw!r}")
    return value


def _positive(unit: str) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        value = _number(raw, float)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0 {unit}, got {raw!r}")
        return value

    return parse


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(_number(raw, int))
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}, got {raw!r}")
        return value

    return parse


def _bind_address(raw: str) -> str:
    # The rule RANKWATCH_METRICS_ADDR follows, so the message names --addr rather than it.
    from rankwatch.exporter.config import bind_address_problem

    problem = bind_address_problem(raw)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{problem}, got {raw!r}")
    return raw


def _timeline(raw: str) -> Any:
    from rankwatch.exporter.cli.demo_plan import parse_timeline

    try:
        return parse_timeline(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _existing_dir(raw: str) -> Path:
    path = Path(raw)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"no such directory: {raw!r}")
    return path


# --- the parser ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The full ``rankwatch`` argument parser (also used to document the options)."""
    from rankwatch.exporter.cli.demo_plan import SCENARIOS

    parser = argparse.ArgumentParser(
        prog="rankwatch",
        description="Find the slow rank in distributed PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"rankwatch {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser(
        "demo",
        help="run the demo job: a small Gloo world with scripted stragglers",
        description="Spawn a small multi-rank job with a scripted timeline of stragglers, "
        "beside a DeepEP group simulated at EP 16 over two nodes (whatever --ranks is) going "
        "through five DeepEP phases; serve /metrics, show a live table, write artifacts and a "
        "summary.",
        epilog="Timeline phases: balanced, input (the straggler sleeps in its data loading), "
        "compute (its forward pass is slowed). Exit codes: 0 done, 1 a rank failed, 2 bad "
        "arguments or configuration, 130 interrupted (Ctrl-C; the summary is still written).",
    )
    demo.add_argument(
        "--duration",
        type=_positive("seconds"),
        default=None,
        metavar="SECONDS",
        help="how long the timeline lasts; its phases are scaled to fit (default 60, or the sum "
        "of --timeline)",
    )
    demo.add_argument(
        "--ranks",
        type=_int_in(2, 8),
        default=4,
        metavar="N",
        help="training ranks, 2..8 (default 4)",
    )
    demo.add_argument(
        "--port",
        type=_int_in(0, 65535),
        default=9464,
        help="/metrics port; 0 picks a free one (default 9464)",
    )
    demo.add_argument(
        "--addr",
        type=_bind_address,
        default="127.0.0.1",
        metavar="ADDRESS",
        help="/metrics address (127.0.0.1; 0.0.0.0 for every interface)",
    )
    demo.add_argument(
        "--out",
        type=Path,
        default=Path("rankwatch-out"),
        metavar="DIR",
        help="output folder (default rankwatch-out)",
    )
    demo.add_argument(
        "--straggler-rank",
        type=_int_in(0, 7),
        default=1,
        metavar="R",
        help="the rank the timeline slows down (default 1)",
    )
    demo.add_argument(
        "--straggler-ms",
        type=_positive("ms"),
        default=40.0,
        metavar="MS",
        help="extra milliseconds per step of the slowed rank (default 40)",
    )
    demo.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="full",
        metavar="NAME",
        help=f"named timeline: {', '.join(sorted(SCENARIOS))} (default full)",
    )
    demo.add_argument(
        "--timeline",
        type=_timeline,
        default=None,
        metavar="SPEC",
        help="explicit timeline, e.g. balanced:10,input:30,balanced:20 (replaces --scenario)",
    )
    demo.add_argument(
        "--interval",
        type=_positive("seconds"),
        default=1.0,
        metavar="SECONDS",
        help="seconds between windows (default 1)",
    )
    demo.add_argument(
        "--plain", action="store_true", help="one line per window instead of the live table"
    )
    demo.set_defaults(handler=_cmd_demo)

    diagnose = sub.add_parser(
        "diagnose",
        help="diagnose one saved window (DeepEP NPZ or step-time JSON)",
        description="Diagnose a saved DeepEP normal-mode window (.npz) or step-time window "
        "(.json) and print the result.",
    )
    # The loaders check the file (regular, within its bounds) and refuse it in one line.
    diagnose.add_argument("window", type=Path, metavar="WINDOW")
    diagnose.add_argument("--json", action="store_true", help="print the full report as JSON")
    diagnose.set_defaults(handler=_cmd_diagnose)

    # Listed for --help only: main() hands `heatmap ...` to the heatmap tool before parsing.
    sub.add_parser("heatmap", help="render heatmaps of a saved DeepEP window (see heatmap -h)")

    replay = sub.add_parser(
        "replay",
        help="re-diagnose every saved window of a folder, in order",
        description="Re-diagnose the saved windows of DIR (NPZ and step-time JSON) in window "
        "order, one line each, then a summary. A file that cannot be read is reported on its "
        "own line and the others are still replayed; the exit code is then 2.",
    )
    replay.add_argument("dir", type=_existing_dir, metavar="DIR")
    replay.add_argument("--json", action="store_true", help="one JSON object per window")
    replay.set_defaults(handler=_cmd_replay)

    config = sub.add_parser(
        "config",
        help="print the effective configuration and every environment variable",
        description="Print every environment variable rankwatch reads, its effective value "
        "and its default.",
    )
    config.add_argument("--json", action="store_true", help="print as JSON")
    config.set_defaults(handler=_cmd_config)

    assets = sub.add_parser(
        "assets",
        help="write out the shipped dashboards, alert rules and deploy manifests",
        description="The Grafana dashboards, Prometheus alert and recording rules, and deploy "
        "manifests of this version, as files: the same as the dashboards/ and deploy/ folders "
        "of a clone.",
    )
    assets_sub = assets.add_subparsers(dest="action", metavar="ACTION")
    assets_sub.required = True
    export = assets_sub.add_parser(
        "export",
        help="write every asset under DIR (dashboards/..., deploy/...)",
        description="Write every asset under DIR, keeping the repository layout. A file "
        "already there with other content is refused unless --force. The dashboards, the rule "
        "file and their Kubernetes objects are rendered from the options below and the "
        "diagnosis thresholds of the environment (RANKWATCH_*, DEEPEP_DIAGNOSE_*); with "
        "neither they are the shipped files.",
    )
    export.add_argument("dir", type=Path, metavar="DIR")
    export.add_argument(
        "--force", action="store_true", help="overwrite files whose content differs"
    )
    export.add_argument(
        "--for",
        dest="for_",
        action="append",
        default=[],
        metavar="ALERT=DURATION",
        help="an alert's for: (pending time before it fires), e.g. "
        "RankwatchStepTimeStragglerCritical=30s; repeatable",
    )
    export.add_argument(
        "--keep-firing-for",
        action="append",
        default=[],
        metavar="ALERT=DURATION",
        help="an alert's keep_firing_for: (hold after its condition clears); repeatable",
    )
    export.add_argument("--runbook-url", help="the runbooks page the alerts and panels link to")
    export.add_argument(
        "--job-selector", help="the label matcher of the rules' selectors, e.g. 'job=\"train\"'"
    )
    export.add_argument(
        "--stale-window-seconds",
        type=int,
        help="window age from which RankwatchNoFreshWindows counts (default 180)",
    )
    export.add_argument(
        "--settings",
        type=Path,
        metavar="FILE",
        help="a JSON object of the same settings (for, keep_firing_for, runbook_url, ...); "
        "options win",
    )
    export.set_defaults(handler=_cmd_assets_export)
    listing = assets_sub.add_parser("list", help="list the shipped files")
    listing.set_defaults(handler=_cmd_assets_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``rankwatch`` command; returns the process exit code."""
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["heatmap"]:
        # The heatmap tool owns its arguments (including --help); hand them over untouched.
        return _cmd_heatmap(argparse.Namespace(args=args_in[1:]))
    parser = build_parser()
    try:
        args = parser.parse_args(args_in)
    except SystemExit as exc:  # argparse already printed usage and the error
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except UsageError as exc:
        print(f"rankwatch {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `rankwatch replay DIR | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


# --- subcommands -----------------------------------------------------------------------------


def _cmd_config(args: argparse.Namespace) -> int:
    from rankwatch.exporter.config import RankwatchConfig, config_options, redacted_url
    from rankwatch.exporter.identity import run_name_from_env
    from rankwatch.exporter.run_name import AT_START

    try:
        # The one object the collectors read (DeepEP settings included, as cfg.deepep).
        cfg = RankwatchConfig.from_env()
    except (ValueError, TypeError) as exc:
        raise UsageError(f"invalid configuration: {exc}") from None
    rows = [
        {
            "variable": opt.env,
            "option": opt.label,
            # A secret's value is never printed: this output gets pasted into tickets.
            "value": _secret_shown(opt.value_in(cfg)) if opt.secret else opt.value_in(cfg),
            "default": opt.default,
            "set": opt.env in os.environ,
        }
        for opt in config_options()
    ]
    run = run_name_from_env()
    # Nothing in the environment names the run: under torch.distributed rank 0 will (run_name).
    source = run.source if cfg.run_id else AT_START
    if args.json:
        doc = {
            "version": _version(),
            "run": {"name": cfg.run_id, "source": source},
            "variables": rows,
        }
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    width = max(len(r["variable"]) for r in rows)
    vwidth = max(len(format_value(r["value"])) for r in rows)
    dwidth = max(len(format_value(r["default"])) for r in rows)
    print(f"rankwatch {_version()}: effective configuration (* = set in the environment)")
    print(f"  {'VARIABLE':<{width}}  {'VALUE':<{vwidth}}  {'DEFAULT':<{dwidth}}  OPTION")
    for r in rows:
        mark = "*" if r["set"] else " "
        print(
            f"{mark} {r['variable']:<{width}}  {format_value(r['value']):<{vwidth}}  "
            f"{format_value(r['default']):<{dwidth}}  {r['option']}"
        )
    if cfg.run_id:
        print(f"Run name: {cfg.run_id} (from {run.source})")
    else:
        print(
            "Run name: none in the environment (no RANKWATCH_RUN_ID, Slurm, Kubernetes Job or "
            f"torchrun run id); {AT_START}"
        )
    print("OTLP push: standard OTEL_EXPORTER_OTLP_* variables; endpoint", end=" ")
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    print(redacted_url(endpoint) if endpoint else "unset (no push)")
    return EXIT_OK


def _cmd_assets_export(args: argparse.Namespace) -> int:
    from rankwatch.diagnosis.config import DiagnosisConfig
    from rankwatch.exporter.cli.assets import export_assets, list_assets, settings_from_options

    try:
        settings = settings_from_options(
            args.settings,
            for_=args.for_,
            keep_firing_for=args.keep_firing_for,
            runbook_url=args.runbook_url,
            job_selector=args.job_selector,
            stale_window_seconds=args.stale_window_seconds,
        )
        config = DiagnosisConfig.from_env()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        written = export_assets(args.dir, force=args.force, settings=settings, config=config)
    except FileNotFoundError as exc:
        print(f"rankwatch assets: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as exc:
        raise UsageError(f"DIR {str(args.dir)!r}: {exc}") from None
    total = len(list_assets())
    print(
        f"rankwatch {_version()}: {total} asset files in {args.dir} "
        f"({len(written)} written, {total - len(written)} already up to date)"
    )
    return EXIT_OK


def _cmd_assets_list(args: argparse.Namespace) -> int:
    from rankwatch.exporter.cli.assets import list_assets

    for asset in list_assets():
        print(asset.relative)
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from rankwatch.exporter.cli.demo import preflight, run_demo
    from rankwatch.exporter.cli.demo_plan import DemoOptions, scenario_timeline

    require_extra("demo")
    if args.straggler_rank >= args.ranks:
        raise UsageError(
            f"--straggler-rank must be below --ranks ({args.ranks}), got {args.straggler_rank}"
        )
    if args.timeline is not None:
        timeline = args.timeline if args.duration is None else args.timeline.scaled(args.duration)
    else:
        timeline = scenario_timeline(args.scenario, args.duration or 60.0)
    options = DemoOptions(
        ranks=args.ranks,
        timeline=timeline,
        port=args.port,
        addr=args.addr,
        out=args.out,
        straggler_rank=args.straggler_rank,
        straggler_ms=args.straggler_ms,
        interval_seconds=args.interval,
        live=None if not args.plain else False,
    )
    try:
        preflight(options)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"invalid configuration: {exc}") from None
    except OSError as exc:
        raise UsageError(f"--addr/--port: {exc.strerror or exc}") from None
    return run_demo(options)


def _cmd_heatmap(args: argparse.Namespace) -> int:
    from rankwatch.exporter.cli import heatmap

    if not {"-h", "--help"} & set(args.args):
        try:
            require_extra("heatmap")
        except UsageError as exc:
            print(f"rankwatch heatmap: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    return int(heatmap.main(list(args.args)))


def _refusal(path: Path, exc: BaseException) -> str:
    """What is wrong with ``path``, once: loader errors already start with the file name."""
    text = str(exc)
    if isinstance(exc, FileNotFoundError):
        return "no such file"
    return text[len(str(path)) + 2 :] if text.startswith(f"{path}: ") else text


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from rankwatch.diagnosis.hang.artifact import is_hang_file_name, load_hang_file

    try:
        if args.window.suffix == ".npz":
            data, text = _diagnose_npz(args.window)
        elif is_hang_file_name(args.window.name):
            data, text = _diagnose_hang_files([load_hang_file(args.window)])
        elif args.window.suffix == ".json":
            data, text = _diagnose_step_json(args.window)
        else:
            raise ValueError(
                f"unknown window type {args.window.suffix!r}: expected a DeepEP window (.npz) "
                "or a step-time window (.json)"
            )
    except (ValueError, TypeError, OSError) as exc:
        raise UsageError(f"WINDOW {str(args.window)!r}: {_refusal(args.window, exc)}") from None
    if args.json:
        print(json.dumps(data, indent=2, allow_nan=False))
    else:
        print(text)
    return EXIT_OK


def _verdict_lines(verdict: Any) -> list[str]:
    sev = f" [{verdict.severity}]" if verdict.severity else ""
    return [
        f"verdict: {verdict.what}{sev}",
        f"  why: {verdict.why}",
        f"  what to do: {verdict.action}",
    ]


def _anomaly_text(anomaly: Any) -> str:
    if anomaly.scope == "rank":
        return f"rank {anomaly.src} ratio {anomaly.factor:.3g}"
    where = "" if anomaly.src is None else f" {anomaly.src}"
    if anomaly.dst is not None:
        where += f"->{anomaly.dst}" if anomaly.src is not None else f" {anomaly.dst}"
    return f"{anomaly.scope}{where} x{anomaly.factor:.3g}"


def _diagnose_npz(path: Path) -> tuple[dict[str, Any], str]:
    from rankwatch.diagnosis.config import NormalConfig
    from rankwatch.diagnosis.deepep.artifact import load_window_artifact
    from rankwatch.diagnosis.deepep.normal import NormalDiagnoser
    from rankwatch.exporter.publish.verdicts import normal_verdict

    window, saved, meta = load_window_artifact(path)
    report = NormalDiagnoser(NormalConfig.from_env()).diagnose(window)
    verdict = normal_verdict(report)
    lines = [
        f"DeepEP normal-mode window {window.window_index} (EP{window.ep_size}, "
        f"{window.ranks_per_node} ranks per node): {path}"
    ]
    for name, result in report.probes.items():
        detail = ""
        if result.anomalies:
            detail = ": " + ", ".join(_anomaly_text(a) for a in result.anomalies)
        elif result.detail:
            detail = f": {result.detail}"
        lines.append(f"  {name:<24} {result.status}{detail}")
    lines.extend(_verdict_lines(verdict))
    lines.append(
        "note: global slowdown needs earlier normal windows as a reference; "
        "`rankwatch replay DIR` re-diagnoses a run's windows in order."
    )
    data = {
        "kind": "deepep_normal",
        "path": str(path),
        "window_index": window.window_index,
        "verdict": verdict.to_dict(),
        "report": report.to_dict(include_arrays=False),
        "saved_diagnosis": saved,
        "created_at_s": meta.created_at_s,
    }
    return data, "\n".join(lines)


def _diagnose_step_json(path: Path) -> tuple[dict[str, Any], str]:
    from rankwatch.diagnosis.step_time.artifact import load_window
    from rankwatch.exporter.publish.verdicts import step_verdict

    saved = load_window(path)
    report = saved.diagnose()
    verdict = step_verdict(report)
    lines = [
        f"Step-time window ({len(report.ranks)} ranks, {report.steps} steps, {report.clock} "
        f"clock, {report.strategy}): {path}",
        "  rank  " + "".join(f"{c:>12}" for c in _STEP_COLUMNS),
    ]
    for rank in sorted(report.rank_means):
        means = report.rank_means[rank]
        cells = "".join(
            f"{'-' if means.get(c) is None else format(means[c], '.2f'):>12}" for c in _STEP_COLUMNS
        )
        lines.append(f"  {rank:>4}  {cells}")
    lines.append(f"  (milliseconds per step)  kind: {report.kind}")
    lines.extend(_verdict_lines(verdict))
    data = {
        "kind": "step_time",
        "path": str(path),
        "verdict": verdict.to_dict(),
        "report": report.to_dict(),
        "saved_report": saved.report,
        "meta": saved.meta,
    }
    return data, "\n".join(lines)


_STEP_COLUMNS = ("input_wait", "forward", "backward", "optimizer", "step", "visible")


def _diagnose_hang_files(files: list[Any]) -> tuple[dict[str, Any], str]:
    """Hang record files (one rank's, or a run's): the verdict their ranks' records give."""
    from rankwatch.diagnosis.hang.artifact import classify_files
    from rankwatch.diagnosis.hang.words import hang_line

    verdict = classify_files(files)
    group = files[0].group if files else ""
    if verdict is None:
        # One rank alone: where it was, not who hung.
        if not files:
            return {"kind": "hang", "records": []}, "no hang records"
        rec = files[0].own
        where = (
            f" in {rec.collective.op} #{rec.collective.seq} of group {rec.collective.group}"
            if rec.collective
            else ""
        )
        text = (
            f"rank {rec.rank} (host {rec.host}, pid {rec.pid}): phase {rec.phase or '?'} for "
            f"{rec.phase_seconds:.1f} s{where}; no progress for {rec.stalled_seconds:.1f} s; "
            f"top frame: {rec.frames[0] if rec.frames else rec.frames_note or 'none'} "
            "(one rank's record: give every rank's file for the verdict)"
        )
        return {"kind": "hang", "files": [f.path for f in files], "record": rec.to_dict()}, text
    budget = max(f.own.budget_seconds for f in files)
    text = hang_line(verdict, group=group, budget_seconds=budget)
    ranks = sorted({f.rank for f in files})
    live = next((f.verdict for f in files if f.verdict), None)
    data = {
        "kind": "hang",
        "files": [f.path for f in files],
        "ranks_with_records": ranks,
        "verdict": verdict.evidence(verdict.stalled_seconds),
        "hang_class": verdict.hang_class,
        "culprit_ranks": list(verdict.ranks),
        "live_verdict": live,
    }
    lines = [text, f"from the records of rank(s) {', '.join(str(r) for r in ranks)}"]
    if live:
        lines.append(
            f"live verdict on the root: {live.get('hang_class')} {live.get('message', '')}"
        )
    return data, "\n".join(lines)


def _cmd_replay(args: argparse.Namespace) -> int:
    from rankwatch.diagnosis.config import NormalConfig
    from rankwatch.diagnosis.deepep.artifact import load_window_artifact
    from rankwatch.diagnosis.deepep.normal import NormalDiagnoser
    from rankwatch.diagnosis.hang.artifact import is_hang_file_name, load_hang_file
    from rankwatch.diagnosis.step_time.artifact import is_step_time_file, load_window
    from rankwatch.exporter.publish.verdicts import describe_normal, describe_step

    failures = 0

    def emit(obj: dict[str, Any], text: str) -> None:
        print(json.dumps(obj, allow_nan=False) if args.json else text, flush=True)

    def refuse(p: Path, exc: BaseException) -> None:
        nonlocal failures
        failures += 1
        reason = _refusal(p, exc)
        emit({"path": str(p), "error": reason}, f"{p}: error: {reason}")

    npz_files, json_files = _saved_window_names(args.dir)
    hang_names = [p for p in json_files if is_hang_file_name(p.name)]
    json_files = [p for p in json_files if not is_hang_file_name(p.name)]
    hang_files = []
    for p in hang_names:
        try:
            hang_files.append(load_hang_file(p))
        except (ValueError, OSError) as exc:
            refuse(p, exc)
    step_files = []
    for p in json_files:
        try:
            if is_step_time_file(p):  # other JSON documents are not ours: left alone
                step_files.append(p)
        except (ValueError, OSError) as exc:
            refuse(p, exc)
    if hang_files:
        data, text = _diagnose_hang_files(hang_files)
        emit(data, text)
    if not npz_files and not step_files and not hang_files and not failures:
        raise UsageError(
            f"DIR {str(args.dir)!r}: no saved windows (DeepEP *.npz or step-time *.json) in it"
        )

    # DeepEP windows go through one diagnoser in window order, so the global-slowdown history
    # builds up exactly as it did live.
    loaded = []
    for p in npz_files:
        try:
            window, saved, meta = load_window_artifact(p)
        except (ValueError, OSError) as exc:
            refuse(p, exc)
            continue
        loaded.append((window.window_index, meta.created_at_s, str(p), window, saved))
    loaded.sort(key=lambda item: item[:3])
    diagnoser = NormalDiagnoser(NormalConfig.from_env())
    classes: dict[str, int] = {}
    differs = 0
    for _, _, name, window, saved in loaded:
        report = diagnoser.diagnose(window)
        now = sorted(i.cls for i in report.incidents)
        before = None if saved is None else sorted(i["class"] for i in saved.get("incidents", []))
        changed = before is not None and before != now
        differs += changed
        for cls in now:
            classes[cls] = classes.get(cls, 0) + 1
        mark = f"  (saved: {', '.join(before or []) or 'no incident'})" if changed else ""
        emit(
            {
                "path": name,
                "kind": "deepep_normal",
                "window_index": window.window_index,
                "incidents": [i.to_dict() for i in report.incidents],
                "saved_incidents": before,
            },
            f"{Path(name).name}  {describe_normal(report)}{mark}",
        )
    step_reports = []
    for p in step_files:
        try:
            saved_step = load_window(p)
            report = saved_step.diagnose()
        except (ValueError, OSError) as exc:
            refuse(p, exc)
            continue
        index = saved_step.meta.get("window_index", -1)
        step_reports.append((index if isinstance(index, int) else -1, str(p), report, saved_step))
    step_reports.sort(key=lambda item: item[:2])
    kinds: dict[str, int] = {}
    for _, name, report, saved_step in step_reports:
        kinds[report.kind] = kinds.get(report.kind, 0) + 1
        before_kind = None if saved_step.report is None else saved_step.report.get("kind")
        changed = before_kind is not None and before_kind != report.kind
        differs += changed
        mark = f"  (saved: {before_kind})" if changed else ""
        emit(
            {
                "path": name,
                "kind": "step_time",
                "report": report.to_dict(),
                "saved_kind": before_kind,
            },
            f"{Path(name).name}  {describe_step(report)}{mark}",
        )
    summary = {
        "deepep_windows": len(loaded),
        "deepep_incidents": classes,
        "step_windows": len(step_reports),
        "step_kinds": kinds,
        "differ_from_saved": differs,
        "refused": failures,
    }

    def counts(d: dict[str, int]) -> str:
        return ", ".join(f"{k} x{v}" for k, v in sorted(d.items())) or "none"

    emit(
        {"summary": summary},
        f"replayed {len(loaded)} DeepEP windows (incidents: {counts(classes)}) and "
        f"{len(step_reports)} step-time windows (kinds: {counts(kinds)}); "
        f"{differs} differ from the saved diagnosis; {failures} refused",
    )
    return EXIT_USAGE if failures else EXIT_OK


def _saved_window_names(folder: Path) -> tuple[list[Path], list[Path]]:
    """Every ``*.npz`` and ``*.json`` entry below ``folder``, whatever its type (the loaders
    refuse what is not a regular file), without following links to folders: a link loop or a
    link to ``/`` cannot make the walk endless."""
    npz: list[Path] = []
    json_files: list[Path] = []
    for where, folders, files in os.walk(folder):
        for name in (*folders, *files):
            if name.endswith(".npz"):
                npz.append(Path(where, name))
            elif name.endswith(".json"):
                json_files.append(Path(where, name))
    return sorted(npz), sorted(json_files)


if __name__ == "__main__":
    sys.exit(main())

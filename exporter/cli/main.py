"""The ``rankwatch`` command: demo, diagnose, heatmap, replay, hosts, config, assets.

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
from rankwatch.exporter.cli.exits import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
)
from rankwatch.exporter.cli.hosts import add_hosts_parser
from rankwatch.exporter.cli.saved_windows import cmd_diagnose, cmd_replay

__all__ = ["format_value", "main"]


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
    diagnose.set_defaults(handler=cmd_diagnose)

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
    replay.set_defaults(handler=cmd_replay)

    add_hosts_parser(sub)

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


if __name__ == "__main__":
    sys.exit(main())

"""``rankwatch diagnose`` and ``rankwatch replay``: saved windows read back and diagnosed again.

``diagnose`` reads one file (a DeepEP window ``.npz``, a step-time window ``.json``, a hang
record); ``replay`` every saved window of a folder, in order, with the run's summary. A file that
cannot be read is refused with one line naming it, the field and the value (``replay`` goes on
with the others and exits 2 at the end).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from rankwatch.exporter.cli.exits import EXIT_OK, EXIT_USAGE, UsageError

__all__ = ["cmd_diagnose", "cmd_replay"]


def _refusal(path: Path, exc: BaseException) -> str:
    """What is wrong with ``path``, once: loader errors already start with the file name."""
    text = str(exc)
    if isinstance(exc, FileNotFoundError):
        return "no such file"
    return text[len(str(path)) + 2 :] if text.startswith(f"{path}: ") else text


def cmd_diagnose(args: argparse.Namespace) -> int:
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


def cmd_replay(args: argparse.Namespace) -> int:
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

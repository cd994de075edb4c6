"""Structured log lines for DeepEP normal-mode windows: pure formatting, returns strings.

Every line has the same shape, so ``grep`` and a one-line regular expression read it::

    [Diagnose] InstanceID: <id> EPSize: <n> WindowIndex: <k> Normal <record>[ <probe>]: <json>

``record`` is ``summary`` (one per window, always), ``detail`` and ``values`` (one pair per probe
in details mode, each detail immediately followed by its values) or ``invalid`` (a window that
could not be diagnosed). The payload is one compact JSON object: keys in a fixed order, floats
with at most 6 significant digits, ``null`` for a missing or invalid value, never NaN. The
instance id has whitespace replaced by ``_`` (``-`` when empty) so the prefix always splits on
spaces. :func:`parse_log_line` reads a line back; ``docs/artifacts.md`` documents each payload.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rankwatch.diagnosis.deepep.normal.report import Anomaly, NormalReport, ProbeResult
from rankwatch.diagnosis.deepep.normal.schema import NOTIFY_PROBES, PROBES
from rankwatch.diagnosis.deepep.normal.window import NormalWindow
from rankwatch.diagnosis.untrusted_files import ArtifactError, parse_json

__all__ = [
    "LINE_PREFIX",
    "RECORDS",
    "NormalLogLine",
    "invalid_window_line",
    "normal_log_lines",
    "parse_log_line",
]

LINE_PREFIX = "[Diagnose]"
RECORDS: tuple[str, ...] = ("summary", "detail", "values", "invalid")
SIGNIFICANT_DIGITS = 6

_LINE = re.compile(
    r"\[Diagnose\] InstanceID: (?P<instance>\S+) EPSize: (?P<ep>\d+) "
    r"WindowIndex: (?P<window>\d+) Normal (?P<record>[a-z]+)(?: (?P<probe>[a-z_]+))?: "
    r"(?P<payload>\{.*\})$"
)


@dataclass(frozen=True)
class NormalLogLine:
    """One parsed log line."""

    instance_id: str
    ep_size: int
    window_index: int
    record: str
    probe: str | None
    payload: dict[str, Any]


def _instance(value: object) -> str:
    text = re.sub(r"\s+", "_", str(value))
    return text or "-"


def _prefix(instance_id: str, ep_size: int, window_index: int) -> str:
    return (
        f"{LINE_PREFIX} InstanceID: {_instance(instance_id)} EPSize: {ep_size} "
        f"WindowIndex: {window_index} Normal"
    )


def _num(value: object) -> Any:
    """A JSON number with at most 6 significant digits (ints kept), None for non-finite."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return float(f"{f:.{SIGNIFICANT_DIGITS}g}") if math.isfinite(f) else None
    return value


def _rounded(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return _num(value)


def _dumps(value: Any) -> str:
    return json.dumps(_rounded(value), separators=(",", ":"), allow_nan=False)


def _array_json(arr: np.ndarray | None) -> str:
    """A JSON (nested) list of a 1-D or 2-D array, ``null`` for non-finite entries.

    One ``%`` format call over all values: matrices reach 1,024 x 1,024 cells, and formatting
    element by element is several times slower. Non-finite values become NaN, whose ``nan``
    is the only alphabetic token a ``%g`` field can produce, and is then renamed ``null``.
    """
    if arr is None:
        return "null"
    a = np.asarray(arr, dtype=np.float64)
    if a.ndim not in (1, 2):
        raise ValueError(f"values: expected a 1-D or 2-D array, got shape {a.shape}")
    clean = np.where(np.isfinite(a), a, np.nan)
    cell = f"%.{SIGNIFICANT_DIGITS}g"
    if a.ndim == 1:
        template = "[" + ",".join([cell] * a.shape[0]) + "]"
    else:
        row = "[" + ",".join([cell] * a.shape[1]) + "]"
        template = "[" + ",".join([row] * a.shape[0]) + "]"
    return (template % tuple(clean.ravel().tolist())).replace("nan", "null")


def _anomaly_brief(a: Anomaly) -> dict[str, Any]:
    return {"probe": a.probe, "scope": a.scope, "ranks": list(a.ranks), "factor": a.factor}


def _summary(report: NormalReport) -> dict[str, Any]:
    statuses = {p: report.probes[p].status for p in PROBES if p in report.probes}
    counts = {p: len(r.anomalies) for p, r in report.probes.items() if r.anomalies}
    return {
        "status": "anomalous" if report.anomalous else "ok",
        "probes": statuses,
        "anomalies": {p: counts[p] for p in PROBES if p in counts},
        "incidents": [
            {
                "class": i.cls,
                "probes": list(i.probes),
                "scope": i.scope,
                "ranks": list(i.ranks),
                "severity": i.severity,
            }
            for i in report.incidents
        ],
        "raw_anomalies": [_anomaly_brief(a) for a in report.raw_anomalies],
    }


def _detail(result: ProbeResult | None) -> dict[str, Any]:
    if result is None:
        return {"kind": None, "status": None}
    d = result.to_dict(include_arrays=False)
    d.pop("probe", None)  # already in the line prefix
    return d


def _values(probe: str, result: ProbeResult | None, window: NormalWindow | None) -> str:
    if probe in NOTIFY_PROBES:
        mean = None if result is None else result.mean_duration_ns
        if mean is None and window is not None and probe in window.notify:
            mean = window.notify_avg_ns(probe)
        ratio = None if result is None else result.notify_ratio
        return f'{{"mean_duration_ns":{_array_json(mean)},"notify_ratio":{_array_json(ratio)}}}'
    cost = None if result is None else result.cost_per_sample
    tokens = None if result is None else result.tokens_per_sample
    if window is not None and probe in window.completion:
        cost = window.cost_per_sample(probe) if cost is None else cost
        tokens = window.tokens_per_sample(probe) if tokens is None else tokens
    return f'{{"cost_per_sample":{_array_json(cost)},"tokens_per_sample":{_array_json(tokens)}}}'


def normal_log_lines(
    report: NormalReport,
    window: NormalWindow | None = None,
    *,
    details: bool = False,
    instance_id: str | None = None,
) -> list[str]:
    """The log lines of one diagnosed window.

    Always the summary line; with ``details`` (``DEEPEP_DIAGNOSE_LOG_DETAILS=1``) also, for
    each of the six probes in schema order, its detail line immediately followed by its values
    line: per-rank mean duration and Notify ratio, or the source-oriented ``[src][dst]`` cost
    and tokens per sample. Values come from the report, or from ``window`` where the report has
    none. The instance id is ``instance_id``, else the report's, else the window's.
    """
    if not isinstance(report, NormalReport):
        raise TypeError(f"report: expected NormalReport, got {type(report).__name__}")
    if window is not None:
        if not isinstance(window, NormalWindow):
            raise TypeError(f"window: expected NormalWindow or None, got {type(window).__name__}")
        if window.ep_size != report.ep_size:
            raise ValueError(
                f"window.ep_size: {window.ep_size} does not match report.ep_size={report.ep_size}"
            )
        if window.window_index != report.window_index:
            raise ValueError(
                f"window.window_index: {window.window_index} does not match "
                f"report.window_index={report.window_index}"
            )
    if not isinstance(details, bool):
        raise TypeError(f"details: expected a bool, got {details!r}")
    if instance_id is not None and not isinstance(instance_id, str):
        raise TypeError(f"instance_id: expected a string or None, got {instance_id!r}")
    inst = instance_id or report.instance_id or (window.instance_id if window else "")
    prefix = _prefix(inst, report.ep_size, report.window_index)
    lines = [f"{prefix} summary: {_dumps(_summary(report))}"]
    if details:
        for probe in PROBES:
            result = report.probes.get(probe)
            lines.append(f"{prefix} detail {probe}: {_dumps(_detail(result))}")
            lines.append(f"{prefix} values {probe}: {_values(probe, result, window)}")
    return lines


def invalid_window_line(
    instance_id: str, ep_size: int, window_index: int, reason: str, message: str = ""
) -> str:
    """The one line logged for a window rejected before diagnosis (e.g. ``counter_reset``)."""
    for name, value in (("ep_size", ep_size), ("window_index", window_index)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name}: must be an int >= 0, got {value!r}")
    if not isinstance(reason, str) or not reason:
        raise ValueError(f"reason: must be a non-empty string, got {reason!r}")
    payload = _dumps({"reason": reason, "message": str(message)})
    return f"{_prefix(instance_id, int(ep_size), int(window_index))} invalid: {payload}"


def parse_log_line(line: str) -> NormalLogLine:
    """Read one normal-mode line back (anything before ``[Diagnose]``, e.g. a timestamp, is
    ignored). Raises ``ValueError`` naming the line when it is not one of ours."""
    if not isinstance(line, str):
        raise TypeError(f"line: expected a string, got {type(line).__name__}")
    start = line.find(LINE_PREFIX)
    m = _LINE.match(line.rstrip("\n"), start) if start >= 0 else None
    if m is None or m["record"] not in RECORDS:
        raise ValueError(f"line: not a normal-mode diagnosis line: {line[:120]!r}")
    try:
        # Bounded like a file's JSON: a payload nested a million deep would otherwise raise
        # RecursionError. A details line of EP 1,024 holds 1,025 lists.
        payload = parse_json("line", "payload", m["payload"], max_items=1 << 16)
    except ArtifactError as exc:
        reason = str(exc).removeprefix("line: payload: ")
        raise ValueError(f"line: payload is not JSON we read ({reason}): {line[:120]!r}") from None
    return NormalLogLine(
        instance_id=m["instance"],
        ep_size=int(m["ep"]),
        window_index=int(m["window"]),
        record=m["record"],
        probe=m["probe"],
        payload=payload,
    )

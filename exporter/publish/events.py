"""Incident events, written two ways: one JSON log line each, and one OTel log record each.

The OpenTelemetry Events API is gone; an event is now a log record with an *event name*
(``rankwatch.incident.open`` / ``rankwatch.incident.close``) and attributes. Both forms carry
the same fields:

================================ ===========================================================
attribute                        meaning
================================ ===========================================================
``rankwatch.incident.id``        stable id of the incident (open and close share it)
``rankwatch.incident.action``    ``open`` or ``close``
``rankwatch.incident.class``     incident class (``step_time_straggler``, ...)
``rankwatch.incident.severity``  ``warning`` or ``critical``
``rankwatch.incident.nature``    ``fault`` or ``property`` (a steady property of the job)
``rankwatch.incident.pages``     true for a critical fault, the only incident that pages
``rankwatch.incident.probe``     DeepEP probe(s), comma-separated; empty for step time
``rankwatch.incident.cause``     straggler kind / bottleneck kind / normal-mode scope
``rankwatch.incident.culprit_ranks`` global ranks blamed (list of ints)
``rankwatch.incident.hostnames`` their hosts, lower case (list of strings)
``rankwatch.incident.score``     straggler score, slowdown factor or Notify ratio (if finite)
``rankwatch.incident.opened_window`` window index at which it opened
``rankwatch.incident.evidence``  the evidence of the latest supporting window (a map)
``rankwatch.incident.close_reason`` why it closed (``clean windows``, ``run ended``); closes only
``rankwatch.incident.lost_rank_seconds`` what it cost the group so far (the close: in total)
``rankwatch.window.index``       window index of this event
``rankwatch.group``, ``rankwatch.run`` the group and run
``rankwatch.attempt``            which start of the run (0 the first; a restart counts up)
================================ ===========================================================

Severity: ``WARN`` for openings and closings alike (the hub logs both at ``WARNING``). An
incident's lifecycle is one story that must be readable at the default level: Python's
last-resort handler and most setups show WARNING and up, so a closing at INFO was never seen,
and ERROR is kept for rankwatch's own failures. How bad the incident is lives in
``rankwatch.incident.severity``, which is what routing should key on. The body is one human
sentence that names the incident id, so an opening and its closing can be matched by eye.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from opentelemetry._logs import LogRecord, SeverityNumber

from rankwatch.diagnosis.deepep.normal.report import json_ready
from rankwatch.diagnosis.vocabulary import PROPERTY
from rankwatch.exporter.publish.incidents import IncidentEvent

__all__ = ["event_attributes", "event_json", "event_log_record", "event_message"]


def _clean(value: Any) -> Any:
    """JSON-ready evidence without None entries (OTel attribute values cannot be null)."""
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_clean(v) for v in value if v is not None]
    return value


def _check(event: Any) -> IncidentEvent:
    if not isinstance(event, IncidentEvent):
        raise TypeError(f"event: expected IncidentEvent, got {type(event).__name__}")
    if event.action not in ("open", "close"):
        raise ValueError(f"event.action: must be 'open' or 'close', got {event.action!r}")
    return event


def event_message(event: IncidentEvent) -> str:
    """One sentence saying what happened, where, and how bad."""
    inc = _check(event).incident
    where = ",".join(str(r) for r in inc.ranks) or "all ranks"
    hosts = f" ({', '.join(inc.hostnames)})" if inc.hostnames else ""
    evidence = inc.evidence if isinstance(inc.evidence, Mapping) else {}
    who = f"rank {where}{hosts}"
    if evidence.get("slow_host"):  # "ranks 2,3 (all of node-b)"
        share = evidence.get("slow_host_share", "all")
        who = f"ranks {where} ({share} of {evidence['slow_host']})"
    probe = f" on {inc.probe}" if inc.probe else ""
    verb = "opened" if event.action == "open" else "closed"
    reason = f" ({event.reason})" if event.action == "close" and event.reason else ""
    score = "" if inc.score is None else f", score {inc.score:.3g}"
    # A first start says nothing of attempts (its line reads as before); a restart says which.
    attempt = f" attempt {event.attempt}" if event.attempt else ""
    if inc.lost_rank_seconds > 0:  # what it cost the group so far (the close: in total)
        score += f", lost {inc.lost_rank_seconds:.0f} rank-seconds"
    if event.action == "open" and evidence.get("message"):
        # A hang's own sentence: who, where, what the others wait in, the top frame.
        return f"rankwatch incident {inc.incident_id} opened: {inc.severity} {evidence['message']}"
    position = str(evidence.get("culprit_position") or "").partition(": ")[2]
    mesh = f" ({position}, within {evidence.get('compared_group')})" if position else ""
    if evidence.get("slow_group"):
        mesh += f", {evidence['slow_group']} slow as a whole"
    nature = " (a property of the job, does not page)" if inc.nature == PROPERTY else ""
    return (
        f"rankwatch incident {inc.incident_id} {verb}{reason}: {inc.severity} {inc.cls}{probe}"
        f"{nature}, {who}{mesh}, cause {inc.cause or 'unknown'}{score} "
        f"(window {event.window_index}, run {event.run or '-'}{attempt}, "
        f"group {event.group or '-'})"
    )


def event_attributes(event: IncidentEvent) -> dict[str, Any]:
    """The event's attributes (see the module table); no None values, no NaN."""
    inc = _check(event).incident
    attrs: dict[str, Any] = {
        "rankwatch.incident.id": inc.incident_id,
        "rankwatch.incident.action": event.action,
        "rankwatch.incident.class": inc.cls,
        "rankwatch.incident.severity": inc.severity,
        "rankwatch.incident.nature": inc.nature,
        "rankwatch.incident.pages": inc.pages,
        "rankwatch.incident.probe": inc.probe,
        "rankwatch.incident.cause": inc.cause,
        "rankwatch.incident.culprit_ranks": [int(r) for r in inc.ranks],
        "rankwatch.incident.hostnames": list(inc.hostnames),
        "rankwatch.incident.opened_window": int(inc.opened_window),
        "rankwatch.incident.evidence": _clean(json_ready(dict(inc.evidence))),
        "rankwatch.window.index": int(event.window_index),
        "rankwatch.group": event.group,
        "rankwatch.run": event.run,
        "rankwatch.attempt": int(event.attempt),
    }
    if inc.score is not None and math.isfinite(inc.score):
        attrs["rankwatch.incident.score"] = float(inc.score)
    if event.action == "close":
        attrs["rankwatch.incident.close_reason"] = event.reason
    if math.isfinite(inc.lost_rank_seconds):
        attrs["rankwatch.incident.lost_rank_seconds"] = float(inc.lost_rank_seconds)
    return attrs


# One level for the whole lifecycle (see the module docstring).
_SEVERITY_NUMBER, _SEVERITY_TEXT = SeverityNumber.WARN, "WARN"


def event_log_record(event: IncidentEvent) -> LogRecord:
    """The OTel log record of an incident event: event name, severity, body, attributes.

    Its timestamp is the time of the window that caused it.
    """
    _check(event)
    return LogRecord(
        timestamp=int(event.time_s * 1e9),
        severity_number=_SEVERITY_NUMBER,
        severity_text=_SEVERITY_TEXT,
        body=event_message(event),
        attributes=event_attributes(event),
        event_name=event.event_name,
    )


def event_json(event: IncidentEvent) -> str:
    """The event as one JSON line (no newline inside): ``event``, ``time_unix_s``, ``severity``,
    ``message`` and the attributes without their ``rankwatch.`` prefix."""
    _check(event)
    doc: dict[str, Any] = {
        "event": event.event_name,
        "time_unix_s": event.time_s,
        "level": _SEVERITY_TEXT,
        "message": event_message(event),
    }
    for key, value in event_attributes(event).items():
        doc[key.removeprefix("rankwatch.")] = value
    return json.dumps(doc, separators=(",", ":"), allow_nan=False, sort_keys=False)

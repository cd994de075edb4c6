"""The normal-mode diagnoser: six independent probe results, the global history, incidents."""

from __future__ import annotations

import dataclasses

from rankwatch.diagnosis.config import NormalConfig, config_or_default
from rankwatch.diagnosis.deepep.normal.completion import GATEWAY_PROBES, diagnose_completion
from rankwatch.diagnosis.deepep.normal.correlate import correlate
from rankwatch.diagnosis.deepep.normal.hang import find_stall
from rankwatch.diagnosis.deepep.normal.history import GlobalHistory
from rankwatch.diagnosis.deepep.normal.notify import diagnose_notify
from rankwatch.diagnosis.deepep.normal.report import Anomaly, Incident, NormalReport, ProbeResult
from rankwatch.diagnosis.deepep.normal.schema import COMPLETION_PROBES, NOTIFY_PROBES
from rankwatch.diagnosis.deepep.normal.window import NormalWindow
from rankwatch.diagnosis.vocabulary import HANG_SUSPECT

__all__ = ["NormalDiagnoser"]


class NormalDiagnoser:
    """Diagnose DeepEP normal-mode windows.

    Pure except for the global-slowdown history (:class:`GlobalHistory`): the same sequence of
    windows always gives the same reports. A probe missing from the window is ``insufficient``.
    A window whose group layout (EP size, ranks per node) differs from the previous one starts
    a fresh history.
    """

    def __init__(self, config: NormalConfig | None = None) -> None:
        self.config = config_or_default(config, NormalConfig)
        self.history = GlobalHistory(config)

    def reset(self) -> None:
        """Forget the global-slowdown history (e.g. after a new warm-up boundary)."""
        self.history.reset()

    def _notify(self, window: NormalWindow, probe: str) -> ProbeResult:
        if probe not in window.notify:
            return ProbeResult(
                probe=probe, kind="notify", status="insufficient", detail="probe not in window"
            )
        return diagnose_notify(window.notify_avg_ns(probe), probe, self.config)

    def _completion(self, window: NormalWindow, probe: str) -> ProbeResult:
        if probe in GATEWAY_PROBES and window.num_nodes == 1:
            # RDMA needs a second node: no path can exist, which is not missing evidence.
            return ProbeResult(
                probe=probe,
                kind="completion",
                status="not_applicable",
                detail="not applicable: the EP group is on one node, no RDMA path exists",
            )
        if probe not in window.completion:
            return ProbeResult(
                probe=probe, kind="completion", status="insufficient", detail="probe not in window"
            )
        cost, samples, tokens = window.completion[probe]
        local = diagnose_completion(
            cost, samples, probe, window.ranks_per_node, self.config, tokens=tokens
        )
        if local.aggregate is None:
            return local
        verdicts = {
            cls: self.history.assess(probe, agg, cls) for cls, agg in local.class_aggregates.items()
        }
        slow = [c for c, (f, st) in verdicts.items() if st == "slow" and f is not None]
        known = {c: f for c, (f, _) in verdicts.items() if f is not None}
        if slow:
            global_class: str | None = max(slow, key=lambda c: known[c])
            global_status = "slow"
        elif any(st == "bootstrapping" for _, st in verdicts.values()) or not known:
            global_class, global_status = None, "bootstrapping"
        else:
            global_class, global_status = max(known, key=lambda c: known[c]), "normal"
        factor = None if global_class is None else known[global_class]
        anomalies = local.anomalies
        if global_status == "slow" and factor is not None:
            anomalies = (Anomaly(probe, "global", None, None, factor), *anomalies)
        # Each class learns on its own: only when it is not slow and stays within the normal
        # band of its history. Local anomalies (a row, a link, one block) do not stop it, since
        # the class aggregate is a median that leaves flagged blocks out.
        for cls, agg in local.class_aggregates.items():
            if verdicts[cls][1] != "slow" and self.history.accepts(probe, agg, cls):
                self.history.learn(probe, agg, cls)
        return dataclasses.replace(
            local,
            anomalies=anomalies,
            status="anomalous" if anomalies else "ok",
            global_factor=factor,
            global_status=global_status,
            global_class=global_class,
            class_factors={c: known.get(c) for c in local.class_aggregates},
        )

    def diagnose(self, window: NormalWindow) -> NormalReport:
        """Diagnose one window: per-probe results, then incidents from their correlation."""
        if not isinstance(window, NormalWindow):
            raise TypeError(f"window: expected a NormalWindow, got {type(window).__name__}")
        self.history.check_layout(window.ep_size, window.ranks_per_node)
        probes: dict[str, ProbeResult] = {}
        for probe in NOTIFY_PROBES:
            probes[probe] = self._notify(window, probe)
        for probe in COMPLETION_PROBES:
            probes[probe] = self._completion(window, probe)
        incidents, raw = correlate(probes, window.ranks_per_node, self.config.hot_load_ratio)
        stall = find_stall(window, self.config)
        if stall is not None:
            # First: a hang ends the job, whatever else the partial window shows.
            hang = Incident(
                cls=HANG_SUSPECT,
                probes=(stall.stage,) if stall.stage else (),
                scope="local",
                ranks=stall.ranks,
                evidence=stall.to_dict(),
                severity="critical",
            )
            incidents = (hang, *incidents)
        return NormalReport(
            window_index=window.window_index,
            ep_size=window.ep_size,
            ranks_per_node=window.ranks_per_node,
            probes=probes,
            incidents=incidents,
            raw_anomalies=raw,
            instance_id=window.instance_id,
        )

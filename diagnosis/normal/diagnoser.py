"""The normal-mode diagnoser: six independent probe results, the global history, incidents."""

from __future__ import annotations

import dataclasses

from ..config import NormalConfig
from .completion import diagnose_completion
from .correlate import correlate
from .history import GlobalHistory
from .notify import diagnose_notify
from .report import Anomaly, NormalReport, ProbeResult
from .schema import COMPLETION_PROBES, NOTIFY_PROBES
from .window import NormalWindow

__all__ = ["NormalDiagnoser"]


class NormalDiagnoser:
    """Diagnose DeepEP normal-mode windows.

    Pure except for the global-slowdown history (:class:`GlobalHistory`): the same sequence of
    windows always gives the same reports. A probe missing from the window is ``insufficient``.
    A window whose group layout (EP size, ranks per node) differs from the previous one starts
    a fresh history.
    """

    def __init__(self, config: NormalConfig | None = None) -> None:
        if config is None:
            config = NormalConfig()
        if not isinstance(config, NormalConfig):
            raise TypeError(f"config: expected a NormalConfig, got {type(config).__name__}")
        self.config = config
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
        factor, global_status = self.history.assess(probe, local.aggregate)
        anomalies = local.anomalies
        if global_status == "slow" and factor is not None:
            anomalies = (Anomaly(probe, "global", None, None, factor), *anomalies)
        result = dataclasses.replace(
            local,
            anomalies=anomalies,
            status="anomalous" if anomalies else "ok",
            global_factor=factor,
            global_status=global_status,
        )
        # Only a window the probe found entirely normal teaches the history.
        if result.status == "ok":
            self.history.learn(probe, local.aggregate)
        return result

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
        incidents, raw = correlate(probes)
        return NormalReport(
            window_index=window.window_index,
            ep_size=window.ep_size,
            ranks_per_node=window.ranks_per_node,
            probes=probes,
            incidents=incidents,
            raw_anomalies=raw,
            instance_id=window.instance_id,
        )

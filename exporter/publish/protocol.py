"""What the root hands each finished window to: the publisher protocol.

The collectors know only this protocol; Prometheus, OTLP, log lines and artifacts implement it.
``publish`` is called from the collectors' background thread and must not block for long
(publishers that do I/O queue the report for their own thread). ``close`` is bounded by its
timeout.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from rankwatch.diagnosis.report import WindowReport

__all__ = ["Publisher"]


@runtime_checkable
class Publisher(Protocol):
    """Receives every window report of a group's root rank."""

    def publish(self, report: WindowReport) -> None:
        """Take one window's report; return quickly."""

    def close(self, timeout_seconds: float) -> None:
        """Flush what is pending and release resources within ``timeout_seconds``."""

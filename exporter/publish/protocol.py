"""What the root hands each finished window to: the publisher protocol.

The collectors know only this protocol; Prometheus, OTLP, log lines and artifacts implement it.
``publish`` is called from the collectors' background thread and must not block for long
(publishers that do I/O queue the report for their own thread). ``close`` is bounded by its
timeout.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from rankwatch.diagnosis.report import WindowReport

__all__ = ["Publisher", "check_publishers", "check_timeout_seconds", "publish_to_all"]


@runtime_checkable
class Publisher(Protocol):
    """Receives every window report of a group's root rank."""

    def publish(self, report: WindowReport) -> None:
        """Take one window's report; return quickly."""

    def close(self, timeout_seconds: float) -> None:
        """Flush what is pending and release resources within ``timeout_seconds``."""


def check_publishers(publishers: object, owner: str) -> tuple[Publisher, ...]:
    """``publishers`` as a tuple; a ``TypeError`` naming ``owner``'s field and the bad value
    otherwise (the check every collector's constructor makes, so the messages agree)."""
    if isinstance(publishers, (str, bytes)) or not isinstance(publishers, Sequence):
        raise TypeError(
            f"{owner}: field publishers: expected a sequence of publishers, got {publishers!r}"
        )
    for i, pub in enumerate(publishers):
        if not (callable(getattr(pub, "publish", None)) and callable(getattr(pub, "close", None))):
            raise TypeError(
                f"{owner}: field publishers[{i}]: {pub!r} has no publish(report) and "
                "close(timeout_seconds) methods"
            )
    return tuple(publishers)


def publish_to_all(
    publishers: Sequence[Publisher], report: WindowReport, logger: logging.Logger
) -> None:
    """Hand ``report`` to every publisher; one that raises is logged on the caller's ``logger``
    (where its collector's log goes) and the others still get it: a broken publisher must not
    starve the rest."""
    for pub in publishers:
        try:
            pub.publish(report)
        except Exception:
            logger.exception(
                "rankwatch: publisher %r failed on window %d", pub, report.window_index
            )


def check_timeout_seconds(timeout_seconds: Any) -> None:
    """The ``close(timeout_seconds)`` argument of every publisher: a finite number >= 0."""
    if (
        isinstance(timeout_seconds, bool)
        or not isinstance(timeout_seconds, (int, float))
        or not math.isfinite(timeout_seconds)
        or timeout_seconds < 0
    ):
        raise ValueError(f"timeout_seconds: expected a finite number >= 0, got {timeout_seconds!r}")

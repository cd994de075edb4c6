"""The aggregator child: ``python -m rankwatch.exporter.aggregator`` (started by
:class:`~.process.Aggregator`; its control frames on stdin and stdout)."""

from __future__ import annotations

import sys

from rankwatch.exporter.aggregator.service import ServiceSetup, run_service
from rankwatch.exporter.child_pipe import take_control_pipes


def main() -> int:
    setup, control_out = take_control_pipes(ServiceSetup)
    if setup is None:
        return 0
    run_service(setup, 0, control_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

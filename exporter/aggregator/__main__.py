"""The aggregator child: ``python -m rankwatch.exporter.aggregator`` (started by
:class:`~.process.Aggregator`; its control frames on stdin and stdout)."""

from __future__ import annotations

import logging
import os
import signal
import sys

from rankwatch.exporter.aggregator.service import ServiceSetup, run_service
from rankwatch.exporter.child_frames import frame, read_frame


class _Forward(logging.Handler):
    """Log records to the root's process, which logs them through the job's own logging."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = frame(("log", record.levelno, record.name, record.getMessage()))
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError:  # the parent is gone
            pass


def main() -> int:
    # The root's process decides when this ends (stop, or its end of the pipe closing): a
    # Ctrl-C sent to the whole process group must not end the summary half-way.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control_out = os.dup(1)
    os.dup2(2, 1)  # whatever prints must not land in the control frames
    sys.stdout = sys.stderr
    # Unbuffered: the frames after the setup are the service's to read from the descriptor.
    with open(0, "rb", buffering=0, closefd=False) as stdin:
        setup = read_frame(stdin)
    if not isinstance(setup, ServiceSetup):
        return 0
    root = logging.getLogger()
    root.handlers[:] = [_Forward(control_out)]
    root.setLevel(setup.log_level)
    run_service(setup, 0, control_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

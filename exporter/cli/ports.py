"""A free TCP port for a process that will listen on it later (the demo's ranks, test worlds).

A port from ``bind(0)`` comes from the kernel's ephemeral range, the same range it hands out
for every outgoing connection and every listener bound to port 0. Between choosing such a port
and the child binding it, any of those can take it: a 4-rank Gloo world opens dozens of them
(its pairs, its store clients) before rank 0 serves ``/metrics``, and a hang-matrix cell's rank 0
once found its ``/metrics`` port taken. A port chosen outside the ephemeral range can only be
taken by another program that asks for that very number.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST_PORT = 10000  # below: the well-known and commonly configured service ports
_HIGHEST_PORT = 65535
_TRIES = 64
_ephemeral_file = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()  # not handed twice by one process before its user binds it
_draw = random.SystemRandom()  # a test's random.seed() must not make two processes agree


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range ``(low, high)``, inclusive; Linux's default where the
    system does not say."""
    try:
        low, high = (int(part) for part in _ephemeral_file.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _outside_ephemeral() -> list[range]:
    low, high = ephemeral_range()
    below = range(_LOWEST_PORT, min(low, _HIGHEST_PORT + 1))
    above = range(max(high + 1, _LOWEST_PORT), _HIGHEST_PORT + 1)
    return [span for span in (below, above) if len(span) > 0]


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _port_at(spans: list[range], index: int) -> int:
    for span in spans:
        if index < len(span):
            return span[index]
        index -= len(span)
    raise IndexError(index)


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on now, outside the ephemeral range where the
    system leaves room for one; never the same one twice in this process. The candidates are
    tried in order from a random one, so a free one among few is found."""
    spans = _outside_ephemeral()
    total = sum(len(span) for span in spans)
    start = _draw.randrange(total) if total else 0
    for step in range(min(total, _TRIES)):
        port = _port_at(spans, (start + step) % total)
        if port not in _handed_out and _bindable(host, port):
            _handed_out.add(port)
            return port
    # An ephemeral range that covers every port: the kernel's choice is all there is.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    _handed_out.add(port)
    return port

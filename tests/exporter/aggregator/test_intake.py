"""The aggregator's intake over real sockets: hellos, rows, strays, refusals and room."""

from __future__ import annotations

import logging
import selectors
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from rankwatch.diagnosis.step_time import ROW_WIDTH
from rankwatch.exporter.aggregator.intake import RESERVED_FILES, Event, Intake, _open_files
from rankwatch.exporter.aggregator.wire import (
    FLAG_END_OF_ROUND,
    KIND_REFUSED,
    KIND_WELCOME,
    encode_hello,
    encode_rows,
    split_frames,
)

TOKEN = "cd" * 16
RANK = 1


@pytest.fixture
def intake() -> Iterator[Intake]:
    selector = selectors.DefaultSelector()
    server = Intake("127.0.0.1", TOKEN, (0, 1, 2, 3), selector)
    yield server
    server.close()
    selector.close()


def pump(server: Intake, until: int, timeout: float = 5.0) -> list[Event]:
    """Serve until ``until`` events came (or the timeout)."""
    out: list[Event] = []
    deadline = time.monotonic() + timeout
    while len(out) < until and time.monotonic() < deadline:
        for key, events in server.selector.select(0.05):
            out += server.ready(key, events)
    return out


def client(server: Intake) -> socket.socket:
    return socket.create_connection(server.address, timeout=5)


def answers(sock: socket.socket) -> list[int]:
    sock.settimeout(5)
    data = bytearray(sock.recv(4096))
    frames, _ = split_frames(data)
    return [kind for kind, _ in frames]


def rows(n: int) -> np.ndarray:
    out = np.zeros((n, ROW_WIDTH))
    out[:, 0] = np.arange(n)
    return out


def test_a_rank_says_hello_and_ships_rows(intake: Intake) -> None:
    sock = client(intake)
    sock.sendall(
        encode_hello(2, 1, 99, TOKEN, "node-a", "", "")
        + encode_rows(rows(3), rank=2, seq=1, flags=FLAG_END_OF_ROUND, strategy="ddp", lost=0)
    )
    events = pump(intake, 2)
    assert [e.kind for e in events] == ["hello", "rows"]
    assert events[0].hello is not None and events[0].hello.hostname == "node-a"
    assert events[1].rank == 2 and events[1].rows is not None and len(events[1].rows.rows) == 3
    assert answers(sock) == [KIND_WELCOME]
    sock.close()
    assert [(e.kind, e.rank) for e in pump(intake, 1)] == [("closed", 2)]


def test_strays_are_closed_and_named(intake: Intake, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    wrong_token = client(intake)
    wrong_token.sendall(encode_hello(1, 0, 1, "ef" * 16, "h", "", ""))
    outsider = client(intake)
    outsider.sendall(encode_hello(9, 0, 1, TOKEN, "h", "", ""))
    rows_first = client(intake)
    rows_first.sendall(encode_rows(rows(1), rank=1, seq=1, flags=0, strategy=None, lost=0))
    garbage = client(intake)
    garbage.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
    assert pump(intake, 1, timeout=1.0) == []
    assert answers(outsider) == [KIND_REFUSED]
    for sock in (wrong_token, rows_first, garbage):
        sock.settimeout(5)
        assert sock.recv(10) == b""  # closed
    text = caplog.text
    assert "another group's token (rank 1)" in text
    assert "expected a hello first" in text
    assert "field length: value" in text  # the HTTP request read as a frame length
    assert intake.by_rank == {}


def test_a_rank_that_connects_again_replaces_its_old_connection(intake: Intake) -> None:
    first = client(intake)
    first.sendall(encode_hello(1, 0, 1, TOKEN, "h", "", ""))
    assert [e.kind for e in pump(intake, 1)] == ["hello"]
    second = client(intake)
    second.sendall(encode_hello(1, 0, 1, TOKEN, "h", "", ""))
    events = pump(intake, 1)
    assert [e.kind for e in events] == ["hello"]  # no "closed": the rank is still connected
    first.settimeout(5)
    assert answers(first) == [KIND_WELCOME] and first.recv(10) == b""
    assert intake.by_rank[1].sock.getpeername() == second.getsockname()


def test_ranks_beyond_the_open_file_room_are_refused_and_named() -> None:
    selector = selectors.DefaultSelector()
    server = Intake("127.0.0.1", TOKEN, (0, 1, 2, 3), selector)
    opened = _open_files()
    assert opened is not None
    server.file_limit = opened - len(server._conns) + RESERVED_FILES + 2  # room for two
    socks = []
    try:
        for rank in range(4):
            sock = client(server)
            sock.sendall(encode_hello(rank, 0, 1, TOKEN, "h", "", ""))
            socks.append(sock)
            pump(server, 0, timeout=0.2)
        events = pump(server, 4, timeout=2.0)
        kinds = sorted((e.kind, e.rank) for e in events)
        assert kinds == [("hello", 0), ("hello", 1), ("refused", 2), ("refused", 3)]
        assert server.refused == {2, 3}
        assert [answers(s)[0] for s in socks] == [KIND_WELCOME] * 2 + [KIND_REFUSED] * 2
    finally:
        for sock in socks:
            sock.close()
        server.close()
        selector.close()

"""The free port a harness or the demo hands to a process that listens later."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest

from rankwatch.exporter.cli import ports


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_ports_come_from_outside_the_ephemeral_range_and_are_bindable() -> None:
    low, high = ports.ephemeral_range()
    handed = [ports.free_port() for _ in range(50)]
    assert len(set(handed)) == 50  # never twice in one process
    for port in handed:
        assert not low <= port <= high
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_port_something_listens_on_is_never_handed_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A system whose ephemeral range leaves the top five ports; four of them are taken.
    top = range(65531, 65536)
    free = next(port for port in top if _bindable(port))
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("10000\t65530\n")
    monkeypatch.setattr(ports, "_ephemeral_file", range_file)
    monkeypatch.setattr(ports, "_handed_out", set())
    taken = []
    try:
        for port in top:
            if port == free:
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            taken.append(s)
            with contextlib.suppress(OSError):  # already taken by another program
                s.bind(("127.0.0.1", port))
                s.listen()
        first, second = ports.free_port(), ports.free_port()
    finally:
        for s in taken:
            s.close()
    assert first == free
    # the one candidate handed out already: the kernel's choice, from its own range
    assert second != free and second not in top and _bindable(second)


def test_an_ephemeral_range_that_covers_every_port_falls_back_to_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("1024 65535\n")
    monkeypatch.setattr(ports, "_ephemeral_file", range_file)
    port = ports.free_port()
    assert 1024 <= port <= 65535 and not _listening(port)


@pytest.mark.parametrize("text", ["", "not numbers", "1 2 3"])
def test_an_unreadable_range_is_linux_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text(text)
    monkeypatch.setattr(ports, "_ephemeral_file", range_file)
    assert ports.ephemeral_range() == (32768, 60999)
    monkeypatch.setattr(ports, "_ephemeral_file", tmp_path / "missing")
    assert ports.ephemeral_range() == (32768, 60999)

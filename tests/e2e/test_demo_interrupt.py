"""Ctrl-C in the middle of ``rankwatch demo``: every rank stops, the summary is still written."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_demo import demo_env
from tests.exporter.cli.test_cli import CLI

pytestmark = [pytest.mark.multiproc, pytest.mark.parallel_safe]


def _reader(stream: Any, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def test_ctrl_c_stops_every_rank_and_still_writes_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # A session of its own, so the signal can go to the whole process group, as a terminal's
    # Ctrl-C does: the parent and every rank receive it.
    proc = subprocess.Popen(
        [
            str(CLI), "demo", "--ranks", "2", "--duration", "300", "--port", "0",
            "--out", str(out), "--plain",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=demo_env(),
        start_new_session=True,
    )  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                break
            seen.append(line)
            if line.split("] ", 1)[-1].startswith("step w3:"):
                break
        assert any("step w3:" in ln for ln in seen), "".join(seen)[-3000:]
        interrupted_at = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        returncode = proc.wait(timeout=60)
        took = time.monotonic() - interrupted_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    output = "".join(seen)
    assert returncode == 130, output[-3000:]
    assert took < 30, f"took {took:.1f} s to stop"
    assert "Ctrl-C: stopping every rank" in output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["interrupted"] is True
    assert summary["run"]["stop_reason"] == "interrupted"
    assert summary["run"]["steps"] > 0
    assert summary["step_time"]["window_kind"] == "summary"
    assert "rankwatch summary" in output
    # Nothing of the demo is left running (multiprocessing's resource tracker leaves last,
    # once it sees the parent gone).
    gone_by = time.monotonic() + 15
    while time.monotonic() < gone_by:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        left = subprocess.run(
            ["ps", "-ww", "-o", "pid,args", "-g", str(proc.pid)], capture_output=True, text=True
        ).stdout
        pytest.fail(f"processes of the demo still running 15 s after it exited:\n{left}")


def _children(pid: int) -> list[int]:
    """The spawned ranks of a demo (not multiprocessing's resource tracker)."""
    listing = subprocess.run(
        # -ww: never cut the command line to the (possibly narrow) terminal width
        ["ps", "-ww", "--ppid", str(pid), "-o", "pid=,args="],
        capture_output=True,
        text=True,
    ).stdout
    return sorted(int(line.split()[0]) for line in listing.splitlines() if "spawn_main" in line)


def test_a_killed_rank_ends_the_demo_with_exit_code_1(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            str(CLI), "demo", "--ranks", "3", "--duration", "300", "--port", "0",
            "--out", str(out), "--plain",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=demo_env(),
        start_new_session=True,
    )  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                break
            seen.append(line)
            if line.split("] ", 1)[-1].startswith("step w2:"):
                break
        ranks = _children(proc.pid)
        assert len(ranks) == 3, "".join(seen)[-3000:]
        os.kill(ranks[-1], signal.SIGKILL)
        killed_at = time.monotonic()
        returncode = proc.wait(timeout=90)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    output = "".join(seen)
    assert returncode == 1, output[-3000:]
    assert took < 60, f"took {took:.1f} s to give up"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["stop_reason"] == "a rank failed"
    assert any(e.endswith("killed by signal 9") for e in summary["run"]["errors"])
    assert summary["run"]["steps"] > 0
    assert "rankwatch summary" in output

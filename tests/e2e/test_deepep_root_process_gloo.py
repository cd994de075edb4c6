"""The DeepEP collector with its EP root's windows in a child process, on a real Gloo world:
``Diagnose`` starts the child on the root (``DEEPEP_DIAGNOSE_ROOT_PROCESS_MIN_EP``), its reports
reach the root's publishers, and they are the in-process root's on the same counters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from tests.e2e.test_deepep_gloo import BASE_ENV, Collect, _create, ll_window, run_world, write_ll

pytestmark = [pytest.mark.multiproc, pytest.mark.parallel_safe, pytest.mark.timeout(180)]

ROUNDS = 3


def _started(pub: Collect, **settings: str) -> Any:
    """The low-latency collector of the world, started, reporting to ``pub``."""
    diag = _create(
        dist.group.WORLD,
        dict(BASE_ENV, **settings),
        enable_ll_diagnose=True,
        enable_normal_diagnose=False,
        publishers=[pub],
    )
    assert diag is not None
    diag.start()
    return diag


def _rounds(min_ep: str, rank: int, world: int) -> dict[str, Any]:
    from rankwatch.exporter.deepep.root_process import DeepEPRootProcess

    pub = Collect()
    diag = _started(pub, DEEPEP_DIAGNOSE_ROOT_PROCESS_MIN_EP=min_ep)
    for k in range(ROUNDS):
        write_ll(diag, ll_window(world, 40 + k), rank)
        diag.diagnose_ll_sync()
    # DeepXTrace's synchronous call right after the queued ones: formed after them (the child
    # answers in order; the in-process root waits for its worker's turn), its report in hand.
    write_ll(diag, ll_window(world, 40 + ROUNDS), rank)
    _, blocking = diag.diagnose_sync_blocking("low_latency")
    child = isinstance(diag._root, DeepEPRootProcess)
    pid = diag._root.pid if child else None
    diag.stop(10.0)
    return {
        "child": child,
        "pid": pid,
        "blocking": None if blocking is None else blocking.window_index,
        "reports": [
            {
                "index": r.window_index,
                "ll": {p: np.asarray(x.matrix) for p, x in (r.low_latency or {}).items()},
                "verdicts": {p: x.to_dict() for p, x in (r.low_latency or {}).items()},
            }
            for r in pub.reports
        ],
        "rejected": dict(diag.rejected_windows),
    }


def _both(rank: int, world: int) -> dict[str, Any]:
    return {"child": _rounds("1", rank, world), "thread": _rounds("0", rank, world)}


def test_the_root_child_publishes_what_the_in_process_root_does(tmp_path: Path) -> None:
    results = run_world(_both, 2, tmp_path)
    root, other = results[0], results[1]
    child, thread = root["child"], root["thread"]
    assert child["child"] and child["pid"] is not None and not thread["child"]
    assert not other["child"]["child"] and other["child"]["reports"] == []
    # Every round's window, published by the root's publishers, numbered 0..ROUNDS.
    assert [r["index"] for r in child["reports"]] == list(range(ROUNDS + 1))
    assert child["blocking"] == ROUNDS
    for k, r in enumerate(child["reports"]):
        want = ll_window(2, 40 + k)
        for i, phase in enumerate(("dispatch", "combine")):
            assert np.array_equal(r["ll"][phase], want[:, i, :])
    # The same verdicts as the root on a thread of the training process.
    assert thread["blocking"] == ROUNDS
    assert [r["verdicts"] for r in child["reports"]] == [r["verdicts"] for r in thread["reports"]]
    assert child["rejected"] == thread["rejected"] == {}


# ---- the root's child killed and stuck while ranks train ------------------------------------


RUN_S = 12.0


def _faults_rank(rank: int, world: int) -> dict[str, Any]:
    """One rank of a world of 2 in asynchronous mode (snapshots every 0.2 s), training on its
    main thread without collectives; rank 0 keeps its root child's pid in ``child.pid``."""
    import logging
    import os
    import time

    import torch

    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    out = os.environ["RANKWATCH_TEST_OUT"]
    logging.getLogger("rankwatch.exporter.deepep").addHandler(Lines(logging.WARNING))
    pub = Stamped()
    diag = _started(
        pub,
        DEEPEP_DIAGNOSE_ASYNC="1",
        DEEPEP_DIAGNOSE_ROOT_PROCESS_MIN_EP="1",
        DEEPEP_DIAGNOSE_ROOT_STALL_SECONDS="2",
    )
    pid_file = Path(out, "child.pid")
    a = torch.randn(64, 64)
    rng = np.random.default_rng(rank)
    slowest, steps, start = 0.0, 0, time.monotonic()
    while time.monotonic() - start < RUN_S:
        t0 = time.monotonic()
        write_ll(diag, rng.integers(1, 100, size=(world, 2, world)), rank)
        (a @ a).sum()
        time.sleep(0.01)
        if rank == 0:
            pid = diag._root.pid
            known = pid_file.read_text() if pid_file.exists() else ""
            if pid is not None and diag._root.ready and known != str(pid):
                pid_file.write_text(str(pid))
        slowest = max(slowest, time.monotonic() - t0)
        steps += 1
    t0 = time.monotonic()
    diag.stop(5.0)
    return {
        "steps": steps,
        "slowest_step_s": slowest,
        "stop_s": time.monotonic() - t0,
        "lines": lines,
        "restarts": getattr(diag._root, "restarts", None),
        "reports": [
            {"index": r.window_index, "reason": r.low_latency_invalid_reason, "wall": w}
            for r, w in zip(pub.reports, pub.walls, strict=True)
        ],
    }


class Stamped(Collect):
    """Keeps every report and when it came."""

    def __init__(self) -> None:
        super().__init__()
        self.walls: list[float] = []

    def publish(self, report: Any) -> None:
        import time

        super().publish(report)
        self.walls.append(time.time())


def test_the_root_child_killed_or_stuck_costs_windows_only(tmp_path: Path) -> None:
    """The EP root's child SIGKILLed, then the next one SIGSTOPped for good (killed after the
    2 s stall budget): both ranks train on without waiting, each fault is one line and one
    report naming the gap, the windows resume after each, and stop() keeps its bound."""
    import os
    import signal
    import threading
    import time

    from rankwatch.exporter.deepep.root_process import LOST_REASON

    results: list[Any] = []
    world = threading.Thread(target=lambda: results.extend(run_world(_faults_rank, 2, tmp_path)))
    world.start()
    pid_file = tmp_path / "child.pid"

    def child_pid(other_than: int = 0, timeout_s: float = 30.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = pid_file.read_text() if pid_file.exists() else ""
            if text and int(text) != other_than:
                return int(text)
            time.sleep(0.05)
        raise AssertionError(f"no root child other than {other_than} within {timeout_s} s")

    first = child_pid()
    time.sleep(1.5)
    killed_at = time.time()
    os.kill(first, signal.SIGKILL)
    second = child_pid(first)
    time.sleep(1.0)
    stuck_at = time.time()
    os.kill(second, signal.SIGSTOP)
    child_pid(second)
    back_at = time.time()
    world.join(160)  # run_world kills the ranks that outlive its own deadline
    res = results
    assert len(res) == 2, "the world did not finish (run_world's error is above)"
    root = res[0]
    walls = [r["wall"] for r in root["reports"] if r["reason"] is None]
    lost = [r for r in root["reports"] if r["reason"] == LOST_REASON]
    print(
        f"{len(walls)} windows, {len(lost)} gap reports, lines {root['lines']}, slowest steps "
        f"{[round(r['slowest_step_s'], 3) for r in res]} s, stop {root['stop_s']:.2f} s"
    )
    assert root["restarts"] == 2
    assert len(lost) == 2
    ended = [line for line in root["lines"] if "ended (status -9)" in line]
    stuck = [line for line in root["lines"] if "has not answered a snapshot" in line]
    assert len(ended) == 1 and len(stuck) == 1 and len(root["lines"]) == 2, root["lines"]
    # Windows before the kill, between the faults, and after the last child came back.
    assert any(t < killed_at for t in walls)
    assert any(killed_at < t < stuck_at for t in walls)
    assert any(t > back_at for t in walls)
    # Numbered on without a repeat.
    indices = [r["index"] for r in root["reports"]]
    assert indices == sorted(set(indices))
    # Training never waited for any of it; stop kept its bound.
    for r in res:
        assert r["slowest_step_s"] < 0.5, r["slowest_step_s"]
        assert r["stop_s"] < 5.5, r["stop_s"]

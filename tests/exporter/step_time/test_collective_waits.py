"""Every collective wait of the training thread is a sync wait (real Gloo worlds).

Each world is spawned processes with torchrun's environment; one rank sleeps before a
collective and its peer's wait column grows by about that sleep. Times are checked from below
with a wide margin (a sleep of S seconds makes the peer wait at least about S, less the two
ranks' skew on a loaded machine) or against another measurement of the same row (a wait
counted twice would exceed the step that holds it).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from typing import Any

import pytest
import torch

from rankwatch.diagnosis.step_time.table import column
from rankwatch.exporter.step_time.collectives import (
    collective_wait_targets,
    install_collective_waits,
)
from rankwatch.exporter.step_time.timer import StepTimer
from tests.framework_world import run_world

SLEEP_S = 0.1  # the late rank's sleep before the collective
STEPS_PER_KIND = 3
FWD, BWD = column("cpu", "forward"), column("cpu", "backward")
FWW, BWW = column("cpu", "forward_wait"), column("cpu", "backward_wait")
STEP = column("cpu", "step")
MOD = "tests.exporter.step_time.test_collective_waits"
FLOOR_MS = 0.5 * SLEEP_S * 1e3  # about the sleep, less a loaded machine's skew


# ---- helpers run inside the spawned ranks ----------------------------------------------------


def _init() -> Any:
    import torch.distributed as dist

    torch.manual_seed(0)
    dist.init_process_group("gloo")
    return dist


def _rankwatch() -> Any:
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    # Sync mode, never collected: the background thread stays idle, rows stay in the ring.
    return RankWatch(config=RankwatchConfig.from_env(env={}, async_mode=False, sync_step=10**6))


def _rows(timer: Any) -> list[list[float]]:
    rows, _, lost = timer.read(0)
    assert lost == 0
    return [[float(v) for v in r] for r in rows]


def _late(rank: int, late_rank: int = 1) -> None:
    if rank == late_rank:
        time.sleep(SLEEP_S)


def _kinds(dist: Any, rank: int) -> dict[str, Any]:
    """What each rank runs for each kind of collective (rank 1 is late to every one)."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed import distributed_c10d

    peer = 1 - rank
    t = torch.ones(4)

    def isend_irecv() -> None:
        if rank == 1:
            dist.isend(t, 0).wait()
        else:
            dist.irecv(t, 1).wait()

    def batch_p2p() -> None:
        got = torch.empty(4)
        ops = [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, got, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def other_thread() -> None:
        # Rank 0 runs its side on another thread: nothing of it is timed.
        if rank == 0:
            th = threading.Thread(target=dist.all_reduce, args=(t,))
            th.start()
            th.join()
        else:
            dist.all_reduce(t)

    return {
        "all_reduce": lambda: dist.all_reduce(t),
        "c10d_all_reduce": lambda: distributed_c10d.all_reduce(t),
        "async_op": lambda: dist.all_reduce(t, async_op=True).wait(),
        "isend_irecv": isend_irecv,
        "batch_isend_irecv": batch_p2p,
        "barrier": lambda: dist.barrier(),
        "all_gather_object": lambda: dist.all_gather_object([None, None], rank),
        "broadcast": lambda: dist.broadcast(t, 1),
        "functional": lambda: float(funcol.all_reduce(t, "sum", dist.group.WORLD).sum()),
        "other_thread": other_thread,
    }


def scenario_c10d(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Rank 1 late to every kind; every kind runs in explicit steps of its own."""
    dist = _init()
    originals = [vars(owner)[name] for owner, name in collective_wait_targets()]
    rw = _rankwatch()
    rw.watch()  # no model: the collective waits alone
    result: dict[str, Any] = {}

    def run(name: str, fn: Any, inside: Any = None, watches: tuple[Any, ...] = (rw,)) -> None:
        for _ in range(1 + STEPS_PER_KIND):  # one warm-up step (first-use costs), not checked
            with contextlib.ExitStack() as steps:
                for w in watches:
                    steps.enter_context(w.step())
                _late(rank)
                with inside() if inside is not None else contextlib.nullcontext():
                    fn()
        for k, w in enumerate(watches):
            rows = _rows(w.timer)[-STEPS_PER_KIND:]
            result[name + "_second" * k] = [[r[FWW], r[FWD], r[STEP]] for r in rows]

    kinds = _kinds(dist, rank)
    for name, fn in kinds.items():
        run(name, fn)
    # Inside a user's sync_wait block the collective is counted once, by the block.
    run("inside_sync_wait", kinds["all_reduce"], inside=rw.sync_wait)
    # A second watch() on the same RankWatch: still one credit per wait.
    rw.watch()
    run("second_watch", kinds["all_reduce"])
    # While torch.compile traces (and in the compiled graph) nothing is timed.
    import torch.distributed._functional_collectives as funcol

    def reduced(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

    compiled = torch.compile(reduced, backend="eager", fullgraph=True)
    run("compiled", lambda: compiled(torch.ones(4)))
    # A second RankWatch in the process: each timer credited once.
    rw2 = _rankwatch()
    rw2.watch()
    run("two_rankwatch", kinds["all_reduce"], watches=(rw, rw2))
    rw2.close(5.0)
    run("one_closed", kinds["all_reduce"])
    rw.close(5.0)
    result["restored_after_close"] = [
        vars(owner)[name] is before
        for (owner, name), before in zip(collective_wait_targets(), originals, strict=True)
    ]
    written = rw.timer.written
    with rw.timer.step():
        kinds["all_reduce"]()
    result["after_close"] = [[r[FWW], r[FWD], r[STEP]] for r in _rows(rw.timer)[written:]]
    dist.destroy_process_group()
    return result


# ---- parent side ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def c10d_world(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return run_world(f"{MOD}:scenario_c10d", 2, tmp_path_factory.mktemp("c10d"))


TIMED_KINDS = [
    "all_reduce",
    "c10d_all_reduce",
    "async_op",
    "isend_irecv",
    "batch_isend_irecv",
    "barrier",
    "all_gather_object",
    "broadcast",
    "functional",
    "inside_sync_wait",
    "second_watch",
    "two_rankwatch",
    "one_closed",
]


@pytest.mark.parametrize("kind", TIMED_KINDS)
def test_the_peer_of_a_late_rank_waits_in_each_kind_of_collective(
    c10d_world: dict[int, dict[str, Any]], kind: str
) -> None:
    waiting, late = c10d_world[0][kind], c10d_world[1][kind]
    fww = [r[0] for r in waiting]
    assert statistics.median(fww) >= FLOOR_MS, (kind, waiting)
    # The late rank waited less than its peer: it is the one that arrived last.
    assert statistics.median(r[0] for r in late) < statistics.median(fww), (kind, late, waiting)
    for wait_ms, forward_ms, step_ms in waiting:
        # A wait outside a timed forward is a pre-forward wait: forward holds it too, and it
        # is in the step once (a wait counted twice would outgrow the step).
        assert forward_ms == pytest.approx(wait_ms)
        assert wait_ms <= step_ms + 0.05, (kind, waiting)


def test_a_second_rankwatch_in_the_process_is_credited_once_too(
    c10d_world: dict[int, dict[str, Any]],
) -> None:
    second = c10d_world[0]["two_rankwatch_second"]
    assert statistics.median(r[0] for r in second) >= FLOOR_MS, second
    for wait_ms, _, step_ms in second:
        assert wait_ms <= step_ms + 0.05, second


def test_nothing_is_timed_on_another_thread_while_compiling_or_after_close(
    c10d_world: dict[int, dict[str, Any]],
) -> None:
    res = c10d_world[0]
    assert all(math.isnan(r[0]) for r in res["other_thread"]), res["other_thread"]
    assert all(math.isnan(r[0]) for r in res["compiled"]), res["compiled"]
    assert all(res["restored_after_close"]), res["restored_after_close"]
    # The timer (closed RankWatch, its step timed by hand) saw a step and no wait in it.
    assert len(res["after_close"]) == 1 and math.isnan(res["after_close"][0][0])


def test_bad_timer_is_refused_with_the_field_named() -> None:
    for bad in (None, "timer", 3, object()):
        with pytest.raises(TypeError, match="install_collective_waits: field timer"):
            install_collective_waits(bad)  # type: ignore[arg-type]


def test_install_and_remove_restore_torch_and_nest_per_timer() -> None:
    before = {(id(o), n): vars(o)[n] for o, n in collective_wait_targets()}
    timer = StepTimer(4)
    first, second = install_collective_waits(timer), install_collective_waits(timer)
    assert all(vars(o)[n] is not before[(id(o), n)] for o, n in collective_wait_targets())
    for h in first:
        h.remove()
    # Still installed for the second handle of the same timer.
    assert all(vars(o)[n] is not before[(id(o), n)] for o, n in collective_wait_targets())
    for h in second:
        h.remove()
        h.remove()  # idempotent
    assert all(vars(o)[n] is before[(id(o), n)] for o, n in collective_wait_targets())

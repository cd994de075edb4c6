"""What timing a collective's wait adds to it: the same collective timed and untimed, side by
side in one run.

Each figure is a block of ``CALLS`` calls with the collective waits installed for a timer with
an open step (every wait credited to it) against a block of the same calls without them, the
blocks interleaved ``REPEATS`` times so both see the same machine load; the row's median is
the timed block's cost per call less the untimed one's (the extra per collective), its
baseline the untimed cost per call.

* 1-element ``all_reduce`` on a single-process Gloo group (no peer: the collective's own cost
  is small, so the wait's share is large);
* 1-element ``all_reduce`` on a 2-rank Gloo group (two spawned processes in lockstep);
* ``Work.wait()`` of a work that has completed (the shadow alone: a thread check, the
  compile check, a flag and two clock reads);
* a pipeline schedule's action held as a phase (:mod:`rankwatch.exporter.step_time.pipeline`:
  the shadow around an action that does nothing, against the bare action);
* a DDP forward (1-process Gloo group, no gradients) with ``watch()``'s hooks, with and
  without the eager pass-through of the shadows that time a DDP model compiled after
  ``watch()``.

Usage: ``python -m bench.run_all --only bench_collective_waits``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

from bench.bench_hot_path import _row

REPEATS = 9
CALLS = 2_000
WAITS = 20_000  # Work.wait() calls per block (a completed work: no collective at all)
TARGET_US = 2.0  # the extra per collective this module is held to


def _extras(
    run_block: Any, timer: Any, calls: int, shadowed_block: Any = None
) -> tuple[list[float], list[float]]:
    """(extra us per call timed over untimed, untimed us per call), per repetition: the block
    with the collective waits installed against it without them, or ``shadowed_block``
    against ``run_block``."""
    from rankwatch.exporter.step_time.collectives import install_collective_waits

    run_block(calls // 10)  # warm-up
    extras, bases = [], []
    for k in range(REPEATS):
        pair = {}
        for timed in (k % 2 == 0, k % 2 != 0):  # the order alternates
            install = timed and shadowed_block is None
            handles = install_collective_waits(timer) if install else []
            block = shadowed_block if timed and shadowed_block is not None else run_block
            timer.start_step()
            t0 = time.perf_counter_ns()
            block(calls)
            pair[timed] = (time.perf_counter_ns() - t0) / calls / 1e3
            timer.end_step()
            for handle in handles:
                handle.remove()
        extras.append(pair[True] - pair[False])
        bases.append(pair[False])
    return extras, bases


def _all_reduce_block(calls: int) -> None:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    for _ in range(calls):
        dist.all_reduce(t)


def _world_rank(rank: int, world: int, port: int, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    from rankwatch.exporter.step_time.timer import StepTimer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        result = _extras(_all_reduce_block, StepTimer(8), CALLS)
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


def _two_ranks() -> tuple[list[float], list[float]]:
    from tests.servers import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_world_rank, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(60)
    return result  # type: ignore[no-any-return]


def _completed_wait_block(work: Any) -> Any:
    def block(calls: int) -> None:
        for _ in range(calls):
            work.wait()

    return block


def _action_blocks(timer: Any) -> tuple[Any, Any]:
    """(bare, held): blocks calling an action that does nothing, bare and through the
    pipeline shadow (subscribed for ``timer``: each call holds and releases ``forward``)."""
    from threading import get_ident

    from rankwatch.exporter.step_time.collectives import ShadowRegistry
    from rankwatch.exporter.step_time.pipeline import _held_phase

    def forward_one_chunk(stage: Any) -> None:
        return None

    registry = ShadowRegistry(list, _held_phase)
    registry.subscribe(timer.sync_wait(), get_ident())
    held = _held_phase(registry, forward_one_chunk)
    stage = object()

    def bare(calls: int) -> None:
        for _ in range(calls):
            forward_one_chunk(stage)

    def shadowed(calls: int) -> None:
        for _ in range(calls):
            held(stage)

    return bare, shadowed


def _ddp_blocks() -> tuple[Any, Any]:
    """(without, with): blocks of DDP forwards under ``install()``'s hooks, one DDP object
    without the late-compile shadows of ``_pre_forward``/``_post_forward``, one with."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from rankwatch.exporter.step_time.hooks import AttributeShadow, install
    from rankwatch.exporter.step_time.timer import StepTimer

    blocks = []
    for keep in (False, True):
        ddp = DDP(torch.nn.Linear(1, 1))
        for handle in install(StepTimer(8), ddp, []):
            late = isinstance(handle, AttributeShadow) and handle._name in vars(ddp)
            if late and not keep:
                handle.remove()
        x = torch.ones(1, 1)

        def block(calls: int, ddp: Any = ddp, x: Any = x) -> None:
            with torch.no_grad():
                for _ in range(calls):
                    ddp(x)

        blocks.append(block)
    return blocks[0], blocks[1]


def run() -> list[dict[str, Any]]:
    """Rows: extra us per collective, 1 process and 2 ranks; the shadow alone."""
    import torch
    import torch.distributed as dist

    from rankwatch.exporter.step_time.timer import StepTimer
    from tests.servers import free_port

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        timer = StepTimer(8)
        single = _extras(_all_reduce_block, timer, CALLS)
        work = dist.all_reduce(torch.ones(1), async_op=True)
        work.wait()
        shadow = _extras(_completed_wait_block(work), timer, WAITS)
        without, with_late = _ddp_blocks()
        ddp = _extras(without, timer, CALLS, shadowed_block=with_late)
    finally:
        dist.destroy_process_group()
    pair = _two_ranks()
    bare, held = _action_blocks(timer)
    action = _extras(bare, timer, WAITS, shadowed_block=held)
    rows = (
        ("extra per 1-element all_reduce, 1-process Gloo group", single),
        ("extra per 1-element all_reduce, 2-rank Gloo group", pair),
        ("extra per Work.wait() of a completed work (the shadow alone)", shadow),
        ("extra per pipeline schedule action held as a phase", action),
        ("extra per DDP forward: the late-compile shadows passing through", ddp),
    )
    return [_row(name, TARGET_US, extras, "us", bases) for name, (extras, bases) in rows]

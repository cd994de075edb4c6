"""Training-loop perturbation: step time of a small CPU DDP job with and without rankwatch.

Four spawned ranks train an MLP under ``DistributedDataParallel`` on Gloo. The run alternates
blocks of steps without rankwatch and with it (``RankWatch`` + ``watch()`` hooks, async
shipping every 0.5 s, ten times more often than the default, so the background gather and the
root's diagnosis run during every block); the order flips from pair to pair so a drift in
machine load does not favour either side. Rank 0 times every step; a block's figure is its
median step time, and a pair's overhead is ``with / without - 1``.

Rows: the step time with rankwatch (baseline: without) and the overhead in percent (median and
spread over the pairs), then the same for rank 0's process CPU time per step, which a shared
machine's scheduling disturbs less than wall time. Target: under 1 % median overhead. On a
two-core machine running four ranks (and other work), block medians of the wall time move by
tens of percent from block to block; read the spread before the median.

Usage: ``python -m bench.bench_training_overhead``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Any

from rankwatch.exporter.cli.ports import free_port

WORLD = 4
PAIRS = 20
BLOCK_STEPS = 40
WARMUP_STEPS = 5
INTERVAL_S = 0.5
TARGET_PCT = 1.0


def _block(
    model: Any, opt: Any, batches: Any, steps: int, collect: Any
) -> tuple[list[float], float]:
    """Wall time of every step (s), and the process CPU time per step (ms)."""
    import torch

    loss_fn = torch.nn.functional.cross_entropy
    times = []
    it = iter(batches)
    cpu0 = time.process_time()
    for _ in range(steps):
        t0 = time.perf_counter()
        x, y = next(it)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if collect is not None:
            collect()
        times.append(time.perf_counter() - t0)
    return times, (time.process_time() - cpu0) / steps * 1e3


def _worker(rank: int, port: int, queue: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["LOCAL_RANK"] = str(rank)
    import torch
    import torch.distributed as dist

    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(256, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = (torch.randn(64, 256), torch.randint(0, 10, (64,)))
    batches = [batch] * (BLOCK_STEPS + WARMUP_STEPS)
    cfg = RankwatchConfig.from_env(env={}, interval_seconds=INTERVAL_S, gather_timeout_seconds=5.0)
    medians: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    thread_share: list[float] = []  # root's background-thread CPU seconds per wall second
    reports = 0
    _block(model, opt, batches, WARMUP_STEPS * 4, None)
    for pair in range(PAIRS):
        for mode in ("off", "on") if pair % 2 == 0 else ("on", "off"):
            if mode == "on":
                rw = RankWatch(config=cfg)
                loader = rw.watch(model, opt, batches)
                wall0 = time.perf_counter()
                times, cpu_ms = _block(model, opt, loader, BLOCK_STEPS + WARMUP_STEPS, rw.collect)
                wall = time.perf_counter() - wall0
                rw.close(5.0)
                reports += rw.latest_report is not None
                collector = rw._collector
                if collector is not None:
                    thread_share.append(collector.cpu_seconds / wall * 100)
            else:
                times, cpu_ms = _block(model, opt, batches, BLOCK_STEPS + WARMUP_STEPS, None)
            medians[mode].append(statistics.median(times[WARMUP_STEPS:]) * 1e3)
            cpu[mode].append(cpu_ms)
    if rank == 0:
        queue.put({"medians": medians, "cpu": cpu, "reports": reports, "thread": thread_share})
    dist.destroy_process_group()


def run() -> list[dict[str, Any]]:
    """Two rows: step time with rankwatch (ms, baseline without) and the overhead (%)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    on, off = result["medians"]["on"], result["medians"]["off"]
    overheads = [(a / b - 1.0) * 100 for a, b in zip(on, off, strict=True)]
    med_on, med_off = statistics.median(on), statistics.median(off)
    cpu_on, cpu_off = result["cpu"]["on"], result["cpu"]["off"]
    cpu_over = [(a / b - 1.0) * 100 for a, b in zip(cpu_on, cpu_off, strict=True)]
    return [
        {
            "name": f"DDP step, {WORLD} Gloo ranks, CPU MLP, with rankwatch",
            "target": None,
            "median": med_on,
            "spread": max(on) - min(on),
            "unit": "ms",
            "baseline": med_off,
            "ratio": med_on / med_off,
        },
        {
            "name": f"rankwatch overhead per step ({PAIRS} interleaved block pairs, "
            f"{result['reports']} blocks with a published window)",
            "target": TARGET_PCT,
            "median": statistics.median(overheads),
            "spread": max(overheads) - min(overheads),
            "unit": "%",
            "baseline": 0.0,
            "ratio": None,
        },
        {
            # CPU time is steadier than wall time on a shared machine: a second view of the
            # same cost (rank 0's whole process: training, Gloo, rankwatch's thread, the store).
            "name": "rank-0 process CPU time per step, with rankwatch",
            "target": None,
            "median": statistics.median(cpu_on),
            "spread": max(cpu_on) - min(cpu_on),
            "unit": "ms",
            "baseline": statistics.median(cpu_off),
            "ratio": statistics.median(cpu_on) / statistics.median(cpu_off),
        },
        {
            # Includes the final shipment and summary of close(), counted against the block.
            "name": f"root's rankwatch thread CPU, shipping every {INTERVAL_S} s",
            "target": None,
            "median": statistics.median(result["thread"]),
            "spread": max(result["thread"]) - min(result["thread"]),
            "unit": "% of a core",
            "baseline": None,
            "ratio": None,
        },
        {
            "name": "rank-0 process CPU time overhead per step",
            "target": TARGET_PCT,
            "median": statistics.median(cpu_over),
            "spread": max(cpu_over) - min(cpu_over),
            "unit": "%",
            "baseline": 0.0,
            "ratio": None,
        },
    ]


if __name__ == "__main__":
    from bench.run_all import table

    print(table(run()), end="")

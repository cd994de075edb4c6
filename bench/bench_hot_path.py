"""Hot-path cost of the step timer on the CPU clock, against the bare clock reads it wraps.

Three figures, each measured side by side with its baseline in the same loop (interleaved
repetitions, so both see the same machine load):

* one phase mark (``with rw.phase("forward"): pass``: enter and exit) against the two
  ``time.perf_counter_ns()`` calls and the subtraction it stands for. Target: under 5 us;
* one step's bookkeeping (``rw.step()``, five phases, ``rw.collect()``) as a share of a
  10 ms step, against the twelve bare clock reads. Target: under 1 %;
* ``rw.watch()`` hooks on a tiny MLP training step (loader wrapper, forward, backward and
  optimizer hooks): the extra time per step over the same step on an identical unhooked
  model. Target: under 100 us (1 % of a 10 ms step).

Usage: ``python -m bench.bench_hot_path``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

REPEATS = 9
MARKS = 50_000
STEPS = 10_000
HOOK_STEPS = 300
STEP_BUDGET_US = 10_000.0  # the 10 ms step the per-step target refers to


def _rankwatch() -> Any:
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.rankwatch import RankWatch

    # One process, no publishers: the background thread idles; what is timed is the hot path.
    cfg = RankwatchConfig.from_env(env={}, interval_seconds=3600.0, max_buffered_steps=STEPS * 2)
    return RankWatch(config=cfg, gpu_timing=False)


def _mark_cost_us(rw: Any, n: int) -> float:
    phase = rw.phase
    clock = time.perf_counter_ns
    t0 = clock()
    for _ in range(n):
        with phase("forward"):
            pass
    return (clock() - t0) / n / 1e3


def _bare_mark_us(n: int) -> float:
    clock = time.perf_counter_ns
    acc = 0
    t0 = clock()
    for _ in range(n):
        a = clock()
        acc += clock() - a
    return (clock() - t0) / n / 1e3


def _step_cost_us(rw: Any, n: int) -> float:
    step, phase, collect = rw.step, rw.phase, rw.collect
    clock = time.perf_counter_ns
    t0 = clock()
    for _ in range(n):
        with step():
            with phase("input_wait"):
                pass
            with phase("h2d"):
                pass
            with phase("forward"):
                pass
            with phase("backward"):
                pass
            with phase("optimizer"):
                pass
        collect()
    return (clock() - t0) / n / 1e3


def _bare_step_us(n: int) -> float:
    clock = time.perf_counter_ns
    acc = [0] * 6
    t0 = clock()
    for _ in range(n):
        s = clock()
        for k in range(5):
            a = clock()
            acc[k] += clock() - a
        acc[5] += clock() - s
    return (clock() - t0) / n / 1e3


def _tiny_training(rw: Any | None, steps: int) -> tuple[Any, Any, Any]:
    """(model, optimizer, batch iterator) of a tiny MLP; hooked and wrapped if ``rw``."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(16, 32), torch.randn(16, 1))] * steps
    loader: Any = data if rw is None else rw.watch(model, opt, data)
    return model, opt, iter(loader)


def _interleaved_steps_us(hooked: Any, bare: Any, steps: int) -> tuple[float, float]:
    """Median step time (us) of the hooked and the bare model, steps alternating A, B, A, B."""
    import torch

    mse = torch.nn.functional.mse_loss
    clock = time.perf_counter_ns
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(steps):
        for k, (model, opt, batches) in enumerate((hooked, bare)):
            t0 = clock()
            x, y = next(batches)  # the hooked loader's fetch opens the step
            mse(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            times[k].append((clock() - t0) / 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def _row(
    name: str, target: float, values: list[float], unit: str, baselines: list[float]
) -> dict[str, Any]:
    med, base = statistics.median(values), statistics.median(baselines)
    return {
        "name": name,
        "target": target,
        "median": med,
        "spread": max(values) - min(values),
        "unit": unit,
        "baseline": base,
        "ratio": med / base if base else None,
    }


def run() -> list[dict[str, Any]]:
    """Rows: phase mark (us), step bookkeeping (% of 10 ms), watch() hooks per step (us)."""
    import torch

    torch.set_num_threads(1)
    rw = _rankwatch()
    hooked_rw = _rankwatch()
    try:
        marks, bare_marks, steps, bare_steps = [], [], [], []
        _mark_cost_us(rw, 1000)  # warm-up
        for _ in range(REPEATS):
            marks.append(_mark_cost_us(rw, MARKS))
            bare_marks.append(_bare_mark_us(MARKS))
            steps.append(_step_cost_us(rw, STEPS) / STEP_BUDGET_US * 100)
            bare_steps.append(_bare_step_us(STEPS) / STEP_BUDGET_US * 100)
        extra, plain = [], []
        total = HOOK_STEPS * (REPEATS + 1)
        hooked, bare = _tiny_training(hooked_rw, total), _tiny_training(None, total)
        _interleaved_steps_us(hooked, bare, HOOK_STEPS)  # warm-up
        for _ in range(REPEATS):
            with_hooks, without = _interleaved_steps_us(hooked, bare, HOOK_STEPS)
            extra.append(with_hooks - without)
            plain.append(without)
    finally:
        rw.close(2.0)
        hooked_rw.close(2.0)
    rows = [
        _row("phase mark (enter + exit), CPU clock", 5.0, marks, "us", bare_marks),
        _row(
            "step bookkeeping (step, 5 phases, collect) per 10 ms step",
            1.0,
            steps,
            "%",
            bare_steps,
        ),
        _row("watch() hooks per tiny-MLP step (extra over unhooked)", 100.0, extra, "us", plain),
    ]
    # The hooks row's baseline is the unhooked step itself: its ratio is the relative cost.
    rows[2]["ratio"] = statistics.median(extra) / statistics.median(plain)
    return rows


if __name__ == "__main__":
    from bench.run_all import table

    print(table(run()), end="")

"""Hot-path cost of the step timer on the CPU clock, against the bare clock reads it wraps.

Three figures, each measured side by side with its baseline in the same loop (interleaved
repetitions, so both see the same machine load):

* one phase mark (``with rw.phase("forward"): pass``: enter and exit) against the two
  ``time.perf_counter_ns()`` calls and the subtraction it stands for. Target: under 1 us;
* one step's bookkeeping (``rw.step()``, five phases, ``rw.collect()``) as a share of a
  10 ms step, against the twelve bare clock reads. Target: under 1 %;
* ``rw.watch()`` hooks on a tiny MLP training step (loader wrapper, forward, backward and
  optimizer hooks) and the same step timed by ``step()`` and five ``phase()`` marks: the
  extra time per step over the same step on an identical unhooked model, the three loops in
  interleaved blocks (median step per block, the block order rotating). Targets: hooks
  10 us, explicit phases 5 us per step. Two floors run in the same blocks: no-op hooks of the
  kinds ``watch()`` installs (torch's own cost), and six context managers that only read the
  clock around the same step (the least any explicit API of a step and five phases costs).

Usage: ``python -m bench.bench_hot_path``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.run_all import row

REPEATS = 9
MARKS = 50_000
STEPS = 10_000
HOOK_STEPS = 600
HOOKS_TARGET_US = 10.0  # watch() hooks per step, CPU clock
EXPLICIT_TARGET_US = 5.0  # step() and five phase() marks per step
STEP_BUDGET_US = 10_000.0  # the 10 ms step the per-step target refers to


def _rankwatch() -> Any:
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.step_time.rank_watch import RankWatch

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


def _bare_block_us(training: Any, steps: int) -> float:
    """Median step time (us) of the unhooked tiny MLP over ``steps`` steps."""
    import torch

    mse = torch.nn.functional.mse_loss
    clock = time.perf_counter_ns
    model, opt, batches = training
    times = []
    for _ in range(steps):
        t0 = clock()
        x, y = next(batches)
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(clock() - t0)
    return statistics.median(times) / 1e3


def _explicit_block_us(rw: Any, training: Any, steps: int) -> float:
    """Median step time (us) of the tiny MLP timed by ``step()`` and five ``phase()`` marks."""
    import torch

    mse = torch.nn.functional.mse_loss
    clock = time.perf_counter_ns
    step, phase, collect = rw.step, rw.phase, rw.collect
    model, opt, batches = training
    times = []
    for _ in range(steps):
        t0 = clock()
        with step():
            with phase("input_wait"):
                x, y = next(batches)
            with phase("h2d"):
                pass  # already on the CPU
            with phase("forward"):
                loss = mse(model(x), y)
            with phase("backward"):
                loss.backward()
            with phase("optimizer"):
                opt.step()
                opt.zero_grad()
        collect()
        times.append(clock() - t0)
    return statistics.median(times) / 1e3


class _FloorMark:
    """The least a phase mark can do: read the clock on enter and exit and keep the pair."""

    __slots__ = ("_i", "_marks", "_start")

    def __init__(self, marks: list[tuple[int, int]], index: int) -> None:
        self._marks, self._i, self._start = marks, index, 0

    def __enter__(self) -> None:
        self._start = time.perf_counter_ns()

    def __exit__(self, *exc: object) -> None:
        self._marks.append((self._i, time.perf_counter_ns() - self._start))


def _floor_block_us(training: Any, steps: int) -> float:
    """Median step time (us) of the tiny MLP under six :class:`_FloorMark` context managers
    (a step and five phases): the floor under any explicit API of context managers, with no
    bookkeeping beyond keeping the clock readings."""
    import torch

    mse = torch.nn.functional.mse_loss
    clock = time.perf_counter_ns
    model, opt, batches = training
    marks: list[tuple[int, int]] = []
    step, wait, h2d, fwd, bwd, optim = (_FloorMark(marks, i) for i in range(6))
    times = []
    for _ in range(steps):
        t0 = clock()
        with step:
            with wait:
                x, y = next(batches)
            with h2d:
                pass
            with fwd:
                loss = mse(model(x), y)
            with bwd:
                loss.backward()
            with optim:
                opt.step()
                opt.zero_grad()
        times.append(clock() - t0)
    marks.clear()
    return statistics.median(times) / 1e3


def _noop_hooked(steps: int) -> tuple[Any, Any, Any]:
    """The tiny MLP with hooks of the kinds ``watch()`` installs, all doing nothing: forward
    pre and post hooks, a pre hook on the output's autograd node per forward queuing a final
    callback, optimizer step pre and post hooks. Their cost is torch's own, the floor under
    what any tool timing these points from public hooks pays."""
    import torch

    model, opt, batches = _tiny_training(None, steps)
    engine = torch.autograd.Variable._execution_engine

    def nothing(*args: Any) -> None:
        return None

    def at_output_grad(*grads: Any) -> None:
        engine.queue_callback(nothing)

    def forward_post(module: Any, args: Any, output: Any) -> None:
        output.grad_fn.register_prehook(at_output_grad)

    model.register_forward_pre_hook(nothing, prepend=True)
    model.register_forward_hook(forward_post, always_call=True)
    opt.register_step_pre_hook(nothing)
    opt.register_step_post_hook(nothing)
    return model, opt, batches


def _training_blocks(hooked_rw: Any, explicit_rw: Any) -> dict[str, list[float]]:
    """Per block, in us: the extra step time of hooks, explicit phases, no-op hooks and the
    clock-only context managers, and the bare step (key ``bare``).

    The five loops run the same tiny MLP in interleaved blocks (the order rotating every
    round), each block's median step against the bare block's of the same round, so all of
    them see the same machine load.
    """
    total = HOOK_STEPS * (REPEATS + 1)
    hooked = _tiny_training(hooked_rw, total)
    bare = _tiny_training(None, total * 2)
    explicit = _tiny_training(None, total)
    noop = _noop_hooked(total * 2)
    floor = _tiny_training(None, total)
    runners = {
        "bare": lambda n: _bare_block_us(bare, n),
        "hooks": lambda n: _bare_block_us(hooked, n),  # the hooks time it: the bare loop
        "explicit": lambda n: _explicit_block_us(explicit_rw, explicit, n),
        "noop": lambda n: _bare_block_us(noop, n),
        "floor": lambda n: _floor_block_us(floor, n),
    }
    names = list(runners)
    for run_block in runners.values():  # warm-up
        run_block(HOOK_STEPS // 4)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(REPEATS):
        medians = {name: runners[name](HOOK_STEPS // 2) for name in names[r:] + names[:r]}
        for name in names:
            base = 0.0 if name == "bare" else medians["bare"]
            out[name].append(medians[name] - base)
    return out


def _row(
    name: str, target: float | None, values: list[float], unit: str, baselines: list[float]
) -> dict[str, Any]:
    # Each value is one round's figure.
    return row(name, unit, [[v] for v in values], [[b] for b in baselines], target)


def run() -> list[dict[str, Any]]:
    """Rows: phase mark (us), step bookkeeping (% of 10 ms), watch() hooks per step (us)."""
    import torch

    torch.set_num_threads(1)
    rw = _rankwatch()
    hooked_rw = _rankwatch()
    explicit_rw = _rankwatch()
    try:
        marks, bare_marks, steps, bare_steps = [], [], [], []
        _mark_cost_us(rw, 1000)  # warm-up
        for _ in range(REPEATS):
            marks.append(_mark_cost_us(rw, MARKS))
            bare_marks.append(_bare_mark_us(MARKS))
            steps.append(_step_cost_us(rw, STEPS) / STEP_BUDGET_US * 100)
            bare_steps.append(_bare_step_us(STEPS) / STEP_BUDGET_US * 100)
        blocks = _training_blocks(hooked_rw, explicit_rw)
    finally:
        rw.close(2.0)
        hooked_rw.close(2.0)
        explicit_rw.close(2.0)
    rows = [
        _row("phase mark (enter + exit), CPU clock", 1.0, marks, "us", bare_marks),
        _row(
            "step bookkeeping (step, 5 phases, collect) per 10 ms step",
            1.0,
            steps,
            "%",
            bare_steps,
        ),
    ]
    plain = blocks["bare"]
    for key, name, target in (
        ("hooks", "watch() hooks per tiny-MLP step (extra over unhooked)", HOOKS_TARGET_US),
        (
            "explicit",
            "step() + 5 phase() per tiny-MLP step (extra over unhooked)",
            EXPLICIT_TARGET_US,
        ),
        ("noop", "no-op hooks of the same kinds per tiny-MLP step (torch's own cost)", None),
        (
            "floor",
            "six context managers that only read the clock per tiny-MLP step (the floor)",
            None,
        ),
    ):
        row = _row(name, target, blocks[key], "us", plain)
        # The baseline is the unhooked step itself: the ratio is the relative cost.
        row["ratio"] = statistics.median(blocks[key]) / statistics.median(plain)
        rows.append(row)
    return rows


if __name__ == "__main__":
    from bench.run_all import table

    print(table(run()), end="")

"""The GPU clock's device check, run by hand on a machine with a CUDA GPU (``make gpu-check``).

Without CUDA it prints one line and exits 0. With CUDA (one GPU suffices) it runs five cells,
each in its own process with a hard time limit (a cell that hangs or fails is reported as
failed; the others still run; about six minutes at most), and prints one table:

* ``clock``: one process trains a small model under ``watch()`` with GPU timing, and times the
  same loop itself with its own ``torch.cuda.Event`` pairs around forward, backward and the
  optimizer. Rankwatch's GPU columns must be present on every step and agree with the
  script's own events (within ``CLOCK_TOLERANCE_MS`` + ``CLOCK_TOLERANCE_SHARE``);
* ``gloo``: two processes share the GPU (Gloo with CUDA tensors, DDP). Per scenario one rank
  (``SLOW_RANK``) is slow: ``data`` (its loader sleeps ``FAULT_MS`` on the host), ``forward``
  and ``backward`` (``torch.cuda._sleep`` of about ``FAULT_MS`` on its compute stream, in the
  forward pass or in the backward pass), and a ``control`` without fault. Both ranks' rows are
  diagnosed: the verdict (kind, culprit, clock, visible definition) is printed beside the one
  expected; the faults must be named on the GPU clock with the sync-wait definition;
* ``nccl``: the same on NCCL, one GPU per rank, when two or more GPUs exist (else skipped,
  which counts as right);
* ``cost``: the same loop unwatched and watched (GPU timing on), the per-step wall time of
  each side by side; the watched loop may cost at most ``COST_LIMIT_SHARE`` more (plus
  ``COST_LIMIT_MS``);
* ``accelerate``: with four or more GPUs (else skipped, which counts as right), Accelerate's
  N-D parallelism, which cannot run on a CPU: ``ParallelismConfig(dp_shard_size=2,
  tp_size=2)``, FSDP2 over transformers' tensor parallel plan on a tiny Llama
  (:mod:`bench.trainer_accelerate`), 4 NCCL ranks under rankwatch with the real publisher
  hub. Per scenario (``ACCELERATE_SCENARIOS``) the run's verdict and the incidents opened:
  the slow rank named, and no incident in the control.
* ``hang``: two processes share the GPU (Gloo with CUDA tensors, DDP), hang budget
  ``HANG_BUDGET_S``: ``sleep`` (the slow rank sleeps on the host before the collective the
  other waits in: ``stuck_alive`` naming it) and ``mismatch`` (it calls one ``all_reduce`` the
  other never calls: ``collective_mismatch`` naming it). Each world is killed once the root
  heard of the incident, or after 30 s.

Exit 0 when every cell is right, 1 otherwise. Nothing is downloaded; seeds are fixed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.device_deepxtrace import sleep_cycles_per_ms
from rankwatch.exporter.cli.ports import free_port

PROG = "gpu_check"
REPO = Path(__file__).resolve().parents[1]  # ``python -m bench.gpu_check`` runs from here
SLOW_RANK = 1
FAULT_MS = 30.0
STEPS = 60  # per scenario; the first WARMUP_STEPS are left out of the window
WARMUP_STEPS = 10
CLOCK_TOLERANCE_MS = 0.5
CLOCK_TOLERANCE_SHARE = 0.10
COST_LIMIT_SHARE = 0.05
COST_LIMIT_MS = 0.5
# Hard limits per cell (seconds): the sum stays under eight minutes.
CELL_SECONDS = {
    "clock": 45.0,
    "gloo": 75.0,
    "nccl": 75.0,
    "cost": 40.0,
    "accelerate": 150.0,
    "hang": 100.0,
}
SCENARIOS = ("data", "forward", "backward", "control")
EXPECTED = {
    "data": ("INPUT_STRAGGLER", SLOW_RANK),
    "forward": ("COMPUTE_STRAGGLER", SLOW_RANK),
    "backward": ("COMPUTE_STRAGGLER", SLOW_RANK),
    "control": (None, None),  # no straggler kind
}
STRAGGLER_KINDS = ("STRAGGLER", "INPUT_STRAGGLER", "H2D_STRAGGLER", "COMPUTE_STRAGGLER")
ACCELERATE_WORLD = 4
# FSDP2 jobs: compute is never attributed (the step-time policy), a slow forward is STRAGGLER.
ACCELERATE_SCENARIOS = {
    "control": (None, None),
    "data": ("INPUT_STRAGGLER", SLOW_RANK),
    "forward": ("STRAGGLER", SLOW_RANK),
}


# --------------------------------------------------------------------------- table logic


@dataclass(frozen=True)
class Check:
    """One row of the table."""

    cell: str
    expected: str
    got: str
    ok: bool


def judge_clock(rankwatch_ms: dict[str, list[float]], own_ms: dict[str, list[float]]) -> Check:
    """Rankwatch's GPU columns against the script's own events, phase by phase and step by
    step: present everywhere, and within the tolerance."""
    worst, missing = 0.0, 0
    for phase, own in own_ms.items():
        got = rankwatch_ms.get(phase, [])
        if len(got) != len(own):
            return Check("clock", "a GPU row per step", f"{len(got)} {phase} of {len(own)}", False)
        for a, b in zip(got, own, strict=True):
            if a is None or math.isnan(a):
                missing += 1
                continue
            allowed = CLOCK_TOLERANCE_MS + CLOCK_TOLERANCE_SHARE * b
            worst = max(worst, abs(a - b) - allowed)
    ok = missing == 0 and worst <= 0.0
    expected = f"GPU columns on every step, within {CLOCK_TOLERANCE_MS} ms + " + (
        f"{CLOCK_TOLERANCE_SHARE:.0%} of the script's own events"
    )
    got_text = f"{missing} absent, worst excess {max(worst, 0.0):.3f} ms"
    return Check("clock", expected, got_text, ok)


def verdict_of(per_rank: dict[int, Any], window: int) -> dict[str, Any]:
    """The diagnosis of two ranks' rows: kind, culprit, clock, visible definition."""
    import numpy as np

    from rankwatch.diagnosis.step_time import diagnose_arrays

    arrays = {r: np.asarray(rows, dtype=np.float64) for r, rows in per_rank.items()}
    report = diagnose_arrays(arrays, strategy="ddp", window=window)
    culprit = report.straggler.culprit_rank if report.straggler is not None else None
    return {
        "kind": report.kind,
        "culprit": culprit,
        "clock": report.clock,
        "visible": report.visible_definition,
    }


def judge_verdict(cell: str, scenario: str, verdict: dict[str, Any]) -> Check:
    """A scenario's verdict against the expected one: the fault named on the GPU clock with
    the sync-wait definition; the control without a straggler kind."""
    kind, rank = EXPECTED[scenario]
    on_gpu = verdict["clock"] == "gpu" and verdict["visible"] == "sync_wait"
    if kind is None:
        ok = on_gpu and verdict["kind"] not in STRAGGLER_KINDS
        expected = "no straggler (gpu, sync_wait)"
    else:
        ok = on_gpu and verdict["kind"] == kind and verdict["culprit"] == rank
        expected = f"{kind} rank {rank} (gpu, sync_wait)"
    got = f"{verdict['kind']} rank {verdict['culprit']} ({verdict['clock']}, {verdict['visible']})"
    return Check(f"{cell} {scenario}", expected, got, ok)


def judge_cost(unwatched_ms: float, watched_ms: float) -> Check:
    """Per-step wall time watched vs unwatched."""
    limit = unwatched_ms * (1 + COST_LIMIT_SHARE) + COST_LIMIT_MS
    return Check(
        "cost",
        f"watched <= {limit:.3f} ms/step",
        f"unwatched {unwatched_ms:.3f}, watched {watched_ms:.3f} ms/step",
        watched_ms <= limit,
    )


def judge_accelerate(scenario: str, result: dict[str, Any]) -> Check:
    """An Accelerate N-D scenario: the run's verdict names the slow rank with the expected
    kind and no incident opened on another rank (none in the control)."""
    kind, rank = ACCELERATE_SCENARIOS[scenario]
    others = [ranks for ranks in result["opened"] if ranks != [rank]]
    if kind is None:
        ok = result["kind"] not in STRAGGLER_KINDS and not result["opened"]
        expected = "no straggler, no incident"
    else:
        ok = result["kind"] == kind and result["culprit"] == rank and not others
        expected = f"{kind} rank {rank}, no incident on another rank"
    got = f"{result['kind']} rank {result['culprit']}, incidents {result['opened']}"
    return Check(f"accelerate {scenario}", expected, got, ok)


def render(checks: Sequence[Check]) -> str:
    """The table, one row per check."""
    header = ("cell", "expected", "got", "ok")
    rows = [(c.cell, c.expected, c.got, "ok" if c.ok else "FAIL") for c in checks]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    return "\n".join(
        "  ".join(f"{cell:<{w}}" for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in (header, *rows)
    )


def exit_code(checks: Sequence[Check]) -> int:
    return 0 if checks and all(c.ok for c in checks) else 1


# --------------------------------------------------------------------------- cells (CUDA)


def _model(device: Any) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)
    ).to(device)


class _GpuSleep:
    """Sleeps ``ms`` on the compute stream in forward (``forward``) or in backward."""

    def __init__(self, cycles: int, where: str) -> None:
        import torch

        self.cycles, self.where = cycles, where

        class _Backward(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: Any) -> Any:
                return x.view_as(x)

            @staticmethod
            def backward(ctx: Any, grad: Any) -> Any:
                torch.cuda._sleep(cycles)
                return grad

        self._backward = _Backward

    def __call__(self, x: Any) -> Any:
        import torch

        if self.where == "forward":
            torch.cuda._sleep(self.cycles)
            return x
        return self._backward.apply(x)


def _batches(n: int, sleep_ms: float = 0.0) -> Any:
    import torch

    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        if sleep_ms:
            time.sleep(sleep_ms / 1e3)
        yield torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen)


def _config() -> Any:
    from rankwatch.exporter.config import RankwatchConfig

    return RankwatchConfig.from_env(env={}, end_summary=False)


def cell_clock(out: Path) -> None:
    """Rankwatch's GPU columns and the script's own events over the same loop."""
    import torch

    from rankwatch.diagnosis.step_time.table import column
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rw = RankWatch(config=_config(), gpu_timing=True)
    loader = rw.watch(model, opt, _batches(STEPS))
    marks: list[list[Any]] = []
    for x, y in loader:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        loss = torch.nn.functional.mse_loss(model(x), y)
        ev[1].record()
        loss.backward()
        ev[2].record()
        opt.step()
        ev[3].record()
        opt.zero_grad()
        marks.append(ev)
    rw.close(10.0)
    torch.cuda.synchronize()
    assert rw.timer is not None
    rows = rw.timer.ring[: rw.timer.written]
    phases = ("forward", "backward", "optimizer")
    own = {p: [marks[i][k].elapsed_time(marks[i][k + 1]) for i in range(len(marks))]
           for k, p in enumerate(phases)}  # fmt: skip
    got = {p: rows[:, column("gpu", p)].tolist() for p in phases}
    out.write_text(json.dumps({"rankwatch": got, "own": own}))


def _ddp_worker(rank: int, world: int, port: int, backend: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from rankwatch.exporter.step_time.rank_watch import RankWatch

    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    device = torch.device("cuda", rank if backend == "nccl" else 0)
    torch.cuda.set_device(device)
    cycles = int(sleep_cycles_per_ms() * FAULT_MS)
    results: dict[str, Any] = {}
    for scenario in SCENARIOS:
        slow = rank == SLOW_RANK
        fault = (
            _GpuSleep(cycles, scenario) if slow and scenario in ("forward", "backward") else None
        )
        inner = _model(device)
        if fault is not None:  # the slow rank's fault, on its compute stream
            inner.register_forward_hook(lambda m, a, o, f=fault: f(o))
        model = torch.nn.parallel.DistributedDataParallel(inner, device_ids=[device.index])
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        rw = RankWatch(config=_config(), gpu_timing=True)
        sleep_ms = FAULT_MS if slow and scenario == "data" else 0.0
        for x, y in rw.watch(model, opt, _batches(STEPS, sleep_ms)):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        rw.close(10.0)
        assert rw.timer is not None
        rows = rw.timer.ring[: rw.timer.written][WARMUP_STEPS:]
        results[scenario] = [[None if math.isnan(v) else v for v in r] for r in rows.tolist()]
        dist.barrier()
    Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _run_ranks(target: Any, args_per_rank: list[tuple[Any, ...]], job: str) -> None:
    """One spawned process per rank (``target(*args)``), joined; ``RuntimeError`` naming the
    ranks that failed."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args) for args in args_per_rank]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"rank(s) {failed} of the {job} job failed")


def cell_ddp(out: Path, backend: str) -> None:
    """Two ranks, four scenarios; writes each scenario's verdict."""

    port = free_port()
    parts = [str(out) + f".rank{r}" for r in range(2)]
    _run_ranks(_ddp_worker, [(r, 2, port, backend, parts[r]) for r in range(2)], backend)
    per_rank = [json.loads(Path(p).read_text()) for p in parts]
    verdicts = {
        s: verdict_of({r: per_rank[r][s] for r in range(2)}, window=STEPS) for s in SCENARIOS
    }
    out.write_text(json.dumps(verdicts))


def cell_cost(out: Path) -> None:
    """Per-step wall time of the same loop unwatched and watched."""
    import torch

    from rankwatch.exporter.step_time.rank_watch import RankWatch

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)

    def run(watched: bool) -> float:
        model = _model(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        rw = RankWatch(config=_config(), gpu_timing=True) if watched else None
        batches = [(x.to(device), y.to(device)) for x, y in _batches(STEPS * 4)]
        loader = rw.watch(model, opt, batches) if rw is not None else batches
        torch.cuda.synchronize()
        start = time.perf_counter()
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - start) * 1e3 / (STEPS * 4)
        if rw is not None:
            rw.close(10.0)
        return per_step

    run(False)  # warm-up: kernels loaded, allocator grown
    results = {
        "unwatched": min(run(False) for _ in range(3)),
        "watched": min(run(True) for _ in range(3)),
    }
    out.write_text(json.dumps(results))


def _accelerate_worker(rank: int, port: int, scenario: str, out: str) -> None:
    import torch

    from bench import trainer_accelerate
    from bench.accuracy_frameworks import torchrun_env
    from bench.accuracy_parallel import recording_rankwatch

    os.environ.update(torchrun_env(rank, ACCELERATE_WORLD, port))
    torch.cuda.set_device(rank)
    slow = rank == SLOW_RANK
    cycles = int(FAULT_MS * sleep_cycles_per_ms())
    hook = (lambda *_: torch.cuda._sleep(cycles)) if slow and scenario == "forward" else None
    delay_s = FAULT_MS / 1e3 if slow and scenario == "data" else 0.0
    made: list[Any] = []

    def factory() -> Any:
        made.append(recording_rankwatch(f"gpu-check-accelerate-{scenario}"))
        return made[0][0]

    # The cell's folder, which every rank sees: rank 0 saves the model there once.
    model_folder = str(Path(out).parent / "tiny-llama")
    trainer_accelerate.run(model_folder, STEPS, delay_s, hook, factory)
    recorded = made[0][1]()
    if recorded:
        summary = next(w for w in recorded["windows"] if w["window"] == "summary")
        opened = [i["ranks"] for i in recorded["incidents"] if i["action"] == "open"]
        result = {"kind": summary["kind"], "culprit": summary["culprit"], "opened": opened}
        Path(out).write_text(json.dumps(result))


def cell_accelerate(out: Path) -> None:
    """Four NCCL ranks per scenario (a world each); writes each scenario's verdict."""

    results = {}
    for scenario in ACCELERATE_SCENARIOS:
        port = free_port()
        part = f"{out}.{scenario}"
        ranks = [(r, port, scenario, part) for r in range(ACCELERATE_WORLD)]
        _run_ranks(_accelerate_worker, ranks, f"Accelerate {scenario}")
        results[scenario] = json.loads(Path(part).read_text())
    out.write_text(json.dumps(results))


HANG_BUDGET_S = 3.0
HANG_SCENARIOS = ("sleep", "mismatch")
HANG_EXPECTED = {
    "sleep": ("stuck_alive", [SLOW_RANK]),
    "mismatch": ("collective_mismatch", [SLOW_RANK]),
}


def _hang_worker(rank: int, world: int, port: int, scenario: str, out: str) -> None:
    """One rank of a hang scenario on the GPU (Gloo with CUDA tensors, DDP): ``sleep``, the
    slow rank sleeps on the host before a collective the other waits in; ``mismatch``, it
    calls one ``all_reduce`` the other never calls (the other broadcasts). The root writes
    the first hang incident it hears of and ends its process; the driver kills the rest."""
    import torch
    import torch.distributed as dist

    from rankwatch.exporter import init

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)

    def on_incident(event: Any) -> None:
        inc = event.incident
        if event.action == "open" and inc.cls == "hang":
            Path(out).write_text(json.dumps({"cause": inc.cause, "ranks": list(inc.ranks),
                                             "probe": inc.probe, "evidence": dict(inc.evidence)},
                                            default=str))  # fmt: skip
            os._exit(0)

    rw = init(
        on_incident=on_incident,
        metrics_enabled=False,
        hang_budget_seconds=HANG_BUDGET_S,
        hang_poll_seconds=0.25,
    )
    model = torch.nn.parallel.DistributedDataParallel(_model(device), device_ids=[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    flag = torch.zeros(1, device=device)
    for step, (x, y) in enumerate(rw.watch(model, opt, _batches(STEPS))):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if rank == SLOW_RANK and step == WARMUP_STEPS:
            if scenario == "sleep":
                time.sleep(600)
            else:
                dist.all_reduce(torch.ones(1, device=device))
        dist.broadcast(flag, 0)
    time.sleep(600)


def cell_hang(out: Path) -> None:
    """Each hang scenario in a 2-rank world of its own; writes each one's incident."""
    import torch.multiprocessing as mp

    results: dict[str, Any] = {}
    ctx = mp.get_context("spawn")
    for scenario in HANG_SCENARIOS:
        port = free_port()
        part = f"{out}.{scenario}"
        procs = [
            ctx.Process(target=_hang_worker, args=(r, 2, port, scenario, part)) for r in range(2)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and not Path(part).exists():
            time.sleep(0.2)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        results[scenario] = json.loads(Path(part).read_text()) if Path(part).exists() else None
    out.write_text(json.dumps(results))


def judge_hang(scenario: str, incident: dict[str, Any] | None) -> Check:
    """A hang scenario's incident against the expected class and named rank."""
    cause, ranks = HANG_EXPECTED[scenario]
    expected = f"hang {cause} rank {ranks}"
    if incident is None:
        return Check(f"hang/{scenario}", expected, "no hang incident", False)
    got = f"hang {incident['cause']} rank {incident['ranks']}"
    return Check(
        f"hang/{scenario}", expected, got, (incident["cause"], incident["ranks"]) == (cause, ranks)
    )


CELLS = {
    "clock": cell_clock,
    "gloo": lambda out: cell_ddp(out, "gloo"),
    "nccl": lambda out: cell_ddp(out, "nccl"),
    "cost": cell_cost,
    "accelerate": cell_accelerate,
    "hang": cell_hang,
}


# --------------------------------------------------------------------------- driver


def run_cell(name: str, workdir: Path) -> tuple[Any, str]:
    """Run one cell in a process session of its own under its hard time limit: (result,
    error). On time out the whole session is killed, the ranks a cell spawned included."""
    out = workdir / f"{name}.json"
    log = workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "bench.gpu_check", "--cell", name, "--out", str(out)]
    with log.open("w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=CELL_SECONDS[name])
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, f"no result within {CELL_SECONDS[name]:.0f} s"
    if code != 0 or not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return None, f"exit {code}: {tail[0][:120]}"
    return json.loads(out.read_text()), ""


def checks_of(name: str, result: Any, error: str) -> list[Check]:
    """The table rows of one cell's result (or of its failure)."""
    if error:
        return [Check(name, "the cell runs", error, False)]
    if name == "clock":
        return [judge_clock(result["rankwatch"], result["own"])]
    if name == "cost":
        return [judge_cost(result["unwatched"], result["watched"])]
    if name == "accelerate":
        return [judge_accelerate(s, result[s]) for s in ACCELERATE_SCENARIOS]
    if name == "hang":
        return [judge_hang(s, result.get(s)) for s in HANG_SCENARIOS]
    return [judge_verdict(name, s, result[s]) for s in SCENARIOS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--cell", choices=sorted(CELLS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cell:
        CELLS[args.cell](Path(args.out))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(f"{PROG}: no CUDA device here: nothing to check (run it on a machine with a GPU)")
        return 0
    gpus = torch.cuda.device_count()
    checks: list[Check] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rankwatch-gpu-check-") as tmp:
        for name in CELLS:
            if name == "nccl" and gpus < 2:
                checks.append(Check("nccl", "2+ GPUs", f"skipped: {gpus} GPU", True))
                continue
            if name == "accelerate" and gpus < ACCELERATE_WORLD:
                need = f"{ACCELERATE_WORLD}+ GPUs"
                checks.append(Check("accelerate", need, f"skipped: {gpus} GPU(s)", True))
                continue
            result, error = run_cell(name, Path(tmp))
            checks.extend(checks_of(name, result, error))
    print(render(checks))
    print(f"{PROG}: {sum(c.ok for c in checks)}/{len(checks)} right in "
          f"{time.monotonic() - started:.0f} s on {torch.cuda.get_device_name(0)}")  # fmt: skip
    return exit_code(checks)


if __name__ == "__main__":
    os.environ.setdefault("RANKWATCH_END_SUMMARY", "0")
    sys.exit(main())

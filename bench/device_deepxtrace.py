"""Device check: DeepEP's kernels write rankwatch's counters through DeepXTrace's API.

One process per GPU under ``torchrun``; rankwatch is installed as ``deepxtrace`` on every rank.
Rank 0 prints one table of checks (check, expected, got, ok); the exit code is 0 when every
check is ok, 1 when one failed, 2 when the run cannot be made here (one line says what is
missing). Every check is evaluated even when an earlier step failed. Neither mode has been run
on a GPU yet.

``--mode ll`` (upstream DeepEP, any EP size, e.g. ``torchrun --nproc-per-node 8``): builds
``ds.Diagnose(group, enable_async=False)`` as DeepXTrace's README does, hands
``get_stats_ll_stats_tensor()`` to ``low_latency_dispatch`` / ``low_latency_combine`` for
``--steps`` steps with ``diagnose_ll_sync(diagnose_step=steps)`` every step, and checks that the
kernels added to the counters on every rank, that rank 0 got the ``[dispatch, combine]``
results and that ``diagnose_rank0.log`` holds them.

``--mode normal`` (DeepEP built from pull request 720, internode, 16 or more ranks on nodes of
8 GPUs, e.g. two nodes of ``torchrun --nnodes 2 --nproc-per-node 8``): the Buffer takes
rankwatch's module through ``enable_deepxtrace=True`` (a build without that argument, such as
the fork at 4365d77, is wired through its own schema check and counter getter instead). Three
windows of ``--steps`` steps, each step a dispatch, a cached dispatch and a combine, with
``diagnose_normal_sync(steps)`` every step: a warm-up window, a control window that must open
no incident, and a window in which ``--delay-rank`` sleeps ``--delay-ms`` on its compute stream
before every dispatch, which must be named ``pre_stage_arrival_skew`` for that rank. The checks
also ask that the Buffer's 15 counters are the module's, and that the kernels added to all 15
on every rank.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankwatch.diagnosis.deepep.normal.schema import NVL_DOMAIN_SIZE
from rankwatch.diagnosis.vocabulary import PRE_STAGE_ARRIVAL_SKEW

PROG = "device_deepxtrace"
MODES = ("ll", "normal")
MIN_NORMAL_RANKS = 2 * NVL_DOMAIN_SIZE  # the internode kernels, the only ones that count

# --------------------------------------------------------------------------- checks and table


@dataclass(frozen=True)
class Check:
    """One row of the table."""

    name: str
    expected: str
    got: str
    ok: bool


def run_check(name: str, expected: str, judge: Callable[[], tuple[str, bool]]) -> Check:
    """Evaluate one check; ``judge`` returns (what was seen, ok). An exception fails only this
    check, its message becoming what was seen."""
    try:
        got, ok = judge()
    except Exception as exc:  # every check must finish, whatever the others did
        return Check(name, expected, f"error: {type(exc).__name__}: {exc}", False)
    return Check(name, expected, got, bool(ok))


def format_table(checks: Sequence[Check]) -> str:
    """The checks as a plain-text table with a header row and aligned columns."""
    rows = [("check", "expected", "got", "ok")]
    rows += [(c.name, c.expected, c.got, "ok" if c.ok else "FAIL") for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r[:3], widths, strict=True)) + "  " + r[3]
        for r in rows
    )


def exit_code(checks: Sequence[Check]) -> int:
    """0 when there are checks and all are ok, else 1."""
    return 0 if checks and all(c.ok for c in checks) else 1


def missing_requirement(
    mode: str,
    *,
    cuda: bool,
    deep_ep: bool,
    pr720: bool | None = None,
    world_size: int = 1,
) -> str | None:
    """What this machine lacks for ``mode`` (one line), or None. ``pr720`` is only asked when
    DeepEP is there (None: not known yet)."""
    if mode not in MODES:
        raise ValueError(f"mode: must be one of {', '.join(MODES)}, got {mode!r}")
    if not cuda:
        return "needs CUDA (torch.cuda.is_available() is False)"
    if not deep_ep:
        return "needs DeepEP (import deep_ep failed)"
    if mode == "ll":
        return None
    if pr720 is False:
        return (
            "needs DeepEP built from pull request 720 (its Buffer has no DeepXTrace "
            "normal-mode statistics)"
        )
    if world_size < MIN_NORMAL_RANKS:
        return (
            f"needs >= {MIN_NORMAL_RANKS} ranks on nodes of {NVL_DOMAIN_SIZE} GPUs "
            f"(the internode kernels); WORLD_SIZE is {world_size}"
        )
    return None


def incidents_of(result: object) -> list[tuple[str, tuple[int, ...]]]:
    """(class, ranks) of every incident in a ``diagnose_normal_sync`` result on rank 0."""
    if not isinstance(result, list) or len(result) != 1 or not isinstance(result[0], Mapping):
        raise ValueError(f"expected one result dict, got {result!r}")
    window = result[0]
    if window.get("status") != "ok":
        raise ValueError(f"window not diagnosed: {dict(window)!r}")
    return [(str(i["class"]), tuple(int(r) for r in i["ranks"])) for i in window["incidents"]]


def judge_quiet(result: object) -> tuple[str, bool]:
    """The control window: diagnosed, and no incident."""
    found = incidents_of(result)
    return (", ".join(f"{c} {list(r)}" for c, r in found) or "no incident"), not found


def judge_delay(result: object, delayed_rank: int) -> tuple[str, bool]:
    """The delay window: a ``pre_stage_arrival_skew`` incident naming exactly the delayed rank
    (other incidents are shown; a skew naming other ranks fails)."""
    found = incidents_of(result)
    skews = [r for c, r in found if c == PRE_STAGE_ARRIVAL_SKEW]
    ok = bool(skews) and all(r == (delayed_rank,) for r in skews)
    raw = result[0].get("raw_anomalies", []) if isinstance(result, list) else []
    got = ", ".join(f"{c} {list(r)}" for c, r in found) or "no incident"
    if not skews and raw:
        got += f"; raw anomalies {[(a['probe'], a['src']) for a in raw]}"
    return got, ok


def judge_unmoved(names: Sequence[str], moved_per_rank: Sequence[object]) -> tuple[str, bool]:
    """Which counters stayed zero on some rank. ``moved_per_rank`` holds per rank the names
    that moved, or the error string of a rank that could not read its counters."""
    if not moved_per_rank:
        return "no rank reported", False
    errors = [(r, v) for r, v in enumerate(moved_per_rank) if not isinstance(v, (list, tuple))]
    if errors:
        return f"ranks {[r for r, _ in errors]} could not read: {errors[0][1]}", False
    moved_sets = [set(v) for v in moved_per_rank if isinstance(v, (list, tuple))]
    stuck = {n: [r for r, m in enumerate(moved_sets) if n not in m] for n in names}
    stuck = {n: ranks for n, ranks in stuck.items() if ranks}
    if not stuck:
        return f"{len(names)} of {len(names)} on {len(moved_per_rank)} ranks", True
    parts = [f"{n} (ranks {r if len(r) < 4 else f'{len(r)} ranks'})" for n, r in stuck.items()]
    return f"{len(names) - len(stuck)} of {len(names)}; zero: " + "; ".join(parts), False


def judge_others_empty(results: Sequence[object]) -> tuple[str, bool]:
    """Every rank but 0 got ``[]`` from the collecting call (``results`` by rank)."""
    bad = [r for r, v in enumerate(results) if r > 0 and v != []]
    return ("all []" if not bad else f"not [] on ranks {bad}"), not bad


def _not_reached(state: Mapping[str, Any], key: str) -> Any:
    """``state[key]``, or an error naming the step that did not produce it."""
    if key not in state:
        raise RuntimeError(f"not reached ({state.get('error', 'no value')})")
    return state[key]


def _value_or_error(compute: Callable[[], Any]) -> Any:
    """``compute()``, or its error as a string: what a rank hands to a gather, which every
    rank must enter whatever happened to it."""
    try:
        return compute()
    except Exception as exc:
        return f"error: {type(exc).__name__}: {exc}"


def _phase(state: dict[str, Any], key: str, run: Callable[[], Any]) -> None:
    """Run one bounded step of the device run; its failure is kept for the checks."""
    try:
        state[key] = run()
    except Exception as exc:
        state.setdefault("error", f"{key}: {type(exc).__name__}: {exc}")
        print(f"{PROG}: {key} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- device runs


def _init_world() -> tuple[Any, int, int]:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    return group, dist.get_rank(), dist.get_world_size()


def _gather(group: Any, value: object) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * group.size()
    dist.all_gather_object(out, value, group=group)
    return out


def _random_batch(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """One step's tokens (bf16), top-k expert indices and weights, on the current GPU."""
    import deep_ep
    import torch

    x = torch.randn((args.num_tokens, args.hidden), dtype=torch.bfloat16, device="cuda")
    scores = torch.randn((args.num_tokens, args.num_experts), device="cuda").abs()
    topk_idx = torch.topk(scores, args.num_topk, dim=-1)[1].to(deep_ep.topk_idx_t)
    return x, topk_idx, torch.rand((args.num_tokens, args.num_topk), device="cuda")


def run_low_latency(args: argparse.Namespace, group: Any, rank: int, ep: int) -> list[Check]:
    """The low-latency run; the checks on rank 0 (empty elsewhere)."""
    import deep_ep
    import torch
    from deepxtrace import diagnose as ds

    log_dir = os.environ["DEEPEP_DIAGNOSE_LOG_PATH"]
    state: dict[str, Any] = {}
    _phase(state, "diag", lambda: ds.Diagnose(group=group, enable_async=False))
    diag = state.get("diag")
    dispatch_stats, combine_stats = diag.get_stats_ll_stats_tensor() if diag else (None, None)
    _phase(
        state,
        "buffer",
        lambda: deep_ep.Buffer(
            group,
            num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
                args.num_tokens, args.hidden, ep, args.num_experts
            ),
            low_latency_mode=True,
            num_qps_per_rank=args.num_experts // ep,
            explicitly_destroy=True,
        ),
    )
    buffer = state.get("buffer")

    def steps() -> list[Any]:
        assert diag is not None and buffer is not None, "no Diagnose or no Buffer"
        results = []
        for _ in range(args.steps):
            x, topk_idx, weights = _random_batch(args)
            recv_x, _, handle, _, _ = buffer.low_latency_dispatch(
                x,
                topk_idx,
                args.num_tokens,
                args.num_experts,
                dispatch_wait_recv_cost_stats=dispatch_stats,
                use_fp8=False,
            )
            buffer.low_latency_combine(
                recv_x, topk_idx, weights, handle, combine_wait_recv_cost_stats=combine_stats
            )
            results.append(diag.diagnose_ll_sync(diagnose_step=args.steps))
        torch.cuda.synchronize()
        return results

    _phase(state, "results", steps)

    def moved() -> list[str]:
        pairs = (("dispatch", dispatch_stats), ("combine", combine_stats))
        return [n for n, t in pairs if t is not None and int(t.sum()) > 0]

    _phase(state, "moved", lambda: _gather(group, _value_or_error(moved)))
    _phase(state, "others", lambda: _gather(group, state.get("results", [None])[-1]))
    if diag is not None:
        _phase(state, "stop", diag.stop)
    if buffer is not None:
        _phase(state, "destroy", buffer.destroy)
    if rank != 0:
        return []

    def results_on_rank0() -> tuple[str, bool]:
        results = _not_reached(state, "results")
        early = [i for i, r in enumerate(results[:-1]) if r is not None]
        last = results[-1]
        ok = not early and isinstance(last, list) and len(last) == 2
        return f"{len(last) if isinstance(last, list) else last!r} results; early {early}", ok

    def log_lines() -> tuple[str, bool]:
        text = (Path(log_dir) / "diagnose_rank0.log").read_text()
        n = text.count("Wait Recv Cost Per Token")
        return f"{n} matrix lines", n >= 2

    return [
        run_check(
            "kernels counted",
            f"dispatch, combine moved on all {ep} ranks",
            lambda: judge_unmoved(("dispatch", "combine"), _not_reached(state, "moved")),
        ),
        run_check(
            "results on rank 0",
            f"[dispatch, combine] at step {args.steps} only",
            results_on_rank0,
        ),
        run_check(
            "results elsewhere",
            "[] on ranks 1..",
            lambda: judge_others_empty(_not_reached(state, "others")),
        ),
        run_check("DeepXTrace log", "diagnose_rank0.log: 2 matrix lines", log_lines),
    ]


def _buffer_module(deep_ep: Any) -> Any:
    """The module that defines DeepEP's Buffer (``deep_ep.buffer`` in pull request 720)."""
    return sys.modules[deep_ep.Buffer.__module__]


def has_pr720(deep_ep: Any) -> bool:
    """Whether this DeepEP build carries pull request 720's DeepXTrace normal-mode statistics."""
    return hasattr(_buffer_module(deep_ep), "_REQUIRED_NORMAL_STATS_SCHEMA")


def sleep_cycles_per_ms() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured once."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


def _normal_buffer(args: argparse.Namespace, group: Any, ds: Any) -> Any:
    """PR 720's Buffer with DeepXTrace on: through ``enable_deepxtrace=True`` where the build
    takes it, else through the build's own schema check and counter getter (fork 4365d77)."""
    import deep_ep

    params = inspect.signature(deep_ep.Buffer.__init__).parameters
    kwargs: dict[str, Any] = {"explicitly_destroy": True}
    if "enable_deepxtrace" in params:
        kwargs["enable_deepxtrace"] = True
        if "enable_deepxtrace_async" in params:
            kwargs["enable_deepxtrace_async"] = False
        return deep_ep.Buffer(group, args.nvl_bytes, args.rdma_bytes, **kwargs)
    buffer = deep_ep.Buffer(group, args.nvl_bytes, args.rdma_bytes, **kwargs)
    _buffer_module(deep_ep)._validate_deepxtrace_normal_stats_schema(ds)
    buffer.diagnose = ds.Diagnose(
        group=group,
        enable_ll_diagnose=False,
        enable_normal_diagnose=True,
        enable_async=False,
        snapshot_stream=buffer.get_comm_stream(),
    )
    buffer._initialize_normal_notify_timer_states()
    buffer._normal_diagnose_stats = buffer._get_normal_diagnose_stats()
    return buffer


def run_normal(args: argparse.Namespace, group: Any, rank: int, ep: int) -> list[Check]:
    """The normal-mode run; the checks on rank 0 (empty elsewhere)."""
    import torch
    from deepxtrace import diagnose as ds

    import rankwatch.exporter.deepep.deepxtrace as served

    state: dict[str, Any] = {}
    _phase(state, "buffer", lambda: _normal_buffer(args, group, ds))
    buffer = state.get("buffer")
    diag: Any = getattr(buffer, "diagnose", None)
    sync = getattr(buffer, "diagnose_normal_sync", None) or getattr(
        diag, "diagnose_normal_sync", None
    )
    cycles = 0.0
    if rank == args.delay_rank:
        _phase(state, "calibrate", sleep_cycles_per_ms)
        # Without a measured clock, assume 1.5 GHz rather than inject no delay at all.
        cycles = state.get("calibrate", 1.5e6) * args.delay_ms

    def window(delay: bool) -> Any:
        assert buffer is not None and sync is not None, "no Buffer with DeepXTrace"
        early = []  # steps before the last that returned something
        result = None
        for step in range(args.steps):
            x, topk_idx, weights = _random_batch(args)
            per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(
                topk_idx, args.num_experts
            )
            if delay and cycles:
                torch.cuda._sleep(int(cycles))  # this rank reaches dispatch late
            recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(
                x,
                num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma,
                is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert,
                topk_idx=topk_idx,
                topk_weights=weights,
            )
            buffer.dispatch(x, handle=handle)  # cached: the cached Notify counters
            buffer.combine(recv_x, handle, topk_weights=recv_weights)
            result = sync(args.steps)
            if result is not None and step < args.steps - 1:
                early.append(step)
        torch.cuda.synchronize()
        if early:
            raise RuntimeError(f"results before step {args.steps}, at steps {early}")
        return result

    _phase(state, "warm", lambda: window(False))
    _phase(state, "control", lambda: window(False))
    _phase(state, "delay", lambda: window(True))

    def moved() -> list[str]:
        tensors = diag.get_stats_normal_stats_tensor()
        return [
            n
            for n, t in zip(served.NORMAL_STATS_SCHEMA, tensors, strict=True)
            if t is not None and int(t.sum()) > 0
        ]

    _phase(state, "moved", lambda: _gather(group, _value_or_error(moved)))
    _phase(state, "others", lambda: _gather(group, state.get("control")))
    if buffer is not None:
        _phase(state, "destroy", buffer.destroy)
    if rank != 0:
        return []

    def module_served() -> tuple[str, bool]:
        ours = isinstance(diag, served.Diagnose)
        module = sys.modules.get("deepxtrace.diagnose")
        mine = ours and module is served
        enabled = getattr(buffer, "deepxtrace_enabled", diag is not None)
        got = f"module {getattr(module, '__name__', module)}, diagnose {type(diag).__name__}"
        return got + ("" if enabled else ", deepxtrace_enabled False"), mine and enabled

    def bound() -> tuple[str, bool]:
        held = getattr(_not_reached(state, "buffer"), "_normal_diagnose_stats", None)
        if not isinstance(held, Mapping):
            raise RuntimeError("the Buffer holds no _normal_diagnose_stats")
        ours = diag.get_stats_normal_stats_tensor()
        same = [
            n
            for n, t in zip(served.NORMAL_STATS_SCHEMA, ours, strict=True)
            if held.get(n) is not None and held[n].data_ptr() == t.data_ptr()
        ]
        return f"{len(same)} of {len(ours)}", len(same) == len(ours)

    def rank0_result() -> tuple[str, bool]:
        result = _not_reached(state, "control")
        incidents_of(result)
        return f"status ok, window {result[0]['window_index']}", True

    n = len(served.NORMAL_STATS_SCHEMA)
    return [
        run_check("module served", "deepxtrace.diagnose is rankwatch's", module_served),
        run_check("counters bound", f"Buffer's {n} tensors are the module's", bound),
        run_check(
            "kernels counted",
            f"{n} of {n} moved on all {ep} ranks",
            lambda: judge_unmoved(served.NORMAL_STATS_SCHEMA, _not_reached(state, "moved")),
        ),
        run_check("window on rank 0", f"one dict at step {args.steps}", rank0_result),
        run_check(
            "window elsewhere",
            "[] on ranks 1..",
            lambda: judge_others_empty(_not_reached(state, "others")),
        ),
        run_check(
            "control window", "no incident", lambda: judge_quiet(_not_reached(state, "control"))
        ),
        run_check(
            "delay window",
            f"{PRE_STAGE_ARRIVAL_SKEW} [{args.delay_rank}]",
            lambda: judge_delay(_not_reached(state, "delay"), args.delay_rank),
        ),
    ]


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; bad values exit with argparse's message naming the option."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="ll", help="ll (default) or normal")
    parser.add_argument("--steps", type=int, default=20, help="steps per window (default 20)")
    parser.add_argument("--num-tokens", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=None)
    parser.add_argument("--nvl-bytes", type=int, default=10**9, help="normal mode")
    parser.add_argument("--rdma-bytes", type=int, default=10**9, help="normal mode")
    parser.add_argument("--delay-rank", type=int, default=9, help="normal mode (default 9)")
    parser.add_argument("--delay-ms", type=float, default=2.0, help="normal mode (default 2)")
    args = parser.parse_args(argv)
    normal = args.mode == "normal"
    if args.num_tokens is None:
        args.num_tokens = 1024 if normal else 128
    if args.num_experts is None:
        args.num_experts = 256 if normal else 288
    for name in ("steps", "num_tokens", "hidden", "num_topk", "num_experts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.delay_ms <= 0 or args.delay_rank < 0:
        parser.error(
            f"--delay-ms must be > 0 and --delay-rank >= 0, got {args.delay_ms}, {args.delay_rank}"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    deep_ep = cuda and importlib.util.find_spec("deep_ep") is not None
    pr720 = None
    if deep_ep and args.mode == "normal":
        pr720 = has_pr720(importlib.import_module("deep_ep"))
    missing = missing_requirement(
        args.mode, cuda=cuda, deep_ep=deep_ep, pr720=pr720, world_size=world_size
    )
    if missing is None and args.mode == "normal" and not args.delay_rank < world_size:
        missing = f"--delay-rank {args.delay_rank} is not a rank of {world_size}"
    if missing is not None:
        print(f"{PROG} --mode {args.mode}: {missing}; not run", flush=True)
        return 2

    os.environ.setdefault("DEEPEP_DIAGNOSE_LOG_PATH", tempfile.mkdtemp(prefix="deepxtrace-check-"))
    os.environ["DEEPEP_DIAGNOSE_LOG_DETAILS"] = "1"
    # Diagnosis on and synchronous, whatever the launcher's environment says.
    os.environ["DEEPEP_DIAGNOSE_ENABLE"] = "1"
    os.environ["DEEPEP_DIAGNOSE_ASYNC"] = "0"
    from rankwatch.exporter.deepep import install_as_deepxtrace

    # The check is of rankwatch's module: served in this process even where a real DeepXTrace
    # is installed (nothing is uninstalled).
    install_as_deepxtrace(force=True)
    group, rank, ep = _init_world()
    started = time.monotonic()
    run = run_normal if args.mode == "normal" else run_low_latency
    checks = run(args, group, rank, ep)
    import torch.distributed as dist

    dist.destroy_process_group()
    if rank != 0:
        return 0
    print(f"{PROG} --mode {args.mode}: EP {ep}, {time.monotonic() - started:.1f} s", flush=True)
    print(format_table(checks), flush=True)
    return exit_code(checks)


if __name__ == "__main__":
    sys.exit(main())

"""Device check: DeepEP's low-latency kernels write rankwatch's counters through DeepXTrace's API.

Run on GPU nodes with DeepEP installed, one process per GPU, e.g.
``torchrun --nproc-per-node 8 bench/device_deepxtrace.py``. Each rank installs rankwatch as
``deepxtrace``, builds ``ds.Diagnose(group, enable_async=False)`` as DeepXTrace's README does,
hands ``get_stats_ll_stats_tensor()`` to ``Buffer.low_latency_dispatch`` / ``low_latency_combine``
(upstream DeepEP, ``deep_ep/buffers/legacy.py``) for ``--steps`` steps and calls
``diagnose_ll_sync(diagnose_step=steps)`` every step. It checks that the kernels added to the
counters on every rank, that rank 0 got the ``[dispatch, combine]`` results and that
``diagnose_rank0.log`` holds them. Without CUDA or DeepEP it says so and exits with 2; it has
not been run on a GPU yet. Normal mode (DeepEP pull request 720, internode, 16+ GPUs) is not
covered here.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per window (default 20)")
    parser.add_argument("--num-tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=288)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available() or importlib.util.find_spec("deep_ep") is None:
        print("device_deepxtrace: needs CUDA and DeepEP (import deep_ep); not run", flush=True)
        return 2
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    rank, ep = dist.get_rank(), dist.get_world_size()
    log_dir = os.environ.setdefault(
        "DEEPEP_DIAGNOSE_LOG_PATH", tempfile.mkdtemp(prefix="deepxtrace-check-")
    )
    os.environ["DEEPEP_DIAGNOSE_LOG_DETAILS"] = "1"

    from rankwatch.exporter.deepep import install_as_deepxtrace

    install_as_deepxtrace()
    import deep_ep
    from deepxtrace import diagnose as ds

    diag = ds.Diagnose(group=group, enable_async=False)
    dispatch_stats, combine_stats = diag.get_stats_ll_stats_tensor()
    assert dispatch_stats is not None and combine_stats is not None
    assert dispatch_stats.is_cuda and tuple(dispatch_stats.shape) == (ep,)

    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        args.num_tokens, args.hidden, ep, args.num_experts
    )
    buffer = deep_ep.Buffer(
        group,
        num_rdma_bytes=num_rdma_bytes,
        low_latency_mode=True,
        num_qps_per_rank=args.num_experts // ep,
        explicitly_destroy=True,
    )
    results = []
    for _ in range(args.steps):
        x = torch.randn((args.num_tokens, args.hidden), dtype=torch.bfloat16, device="cuda")
        scores = torch.randn((args.num_tokens, args.num_experts), device="cuda").abs()
        topk_idx = torch.topk(scores, args.num_topk, dim=-1)[1].to(deep_ep.topk_idx_t)
        topk_weights = torch.rand((args.num_tokens, args.num_topk), device="cuda")
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(
            x,
            topk_idx,
            args.num_tokens,
            args.num_experts,
            dispatch_wait_recv_cost_stats=dispatch_stats,
            use_fp8=False,
        )
        buffer.low_latency_combine(
            recv_x, topk_idx, topk_weights, handle, combine_wait_recv_cost_stats=combine_stats
        )
        results.append(diag.diagnose_ll_sync(diagnose_step=args.steps))
    torch.cuda.synchronize()

    problems = []
    if int(dispatch_stats.sum()) <= 0 or int(combine_stats.sum()) <= 0:
        problems.append(f"rank {rank}: the kernels added nothing to the counters")
    last = results[-1]
    if any(r is not None for r in results[:-1]):
        problems.append(f"rank {rank}: a result before step {args.steps}")
    if rank == 0:
        if not (isinstance(last, list) and len(last) == 2):
            problems.append(f"rank 0: expected [dispatch, combine] results, got {last!r}")
        log_file = Path(log_dir) / "diagnose_rank0.log"
        if "Wait Recv Cost Per Token" not in log_file.read_text():
            problems.append(f"rank 0: no DeepXTrace lines in {log_file}")
        print(f"device_deepxtrace: EP {ep}, results {last}", flush=True)
    elif last != []:
        problems.append(f"rank {rank}: expected [] on a non-root rank, got {last!r}")
    diag.stop()
    buffer.destroy()
    dist.destroy_process_group()
    for p in problems:
        print(f"device_deepxtrace: FAIL {p}", file=sys.stderr, flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

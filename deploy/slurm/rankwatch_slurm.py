#!/usr/bin/env python3
"""Run one node's share of a Slurm training job with rankwatch ports that cannot collide, and
publish them to Prometheus as file service-discovery targets.

Run it once per node (``srun --ntasks-per-node=1``) in front of the per-node launcher
(``torchrun``); see ``rankwatch.sbatch`` beside this file. It:

1. claims a block of ``--ranks-per-node`` consecutive ports for this job on this node. The
   preferred block is derived from the job id (``port_min + (SLURM_JOB_ID % blocks) *
   ranks_per_node``), so a job usually gets the same ports on every node; two jobs whose ids map
   to the same block, or a port another program already listens on, move the later job to the
   next free block. The claim is a file created exclusively (``O_CREAT | O_EXCL``) in a
   node-local directory shared by all jobs (``--claim-dir``) and names this process; a claim
   whose process is gone is stale and taken over. Every port of the block is also bound once
   to check that nothing else listens on it;
2. writes ``<sd-dir>/rankwatch-<job id>-<host>.json``: one file-SD target group with this node's
   ``host:port`` per local rank and the labels ``slurm_job_id``, ``slurm_job_name`` and
   ``cluster`` (Slurm's cluster name), written atomically (temporary file, then rename) so that
   Prometheus never reads half a file;
3. runs the launcher with ``RANKWATCH_METRICS_PORT`` set to the block's first port (rankwatch
   serves local rank ``i`` on that port + ``i``) and ``RANKWATCH_METRICS_ADDR=0.0.0.0`` unless
   set, forwards SIGTERM/SIGINT to it (``scancel``, the time limit), and when it ends removes
   the target file and the claim, so Prometheus stops scraping the job's ranks. Its exit status
   is the launcher's.

Why not port 0: rankwatch can listen on an ephemeral port (``RANKWATCH_METRICS_PORT=0``) but
then each rank would have to publish its own port; a claimed block keeps one target file per
node, written before training starts, and ports stay below the kernel's ephemeral range
(``--port-max`` defaults to 32767) so that outgoing connections cannot occupy them.

Standard library only: it runs before the training environment is set up.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PORT_MIN = 20000
DEFAULT_PORT_MAX = 32767  # below Linux' default ephemeral range (32768-60999)
DEFAULT_CLAIM_DIR = "/var/tmp/rankwatch-ports"


@dataclass(frozen=True)
class Block:
    """A claimed range of ports: ``first .. first + size - 1``, and its claim file."""

    first: int
    size: int
    claim: Path

    @property
    def ports(self) -> range:
        return range(self.first, self.first + self.size)


def _process_start(pid: int) -> str | None:
    """The start time of ``pid`` (field 22 of /proc/pid/stat), or None if it does not exist:
    with the pid it identifies a process even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner() -> str:
    pid = os.getpid()
    return json.dumps(
        {"pid": pid, "start": _process_start(pid), "job": os.environ.get("SLURM_JOB_ID")}
    )


def _stale(claim: Path) -> bool:
    """A claim whose process no longer runs (or an unreadable, half-written one)."""
    try:
        owner = json.loads(claim.read_text())
        return _process_start(int(owner["pid"])) != owner["start"]
    except (OSError, ValueError, KeyError, TypeError):
        return True


def _bindable(port: int, addr: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As the metrics server binds (SO_REUSEADDR): a port whose last scrapes left
        # connections in TIME_WAIT is free for it, one with a live listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError:
            return False
    return True


def claim_block(
    job_id: int, size: int, port_min: int, port_max: int, claim_dir: Path, addr: str = "0.0.0.0"
) -> Block:
    """Claim ``size`` consecutive ports for this process: the job id's preferred block first,
    then the following ones. Raises RuntimeError when every block is taken."""
    if size < 1 or port_min < 1 or port_max > 65535 or port_max - port_min + 1 < size:
        raise ValueError(
            f"ports: {size} per node do not fit in {port_min}..{port_max} (ranks_per_node, "
            "port_min, port_max)"
        )
    claim_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        claim_dir.chmod(0o1777)  # every user's jobs claim here (sticky: only owners delete)
    # One claimer at a time on this node: between creating a claim and writing its owner the
    # file is empty, and a concurrent claimer would read that as a stale claim and take the
    # block too. The lock is released by the kernel if the holder dies.
    # Opened read-only: any user's job can lock it (the first creator owns the file).
    lock_fd = os.open(claim_dir / ".lock", os.O_RDONLY | os.O_CREAT, 0o644)
    with os.fdopen(lock_fd) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        blocks = (port_max - port_min + 1) // size
        for i in range(blocks):
            first = port_min + ((job_id + i) % blocks) * size
            claim = claim_dir / f"{first}-{size}"
            if _overlaps_other_claim(claim_dir, first, size, claim):
                continue
            try:
                fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not _stale(claim):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    claim.unlink()
                try:
                    fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    continue  # another job took it over first
            with os.fdopen(fd, "w") as f:
                f.write(_owner())
            if all(_bindable(p, addr) for p in range(first, first + size)):
                return Block(first, size, claim)
            claim.unlink()  # something else listens there: try the next block
    raise RuntimeError(f"no free block of {size} ports in {port_min}..{port_max} on this node")


def _overlaps_other_claim(claim_dir: Path, first: int, size: int, own: Path) -> bool:
    """Another live claim (of another block size) covering any of these ports."""
    for other in claim_dir.iterdir():
        if other.name == own.name:
            continue
        try:
            o_first, o_size = (int(x) for x in other.name.split("-"))
        except ValueError:
            continue
        if o_first < first + size and first < o_first + o_size and not _stale(other):
            return True
    return False


def target_groups(host: str, block: Block, labels: Mapping[str, str]) -> list[dict[str, object]]:
    """The file-SD content: one group, one ``host:port`` per local rank."""
    return [{"targets": [f"{host}:{p}" for p in block.ports], "labels": dict(labels)}]


def write_targets(path: Path, groups: list[dict[str, object]]) -> None:
    """Atomically (Prometheus re-reads the file whenever it changes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(groups, indent=2) + "\n")
    os.replace(tmp, path)


def slurm_labels(env: Mapping[str, str], extra: Sequence[str]) -> dict[str, str]:
    labels = {
        "slurm_job_id": env.get("SLURM_JOB_ID", ""),
        "slurm_job_name": env.get("SLURM_JOB_NAME", ""),
        "cluster": env.get("SLURM_CLUSTER_NAME", ""),
    }
    for pair in extra:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--label {pair!r}: expected NAME=VALUE")
        labels[key] = value
    return {k: v for k, v in labels.items() if v}  # an empty label is no label


def _default_ranks(env: Mapping[str, str]) -> int:
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE"):
        value = env.get(name, "").split("(")[0]
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 8


@contextlib.contextmanager
def _forwarding(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    """Pass SIGTERM/SIGINT on to the launcher, which shuts its ranks down."""

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv: Sequence[str] | None = None) -> int:
    env = os.environ
    parser = argparse.ArgumentParser(
        description="Claim non-colliding rankwatch ports on this node, publish them as "
        "Prometheus file-SD targets, and run the launcher (everything after --).",
    )
    parser.add_argument(
        "--sd-dir",
        default=env.get("RANKWATCH_FILE_SD_DIR"),
        help="directory Prometheus' file_sd_configs reads (shared with it); "
        "default $RANKWATCH_FILE_SD_DIR",
    )
    parser.add_argument("--ranks-per-node", type=int, default=_default_ranks(env))
    parser.add_argument("--port-min", type=int, default=DEFAULT_PORT_MIN)
    parser.add_argument("--port-max", type=int, default=DEFAULT_PORT_MAX)
    parser.add_argument("--claim-dir", type=Path, default=Path(DEFAULT_CLAIM_DIR))
    parser.add_argument(
        "--host",
        default=env.get("SLURMD_NODENAME") or socket.gethostname(),
        help="name Prometheus reaches this node by (default: the Slurm node name)",
    )
    parser.add_argument("--label", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- launcher and arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the launcher after --, e.g. -- torchrun ... train.py")
    if not args.sd_dir:
        parser.error("--sd-dir (or RANKWATCH_FILE_SD_DIR) is required")
    job_id = env.get("SLURM_JOB_ID", "")
    if not job_id.isdigit():
        parser.error(f"SLURM_JOB_ID: expected a job id, got {job_id!r} (run inside a job)")
    try:
        labels = slurm_labels(env, args.label)
        block = claim_block(
            int(job_id), args.ranks_per_node, args.port_min, args.port_max, args.claim_dir
        )
    except (ValueError, RuntimeError) as exc:
        parser.error(str(exc))
    targets = Path(args.sd_dir) / f"rankwatch-{job_id}-{args.host}.json"
    child_env = {**env, "RANKWATCH_METRICS_PORT": str(block.first)}
    child_env.setdefault("RANKWATCH_METRICS_ADDR", "0.0.0.0")
    try:
        write_targets(targets, target_groups(args.host, block, labels))
        print(
            f"rankwatch: {args.host} ports {block.first}-{block.ports[-1]} -> {targets}",
            file=sys.stderr,
            flush=True,
        )
        proc = subprocess.Popen(command, env=child_env)
        with _forwarding(proc):
            return proc.wait()
    finally:
        with contextlib.suppress(FileNotFoundError):
            targets.unlink()
        with contextlib.suppress(FileNotFoundError):
            block.claim.unlink()


if __name__ == "__main__":
    sys.exit(main())

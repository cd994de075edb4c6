"""With ``gloo_lazy_connect`` (the default), rankwatch's Gloo group connects a rank to its root
only, not to every member; switched off, it is Gloo's full mesh."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.rank_processes import rank_process
from tests.servers import free_port

# Not parallel_safe: the sockets are counted while the ranks train, so a mesh that is still
# connecting on a starved core counts short (seen beside another world).
pytestmark = pytest.mark.multiproc

WORLD = 6


def socket_fds() -> int:
    """Sockets this process holds (file descriptors that are sockets)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed while listing (the listing's own one)
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def socket_table() -> dict[str, str]:
    """This process's sockets by inode, each described as its TCP ports and state where it is
    a TCP socket (for failure messages: which sockets came and went)."""
    tcp: dict[str, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                local, remote = (int(c.rsplit(":", 1)[1], 16) for c in cols[1:3])
                tcp[cols[9]] = f"{local}->{remote} state {cols[3]}"
    out: dict[str, str] = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inode = link[8:-1]
                out[inode] = tcp.get(inode, "not tcp")
    return out


def os_threads() -> int:
    """Threads of this process, Python's and native ones (Gloo's device and worker threads)."""
    return len(os.listdir("/proc/self/task"))


def _lazy_transport(
    rank: int,
    world: int,
    port: int,
    timeout_s: float,
    on_joined: Any = None,
    transport_class: Any = None,
) -> tuple[Any, Any]:
    """Join the job (then call ``on_joined``), then rankwatch's lazily connected group:
    ``(layout, transport)`` (a ``Transport``, or ``transport_class``)."""
    import torch.distributed as dist

    from rankwatch.exporter.gloo import create_gloo_group, dedicated_store
    from rankwatch.exporter.step_time.transport import GroupLayout, Transport

    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timeout
    )
    if on_joined is not None:
        on_joined()
    layout = GroupLayout(tuple(range(world)), rank)
    group = create_gloo_group(layout.ranks, False, timeout, lazy=True)
    cls = Transport if transport_class is None else transport_class
    return layout, cls(layout, group, dedicated_store(group), lazy=True)


def _send_one(transport: Any, rank: int) -> None:
    """Ship one message of three rows to the root."""
    import numpy as np

    from rankwatch.diagnosis.step_time.table import ROW_WIDTH
    from rankwatch.exporter.step_time.messages import FLAG_END_OF_ROUND, encode_message

    rows = np.zeros((3, ROW_WIDTH))
    rows[:, 0] = (0, 1, 2)
    buf = transport.send_buffer
    encode_message(buf, rows, sender=rank, seq=1, flags=FLAG_END_OF_ROUND, lost=0, strategy=None)
    transport.send(buf)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    try:
        import torch.distributed as dist

        before = -1

        def count_before() -> None:
            nonlocal before
            before = socket_fds()

        layout, transport = _lazy_transport(rank, world, port, 60.0, count_before)
        received = 0
        if layout.is_root:
            deadline = time.monotonic() + 60
            while received < world - 1 and time.monotonic() < deadline:
                received += len(transport.poll())
                time.sleep(0.01)
        else:
            _send_one(transport, rank)
        after = socket_fds()
        lazy_left = os.environ.get("TORCH_GLOO_LAZY_INIT")
        dist.barrier()
        Path(out).write_text(
            json.dumps({"new": after - before, "received": received, "env_after": lazy_left})
        )
        dist.destroy_process_group()
    except Exception:
        Path(out).write_text(json.dumps({"error": traceback.format_exc()}))


def _run_world(target: Any, tmp_path: Path) -> list[dict[str, Any]]:
    """Spawn WORLD ranks running ``target(rank, world, port, out)``; what each wrote."""
    port = free_port()
    outs = [str(tmp_path / f"r{r}.json") for r in range(WORLD)]
    procs = [rank_process(target, (r, WORLD, port, outs[r])) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
    got: list[dict[str, Any]] = [
        json.loads(Path(o).read_text())
        if Path(o).exists()
        else {"error": f"no result: exit code {p.exitcode}"}
        for o, p in zip(outs, procs, strict=True)
    ]
    for r, g in enumerate(got):
        assert "error" not in g, (r, g.get("error"))
    return got


def test_a_rank_opens_one_monitoring_connection_not_a_mesh(tmp_path: Path) -> None:
    got = _run_world(_rank, tmp_path)
    assert got[0]["received"] == WORLD - 1
    # A non-root rank: its group's listening socket and its connection to the root (an eager
    # group holds one socket per member: WORLD here).
    assert all(g["new"] <= 2 for g in got[1:]), [g["new"] for g in got]
    # The root: the listener and one connection per peer.
    assert got[0]["new"] <= WORLD
    assert all(g["env_after"] is None for g in got)  # the switch does not leak to other groups


def _rankwatch_rank(rank: int, world: int, port: int, out: str, env: dict[str, str]) -> None:
    try:
        import torch.distributed as dist

        from rankwatch.exporter.config import RankwatchConfig
        from rankwatch.exporter.step_time.rank_watch import RankWatch

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        before, tasks_before = socket_fds(), os_threads()
        table_before = socket_table()
        cfg = RankwatchConfig.from_env(
            env=env,
            interval_seconds=0.2,
            metrics_enabled=False,
            otlp_enabled=False,
        )
        rw = RankWatch(config=cfg, publishers=[])
        for _ in range(40):
            with rw.step(), rw.phase("forward"):
                time.sleep(0.01)
            rw.collect()
        during = socket_fds() - before
        table_during = socket_table()
        # Every rank counts before any closes: a rank that closed first would take its end of
        # the pairs with it (a rank that started late counted a part of the mesh).
        dist.barrier()
        rw.close(10.0)
        latest = rw.latest_report
        deadline = time.monotonic() + 5.0
        while (
            connectors := [t.name for t in threading.enumerate() if "connect" in t.name]
        ) and time.monotonic() < deadline:
            time.sleep(0.01)
        # Closed, rankwatch's group is destroyed: its connections, listening socket and Gloo
        # threads are gone, not kept for the life of the process.
        while (left := socket_fds() - before) > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        Path(out).write_text(
            json.dumps(
                {
                    "new": during,
                    "sockets_left": left,
                    "threads_left": os_threads() - tasks_before,
                    "missing": None if latest is None else latest.missing_ranks,
                    "ranks": None if latest is None else [i.rank for i in latest.ranks],
                    "connectors_left": connectors,
                    "came": [v for k, v in table_during.items() if k not in table_before],
                    "went": [v for k, v in table_before.items() if k not in table_during],
                }
            )
        )
        dist.destroy_process_group()
    except Exception:
        Path(out).write_text(json.dumps({"error": traceback.format_exc()}))


def test_rankwatch_holds_one_connection_per_rank_by_default(tmp_path: Path) -> None:
    got = _run_world(functools.partial(_rankwatch_rank, env={}), tmp_path)
    # Every rank's rows reached the root, each over its one connection to it.
    assert got[0]["ranks"] == list(range(WORLD)) and got[0]["missing"] == []
    assert all(g["new"] <= 2 for g in got[1:]), [g["new"] for g in got]
    assert got[0]["new"] <= WORLD
    # Closing stops the root's connector threads (every rank connected: none is left waiting)
    # and destroys the group on every rank.
    assert got[0]["connectors_left"] == []
    assert all(g["sockets_left"] <= 0 for g in got), [g["sockets_left"] for g in got]
    assert all(g["threads_left"] <= 0 for g in got), [g["threads_left"] for g in got]


def test_rankwatch_without_lazy_connect_holds_the_full_mesh(tmp_path: Path) -> None:
    env = {"RANKWATCH_GLOO_LAZY_CONNECT": "0"}
    got = _run_world(functools.partial(_rankwatch_rank, env=env), tmp_path)
    assert got[0]["ranks"] == list(range(WORLD)) and got[0]["missing"] == []
    # A connection to every other member and the group's listening socket, on every rank,
    # all closed with the group. (The sockets that came and went say why, if not.)
    short = {r: (g["came"], g["went"]) for r, g in enumerate(got) if g["new"] < WORLD}
    assert not short, ([g["new"] for g in got], short)
    assert all(g["sockets_left"] <= 0 for g in got), [g["sockets_left"] for g in got]


# RankWatch's own files on the root (the group's listening socket, its event loop's, ...).
GROUP_FILES = 4
# Files rankwatch keeps for training under a limit this low.
KEPT_FILES = 64


def _tight_root_rank(rank: int, world: int, port: int, out: str, spare_files: int) -> None:
    try:
        import resource

        import torch.distributed as dist

        from rankwatch.exporter.config import RankwatchConfig
        from rankwatch.exporter.step_time.rank_watch import RankWatch

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        if rank == 0:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            limit = len(os.listdir("/proc/self/fd")) + spare_files
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        cfg = RankwatchConfig.from_env(
            env={}, interval_seconds=0.2, metrics_enabled=False, otlp_enabled=False
        )
        rw = RankWatch(config=cfg, publishers=[])
        for _ in range(40):
            with rw.step(), rw.phase("forward"):
                time.sleep(0.01)
            rw.collect()
        collector = rw._collector
        assert collector is not None and collector.transport is not None
        transport = collector.transport
        admitted = transport.admitted() if rank else None
        refused = sorted(transport.refused)
        rw.close(5.0)
        latest = rw.latest_report
        Path(out).write_text(
            json.dumps(
                {
                    "admitted": admitted,
                    "refused": refused,
                    "sent": collector.sent_messages,
                    "kind": None if latest is None else latest.window_kind,
                    "missing": None if latest is None else list(latest.missing_ranks),
                }
            )
        )
        dist.destroy_process_group()
    except Exception:
        Path(out).write_text(json.dumps({"error": traceback.format_exc()}))


@pytest.mark.parametrize(
    "spare_files",
    [
        # Room for two of the five connections: before admission, Gloo's accept of the third
        # failed and aborted the root's process; now none is admitted (the kept files).
        GROUP_FILES + 2,
        # Room for about two beyond the kept files: those ranks ship, the others do not.
        KEPT_FILES + GROUP_FILES + 2,
    ],
)
def test_a_root_short_of_open_files_admits_what_fits_and_lives(
    tmp_path: Path, spare_files: int
) -> None:
    """The root admits ranks only while its open-file limit leaves room (less the files kept
    for training): the others never connect and are named missing, and the root lives."""
    got = _run_world(functools.partial(_tight_root_rank, spare_files=spare_files), tmp_path)
    refused = got[0]["refused"]
    if spare_files < KEPT_FILES:
        assert refused == list(range(1, WORLD)), refused
    else:
        assert 1 <= len(refused) < WORLD - 1, refused
    assert got[0]["kind"] == "summary" and got[0]["missing"] == refused, got[0]
    for rank in range(1, WORLD):
        shipped = got[rank]["sent"] > 0
        assert got[rank]["admitted"] == shipped == (rank not in refused), (rank, got[rank])


LATE = 2  # the peer whose first receive the root records late


def _late_record_transport() -> Any:
    """A root ``Transport`` whose connector records rank ``LATE``'s first receive half a second
    after posting it: the moment, widened, in which that rank's send completes and rings while
    the window thread's poll does not know of its receive yet."""
    import torch
    import torch.distributed as dist

    from rankwatch.exporter.step_time.messages import MESSAGE_SHAPE, TAG
    from rankwatch.exporter.step_time.transport import Transport

    class LateRecord(Transport):
        def _post(self, peer: int) -> None:
            if peer != LATE or peer in self._recv:
                super()._post(peer)
                return
            buf = torch.empty(MESSAGE_SHAPE, dtype=torch.float64)
            work = dist.irecv(buf, src=peer, group=self.group, tag=TAG)
            time.sleep(0.5)
            self._recv[peer] = (work, buf)

    return LateRecord


def _late_record_rank(rank: int, world: int, port: int, out: str) -> None:
    try:
        import torch.distributed as dist

        from rankwatch.exporter.step_time.messages import decode_message

        late = _late_record_transport() if rank == 0 else None
        layout, transport = _lazy_transport(rank, world, port, 60.0, transport_class=late)
        received: list[int] = []
        if layout.is_root:
            deadline = time.monotonic() + 20
            while len(received) < world - 1 and time.monotonic() < deadline:
                received += [decode_message(m).sender for m in transport.poll()]
                time.sleep(0.01)
        else:
            _send_one(transport, rank)
        dist.barrier()
        Path(out).write_text(json.dumps({"received": sorted(received)}))
        dist.destroy_process_group()
    except Exception:
        Path(out).write_text(json.dumps({"error": traceback.format_exc()}))


def test_a_ring_before_the_first_receive_is_recorded_is_not_skipped(tmp_path: Path) -> None:
    """Every peer's message arrives although one peer's send completes (and rings the total)
    while the root's poll does not yet know of its receive: the total is not taken as read
    until every ring it counts has been."""
    got = _run_world(_late_record_rank, tmp_path)
    assert got[0]["received"] == list(range(1, WORLD))


DEAD = (2, 3, 4)  # ranks that create their end of the group, then die before connecting


def _all_joined(world: int, timeout_s: float) -> None:
    """Wait until every rank has joined: neither ``init_process_group`` nor ``new_group``
    waits for the others, and a rank that dies while a peer still connects the job's full
    mesh fails that peer's join ("Connection closed by peer")."""
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    store.add("joined", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("joined", 0) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank joined in {timeout_s} s")
        time.sleep(0.01)


def _dead_before_connecting_rank(rank: int, world: int, port: int, out: str) -> None:
    try:
        layout, transport = _lazy_transport(rank, world, port, 30.0)
        _all_joined(world, 30.0)
        result: dict[str, Any] = {}
        if rank in DEAD:
            Path(out).write_text(json.dumps(result))
            os._exit(0)  # its hello is in the store; its connection will never be made
        if layout.is_root:
            time.sleep(1.5)  # the dead ranks are gone before the root's first receive
            received, slowest_poll_s, deadline = 0, 0.0, time.monotonic() + 20
            while received < world - 1 - len(DEAD) and time.monotonic() < deadline:
                t0 = time.monotonic()
                received += len(transport.poll())
                slowest_poll_s = max(slowest_poll_s, time.monotonic() - t0)
                time.sleep(0.01)
            result.update(received=received, slowest_poll_s=slowest_poll_s)
        else:
            time.sleep(2.0)
            _send_one(transport, rank)
        Path(out).write_text(json.dumps(result))
        os._exit(0)  # no teardown: the group has dead members
    except Exception:
        Path(out).write_text(json.dumps({"error": traceback.format_exc()}))


def test_a_rank_dead_before_connecting_does_not_hold_the_root(tmp_path: Path) -> None:
    # Gloo connects a lazy pair inside the root's first receive from it and waits there for a
    # peer that never connects; the root posts first receives on connector threads, so its
    # polls stay quick and the live ranks' messages arrive.
    got = _run_world(_dead_before_connecting_rank, tmp_path)
    root = got[0]
    assert root["received"] == WORLD - 1 - len(DEAD), root
    assert root["slowest_poll_s"] < 1.0, root

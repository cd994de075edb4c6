"""Point-to-point shipping of step rows to the group's root, over the dedicated Gloo group.

Each rank ``isend``s fixed-size messages (:mod:`.messages`) to the root, which keeps one
``irecv`` posted per peer.

Gloo cannot abandon a wait: ``work.wait(timeout)`` that times out closes *every* connection of
the group, and a posted receive cannot be polled (``is_completed()`` stays False until waited
on). So the root never waits on a receive that has not arrived. After a sender's send
completed (the data is in the root's posted buffer or on the wire to it) the sender increments
its *doorbell*, a counter in the job's c10d store, then the group's doorbell total; the root
reads the total per poll, all doorbells with one ``multi_get`` when it moved, and waits only
on receives whose doorbell moved, which return at once. With ``gloo_lazy_connect`` the group
connects lazily, so a rank opens a connection to the root only, never a full mesh; the
root's first receives, which make those connections, are posted by connector threads (Gloo
waits inside them for a peer that never connects). A dead peer's connection failing never
affects the others'.

The root of a lazily connected group holds one connection per rank, so it admits ranks only
while its open-file limit leaves room (:func:`connection_room`): Gloo aborts the whole process
when it cannot accept a connection for want of a file descriptor. A rank ships once the root
has admitted it (its admission key); the others are named missing.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from rankwatch.exporter.step_time.messages import MESSAGE_SHAPE, TAG, message_buffer

__all__ = ["GroupLayout", "Transport", "connection_room"]

log = logging.getLogger(__name__)

# Threads posting first receives on a lazily connected group: each rank that died before
# its connection was made holds one for the group's timeout; the others keep connecting.
_CONNECTOR_THREADS = 8
_ANY_DOORBELL = "db/any"
# Open files the root leaves to training when it admits ranks: a quarter of its limit, and
# at least this many (data loaders, checkpoints, the job's own connections).
_FILES_KEPT_FOR_TRAINING = 64
# Seconds between two looks at the open-file room while ranks wait for admission.
_ROOM_CHECK_SECONDS = 1.0


def connection_room() -> int | None:
    """Connections this process may still open for rankwatch: its open-file limit (soft)
    less the files open now and those kept for training (a quarter of the limit, at least
    64). None where the limit is unlimited or the open files cannot be counted (no
    ``/proc/self/fd``)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        open_now = len(os.listdir("/proc/self/fd"))
    except (ImportError, OSError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    return max(0, soft - open_now - max(_FILES_KEPT_FOR_TRAINING, soft // 4))


@dataclass(frozen=True)
class GroupLayout:
    """Who is in the group and who this process is (all global ranks)."""

    ranks: tuple[int, ...]  # ascending
    rank: int

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("GroupLayout.ranks: value () is empty")
        if list(self.ranks) != sorted(set(self.ranks)):
            raise ValueError(
                f"GroupLayout.ranks: value {self.ranks!r} must be ascending without duplicates"
            )

    @property
    def root(self) -> int:
        """The group's root: its lowest global rank."""
        return self.ranks[0]

    @property
    def is_member(self) -> bool:
        return self.rank in self.ranks

    @property
    def is_root(self) -> bool:
        return self.rank == self.root

    @property
    def peers(self) -> tuple[int, ...]:
        """Every member except the root."""
        return self.ranks[1:]


class Transport:
    """Point-to-point messages to the root on the dedicated Gloo group, with store doorbells.

    Non-root: :meth:`send` (blocking; background thread only). Root: :meth:`poll` (returns the
    messages that have arrived; never waits on one that has not).
    """

    def __init__(self, layout: GroupLayout, group: Any, store: Any, *, lazy: bool = False) -> None:
        self.layout = layout
        self.group = group
        self.store = store
        self._db = {r: f"db/{r}" for r in layout.ranks}
        self.send_buffer = message_buffer()
        self._recv: dict[int, tuple[Any, Any]] = {}
        self._consumed: dict[int, int] = {}
        # The group's doorbell total: every send rings it after its own doorbell, so an idle
        # poll reads one key instead of one per peer (4,096 at a time in a large group).
        self._rung = -1
        self.broken: set[int] = set()  # peers whose connection failed
        # Peers that hung up after their last message arrived (the next receive could not be
        # posted): a rank that shipped its final rows and exited, or one that crashed.
        self.closed: set[int] = set()
        self.failed = False  # the store or the root is gone: nothing more will move
        self.lazy = lazy
        # Root: peers said hello but not admitted, for want of open-file room (named missing
        # until admitted); peers admitted. A peer: whether the root admitted it.
        self.refused: set[int] = set()
        self._admitted: set[int] = set()
        self._is_admitted = not lazy  # a full mesh is connected already: nothing to admit
        self._room_checked_at = -float("inf")
        self._refusal_logged = False
        # Peers whose receive is not posted yet: the group connects lazily, and posting a
        # receive connects to the peer, so the root posts one only once the peer says its end
        # of the group exists (its hello key); a connection to a peer that has not created the
        # group yet would be refused.
        self._hello = {r: f"hello/{r}" for r in layout.ranks}
        self._unposted: list[int] = []
        # A lazily connected pair is connected by the root's first receive, and Gloo waits for
        # the connection inside that call, up to the group's timeout: for a rank that died
        # before connecting, that long. First receives are then posted by a few connector
        # threads, so a dead rank holds one of them, never the window thread.
        self._connect_queue: queue.SimpleQueue[int | None] | None = None
        self._connectors: list[threading.Thread] = []
        if lazy and layout.is_root and layout.peers:
            self._connect_queue = queue.SimpleQueue()
            for k in range(min(_CONNECTOR_THREADS, len(layout.peers))):
                thread = threading.Thread(
                    target=self._connector, name=f"rankwatch-connect-{k}", daemon=True
                )
                thread.start()
                self._connectors.append(thread)
        if layout.is_root:
            for peer in layout.peers:
                # Create every key so one multi_get never waits for one.
                self._consumed[peer] = int(store.add(self._db[peer], 0))
                store.add(self._hello[peer], 0)
                self._unposted.append(peer)
        else:
            store.add(self._hello[layout.rank], 1)

    def publish_identity(
        self, hostname: str, local_rank: int, gpu: str = "", gpu_uuid: str = ""
    ) -> None:
        """Tell the root where this rank runs (once, at start-up)."""
        self.store.set(
            f"info/{self.layout.rank}", "\n".join((hostname, str(local_rank), gpu, gpu_uuid))
        )

    def identity(self, rank: int) -> tuple[str, int, str, str] | None:
        """(hostname, local rank, GPU index, GPU UUID) a rank published, or None if it has not
        (yet)."""
        key = f"info/{rank}"
        if not self.store.check([key]):
            return None
        host, local, gpu, gpu_uuid = [*self.store.get(key).decode().split("\n"), "", "", ""][:4]
        try:
            return host, int(local), gpu, gpu_uuid
        except ValueError:
            return host, 0, gpu, gpu_uuid

    def _post(self, peer: int) -> None:
        import torch
        import torch.distributed as dist

        buf = torch.empty(MESSAGE_SHAPE, dtype=torch.float64)
        work = dist.irecv(buf, src=peer, group=self.group, tag=TAG)
        self._recv[peer] = (work, buf)

    def admitted(self) -> bool:
        """Whether this rank may ship: always on a full mesh; on a lazily connected group once
        the root has admitted it (one store look per call until then)."""
        if not self._is_admitted:
            self._is_admitted = bool(self.store.check([f"admit/{self.layout.rank}"]))
        return self._is_admitted

    def send(self, message: NDArray[np.float64]) -> None:
        """Ship one message to the root and ring the doorbell (blocks until the root's posted
        receive has taken it; raises if the root's connection failed). On a lazily connected
        group only once :meth:`admitted`: the first send connects to the root."""
        import torch
        import torch.distributed as dist

        tensor = torch.from_numpy(message)
        work = dist.isend(tensor, dst=self.layout.root, group=self.group, tag=TAG)
        if work is not None:  # None only for a process outside the group
            work.wait()
        self.store.add(self._db[self.layout.rank], 1)
        self.store.add(_ANY_DOORBELL, 1)

    def _admit(self) -> None:
        """Post the first receive of every peer that has created its end of the group (on a
        lazily connected group, of as many as the open-file room allows, and tell them)."""
        if len(self.refused) == len(self._unposted) and time.monotonic() < (
            self._room_checked_at + _ROOM_CHECK_SECONDS
        ):
            return  # only refused peers wait (thousands, at scale): look again in a second
        said = self.store.multi_get([self._hello[p] for p in self._unposted])
        ready = [p for p, value in zip(self._unposted, said, strict=True) if int(value) >= 1]
        if self._connect_queue is not None:
            ready = self._within_room(ready)
            if ready:
                self.store.multi_set([f"admit/{p}" for p in ready], ["1"] * len(ready))
        for peer in ready:
            if self._connect_queue is not None:
                self._admitted.add(peer)
                self.refused.discard(peer)
                self._connect_queue.put(peer)
            else:
                self._post_first(peer)
        taken = set(ready)
        self._unposted = [p for p in self._unposted if p not in taken]

    def _within_room(self, ready: list[int]) -> list[int]:
        """The first of ``ready`` the root's open files leave room to connect to; the rest are
        refused (looked at again once a second)."""
        if not ready:
            return ready
        now = time.monotonic()
        if self.refused and now < self._room_checked_at + _ROOM_CHECK_SECONDS:
            self.refused.update(ready)
            return []
        self._room_checked_at = now
        room = connection_room()
        if room is None:
            return ready
        # Admitted peers not connected yet hold no file descriptor yet, but will.
        connecting = len(self._admitted) - len(self._recv) - len(self._admitted & self.broken)
        room = max(0, room - max(0, connecting))
        if room >= len(ready):
            return ready
        self.refused.update(ready[room:])
        if not self._refusal_logged:
            self._refusal_logged = True
            log.warning(
                "rankwatch: the root's open-file limit leaves no room to connect to %d more "
                "rank(s) (first: rank %d); they are named missing. Raise the limit (ulimit -n) "
                "or split the job into groups (RankWatch(group=...))",
                len(ready) - room,
                ready[room],
            )
        return ready[:room]

    def _post_first(self, peer: int) -> None:
        try:
            self._post(peer)
        except RuntimeError as exc:
            log.warning("rankwatch: cannot connect to rank %d: %s", peer, exc)
            self.broken.add(peer)

    def _connector(self) -> None:
        """Connector thread: posts first receives (``poll`` reads a peer once it is posted)
        until :meth:`close`."""
        assert self._connect_queue is not None
        while (peer := self._connect_queue.get()) is not None:
            self._post_first(peer)

    def close(self) -> None:
        """Stop the connector threads (root). An idle one ends at once; one still connecting
        to a rank that never came ends when Gloo gives up, at the group's timeout at most."""
        if self._connect_queue is not None:
            for _ in self._connectors:
                self._connect_queue.put(None)

    def release(self) -> bool:
        """Destroy the group once nothing of this process uses it any more (after
        :meth:`close`, with the thread that polled or sent gone): its Gloo device's thread,
        listening socket and connections are freed instead of living as long as the process.
        Left alone (False) while a connector thread is still inside Gloo, connecting."""
        import torch.distributed as dist

        if self.group is None:  # released already (None would name the job's default group)
            return False
        for thread in self._connectors:
            thread.join(0.05)
        if any(thread.is_alive() for thread in self._connectors):
            return False
        self._recv.clear()  # the posted receives hold the group's Gloo context
        if not dist.is_initialized():  # the job's own teardown already took every group
            return False
        try:
            dist.destroy_process_group(self.group)
        except (RuntimeError, ValueError) as exc:
            log.warning("rankwatch: destroying rankwatch's Gloo group failed: %s", exc)
            return False
        self.group = None  # the last reference: the group goes now, not at a later collection
        return True

    def poll(self) -> list[NDArray[np.float64]]:
        """Messages that arrived since the last poll (root only; never blocks on a peer)."""
        if self._unposted:
            self._admit()
        # Every peer that can still ring, not only those with a receive on record: a connector
        # thread's first receive is posted (so its peer's send completes and rings) a moment
        # before it is recorded, and a total taken then counts a ring this poll cannot take.
        live = [p for p in self.layout.peers if p not in self.broken and p not in self.closed]
        if not any(p in self._recv for p in live):
            return []
        # Read the total first: every doorbell it counts has already moved (a sender rings
        # its own before the total), so nothing it counts can be missed below.
        total = int(self.store.add(_ANY_DOORBELL, 0))
        if total == self._rung:
            return []
        raw = self.store.multi_get([self._db[p] for p in live])
        out: list[NDArray[np.float64]] = []
        settled = True
        for peer, value in zip(live, raw, strict=True):
            rung = int(value)
            if peer not in self._recv:
                # Rang before its receive was recorded: leave the total unsettled, so that
                # the next poll reads the doorbells again instead of skipping this ring.
                settled = settled and self._consumed[peer] >= rung
                continue
            while self._consumed[peer] < rung:
                work, buf = self._recv[peer]
                try:
                    work.wait()  # the doorbell says it has arrived: returns at once
                except RuntimeError as exc:
                    log.warning("rankwatch: connection to rank %d failed: %s", peer, exc)
                    self.broken.add(peer)
                    break
                self._consumed[peer] += 1
                out.append(buf.numpy())  # a fresh buffer is posted next: no copy needed
                try:
                    self._post(peer)
                except RuntimeError as exc:
                    # The peer closed its end after this message: keep what arrived (its
                    # final rows, when it is done) instead of failing the whole poll.
                    log.info("rankwatch: rank %d closed its connection: %s", peer, exc)
                    self.closed.add(peer)
                    break
        if settled:
            self._rung = total
        return out

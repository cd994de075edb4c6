"""A node's leader: the other ranks of its node ship through it, over one connection.

In a large group every rank holding its own connection to the aggregator means one descriptor
per rank there (65,536 ranks: more than many hosts' open-file limits allow one process) and one
read per rank per window. With node leaders (``RANKWATCH_NODE_LEADERS``; by default in groups
of ``NODE_LEADERS_FROM`` ranks or more, where the launcher says which ranks share a node:
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) the lowest rank of each node listens on a Unix socket of
its host's network namespace (an abstract name: nothing to clean up), and the other ranks of
the node connect there instead. The leader forwards their frames as they came (each names its
rank), says ``GONE`` for a rank whose connection to it ended, and hands the aggregator's answers
back to the rank they name. Its cost is its node's frames, whatever the group's size.

A rank that cannot reach its leader for ``UNREACHABLE_SECONDS`` (the leader's process is gone,
or never listened) ships to the aggregator directly from then on, with one line; the aggregator
sees the leader's ranks leave and come back on their own connections.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from rankwatch.exporter.aggregator.wire import (
    KIND_BLOCKS,
    KIND_HELLO,
    KIND_ROWS,
    WireError,
    decode_hello,
    encode_gone,
    frame_bytes,
    frame_rank,
    rows_final,
    split_frames,
)
from rankwatch.exporter.step_time.shipping import UNIX, Connection

__all__ = ["NODE_LEADERS_FROM", "LeaderRoute", "NodeRelay", "leader_socket_name", "node_leader"]

log = logging.getLogger(__name__)

NODE_LEADERS_FROM = 1024  # "auto": node leaders in groups this large or larger
_READ_BYTES = 1 << 20


def leader_socket_name(group_key: str, leader: int) -> str:
    """The abstract Unix socket name a leader listens on (``group_key`` names the group)."""
    return f"\0rankwatch-{group_key}-leader-{leader}"


def node_leader(rank: int, ranks: tuple[int, ...], mode: str, env: dict[str, str]) -> int | None:
    """The leader of ``rank``'s node in the group (itself when it leads), or None: node
    leaders off, or the launcher did not say which ranks share a node (``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE``, as torchrun sets them: a node's ranks are consecutive)."""
    if mode == "off" or (mode == "auto" and len(ranks) < NODE_LEADERS_FROM):
        return None
    try:
        local_rank = int(env["LOCAL_RANK"])
        local_world = int(env["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if local_world < 2 or not 0 <= local_rank < local_world:
        return None
    first = rank - local_rank
    members = set(ranks)
    node = [r for r in range(first, first + local_world) if r in members]
    return node[0] if node else None


@dataclass(eq=False)
class _Follower:
    sock: socket.socket
    buffer: bytearray = field(default_factory=bytearray)
    hellos: dict[int, bytes] = field(default_factory=dict)  # rank -> its HELLO frame
    finals: set[int] = field(default_factory=set)  # ranks whose final rows went up


class NodeRelay:
    """The leader's side (its collector thread's alone): listens under ``name`` and forwards
    over ``upstream``, the leader's own connection."""

    def __init__(self, name: str, upstream: Connection) -> None:
        self.name = name
        self.upstream = upstream
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(name)
        self.listener.listen(256)
        self.listener.setblocking(False)
        self._followers: list[_Follower] = []
        self._by_rank: dict[int, _Follower] = {}
        self.forwarded = 0  # frames forwarded, for tests and benchmarks

    def hellos(self) -> list[bytes]:
        """The ``HELLO`` of every rank this leader relays now (sent again on every new upstream
        connection)."""
        return [h for f in self._followers for h in f.hellos.values()]

    def waiting(self) -> bool:
        """Whether a rank still connected here has not sent its final rows: a leader that
        stops keeps relaying until none has (within its shutdown budget), so its node's last
        rows reach the summary window."""
        return any(len(f.finals) < len(f.hellos) for f in self._followers)

    def pump(self) -> None:
        """Take new followers, forward what they sent (while the upstream outbox has room:
        otherwise they wait, and so do their rows, in their own rings), route answers."""
        self._accept()
        if self.upstream.room():
            for follower in list(self._followers):
                self._read(follower)
        for rank, data in self.upstream.relayed_answers:
            target = self._by_rank.get(rank)
            if target is not None:
                try:
                    whole = target.sock.send(data) == len(data)
                except BlockingIOError:
                    continue  # best effort: a full socket misses this answer
                except OSError:
                    whole = False
                if not whole:  # half an answer sent: that stream is lost, it connects again
                    self._drop(target)
        self.upstream.relayed_answers.clear()

    def close(self) -> None:
        for follower in list(self._followers):
            self._drop(follower)
        with contextlib.suppress(OSError):
            self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("rankwatch: node relay cannot accept: %s", exc)
                return
            sock.setblocking(False)
            self._followers.append(_Follower(sock))

    def _read(self, follower: _Follower) -> None:
        ended = False
        while True:
            try:
                data = follower.sock.recv(_READ_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                ended = True
                break
            if not data:
                ended = True
                break
            follower.buffer += data
        try:
            frames, used = split_frames(follower.buffer)
            del follower.buffer[:used]
            for kind, payload in frames:
                self._forward(follower, kind, payload)
        except WireError as exc:
            log.warning("rankwatch: node relay dropped a follower's connection: %s", exc)
            ended = True
        if ended:
            self._drop(follower)

    def _forward(self, follower: _Follower, kind: int, payload: bytes) -> None:
        data = frame_bytes(kind, payload)
        if kind == KIND_HELLO:
            rank = decode_hello(payload).rank
            follower.hellos[rank] = data
            self._by_rank[rank] = follower
        elif kind not in (KIND_ROWS, KIND_BLOCKS):
            raise WireError(f"frame: field kind: value {kind} is not relayed")
        elif (rank := frame_rank(payload)) not in follower.hellos:
            raise WireError(f"frame: field rank: value {rank} did not say hello here")
        elif kind == KIND_ROWS and rows_final(payload):
            follower.finals.add(rank)
        self.upstream.queue(data)
        self.forwarded += 1

    def _drop(self, follower: _Follower) -> None:
        with contextlib.suppress(OSError):
            follower.sock.close()
        if follower in self._followers:
            self._followers.remove(follower)
        for rank in follower.hellos:
            if self._by_rank.get(rank) is follower:
                del self._by_rank[rank]
                self.upstream.queue(encode_gone(rank))


class LeaderRoute:
    """A follower's ``address()``: its leader's socket (with the group's token, from the
    aggregator's address) until the leader cannot be reached (its connection broke once
    established, or none was made for ``UNREACHABLE_SECONDS``), the aggregator from then on."""

    def __init__(
        self,
        rank: int,
        leader: int,
        name: str,
        aggregator: Callable[[], tuple[str, int, str] | None],
    ) -> None:
        self.rank, self.leader, self.name, self.aggregator = rank, leader, name, aggregator
        self.connection: Connection | None = None  # set once made
        self.direct = False

    def __call__(self) -> tuple[str, int, str] | None:
        address = self.aggregator()
        if address is None:
            return None
        conn = self.connection
        if not self.direct and conn is not None and (conn.dropped or conn.unreachable()):
            self.direct = True
            log.warning(
                "rankwatch: rank %d cannot reach its node's leader (rank %d); shipping to the "
                "group's aggregator directly",
                self.rank,
                self.leader,
            )
        return address if self.direct else (self.name, UNIX, address[2])

"""The aggregator's intake: a TCP server every rank of the group connects to once.

One listening socket and one connection per rank, all non-blocking on one selector (epoll on
Linux), read as they become readable: a connection's bytes are split into frames
(:mod:`.wire`) in bulk, so a window of N ranks costs N reads, not N waits. A connection is a
rank's once its ``HELLO`` carries the group's token and a rank of the group; anything else is
closed. A rank that connects again (after its connection broke, or to a new aggregator)
replaces its older connection.

Room. A connection is a file descriptor; the aggregator raises its own open-file limit to the
hard limit when it starts (no privilege needed), and takes ranks only while a reserve stays free
(:data:`RESERVED_FILES`). A rank beyond that is told so (``REFUSED``) and named missing, with one
line that says how to make room; the aggregator, unlike the training process it came from,
holds nothing else that needs a descriptor.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from rankwatch.exporter.aggregator.wire import (
    KIND_BLOCKS,
    KIND_GONE,
    KIND_HELLO,
    KIND_ROWS,
    Blocks,
    Hello,
    Rows,
    WireError,
    decode_blocks,
    decode_hello,
    decode_rows,
    encode_refused,
    encode_welcome,
    frame_rank,
    split_frames,
)

__all__ = ["RESERVED_FILES", "Event", "Intake", "raise_open_file_limit"]

log = logging.getLogger(__name__)

# Descriptors kept free beyond the connections: the selector, pipes, artifact files, /metrics
# of nothing (the aggregator serves none), a few connections on their way to be refused.
RESERVED_FILES = 64
_READ_BYTES = 1 << 20
# Bytes a connection may hold before its hello: a stray client cannot make the aggregator
# buffer much.
_PRE_HELLO_BYTES = 4096
# Answers waiting for a rank whose socket is full; beyond this, new answers are dropped.
_OUTBOX_BYTES = 1 << 16


def raise_open_file_limit() -> int | None:
    """Raise this process's soft open-file limit to its hard limit; the limit now (None:
    unlimited or unknown)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
                soft = hard
    except (ImportError, OSError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


@dataclass(eq=False)  # identity: held in a set
class _Conn:
    sock: socket.socket
    peer: str
    buffer: bytearray = field(default_factory=bytearray)
    ranks: set[int] = field(default_factory=set)  # one, or a node's when its leader relays
    refuse: str = ""  # not taken: refused once its hello says who it is
    outbox: bytearray = field(default_factory=bytearray)  # answers the socket did not take yet


@dataclass(frozen=True)
class Event:
    """What a read found: ``hello`` (``hello`` set), ``rows`` (``rank`` and ``rows``),
    ``blocks`` (``rank`` and ``blocks``), ``closed`` (a rank's connection ended) or
    ``refused`` (no room for ``rank``)."""

    kind: str
    rank: int = -1
    hello: Hello | None = None
    rows: Rows | None = None
    blocks: Blocks | None = None


class Intake:
    """The listening socket and every rank's connection, on ``selector``."""

    def __init__(
        self,
        host: str,
        token: str,
        ranks: Sequence[int],
        selector: selectors.BaseSelector,
        *,
        port: int = 0,
        file_limit: int | None = None,
    ) -> None:
        self.token = token
        self.ranks = frozenset(ranks)
        self.selector = selector
        self.listener = socket.create_server((host, port), backlog=min(len(ranks) + 16, 4096))
        self.listener.setblocking(False)
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        selector.register(self.listener, selectors.EVENT_READ, None)
        self.by_rank: dict[int, _Conn] = {}
        self._conns: set[_Conn] = set()
        self.file_limit = file_limit
        self._open_at_start = _open_files()
        self.refused: set[int] = set()
        self._refusal_said = False
        self.frames = 0  # frames read, for the benchmarks
        self.bad_frames = 0

    # ---- room ------------------------------------------------------------------------------

    def room(self) -> int | None:
        """Connections this process may still take (None: no known limit)."""
        if self.file_limit is None or self._open_at_start is None:
            return None
        used = self._open_at_start + len(self._conns)
        return self.file_limit - used - RESERVED_FILES

    # ---- events ----------------------------------------------------------------------------

    def ready(self, key: selectors.SelectorKey, events: int) -> list[Event]:
        """Handle one ready key of the selector (the listener or a connection)."""
        if key.data is None:
            self._accept()
            return []
        conn: _Conn = key.data
        if events & selectors.EVENT_WRITE:
            self._flush(conn)
        if events & selectors.EVENT_READ:
            return self._read(conn)
        return []

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    # Out of descriptors with connections waiting: they stay in the backlog
                    # until room frees (a connection closes), and the ranks keep trying.
                    self._say_no_room(None)
                return
            sock.setblocking(False)
            conn = _Conn(sock, f"{peer[0]}:{peer[1]}")
            room = self.room()
            if room is not None and room <= 0:
                conn.refuse = (
                    "the aggregator's open-file limit leaves no room for this rank's connection"
                )
            self._conns.add(conn)
            self.selector.register(sock, selectors.EVENT_READ, conn)

    def _say_no_room(self, rank: int | None) -> None:
        if self._refusal_said:
            return
        self._refusal_said = True
        log.warning(
            "rankwatch: the group's aggregator has no room for more connections (open-file "
            "limit %s, %d ranks connected; first refused: rank %s); those ranks are named "
            "missing. Raise the hard limit (ulimit -Hn) where the job starts, or split the job "
            "into groups (RankWatch(group=...))",
            self.file_limit,
            len(self.by_rank),
            "?" if rank is None else rank,
        )

    def _read(self, conn: _Conn) -> list[Event]:
        try:
            data = conn.sock.recv(_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            return self._drop(conn)
        conn.buffer += data
        try:
            frames, used = split_frames(conn.buffer)
        except WireError as exc:
            self.bad_frames += 1
            return self._drop(conn, f"{conn.peer}: {exc}")
        del conn.buffer[:used]
        if not frames and not conn.ranks and len(conn.buffer) > _PRE_HELLO_BYTES:
            return self._drop(conn, f"{conn.peer}: no hello in its first bytes")
        out: list[Event] = []
        for kind, payload in frames:
            self.frames += 1
            try:
                if kind == KIND_HELLO:
                    out += self._hello(conn, decode_hello(payload))
                    if conn not in self._conns:
                        return out  # refused and closed
                elif not conn.ranks:
                    raise WireError(f"frame: field kind: value {kind}, expected a hello first")
                elif kind == KIND_ROWS:
                    shipment = decode_rows(payload)
                    _spoken_for(conn, "rows", shipment.rank)
                    out.append(Event("rows", shipment.rank, rows=shipment))
                elif kind == KIND_BLOCKS:
                    closed = decode_blocks(payload)
                    _spoken_for(conn, "blocks", closed.rank)
                    out.append(Event("blocks", closed.rank, blocks=closed))
                elif kind == KIND_GONE:
                    rank = frame_rank(payload)
                    _spoken_for(conn, "gone", rank)
                    conn.ranks.discard(rank)
                    if self.by_rank.get(rank) is conn:
                        del self.by_rank[rank]
                        out.append(Event("closed", rank))
                else:
                    raise WireError(f"frame: field kind: value {kind} is not a rank's frame")
            except WireError as exc:
                self.bad_frames += 1
                return out + self._drop(conn, f"{conn.peer} (ranks {sorted(conn.ranks)}): {exc}")
        return out

    def _hello(self, conn: _Conn, hello: Hello) -> list[Event]:
        if hello.token != self.token:
            self._drop(conn, f"{conn.peer}: hello with another group's token (rank {hello.rank})")
            return []
        if hello.rank not in self.ranks:
            self._refuse(conn, hello.rank, f"rank {hello.rank} is not in this group")
            return []
        if conn.refuse:
            self.refused.add(hello.rank)
            self._say_no_room(hello.rank)
            self._refuse(conn, hello.rank, conn.refuse)
            return [Event("refused", hello.rank)]
        old = self.by_rank.get(hello.rank)
        if old is not None and old is not conn:
            # The rank connected again (its old connection broke unseen, or it left its
            # leader): the old connection no longer speaks for it.
            old.ranks.discard(hello.rank)
            if not old.ranks:
                self._drop(old)
        conn.ranks.add(hello.rank)
        self.by_rank[hello.rank] = conn
        self.refused.discard(hello.rank)
        self.send(hello.rank, encode_welcome(hello.rank))
        return [Event("hello", hello.rank, hello=hello)]

    def _refuse(self, conn: _Conn, rank: int, why: str) -> None:
        """Tell ``rank`` no; close the connection unless it speaks for other ranks too (a
        leader's)."""
        with contextlib.suppress(OSError):
            conn.sock.send(encode_refused(rank, why))
        if not conn.ranks:
            self._drop(conn)

    def _drop(self, conn: _Conn, why: str = "") -> list[Event]:
        if why:
            log.warning("rankwatch: closed a connection to the aggregator: %s", why)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
        self._conns.discard(conn)
        out = []
        for rank in sorted(conn.ranks):
            if self.by_rank.get(rank) is conn:
                del self.by_rank[rank]
                out.append(Event("closed", rank))
        conn.ranks = set()
        return out

    # ---- answers ---------------------------------------------------------------------------

    def send(self, rank: int, data: bytes) -> bool:
        """Send one frame to ``rank`` without waiting: what the socket does not take now waits
        in the connection's outbox; False when even that is full (answers are best-effort: a
        rank that reads none of them misses the newer ones, never half of one)."""
        conn = self.by_rank.get(rank)
        if conn is None:
            return False
        if conn.outbox:
            if len(conn.outbox) + len(data) > _OUTBOX_BYTES:
                return False
            conn.outbox += data
            return True
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return False
        if sent < len(data):
            conn.outbox += data[sent:]
            with contextlib.suppress(KeyError, ValueError):
                self.selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        return True

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            sent = len(conn.outbox)
        del conn.outbox[:sent]
        if not conn.outbox:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def close(self) -> None:
        for conn in list(self._conns):
            self._drop(conn)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self.listener)
        self.listener.close()


def _spoken_for(conn: _Conn, what: str, rank: int) -> None:
    """A frame of ``rank`` on a connection that said hello for it, else ``WireError``."""
    if rank not in conn.ranks:
        raise WireError(f"{what}: field rank: value {rank} did not say hello here")


def _open_files() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None

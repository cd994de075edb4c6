"""This rank's connection to its group's aggregator: frames out, answers in, never a wait.

The collector thread queues each shipment's frames (:mod:`rankwatch.exporter.aggregator.wire`)
and pumps the connection once per turn: connect when the aggregator's address is known (the
c10d store key its root sets, read without waiting), say hello, send what the socket takes
without blocking, read the answers. Frames not sent yet wait in a bounded outbox, whole: a frame
cut by a broken connection is sent again from its start on the next one (the aggregator drops
a frame it did not get whole). When the outbox is full the collector reads no new rows: they
wait in the step timer's ring, which counts what it overwrites, so a slow or absent aggregator
costs training nothing and the loss is counted, not hidden.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Callable

from rankwatch.exporter.aggregator.wire import (
    KIND_OWN,
    KIND_REFUSED,
    KIND_WELCOME,
    OwnMeans,
    WireError,
    decode_own,
    encode_hello,
    frame_bytes,
    frame_rank,
    refused_text,
    split_frames,
)

__all__ = ["OUTBOX_BYTES", "Connection"]

log = logging.getLogger(__name__)

OUTBOX_BYTES = 8 << 20  # frames waiting to be sent, at most (the collector reads no rows beyond)
_CONNECT_SECONDS = 2.0
_FIRST_RETRY_SECONDS = 0.2
_MAX_RETRY_SECONDS = 10.0
_REFUSED_RETRY_SECONDS = 30.0
# Without a connection this long after one failed, the root's side counts as unreachable (an
# aggregator the root restarts is back within about a second and a half).
UNREACHABLE_SECONDS = 5.0


UNIX = -1  # the port of an address whose host is a Unix socket's name (a node's leader)


class Connection:
    """One rank's connection (the collector thread's alone).

    ``address()`` gives ``(host, port, token)`` once there is somewhere to connect, else None:
    the aggregator's TCP address, or a node leader's Unix socket (port ``UNIX``, host its
    name). ``identity`` is ``(hostname, local rank, GPU index, GPU UUID)``. ``relayed()``
    gives the ``HELLO`` frames of the ranks this rank relays (a leader), sent after its own on
    every new connection; answers for those ranks wait in :attr:`relayed_answers`.
    """

    def __init__(
        self,
        rank: int,
        identity: tuple[str, int, str, str],
        address: Callable[[], tuple[str, int, str] | None],
        *,
        pid: int = 0,
        relayed: Callable[[], list[bytes]] = list,
    ) -> None:
        self.rank = rank
        self.identity = identity
        self.address = address
        self.pid = pid
        self.relayed = relayed
        self.relayed_answers: list[tuple[int, bytes]] = []
        self.peer: tuple[str, int] | None = None  # where the current connection goes
        self._sock: socket.socket | None = None
        self._welcomed = False
        self._frames: deque[bytes] = deque()
        self._offset = 0  # bytes of the first frame already sent on this connection
        self.pending_bytes = 0
        self._answers = bytearray()
        self._next_try = 0.0
        self._retry = _FIRST_RETRY_SECONDS
        self._failed_since: float | None = None  # monotonic time of the first failure in a row
        self._said_refused = False
        self.connections = 0  # connections made, for tests and benchmarks
        self.dropped = 0  # established connections that broke
        self.sent_frames = 0

    # ---- state -----------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def unreachable(self, now: float | None = None) -> bool:
        """The aggregator could not be reached for ``UNREACHABLE_SECONDS`` (its root's process
        is likely gone)."""
        if self._failed_since is None:
            return False
        return (time.monotonic() if now is None else now) - self._failed_since >= (
            UNREACHABLE_SECONDS
        )

    def room(self) -> bool:
        """Whether the outbox takes another shipment."""
        return self.pending_bytes < OUTBOX_BYTES

    def queue(self, data: bytes) -> None:
        """One frame to send (whole, in order)."""
        self._frames.append(data)
        self.pending_bytes += len(data)

    # ---- one turn --------------------------------------------------------------------------

    def pump(self, now: float | None = None) -> list[OwnMeans]:
        """Connect if need be, send what the socket takes, read the answers; never blocks for
        long (a connection attempt is bounded by ``_CONNECT_SECONDS``)."""
        now = time.monotonic() if now is None else now
        if self._sock is None and not self._connect(now):
            return []
        answers = self._read()
        if self._sock is not None:
            self._send()
        return answers

    def flush(self, deadline: float) -> bool:
        """Pump until every queued frame is sent or ``deadline`` (monotonic); True if sent."""
        while True:
            self.pump()
            if not self._frames and self._sock is not None:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def close(self) -> None:
        self.peer = None
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    # ---- internals -------------------------------------------------------------------------

    def _connect(self, now: float) -> bool:
        if now < self._next_try:
            return False
        try:
            address = self.address()
        except Exception as exc:  # the store is gone
            log.debug("rankwatch: rank %d cannot read the aggregator's address: %s", self.rank, exc)
            address = None
        if address is None:
            self._next_try = now + _FIRST_RETRY_SECONDS
            return False
        host, port, token = address
        try:
            if port == UNIX:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(_CONNECT_SECONDS)
                sock.connect(host)
            else:
                sock = socket.create_connection((host, port), timeout=_CONNECT_SECONDS)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
        except OSError as exc:
            where = host.lstrip("\0") if port == UNIX else f"{host}:{port}"
            self._failed(now, f"cannot connect to {where} ({exc})")
            return False
        hostname, local_rank, gpu, uuid = self.identity
        hellos = [encode_hello(self.rank, local_rank, self.pid, token, hostname, gpu, uuid)]
        hellos += self.relayed()
        self._sock = sock
        self.peer = (host, port)
        self._welcomed = False
        self._answers.clear()
        self._offset = 0  # a frame cut by the last connection goes again, whole
        self._frames.extendleft(reversed(hellos))
        self.pending_bytes += sum(map(len, hellos))
        self.connections += 1
        return True

    def _failed(self, now: float, why: str) -> None:
        if self._welcomed:
            self.dropped += 1
            self._welcomed = False
        self.close()
        if self._failed_since is None:
            self._failed_since = now
            log.info("rankwatch: rank %d: the group's aggregator: %s; trying again", self.rank, why)
        self._next_try = now + self._retry
        self._retry = min(_MAX_RETRY_SECONDS, self._retry * 2)

    def _send(self) -> None:
        sock = self._sock
        assert sock is not None
        while self._frames:
            head = self._frames[0]
            try:
                sent = sock.send(memoryview(head)[self._offset :])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._failed(time.monotonic(), f"its connection broke ({exc})")
                return
            self._offset += sent
            if self._offset < len(head):
                return  # the socket is full: the rest on a later turn
            self._frames.popleft()
            self.pending_bytes -= len(head)
            self._offset = 0
            self.sent_frames += 1

    def _read(self) -> list[OwnMeans]:
        sock = self._sock
        assert sock is not None
        out: list[OwnMeans] = []
        ended = ""
        while True:
            try:
                data = sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                ended = f"its connection broke ({exc})"
                break
            if not data:
                ended = "it closed the connection"
                break
            self._answers += data
        try:
            frames, used = split_frames(self._answers)
        except WireError as exc:
            self._failed(time.monotonic(), f"it answered in a frame not of ours ({exc})")
            return out
        del self._answers[:used]
        for kind, payload in frames:
            try:
                rank = frame_rank(payload)
            except WireError:
                continue
            if rank != self.rank:  # an answer for a rank this one relays
                self.relayed_answers.append((rank, frame_bytes(kind, payload)))
            elif kind == KIND_WELCOME:
                self._welcomed = True
                self._failed_since = None
                self._retry = _FIRST_RETRY_SECONDS
            elif kind == KIND_REFUSED:
                why = refused_text(payload)
                if not self._said_refused:
                    self._said_refused = True
                    log.warning(
                        "rankwatch: rank %d: the group's aggregator refused its rows: %s",
                        self.rank,
                        why,
                    )
                self.close()
                self._next_try = time.monotonic() + _REFUSED_RETRY_SECONDS
                return out
            elif kind == KIND_OWN:
                with contextlib.suppress(WireError):
                    out.append(decode_own(payload))
        if ended:
            self._failed(time.monotonic(), ended)
        return out

"""Cross-rank windows: every rank ships its finished step rows to the group's root, which
aligns them, diagnoses the window and hands the report to the publishers.

Transport
---------
Rows travel over a Gloo process group created for rankwatch alone (never the training group),
point to point: each rank ``isend``s fixed-size messages (a header row plus ``CHUNK_ROWS`` rows
of ``ROW_WIDTH`` float64, NaN-padded) to the root, which keeps one ``irecv`` posted per peer.

Gloo cannot abandon a wait: ``work.wait(timeout)`` that times out closes *every* connection of
the group, and a posted receive cannot be polled (``is_completed()`` stays False until waited
on). So the root never waits on a receive that has not arrived. After a sender's send
completed (the data is in the root's posted buffer or on the wire to it) the sender increments
its *doorbell*, a counter in the job's c10d store, then the group's doorbell total; the root
reads the total per poll, all doorbells with one ``multi_get`` when it moved, and waits only
on receives whose doorbell moved, which return at once. With ``gloo_lazy_connect`` the group
connects lazily, so a rank opens a connection to the root only, never a full mesh; the
root's first receives, which make those connections, are posted by connector threads (Gloo
waits inside them for a peer that never connects).
A rank that dies or stalls simply stops ringing: the root's round times out on its own clock
(``gather_timeout_seconds``), the window names the rank missing, and later rounds do not wait
for it again until it rings. A dead peer's connection failing never affects the others'.

Rounds
------
Async mode: every rank ships every ``interval_seconds``; the root starts a round every
``interval_seconds``; a rank that shipped within the last interval is in at once, and the root
waits (up to ``gather_timeout_seconds``) for the others' next shipment. Sync mode: every
``sync_step``-th ``collect()`` call ships (round *k* on every rank); the root's round *k* waits
for every expected rank's round *k*.
A rank is *missing* from a window when its shipment did not come in time, or when it still
ships but its steps stopped advancing for ``gather_timeout_seconds`` while other ranks ran on
(its training thread is stuck). Missing ranks go to the diagnosis as absent (``None``).

At shutdown every rank ships what is left with a final flag, and the root builds the summary
window (``summary_window_steps``) once every expected rank's final shipment is in or the
shutdown budget is spent.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
from numpy.typing import NDArray
from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.diagnosis.step_time.blocks import BLOCK_STEPS, StepBlocks
from rankwatch.diagnosis.step_time.rules import (
    ROW_WIDTH,
    StepTimeReport,
    diagnose_arrays,
    diagnose_window,
)
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.identity import DEFAULT_NODE_NAME_ENV, current_gpu, node_hostname
from rankwatch.exporter.publish.protocol import Publisher
from rankwatch.exporter.step_time.artifacts import StepArtifactWriter
from rankwatch.exporter.step_time.timer import StepTimer

__all__ = [
    "CHUNK_ROWS",
    "GroupLayout",
    "Message",
    "RowBuffer",
    "Transport",
    "WindowCollector",
    "decode_message",
    "encode_message",
    "local_identity",
    "root_tail_rows",
    "window_arrays",
]

log = logging.getLogger("rankwatch.exporter.step_time.collector")

CHUNK_ROWS = 512  # rows per message; a message is (1 + CHUNK_ROWS) x ROW_WIDTH float64
TAG = 5277  # Gloo tag of rankwatch messages (the group is ours alone; any fixed tag works)
MAGIC = 52770.0
VERSION = 1.0
FLAG_END_OF_ROUND = 1
FLAG_FINAL = 2
STRATEGY_CODES: dict[str | None, int] = {None: 0, "ddp": 1, "fsdp": 2}
_CODE_STRATEGY = {v: k for k, v in STRATEGY_CODES.items()}
# Header columns.
_H_MAGIC, _H_VERSION, _H_SENDER, _H_SEQ, _H_ROWS, _H_FLAGS, _H_LOST, _H_STRATEGY = range(8)
POLL_SECONDS = 0.02  # root: doorbell poll period while a round or shutdown is waiting
# Root: doorbell poll period otherwise (each poll is one store request, answered by a thread
# of the store's host, usually rank 0: polling fast costs that process CPU time).
IDLE_POLL_SECONDS = 0.1
_MAX_POLLS_PER_DRAIN = 16
# Keep a little more than the window per rank when cutting tails, for steps some rank skipped.
_TAIL_SLACK = 2
# The root's rows per rank, at least: a live window aligns ranks up to about this many steps
# apart (a rank further behind leaves the others no common steps to align on).
ROOT_TAIL_MIN_ROWS = 1024


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


def local_identity(node_name_env: str = DEFAULT_NODE_NAME_ENV) -> tuple[str, int, str, str]:
    """(hostname, local rank, GPU index, GPU UUID) of this process: the hostname is the node
    name from ``node_name_env`` when set (Kubernetes), else the machine's, in lowercase; the
    local rank is ``LOCAL_RANK`` (0 when unset or not a number); the GPU fields are those of the
    current CUDA device as dcgm-exporter labels them, empty on CPU (see
    :mod:`rankwatch.exporter.identity`)."""
    raw = os.environ.get("LOCAL_RANK", "0")
    try:
        local_rank = int(raw)
    except ValueError:
        log.warning("LOCAL_RANK=%r is not an integer; reporting local rank 0", raw)
        local_rank = 0
    gpu, uuid = current_gpu()
    return node_hostname(node_name_env), local_rank, gpu, uuid


# ---- messages ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """One decoded shipment chunk."""

    sender: int
    seq: int
    flags: int
    lost: int
    strategy: str | None
    rows: NDArray[np.float64]

    @property
    def end_of_round(self) -> bool:
        return bool(self.flags & FLAG_END_OF_ROUND)

    @property
    def final(self) -> bool:
        return bool(self.flags & FLAG_FINAL)


def message_buffer() -> NDArray[np.float64]:
    """A message-sized float64 array."""
    return np.full((1 + CHUNK_ROWS, ROW_WIDTH), math.nan)


def encode_message(
    out: NDArray[np.float64],
    rows: NDArray[np.float64],
    *,
    sender: int,
    seq: int,
    flags: int,
    lost: int,
    strategy: str | None,
) -> None:
    """Fill ``out`` (from :func:`message_buffer`) with a header and up to ``CHUNK_ROWS`` rows."""
    n = len(rows)
    if n > CHUNK_ROWS:
        raise ValueError(f"encode_message: field rows: {n} rows exceed CHUNK_ROWS={CHUNK_ROWS}")
    if rows.ndim != 2 or rows.shape[1] != ROW_WIDTH:
        raise ValueError(
            f"encode_message: field rows: shape {rows.shape}, expected [n, {ROW_WIDTH}]"
        )
    out[0] = 0.0
    out[0, :8] = (
        MAGIC,
        VERSION,
        sender,
        seq,
        n,
        flags,
        lost,
        STRATEGY_CODES.get(strategy, 0),
    )
    out[1 : 1 + n] = rows
    out[1 + n :] = math.nan


def decode_message(buf: NDArray[np.float64]) -> Message:
    """Parse a received message; ``ValueError`` if it is not one of ours."""
    head = buf[0]
    if head[_H_MAGIC] != MAGIC or head[_H_VERSION] != VERSION:
        raise ValueError(
            f"decode_message: field header: magic/version {head[_H_MAGIC]!r}/"
            f"{head[_H_VERSION]!r} is not a rankwatch v1 message"
        )
    n = int(head[_H_ROWS])
    if not 0 <= n <= CHUNK_ROWS:
        raise ValueError(f"decode_message: field rows: value {n} out of 0..{CHUNK_ROWS}")
    return Message(
        sender=int(head[_H_SENDER]),
        seq=int(head[_H_SEQ]),
        flags=int(head[_H_FLAGS]),
        lost=int(head[_H_LOST]),
        strategy=_CODE_STRATEGY.get(int(head[_H_STRATEGY])),
        rows=buf[1 : 1 + n].copy(),
    )


# ---- root-side row buffers -----------------------------------------------------------------


class RowBuffer:
    """The root's bounded copy of one rank's rows, in step order.

    Rows whose step id is not above the last one kept are dropped (resent or out of order).
    ``progress_at`` is the monotonic time the rank's last step id last increased. Memory grows
    with the rows received, up to ``capacity`` rows (``ROW_WIDTH`` float64 each).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"RowBuffer.capacity: must be >= 1, got {capacity!r}")
        self.capacity = capacity
        self._data = np.empty((0, ROW_WIDTH))
        self.count = 0  # rows ever appended
        self.last_step = -1.0
        self.progress_at = time.monotonic()
        self.rejected = 0

    def __len__(self) -> int:
        return min(self.count, self.capacity)

    def append(self, rows: NDArray[np.float64], now: float | None = None) -> int:
        """Append rows (ascending step ids expected); returns how many were kept."""
        if len(rows) == 0:
            return 0
        ids = rows[:, 0]
        keep = ids > np.maximum.accumulate(np.concatenate(([self.last_step], ids[:-1])))
        if not keep.all():
            self.rejected += int((~keep).sum())
            rows = rows[keep]
        kept = len(rows)
        if kept == 0:
            return 0
        cap = self.capacity
        if kept > cap:  # only the newest ``cap`` rows can stay; count the rest as passed by
            self.count += kept - cap
            rows = rows[-cap:]
        n = len(rows)
        if len(self._data) < cap:
            # Still filling for the first time, so rows sit in slots 0..count-1: grow in order
            # (or start at full size when this batch overwrites every slot anyway).
            if n == cap:
                self._data = np.empty((cap, ROW_WIDTH))
            elif len(self._data) < self.count + n:
                size = min(cap, max(self.count + n, 2 * len(self._data), 256))
                grown = np.empty((size, ROW_WIDTH))
                grown[: self.count] = self._data[: self.count]
                self._data = grown
        a = self.count % cap
        split = min(n, cap - a)
        self._data[a : a + split] = rows[:split]
        self._data[: n - split] = rows[split:]
        self.count += n
        self.last_step = float(rows[-1, 0])
        self.progress_at = time.monotonic() if now is None else now
        return kept

    def tail(self, n: int, max_step: float | None = None) -> NDArray[np.float64]:
        """Copy of the last ``n`` rows (ascending), only rows with step id <= ``max_step``."""
        size = len(self)
        if size == 0 or n <= 0:
            return np.empty((0, ROW_WIDTH))
        end = self.count
        start = end - size
        cap = self.capacity
        a, b = start % cap, end % cap
        rows = self._data[a:b] if a < b else np.concatenate((self._data[a:], self._data[:b]))
        if max_step is not None:
            rows = rows[: int(np.searchsorted(rows[:, 0], max_step, side="right"))]
        return rows[-n:].copy()


def root_tail_rows(config: RankwatchConfig) -> int:
    """Rows of each rank the root keeps: the live window's tail and two blocks of steps, and
    room for ranks that are apart by several hundred steps (ranks that do not synchronise, a
    rank that stalled and runs behind); older steps live on as block sums, so the root's
    memory does not grow with the run."""
    live = config.diagnosis.step_time.live_window_steps
    return max(live * _TAIL_SLACK + 16, 2 * BLOCK_STEPS + 16, ROOT_TAIL_MIN_ROWS)


def window_arrays(
    buffers: Mapping[int, RowBuffer],
    present: Sequence[int],
    window: int,
    rows: int | None = None,
) -> dict[int, NDArray[np.float64] | None]:
    """Per expected rank: the tail the diagnosis aligns (None for absent ranks).

    Tails are cut at the lowest last step among present ranks (no rank can be aligned beyond
    it) and to ``rows`` rows (default: ``window`` steps plus slack), so a live window costs the
    same however long the buffers are. The diagnosis itself keeps the last ``window`` step ids
    every rank has.
    """
    rows = window * _TAIL_SLACK + 16 if rows is None else rows
    present_set = set(present)
    lasts = [buffers[r].last_step for r in present_set if len(buffers[r])]
    top = min(lasts) if lasts else None
    out: dict[int, NDArray[np.float64] | None] = {}
    for rank, buf in buffers.items():
        if rank not in present_set:
            out[rank] = None
            continue
        out[rank] = buf.tail(rows, top)
    return out


# ---- transport -----------------------------------------------------------------------------


def create_gloo_group(
    ranks: Sequence[int], members_only: bool, timeout: timedelta, lazy: bool | None = None
) -> Any:
    """The dedicated Gloo group over ``ranks`` (global).

    ``members_only=False`` is the ordinary ``new_group``: every process of the job calls it,
    in the same order as its other ``new_group`` calls. ``members_only=True`` lets only the
    members call it (for a group given as a process group handle, which non-members lack).

    ``lazy`` (None: ``RankwatchConfig.gloo_lazy_connect`` from the environment) makes the
    group connect lazily (Gloo's ``TORCH_GLOO_LAZY_INIT``, set only while it is created): a
    pair connects on its first message, and only rank-to-root pairs ever carry one, so a rank
    holds one monitoring connection instead of one per member (a full mesh: thousands of
    sockets per rank in a 4,096-rank job). ``new_group`` ignores Gloo options, so the
    variable is the only switch; other groups are created as they would be without it.
    """
    import torch.distributed as dist

    if lazy is None:
        lazy = _lazy_from_env()
    with _env(_GLOO_LAZY_INIT, "1") if lazy else contextlib.nullcontext():
        return dist.new_group(
            list(ranks), timeout=timeout, backend="gloo", use_local_synchronization=members_only
        )


def _lazy_from_env() -> bool:
    """``gloo_lazy_connect`` as the environment sets it (validated like the config)."""
    name = "RANKWATCH_GLOO_LAZY_CONNECT"
    env = {name: os.environ[name]} if name in os.environ else {}
    return RankwatchConfig.from_env(env=env).gloo_lazy_connect


_GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"
# Threads posting first receives on a lazily connected group: each rank that died before
# its connection was made holds one for the group's timeout; the others keep connecting.
_CONNECTOR_THREADS = 8
_ANY_DOORBELL = "db/any"


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` for the block, then the previous value (or none)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


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
        self._connect_queue: queue.SimpleQueue[int] | None = None
        if lazy and layout.is_root and layout.peers:
            self._connect_queue = queue.SimpleQueue()
            for k in range(min(_CONNECTOR_THREADS, len(layout.peers))):
                threading.Thread(
                    target=self._connector, name=f"rankwatch-connect-{k}", daemon=True
                ).start()
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

        buf = torch.empty((1 + CHUNK_ROWS, ROW_WIDTH), dtype=torch.float64)
        work = dist.irecv(buf, src=peer, group=self.group, tag=TAG)
        self._recv[peer] = (work, buf)

    def send(self, message: NDArray[np.float64]) -> None:
        """Ship one message to the root and ring the doorbell (blocks until the root's posted
        receive has taken it; raises if the root's connection failed)."""
        import torch
        import torch.distributed as dist

        tensor = torch.from_numpy(message)
        work = dist.isend(tensor, dst=self.layout.root, group=self.group, tag=TAG)
        if work is not None:  # None only for a process outside the group
            work.wait()
        self.store.add(self._db[self.layout.rank], 1)
        self.store.add(_ANY_DOORBELL, 1)

    def _admit(self) -> None:
        """Post the first receive of every peer that has created its end of the group."""
        said = self.store.multi_get([self._hello[p] for p in self._unposted])
        waiting = []
        for peer, value in zip(self._unposted, said, strict=True):
            if int(value) < 1:
                waiting.append(peer)
            elif self._connect_queue is not None:
                self._connect_queue.put(peer)
            else:
                self._post_first(peer)
        self._unposted = waiting

    def _post_first(self, peer: int) -> None:
        try:
            self._post(peer)
        except RuntimeError as exc:
            log.warning("rankwatch: cannot connect to rank %d: %s", peer, exc)
            self.broken.add(peer)

    def _connector(self) -> None:
        """Connector thread: posts first receives (``poll`` reads a peer once it is posted)."""
        assert self._connect_queue is not None
        while True:
            self._post_first(self._connect_queue.get())

    def poll(self) -> list[NDArray[np.float64]]:
        """Messages that arrived since the last poll (root only; never blocks on a peer)."""
        if self._unposted:
            self._admit()
        peers = [
            p
            for p in self.layout.peers
            if p not in self.broken and p not in self.closed and p in self._recv
        ]
        if not peers:
            return []
        # Read the total first: every doorbell it counts has already moved (a sender rings
        # its own before the total), so nothing it counts can be missed below.
        total = int(self.store.add(_ANY_DOORBELL, 0))
        if total == self._rung:
            return []
        raw = self.store.multi_get([self._db[p] for p in peers])
        out: list[NDArray[np.float64]] = []
        for peer, value in zip(peers, raw, strict=True):
            rung = int(value)
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
                except RuntimeError:
                    # The peer closed its end after this message: keep what arrived (its
                    # final rows, when it is done) instead of failing the whole poll.
                    self.closed.add(peer)
                    break
        self._rung = total
        return out


# ---- the collector thread ------------------------------------------------------------------


@dataclass
class _PeerState:
    last_heard: float = -math.inf  # monotonic time of the last message
    round_seq: int = -1  # highest round seq whose end arrived
    round_end_at: float = -math.inf  # monotonic time the last end-of-round arrived
    final: bool = False
    missing_since: float | None = None  # set while the rank is considered missing
    lost: int = 0
    strategy: str | None = None


class WindowCollector:
    """The background thread of one rank: ships rows (every rank) and builds windows (root).

    ``trigger()`` is ``collect()``'s hand-off in sync mode (sets an event, never blocks).
    ``stop(timeout)`` ships the last rows, lets the root build the summary window, and joins
    the thread within the timeout.
    """

    def __init__(
        self,
        layout: GroupLayout,
        timer: StepTimer,
        config: RankwatchConfig,
        publishers: Sequence[Publisher],
        transport: Transport | None,
        strategy: Callable[[], str | None],
        identity: tuple[str, int, str, str] | None = None,
    ) -> None:
        self.layout = layout
        self.timer = timer
        self.config = config
        self.publishers = tuple(publishers)
        self.transport = transport
        self._strategy = strategy
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._final_deadline = math.inf
        self._sync_requested = 0
        self._cursor = 0
        self.lost = 0  # rows overwritten in the local ring before they were shipped
        self.sent_messages = 0
        self.latest_report: WindowReport | None = None
        self.reports_published = 0
        # CPU time this thread has used (its own clock): what rankwatch costs besides hooks.
        self.cpu_seconds = 0.0
        self._cpu0 = 0.0
        self._thread = threading.Thread(
            target=self._run, name=f"rankwatch-{layout.rank}", daemon=True
        )
        # Root state (buffers only on the root: the others just ship): the newest rows of each
        # rank, and block sums of the older ones for the summary window.
        cap = root_tail_rows(config)
        self._buffers = {r: RowBuffer(cap) for r in layout.ranks} if layout.is_root else {}
        self._blocks = (
            StepBlocks(
                layout.ranks,
                window_steps=config.diagnosis.step_time.summary_window_steps,
                tail_rows=cap,
            )
            if layout.is_root
            else None
        )
        self._artifacts = StepArtifactWriter.from_config(config) if layout.is_root else None
        self._peers = {r: _PeerState() for r in layout.peers}
        ident = identity if identity is not None else local_identity(config.node_name_env)
        self._info: dict[int, RankInfo] = {layout.rank: RankInfo(layout.rank, *ident)}
        self._window_index = 0
        self._last_key: tuple[Any, ...] | None = None

    # ---- control (training thread) -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def trigger(self) -> None:
        """Sync mode: one more round is due (called every ``sync_step`` collects)."""
        self._sync_requested += 1
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_seconds: float) -> bool:
        """Ship the rest, build the summary (root), join; True if the thread ended in time."""
        if not self._thread.is_alive():
            return True
        start = time.monotonic()
        # The root waits for final shipments for at most half the budget (and never longer
        # than the gather timeout), keeping the rest for the summary and the publishers.
        self._final_deadline = start + min(self.config.gather_timeout_seconds, timeout_seconds / 2)
        self._stop.set()
        self._wake.set()
        self._thread.join(max(0.0, timeout_seconds - (time.monotonic() - start)))
        if self._thread.is_alive():
            log.warning(
                "rankwatch: rank %d background thread still busy after %.1f s (blocked on the "
                "root?); leaving it behind",
                self.layout.rank,
                timeout_seconds,
            )
            return False
        return True

    # ---- thread --------------------------------------------------------------------------

    def _run(self) -> None:
        self._cpu0 = time.thread_time()
        try:
            if self.layout.is_root:
                self._run_root()
            else:
                self._run_sender()
        except Exception:  # the thread must never take training down with it
            log.exception("rankwatch: rank %d background thread failed", self.layout.rank)
        finally:
            self._account()

    def _account(self) -> None:
        self.cpu_seconds = time.thread_time() - self._cpu0

    # sender ---------------------------------------------------------------------------------

    def _run_sender(self) -> None:
        cfg = self.config
        shipped_rounds = 0
        next_ship = time.monotonic() + cfg.interval_seconds
        while True:
            if cfg.async_mode:
                self._wake.wait(max(0.0, next_ship - time.monotonic()))
            else:
                self._wake.wait()
            self._wake.clear()
            self._account()
            stopping = self._stop.is_set()
            if stopping:
                self._ship(self._sync_requested, FLAG_END_OF_ROUND | FLAG_FINAL)
                return
            if cfg.async_mode:
                if time.monotonic() >= next_ship:
                    shipped_rounds += 1
                    self._ship(shipped_rounds, FLAG_END_OF_ROUND)
                    next_ship = time.monotonic() + cfg.interval_seconds
            elif self._sync_requested > shipped_rounds:
                shipped_rounds = self._sync_requested
                self._ship(shipped_rounds, FLAG_END_OF_ROUND)
            if self.transport is not None and self.transport.failed:
                return

    def _ship(self, seq: int, flags: int) -> None:
        transport = self.transport
        if transport is None or transport.failed:
            return
        rows, self._cursor, lost = self.timer.read(self._cursor)
        self.lost += lost
        buf = transport.send_buffer
        chunks = max(1, math.ceil(len(rows) / CHUNK_ROWS))
        try:
            for k in range(chunks):
                part = rows[k * CHUNK_ROWS : (k + 1) * CHUNK_ROWS]
                last = k == chunks - 1
                encode_message(
                    buf,
                    part,
                    sender=self.layout.rank,
                    seq=seq,
                    flags=flags if last else 0,
                    lost=self.lost,
                    strategy=self._strategy(),
                )
                transport.send(buf)
                self.sent_messages += 1
        except Exception as exc:  # root gone, store gone: stop shipping, keep training
            log.warning(
                "rankwatch: rank %d cannot ship to root %d (%s); stopping shipments",
                self.layout.rank,
                self.layout.root,
                exc,
            )
            transport.failed = True

    # root -----------------------------------------------------------------------------------

    def _run_root(self) -> None:
        cfg = self.config
        next_tick = time.monotonic() + cfg.interval_seconds
        rounds_done = 0
        round_start: float | None = None
        round_seq = 0
        while True:
            self._drain()
            now = time.monotonic()
            if self._stop.is_set():
                self._final_round()
                return
            if round_start is None:
                if cfg.async_mode and now >= next_tick:
                    round_start, round_seq = now, rounds_done + 1
                elif not cfg.async_mode and self._sync_requested > rounds_done:
                    round_start, round_seq = now, self._sync_requested
            if round_start is not None:
                waiting = self._waiting_for(round_seq, round_start)
                if not waiting or now >= round_start + cfg.gather_timeout_seconds:
                    for peer in waiting:
                        self._mark_missing(peer, now)
                    self._window("live", cfg.diagnosis.step_time.live_window_steps)
                    rounds_done = round_seq
                    round_start = None
                    next_tick = now + cfg.interval_seconds
            if round_start is not None:
                timeout = POLL_SECONDS
            elif cfg.async_mode:
                timeout = min(IDLE_POLL_SECONDS, max(0.0, next_tick - now))
            else:
                timeout = IDLE_POLL_SECONDS
            self._account()
            self._wake.wait(timeout)
            self._wake.clear()

    def _drain(self) -> None:
        """Move the root's own new rows and every arrived message into the row buffers."""
        if self._blocks is not None:
            self._blocks.flush()  # the blocks the last drain closed, batched over ranks
        now = time.monotonic()
        rows, self._cursor, lost = self.timer.read(self._cursor)
        self.lost += lost
        self._keep(self.layout.rank, rows, now)
        if self.transport is None or self.transport.failed:
            return
        messages: list[NDArray[np.float64]] = []
        try:
            # A multi-chunk shipment's next chunk lands once we re-posted the receive: ask
            # again while messages keep coming (bounded), instead of one chunk per poll period.
            for _ in range(_MAX_POLLS_PER_DRAIN):
                got = self.transport.poll()
                if not got:
                    break
                messages.extend(got)
        except Exception as exc:  # the store is gone: no more rows will arrive
            log.warning("rankwatch: root cannot read shipments (%s); windows stop", exc)
            self.transport.failed = True
        for raw in messages:
            try:
                msg = decode_message(raw)
            except ValueError as exc:
                log.warning("rankwatch: dropped a malformed message: %s", exc)
                continue
            state = self._peers.get(msg.sender)
            if state is None:
                log.warning("rankwatch: message from rank %d, not in the group", msg.sender)
                continue
            self._keep(msg.sender, msg.rows, now)
            state.last_heard = now
            state.lost = msg.lost
            if msg.strategy is not None:
                state.strategy = msg.strategy
            if msg.end_of_round:
                state.round_seq = max(state.round_seq, msg.seq)
                state.round_end_at = now
            if msg.final:
                state.final = True
            if state.missing_since is not None and now > state.missing_since:
                log.info("rankwatch: rank %d is back", msg.sender)
                state.missing_since = None

    def _keep(self, rank: int, rows: NDArray[np.float64], now: float) -> None:
        self._buffers[rank].append(rows, now)
        if self._blocks is not None:
            self._blocks.add(rank, rows)

    def _waiting_for(self, round_seq: int, round_start: float) -> list[int]:
        """Peers expected in this round that have not shipped for it yet.

        Async: a peer is in when it shipped within the last interval (it ships once per
        interval, on its own clock), so a healthy round closes at once. Sync: a peer is in
        when its round ``round_seq`` (or a later one) has arrived.
        """
        recent = round_start - self.config.interval_seconds - POLL_SECONDS
        out = []
        for peer, st in self._peers.items():
            if st.missing_since is not None or st.final or peer in self._broken():
                continue
            done = (
                st.round_end_at >= recent if self.config.async_mode else st.round_seq >= round_seq
            )
            if not done:
                out.append(peer)
        return out

    def _broken(self) -> set[int]:
        """Peers that can ship no more and have not shipped their final rows."""
        if self.transport is None:
            return set()
        hung_up = {p for p in self.transport.closed if not self._peers[p].final}
        return self.transport.broken | hung_up

    def _mark_missing(self, peer: int, now: float) -> None:
        st = self._peers[peer]
        if st.missing_since is None:
            log.warning(
                "rankwatch: rank %d did not ship within %.1f s; marked missing",
                peer,
                self.config.gather_timeout_seconds,
            )
            st.missing_since = now

    def _missing(self, now: float, summary: bool) -> list[int]:
        """Ranks absent from the window: not shipping, or (live windows) shipping without
        progress. The summary counts a rank that shipped its final rows as present, however
        early it stopped stepping."""
        missing = {p for p, st in self._peers.items() if st.missing_since is not None}
        missing |= self._broken()
        if summary:
            return sorted(missing)
        # Stalled: still shipping (or the root itself) but no new step for the gather timeout
        # while another rank ran further.
        lasts = {r: b.last_step for r, b in self._buffers.items() if r not in missing and len(b)}
        if len(lasts) > 1:
            top = max(lasts.values())
            limit = self.config.gather_timeout_seconds
            for r, last in lasts.items():
                if last < top and now - self._buffers[r].progress_at > limit:
                    missing.add(r)
        return sorted(missing)

    def _final_round(self) -> None:
        """Shutdown: wait (bounded) for every expected final shipment, then the summary."""
        while time.monotonic() < self._final_deadline:
            waiting = [
                p
                for p, st in self._peers.items()
                if not st.final and st.missing_since is None and p not in self._broken()
            ]
            if not waiting or self.transport is None or self.transport.failed:
                break
            time.sleep(POLL_SECONDS)
            self._drain()
        now = time.monotonic()
        for peer, st in self._peers.items():
            if not st.final and st.missing_since is None and peer not in self._broken():
                self._mark_missing(peer, now)
        self._window("summary", self.config.diagnosis.step_time.summary_window_steps)

    def _rank_infos(self) -> tuple[RankInfo, ...]:
        if self.transport is not None and not self.transport.failed:
            for r in self.layout.ranks:
                if r in self._info:
                    continue
                try:
                    ident = self.transport.identity(r)
                except Exception:  # the store is gone; report what we know
                    break
                if ident is not None:
                    self._info[r] = RankInfo(r, *ident)
        return tuple(self._info.get(r, RankInfo(r)) for r in self.layout.ranks)

    def strategy(self) -> str | None:
        """The root's own strategy, else the first one a peer detected."""
        mine = self._strategy()
        if mine is not None:
            return mine
        for st in self._peers.values():
            if st.strategy is not None:
                return st.strategy
        return None

    def _window(self, kind: str, window: int) -> None:
        now = time.monotonic()
        missing = self._missing(now, summary=kind == "summary")
        present = [r for r in self.layout.ranks if r not in missing]
        started = time.perf_counter()
        try:
            per_rank, step_time = self._diagnose(kind, present, window)
        except Exception:
            log.exception("rankwatch: step-time diagnosis failed for this window")
            return
        elapsed = time.perf_counter() - started
        key = (step_time.step_range, tuple(missing))
        if kind == "live" and (
            key == self._last_key or (step_time.step_range is None and not missing)
        ):
            return  # nothing new since the last window: do not publish it twice
        self._last_key = key
        report = WindowReport(
            group=self.config.group_name,
            window_index=self._window_index,
            created_at_s=time.time(),
            ranks=self._rank_infos(),
            run=self.config.run_id,
            window_kind=kind,
            missing_ranks=tuple(missing),
            step_time=step_time,
            diagnosis_seconds={"step_time": elapsed},
        )
        self._window_index += 1
        self.latest_report = report
        self.reports_published += 1
        if self._artifacts is not None:
            self._artifacts.save(report, per_rank, window)
        for pub in self.publishers:
            try:
                pub.publish(report)
            except Exception:  # one failing publisher must not starve the others
                log.exception("rankwatch: publisher %r failed", pub)

    def _diagnose(
        self, kind: str, present: list[int], window: int
    ) -> tuple[dict[int, NDArray[np.float64] | None], StepTimeReport]:
        """The window's rows as kept and its report. Live windows come from the rows; the
        summary from the rows and the block sums of older steps (bounded memory)."""
        cfg, strategy = self.config.diagnosis.step_time, self.strategy()
        if kind != "summary" or self._blocks is None:
            # Ranks in step (the usual case) share their last ``window`` rows: aligning just
            # those gives the same window at half the cost; otherwise align the longer tails.
            per_rank = window_arrays(self._buffers, present, window, rows=window)
            report = diagnose_arrays(per_rank, strategy=strategy, window=window, config=cfg)
            if report.steps < window:
                per_rank = window_arrays(self._buffers, present, window)
                report = diagnose_arrays(per_rank, strategy=strategy, window=window, config=cfg)
            return per_rank, report
        keep = set(present)
        tails: dict[int, NDArray[np.float64] | None] = {
            r: (b.tail(len(b)) if r in keep else None) for r, b in self._buffers.items()
        }
        complete = [r for r, b in self._buffers.items() if b.count <= b.capacity]
        means = self._blocks.reduce(tails, window, complete=complete)
        return tails, diagnose_window(means, strategy=strategy, config=cfg)


def dedicated_store(group: Any) -> Any:
    """A prefix of the job's c10d store private to rankwatch's group (doorbells, identities)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore(f"rankwatch/{group.group_name}/", _get_default_store())


def group_timeout(config: RankwatchConfig) -> timedelta:
    """Timeout of the dedicated group's blocking operations.

    Only a sender waits on Gloo (its send completes when the root's posted receive takes it);
    the root never waits on anything that has not arrived. A long timeout keeps a slow root
    from tearing down the senders' connections.
    """
    return timedelta(seconds=max(600.0, 20 * config.gather_timeout_seconds))

"""A simulated group for the scale benchmark: thousands of ranks shipping as real ranks do.

One process plays every rank of a group but one (or all but the root): it opens real TCP
connections to the group's aggregator (one per rank, or one per node of ``per_node`` ranks as
node leaders do), says hello for each rank, and on each round ships every rank's closed block
and its 100 new rows, encoded as :class:`~rankwatch.exporter.step_time.collector.RowShipper`
encodes them, in sync mode (round ``k`` carries ``seq`` k + 1, as a rank's k + 1-th
trigger). Its ranks' rows come from
:func:`~rankwatch.diagnosis.step_time.artifact.example_window` (one input straggler), so the
window's verdict is a real one. It can also hold the root's part (``hold_root``): the
aggregator handle and its publishers, for a benchmark that measures a non-root rank.

Driven over a pipe by :mod:`bench.bench_aggregator`: ``("round", k)`` ships round ``k`` and
answers ``("sent", k, unix time the last frame left)``; ``("stop",)`` ends it.
"""

from __future__ import annotations

import os
import resource
import selectors
import socket
import time
from typing import Any

import numpy as np

ROWS_PER_ROUND = 100
TEMPLATES = 8  # rank r ships template r % 8, the slow rank its own


def _templates(slow: int) -> tuple[list[np.ndarray], np.ndarray]:
    from rankwatch.diagnosis.step_time.artifact import example_window

    window = example_window(TEMPLATES + 1, ROWS_PER_ROUND, slow_rank=TEMPLATES)
    rows = [window.per_rank[r] for r in range(TEMPLATES + 1)]
    assert all(r is not None for r in rows)
    return [r for r in rows[:TEMPLATES] if r is not None], rows[TEMPLATES]  # type: ignore[return-value]


def _records(template: np.ndarray) -> np.ndarray:
    """The closed-block record of one round of ``template`` (index patched per round)."""
    from rankwatch.diagnosis.step_time.blocks import StepBlocks

    blocks = StepBlocks((0,), window_steps=10_000, tail_rows=200, records=True)
    rows = template.copy()
    blocks.add(0, rows)
    later = rows[:1].copy()
    later[:, 0] = ROWS_PER_ROUND
    blocks.add(0, later)
    blocks.flush()
    return blocks.taken_records()[1]


def serve(conn: Any, address: tuple[str, int, str], ranks: list[int], per_node: int) -> None:
    """Play ``ranks`` against the aggregator at ``address`` until told to stop."""
    from rankwatch.exporter.aggregator.wire import (
        FLAG_END_OF_ROUND,
        encode_blocks,
        encode_hello,
        encode_rows,
    )

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    host, port, token = address
    slow = ranks[len(ranks) // 2]
    templates, slow_rows = _templates(slow)
    records = [_records(t) for t in templates]
    slow_records = _records(slow_rows)
    groups = [ranks[i : i + per_node] for i in range(0, len(ranks), per_node)]
    selector = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    for group in groups:
        sock = socket.create_connection((host, port), timeout=60)
        hellos = b"".join(
            encode_hello(r, r % 8, os.getpid(), token, f"node-{r // 8}", "", "") for r in group
        )
        sock.sendall(hellos)
        sock.setblocking(False)
        socks.append(sock)
    conn.send(("ready", len(socks)))
    while True:
        message = conn.recv()
        if message[0] == "stop":
            break
        k = message[1]
        ids = np.arange(k * ROWS_PER_ROUND, (k + 1) * ROWS_PER_ROUND, dtype=np.float64)
        out: list[bytearray] = []
        for group in groups:
            data = bytearray()
            for r in group:
                rows = (slow_rows if r == slow else templates[r % TEMPLATES]).copy()
                rows[:, 0] = ids
                if k > 0:
                    rec = (slow_records if r == slow else records[r % TEMPLATES]).copy()
                    rec["index"] = k - 1
                    data += encode_blocks(r, rec)
                data += encode_rows(
                    rows, rank=r, seq=k + 1, flags=FLAG_END_OF_ROUND, strategy="ddp", lost=0
                )
            out.append(data)
        pending = {s.fileno(): (s, memoryview(d)) for s, d in zip(socks, out, strict=True)}
        for sock in socks:
            selector.register(sock, selectors.EVENT_WRITE)
        while pending:
            for key, _ in selector.select(1.0):
                sock, view = pending[key.fd]
                try:
                    sent = sock.send(view)
                except BlockingIOError:
                    continue
                view = view[sent:]
                if view:
                    pending[key.fd] = (sock, view)
                else:
                    del pending[key.fd]
                    selector.unregister(sock)
        conn.send(("sent", k, time.time()))
        # Answers (OWN frames in a large group) are read and dropped.
        for sock in socks:
            try:
                while sock.recv(1 << 16):
                    pass
            except (BlockingIOError, OSError):
                pass
    for sock in socks:
        sock.close()

"""Window building blocks in one process: messages, the root's row buffers, tails, layouts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwatch.diagnosis.step_time import ROW_WIDTH, diagnose_arrays
from rankwatch.exporter.identity import local_identity
from rankwatch.exporter.step_time.collector import window_arrays
from rankwatch.exporter.step_time.messages import (
    CHUNK_ROWS,
    FLAG_END_OF_ROUND,
    FLAG_FINAL,
    RowBuffer,
    decode_message,
    encode_message,
    message_buffer,
)
from rankwatch.exporter.step_time.transport import GroupLayout


def rows(first: int, n: int, value: float = 1.0) -> np.ndarray:
    out = np.full((n, ROW_WIDTH), math.nan)
    out[:, 0] = np.arange(first, first + n)
    out[:, 1:7] = value
    return out


def test_message_round_trip() -> None:
    buf = message_buffer()
    data = rows(5, 3)
    encode_message(
        buf, data, sender=7, seq=4, flags=FLAG_END_OF_ROUND | FLAG_FINAL, lost=2, strategy="fsdp"
    )
    msg = decode_message(buf)
    assert (msg.sender, msg.seq, msg.lost, msg.strategy) == (7, 4, 2, "fsdp")
    assert msg.end_of_round and msg.final
    np.testing.assert_array_equal(msg.rows, data)
    # A shorter message into the same buffer leaves no stale rows behind.
    encode_message(buf, rows(9, 1), sender=7, seq=5, flags=0, lost=2, strategy=None)
    msg = decode_message(buf)
    assert len(msg.rows) == 1 and msg.strategy is None and not msg.end_of_round
    assert np.isnan(buf[2:]).all()


def test_message_bad_input() -> None:
    buf = message_buffer()
    with pytest.raises(ValueError, match="rows"):
        encode_message(
            buf, rows(0, CHUNK_ROWS + 1), sender=0, seq=0, flags=0, lost=0, strategy=None
        )
    with pytest.raises(ValueError, match="rows"):
        encode_message(buf, np.zeros((2, 5)), sender=0, seq=0, flags=0, lost=0, strategy=None)
    with pytest.raises(ValueError, match="header"):
        decode_message(np.zeros((1 + CHUNK_ROWS, ROW_WIDTH)))
    encode_message(buf, rows(0, 1), sender=0, seq=0, flags=0, lost=0, strategy=None)
    buf[0, 4] = CHUNK_ROWS + 3
    with pytest.raises(ValueError, match="rows"):
        decode_message(buf)
    # A sender of another rankwatch version (rows of another width) is refused by version.
    encode_message(buf, rows(0, 1), sender=0, seq=0, flags=0, lost=0, strategy=None)
    buf[0, 1] = 1.0
    with pytest.raises(ValueError, match=r"is not a rankwatch v2 message \(every rank must run"):
        decode_message(buf)


def test_row_buffer_keeps_the_newest_rows_in_order() -> None:
    buf = RowBuffer(10)
    assert buf.append(rows(0, 4)) == 4
    assert buf.append(rows(4, 4)) == 4
    assert buf.append(rows(8, 5)) == 5  # wraps
    assert len(buf) == 10 and buf.last_step == 12
    assert buf.tail(100)[:, 0].tolist() == list(range(3, 13))
    assert buf.tail(3)[:, 0].tolist() == [10, 11, 12]
    assert buf.tail(4, max_step=9)[:, 0].tolist() == [6, 7, 8, 9]
    # A batch larger than the buffer keeps its newest rows.
    assert buf.append(rows(20, 25)) == 25
    assert buf.tail(100)[:, 0].tolist() == list(range(35, 45))


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(1, 12),
    batches=st.lists(st.tuples(st.integers(-3, 4), st.integers(0, 15)), max_size=12),
    n=st.integers(0, 20),
    cut=st.one_of(st.none(), st.integers(-2, 80)),
)
def test_row_buffer_tail_is_the_end_of_every_row_kept(
    capacity: int, batches: list[tuple[int, int]], n: int, cut: int | None
) -> None:
    # The reference keeps every accepted row in a list; the ring must hand out the same end
    # of it, however often it wrapped and wherever the cut falls.
    buf = RowBuffer(capacity)
    kept: list[float] = []
    next_id = 0
    for shift, count in batches:  # a negative shift resends steps already received
        first = max(0, next_id + shift)
        buf.append(rows(first, count))
        for step in range(first, first + count):
            if not kept or step > kept[-1]:
                kept.append(float(step))
        next_id = max(next_id, first + count)
    ring = kept[-capacity:]
    upto = ring if cut is None else [s for s in ring if s <= cut]
    want = upto[-n:] if n else []
    got = buf.tail(n, None if cut is None else float(cut))
    assert got.shape == (len(want), ROW_WIDTH)
    assert got[:, 0].tolist() == want
    got[:, 1] = -1.0  # a copy: the ring is untouched
    assert (buf.tail(capacity)[:, 1] != -1.0).all()


def test_row_buffer_grows_with_what_it_receives() -> None:
    buf = RowBuffer(5000)
    assert buf._data.nbytes == 0  # nothing allocated before the first rows
    buf.append(rows(0, 10))
    assert len(buf._data) < 5000
    for k in range(1, 12):
        buf.append(rows(k * 1000, 1000))
    assert len(buf._data) == 5000 and len(buf) == 5000
    assert buf.tail(3)[:, 0].tolist() == [11997, 11998, 11999]
    ids = buf.tail(5000)[:, 0]
    assert (np.diff(ids) > 0).all() and ids[0] == 7000
    # A first batch larger than the buffer.
    big = RowBuffer(7)
    assert big.append(rows(0, 20)) == 20
    assert big.tail(10)[:, 0].tolist() == list(range(13, 20))
    big.append(rows(20, 2))
    assert big.tail(10)[:, 0].tolist() == list(range(15, 22))


def test_row_buffer_rejects_resent_and_out_of_order_rows() -> None:
    buf = RowBuffer(8)
    buf.append(rows(0, 3))
    mixed = np.concatenate([rows(1, 2), rows(3, 1), rows(2, 1), rows(4, 1)])
    assert buf.append(mixed) == 2
    assert buf.rejected == 3
    assert buf.tail(8)[:, 0].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="capacity"):
        RowBuffer(0)


def test_row_buffer_progress_time_moves_only_with_new_steps() -> None:
    buf = RowBuffer(4)
    buf.append(rows(0, 2), now=10.0)
    buf.append(rows(0, 2), now=20.0)  # nothing new
    assert buf.progress_at == 10.0
    buf.append(rows(2, 1), now=30.0)
    assert buf.progress_at == 30.0


def test_window_arrays_cut_at_the_slowest_rank_and_name_absent_ranks() -> None:
    buffers = {r: RowBuffer(1000) for r in (0, 2, 5)}
    buffers[0].append(rows(0, 500))
    buffers[2].append(rows(0, 300))
    buffers[5].append(rows(0, 100))
    out = window_arrays(buffers, present=[0, 2], window=50)
    assert out[5] is None
    a0, a2 = out[0], out[2]
    assert a0 is not None and a2 is not None
    assert a0[-1, 0] == 299 and a2[-1, 0] == 299  # no rank aligned past the slowest one
    assert len(a0) <= 50 * 3
    report = diagnose_arrays(out, strategy=None, window=50)
    assert report.missing_ranks == (5,)
    assert report.step_range == (250, 299)


def test_group_layout() -> None:
    layout = GroupLayout((1, 3), 3)
    assert layout.root == 1 and layout.is_member and not layout.is_root
    assert layout.peers == (3,)
    assert not GroupLayout((1, 3), 2).is_member
    with pytest.raises(ValueError, match="ranks"):
        GroupLayout((), 0)
    with pytest.raises(ValueError, match="ranks"):
        GroupLayout((3, 1), 1)
    with pytest.raises(ValueError, match="ranks"):
        GroupLayout((1, 1), 1)


def test_local_identity_reads_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("NODE_NAME", raising=False)
    host, local, gpu, uuid = local_identity()
    assert local == 3 and host == host.lower() and host
    assert (gpu, uuid) == ("", "")  # CPU: no GPU labels
    # On Kubernetes the node name (downward API spec.nodeName) is the hostname, lower case.
    monkeypatch.setenv("NODE_NAME", "GPU-Node-07")
    assert local_identity()[0] == "gpu-node-07"
    monkeypatch.setenv("MY_NODE", "other-node")
    assert local_identity("MY_NODE")[0] == "other-node"
    assert local_identity("")[0] == host
    monkeypatch.setenv("LOCAL_RANK", "x")
    assert local_identity()[1] == 0

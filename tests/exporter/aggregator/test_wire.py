"""The wire between a rank and its aggregator: round trips, and every bad frame named."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from rankwatch.diagnosis.step_time import ROW_WIDTH
from rankwatch.diagnosis.step_time.blocks import block_record_dtype
from rankwatch.exporter.aggregator.wire import (
    FLAG_END_OF_ROUND,
    FLAG_FINAL,
    KIND_BLOCKS,
    KIND_GONE,
    KIND_HELLO,
    KIND_OWN,
    KIND_REFUSED,
    KIND_ROWS,
    KIND_WELCOME,
    MAX_BLOCKS_PER_FRAME,
    MAX_FRAME_BYTES,
    MAX_ROWS_PER_FRAME,
    WireError,
    decode_blocks,
    decode_hello,
    decode_own,
    decode_rows,
    encode_blocks,
    encode_gone,
    encode_hello,
    encode_own,
    encode_refused,
    encode_rows,
    encode_welcome,
    frame_bytes,
    frame_rank,
    refused_text,
    split_frames,
)

TOKEN = "ab" * 16
RANK = 5


def rows(first: int, n: int) -> np.ndarray:
    out = np.full((n, ROW_WIDTH), math.nan)
    out[:, 0] = np.arange(first, first + n)
    out[:, 1:7] = 1.5
    return out


def one(data: bytes) -> tuple[int, bytes]:
    frames, used = split_frames(bytearray(data))
    assert used == len(data) and len(frames) == 1
    return frames[0]


def test_hello_round_trip() -> None:
    kind, payload = one(encode_hello(7, 3, 4242, TOKEN, "node-b", "3", "GPU-1234"))
    assert kind == KIND_HELLO
    hello = decode_hello(payload)
    assert (hello.rank, hello.local_rank, hello.pid, hello.token) == (7, 3, 4242, TOKEN)
    assert (hello.hostname, hello.gpu, hello.gpu_uuid) == ("node-b", "3", "GPU-1234")


def test_rows_round_trip_keeps_every_value_and_flag() -> None:
    data = rows(5, 3)
    data[1, 4] = 0.0  # a measured zero stays a zero, NaN stays NaN
    frame = encode_rows(
        data, rank=RANK, seq=4, flags=FLAG_END_OF_ROUND | FLAG_FINAL, strategy="fsdp", lost=2
    )
    kind, payload = one(frame)
    assert kind == KIND_ROWS
    got = decode_rows(payload)
    assert (got.rank, got.seq, got.lost, got.strategy) == (RANK, 4, 2, "fsdp")
    assert got.end_of_round and got.final
    np.testing.assert_array_equal(got.rows, data)
    empty = decode_rows(
        one(encode_rows(rows(0, 0), rank=RANK, seq=1, flags=0, strategy=None, lost=0))[1]
    )
    assert empty.rows.shape == (0, ROW_WIDTH) and empty.strategy is None


def test_answers_name_their_rank() -> None:
    means = np.array([1.0, math.nan, 3.5])
    kind, payload = one(encode_own(RANK, 12, "gpu", means))
    assert kind == KIND_OWN and frame_rank(payload) == RANK
    own = decode_own(payload)
    assert own.rank == RANK and own.window_index == 12 and own.clock == "gpu"
    assert own.means[0] == 1.0 and math.isnan(own.means[1]) and own.means[2] == 3.5
    for frame, kind_of in (
        (encode_welcome(3), KIND_WELCOME),
        (encode_refused(4, "no room"), KIND_REFUSED),
        (encode_gone(6), KIND_GONE),
    ):
        kind, payload = one(frame)
        assert kind == kind_of and frame_rank(payload) in (3, 4, 6)
        assert frame_bytes(kind, payload) == frame  # a leader relays it whole
    assert refused_text(one(encode_refused(4, "no room"))[1]) == "no room"


def test_blocks_round_trip_and_bad_blocks() -> None:
    records = np.zeros(3, dtype=block_record_dtype())
    records["index"] = (4, 5, 6)
    records["sums"][1, 0, 2] = 7.5
    kind, payload = one(encode_blocks(RANK, records))
    assert kind == KIND_BLOCKS
    got = decode_blocks(payload)
    assert got.rank == RANK and got.records.tobytes() == records.tobytes()
    with pytest.raises(WireError, match="does not hold 3 blocks"):
        decode_blocks(payload[:-1])
    other = bytearray(payload)
    struct.pack_into("<H", other, 4, 50)
    with pytest.raises(WireError, match="field steps: value 50"):
        decode_blocks(bytes(other))
    with pytest.raises(WireError, match="is not a block's"):
        encode_blocks(RANK, np.zeros(1, dtype=[("index", "<i8")]))
    with pytest.raises(WireError, match="exceed"):
        encode_blocks(RANK, np.zeros(MAX_BLOCKS_PER_FRAME + 1, dtype=block_record_dtype()))


def test_frames_split_where_they_end_and_wait_for_the_rest() -> None:
    a = encode_rows(rows(0, 2), rank=RANK, seq=1, flags=0, strategy=None, lost=0)
    b = encode_rows(rows(2, 2), rank=RANK, seq=2, flags=FLAG_END_OF_ROUND, strategy=None, lost=0)
    buffer = bytearray(a + b[:10])
    frames, used = split_frames(buffer)
    assert len(frames) == 1 and used == len(a)
    del buffer[:used]
    buffer += b[10:]
    frames, used = split_frames(buffer)
    assert len(frames) == 1 and used == len(b)
    assert decode_rows(frames[0][1]).seq == 2


def test_bad_frames_are_named() -> None:
    with pytest.raises(WireError, match="field length: value 0"):
        split_frames(bytearray(struct.pack("<I", 0) + b"x"))
    with pytest.raises(WireError, match=f"out of 1..{MAX_FRAME_BYTES}"):
        split_frames(bytearray(struct.pack("<I", MAX_FRAME_BYTES + 1) + b"x"))
    with pytest.raises(WireError, match="rows: field length"):
        decode_rows(b"\x00" * 5)
    payload = one(encode_rows(rows(0, 2), rank=RANK, seq=1, flags=0, strategy=None, lost=0))[1]
    with pytest.raises(WireError, match="does not hold 2 rows"):
        decode_rows(payload[:-8])
    bad_flags = bytearray(payload)
    bad_flags[12] = 0x80
    with pytest.raises(WireError, match="field flags: value 128"):
        decode_rows(bytes(bad_flags))
    too_many = bytearray(payload)
    struct.pack_into("<I", too_many, 22, MAX_ROWS_PER_FRAME + 1)
    with pytest.raises(WireError, match="field rows"):
        decode_rows(bytes(too_many))
    hello = bytearray(one(encode_hello(1, 0, 1, TOKEN, "h", "", ""))[1])
    struct.pack_into("<H", hello, 0, 99)
    with pytest.raises(WireError, match="every rank must run the same rankwatch version"):
        decode_hello(bytes(hello))
    with pytest.raises(WireError, match="hello: field length"):
        decode_hello(b"\x01")
    with pytest.raises(WireError, match="hello: field uuid"):
        decode_hello(one(encode_hello(1, 0, 1, TOKEN, "h", "", ""))[1][:-2])
    with pytest.raises(WireError, match="own: field clock: value 9"):
        own = bytearray(one(encode_own(1, 1, "cpu", np.zeros(1)))[1])
        own[12] = 9
        decode_own(bytes(own))
    with pytest.raises(WireError, match="too short for a rank"):
        frame_rank(b"\x01")


def test_encoders_refuse_what_they_cannot_frame() -> None:
    with pytest.raises(WireError, match="encode_rows: field rows: shape"):
        encode_rows(np.zeros((2, 3)), rank=0, seq=0, flags=0, strategy=None, lost=0)
    with pytest.raises(WireError, match="exceed MAX_ROWS_PER_FRAME"):
        encode_rows(
            rows(0, MAX_ROWS_PER_FRAME + 1), rank=RANK, seq=0, flags=0, strategy=None, lost=0
        )
    with pytest.raises(WireError, match="encode_hello: field token"):
        encode_hello(0, 0, 0, "short", "h", "", "")

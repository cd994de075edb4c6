"""The wire between a rank and its group's aggregator: length-prefixed binary frames over TCP.

Every frame is a 4-byte little-endian length (of what follows), a kind byte and the kind's
payload. A rank sends ``HELLO`` once per connection (who it is, where it runs, and the group's
token, so a stray connection is refused), then, per shipment, ``BLOCKS`` and ``ROWS`` frames:

* ``BLOCKS``: the blocks of 100 steps the rank closed since its last shipment, summed by the
  rank itself (what the summary window needs of older steps:
  :func:`~rankwatch.diagnosis.step_time.blocks.block_record_dtype`), so the aggregator keeps
  them and never reduces them;
* ``ROWS``: a header (the rank they belong to, the round, flags, rows lost) and the rows as
  little-endian float64, ``ROW_WIDTH`` columns each, exactly as the step timer wrote them.

A connection may speak for several ranks (a node's leader relays its node's ranks: one
``HELLO`` each, and ``GONE`` when one of them leaves it): each frame names its rank. The
aggregator answers, each answer naming its rank, ``WELCOME`` or ``REFUSED`` and, in groups too
large for the root to publish every rank's series, ``OWN``: the rank's own means of the window
just diagnosed, which the rank then serves on its own ``/metrics``.

Decoding never trusts a peer: a frame's length is bounded (``MAX_FRAME_BYTES``), every field is
checked, and a malformed frame is a :class:`WireError` naming the field and the value.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from rankwatch.diagnosis.step_time.blocks import BLOCK_STEPS, block_record_dtype
from rankwatch.diagnosis.step_time.table import ROW_WIDTH

__all__ = [
    "FLAG_END_OF_ROUND",
    "FLAG_FINAL",
    "KIND_BLOCKS",
    "KIND_GONE",
    "KIND_HELLO",
    "KIND_OWN",
    "KIND_REFUSED",
    "KIND_ROWS",
    "KIND_WELCOME",
    "MAX_FRAME_BYTES",
    "MAX_ROWS_PER_FRAME",
    "STRATEGY_CODES",
    "Blocks",
    "Hello",
    "OwnMeans",
    "Rows",
    "WireError",
    "decode_blocks",
    "decode_hello",
    "decode_own",
    "decode_rows",
    "encode_blocks",
    "encode_gone",
    "encode_hello",
    "encode_own",
    "encode_refused",
    "encode_rows",
    "encode_welcome",
    "frame_bytes",
    "frame_rank",
    "refused_text",
    "rows_final",
    "split_frames",
]

VERSION = 1
KIND_HELLO = 1
KIND_ROWS = 2
KIND_BLOCKS = 3
KIND_GONE = 4
KIND_WELCOME = 11
KIND_REFUSED = 12
KIND_OWN = 13
FLAG_END_OF_ROUND = 1
FLAG_FINAL = 2
MAX_ROWS_PER_FRAME = 512
MAX_FRAME_BYTES = 1 + 64 + MAX_ROWS_PER_FRAME * ROW_WIDTH * 8  # the largest frame: rows
TOKEN_BYTES = 32  # the group's token, hex
STRATEGY_CODES: dict[str | None, int] = {None: 0, "ddp": 1, "fsdp": 2}
_CODE_STRATEGY = {v: k for k, v in STRATEGY_CODES.items()}
CLOCK_CODES = {"cpu": 0, "gpu": 1}
_CODE_CLOCK = {v: k for k, v in CLOCK_CODES.items()}

_LENGTH = struct.Struct("<I")
_KIND = struct.Struct("<B")
# version, row width, rank, local rank, pid
_HELLO = struct.Struct("<HHiiq")
# rank, seq, flags, strategy code, rows lost before this frame (cumulative), row count
_ROWS = struct.Struct("<iqBBqI")
# rank, steps per block, record count
_BLOCKS = struct.Struct("<iHI")
# answers and a relayed rank's end: the rank they are for
_RANK = struct.Struct("<i")
# rank, window index, clock code, value count
_OWN = struct.Struct("<iqBH")
_TEXT = struct.Struct("<H")


class WireError(ValueError):
    """A frame that is not one of ours, or is malformed: names the field and the value."""


@dataclass(frozen=True, slots=True)
class Hello:
    """The first frame of a rank's connection."""

    rank: int
    local_rank: int
    pid: int
    token: str
    hostname: str
    gpu: str
    gpu_uuid: str


@dataclass(slots=True)
class Rows:
    """One shipment (or one part of it) of a rank's rows."""

    rank: int
    seq: int
    flags: int
    strategy: str | None
    lost: int
    rows: NDArray[np.float64]

    @property
    def end_of_round(self) -> bool:
        return bool(self.flags & FLAG_END_OF_ROUND)

    @property
    def final(self) -> bool:
        return bool(self.flags & FLAG_FINAL)


@dataclass(frozen=True, slots=True)
class OwnMeans:
    """A rank's own window means (``RANK_MEAN_KEYS`` order, NaN where unmeasured)."""

    rank: int
    window_index: int
    clock: str
    means: tuple[float, ...]


def _frame(kind: int, payload: bytes) -> bytes:
    return _LENGTH.pack(1 + len(payload)) + _KIND.pack(kind) + payload


def _text(value: str) -> bytes:
    raw = value.encode("utf-8", "replace")[:1024]
    return _TEXT.pack(len(raw)) + raw


def encode_hello(
    rank: int, local_rank: int, pid: int, token: str, hostname: str, gpu: str, gpu_uuid: str
) -> bytes:
    """The ``HELLO`` frame of a rank."""
    raw_token = token.encode("ascii")
    if len(raw_token) != TOKEN_BYTES:
        raise WireError(f"encode_hello: field token: {len(raw_token)} bytes, expected 32")
    body = _HELLO.pack(VERSION, ROW_WIDTH, rank, local_rank, pid) + raw_token
    body += _text(hostname) + _text(gpu) + _text(gpu_uuid)
    return _frame(KIND_HELLO, body)


def encode_rows(
    rows: NDArray[np.float64],
    *,
    rank: int,
    seq: int,
    flags: int,
    strategy: str | None,
    lost: int,
) -> bytes:
    """One ``ROWS`` frame (at most ``MAX_ROWS_PER_FRAME`` rows; the caller splits)."""
    if rows.ndim != 2 or rows.shape[1] != ROW_WIDTH:
        raise WireError(f"encode_rows: field rows: shape {rows.shape}, expected [n, {ROW_WIDTH}]")
    if len(rows) > MAX_ROWS_PER_FRAME:
        raise WireError(
            f"encode_rows: field rows: {len(rows)} rows exceed MAX_ROWS_PER_FRAME "
            f"({MAX_ROWS_PER_FRAME})"
        )
    head = _ROWS.pack(rank, seq, flags, STRATEGY_CODES.get(strategy, 0), lost, len(rows))
    return _frame(KIND_ROWS, head + np.ascontiguousarray(rows, dtype="<f8").tobytes())


_RECORDS = block_record_dtype(BLOCK_STEPS)
MAX_BLOCKS_PER_FRAME = 256


@dataclass(slots=True)
class Blocks:
    """A rank's closed blocks of steps, summed by the rank (``block_record_dtype``)."""

    rank: int
    records: np.ndarray


def encode_blocks(rank: int, records: np.ndarray) -> bytes:
    """One ``BLOCKS`` frame: a rank's closed blocks (at most ``MAX_BLOCKS_PER_FRAME``)."""
    if records.dtype != _RECORDS:
        raise WireError(f"encode_blocks: field records: dtype {records.dtype} is not a block's")
    if len(records) > MAX_BLOCKS_PER_FRAME:
        raise WireError(
            f"encode_blocks: field records: {len(records)} exceed {MAX_BLOCKS_PER_FRAME}"
        )
    head = _BLOCKS.pack(rank, BLOCK_STEPS, len(records))
    return _frame(KIND_BLOCKS, head + np.ascontiguousarray(records).tobytes())


def decode_blocks(payload: bytes) -> Blocks:
    """A ``BLOCKS`` payload; the records are a read-only view of ``payload``."""
    if len(payload) < _BLOCKS.size:
        raise WireError(f"blocks: field length: value {len(payload)} is too short")
    rank, steps, n = _BLOCKS.unpack_from(payload)
    if steps != BLOCK_STEPS:
        raise WireError(
            f"blocks: field steps: value {steps}, expected {BLOCK_STEPS}: every rank must run "
            "the same rankwatch version"
        )
    if n > MAX_BLOCKS_PER_FRAME or len(payload) != _BLOCKS.size + n * _RECORDS.itemsize:
        raise WireError(f"blocks: field length: value {len(payload)} does not hold {n} blocks")
    records = np.frombuffer(payload, dtype=_RECORDS, count=n, offset=_BLOCKS.size)
    return Blocks(rank, records)


def encode_gone(rank: int) -> bytes:
    """A relayed rank's connection to its leader ended (from the leader)."""
    return _frame(KIND_GONE, _RANK.pack(rank))


def encode_welcome(rank: int) -> bytes:
    return _frame(KIND_WELCOME, _RANK.pack(rank))


def encode_refused(rank: int, why: str) -> bytes:
    return _frame(KIND_REFUSED, _RANK.pack(rank) + why.encode("utf-8", "replace")[:4096])


def encode_own(rank: int, window_index: int, clock: str, means: NDArray[np.float64]) -> bytes:
    """One ``OWN`` frame: a rank's means of the window just diagnosed."""
    values = np.ascontiguousarray(means, dtype="<f8")
    head = _OWN.pack(rank, window_index, CLOCK_CODES.get(clock, 0), len(values))
    return _frame(KIND_OWN, head + values.tobytes())


def frame_rank(payload: bytes) -> int:
    """The rank an answer (``WELCOME``, ``REFUSED``, ``OWN``) or a ``GONE`` is for."""
    if len(payload) < _RANK.size:
        raise WireError(f"frame: field rank: {len(payload)} bytes, too short for a rank")
    (rank,) = _RANK.unpack_from(payload)
    return int(rank)


def rows_final(payload: bytes) -> bool:
    """Whether a ``ROWS`` payload carries the final flag (read from its header alone)."""
    if len(payload) < _ROWS.size:
        raise WireError(f"rows: field length: value {len(payload)} is too short")
    return bool(_ROWS.unpack_from(payload)[2] & FLAG_FINAL)


def refused_text(payload: bytes) -> str:
    """Why a ``REFUSED`` answer refused."""
    return payload[_RANK.size :].decode("utf-8", "replace")


def frame_bytes(kind: int, payload: bytes) -> bytes:
    """A frame read by :func:`split_frames`, whole again (a leader relays it as it came)."""
    return _frame(kind, payload)


def split_frames(buffer: bytearray) -> tuple[list[tuple[int, bytes]], int]:
    """The complete frames at the start of ``buffer`` as ``(kind, payload)``, and how many bytes
    they took (the caller drops them). ``WireError`` for a frame over ``MAX_FRAME_BYTES`` or
    of no length: the connection is not ours, or is broken, and must be closed."""
    out: list[tuple[int, bytes]] = []
    start, size = 0, len(buffer)
    view = memoryview(buffer)
    try:
        while size - start >= _LENGTH.size + 1:
            (length,) = _LENGTH.unpack_from(buffer, start)
            if not 1 <= length <= MAX_FRAME_BYTES:
                raise WireError(f"frame: field length: value {length} out of 1..{MAX_FRAME_BYTES}")
            end = start + _LENGTH.size + length
            if end > size:
                break
            kind = buffer[start + _LENGTH.size]
            out.append((kind, bytes(view[start + _LENGTH.size + 1 : end])))
            start = end
    finally:
        view.release()
    return out, start


def _read_text(payload: bytes, at: int, field: str) -> tuple[str, int]:
    if len(payload) < at + _TEXT.size:
        raise WireError(f"hello: field {field}: missing")
    (n,) = _TEXT.unpack_from(payload, at)
    at += _TEXT.size
    if len(payload) < at + n:
        raise WireError(f"hello: field {field}: {n} bytes announced, {len(payload) - at} sent")
    return payload[at : at + n].decode("utf-8", "replace"), at + n


def decode_hello(payload: bytes) -> Hello:
    """A ``HELLO`` payload; ``WireError`` when it is not one this version reads."""
    if len(payload) < _HELLO.size + TOKEN_BYTES:
        raise WireError(f"hello: field length: value {len(payload)} is too short")
    version, width, rank, local_rank, pid = _HELLO.unpack_from(payload)
    if version != VERSION or width != ROW_WIDTH:
        raise WireError(
            f"hello: field version: value {version} (rows of {width} columns) is not rankwatch "
            f"wire version {VERSION} ({ROW_WIDTH} columns): every rank must run the same "
            "rankwatch version"
        )
    if rank < 0:
        raise WireError(f"hello: field rank: value {rank} is negative")
    at = _HELLO.size
    token = payload[at : at + TOKEN_BYTES].decode("ascii", "replace")
    at += TOKEN_BYTES
    hostname, at = _read_text(payload, at, "hostname")
    gpu, at = _read_text(payload, at, "gpu")
    gpu_uuid, at = _read_text(payload, at, "uuid")
    return Hello(rank, local_rank, pid, token, hostname, gpu, gpu_uuid)


def decode_rows(payload: bytes) -> Rows:
    """A ``ROWS`` payload; the rows are a read-only view of ``payload``."""
    if len(payload) < _ROWS.size:
        raise WireError(f"rows: field length: value {len(payload)} is too short")
    rank, seq, flags, strategy, lost, n = _ROWS.unpack_from(payload)
    if n > MAX_ROWS_PER_FRAME:
        raise WireError(f"rows: field rows: value {n} out of 0..{MAX_ROWS_PER_FRAME}")
    if len(payload) != _ROWS.size + n * ROW_WIDTH * 8:
        raise WireError(
            f"rows: field length: value {len(payload)} does not hold {n} rows of {ROW_WIDTH}"
        )
    if flags & ~(FLAG_END_OF_ROUND | FLAG_FINAL):
        raise WireError(f"rows: field flags: value {flags} has unknown bits")
    if lost < 0:
        raise WireError(f"rows: field lost: value {lost} is negative")
    rows = np.frombuffer(payload, dtype="<f8", offset=_ROWS.size).reshape(n, ROW_WIDTH)
    return Rows(rank, seq, flags, _CODE_STRATEGY.get(strategy), lost, rows)


def decode_own(payload: bytes) -> OwnMeans:
    """An ``OWN`` payload."""
    if len(payload) < _OWN.size:
        raise WireError(f"own: field length: value {len(payload)} is too short")
    rank, index, clock, n = _OWN.unpack_from(payload)
    if len(payload) != _OWN.size + 8 * n:
        raise WireError(f"own: field length: value {len(payload)} does not hold {n} values")
    if clock not in _CODE_CLOCK:
        raise WireError(f"own: field clock: value {clock} is not a clock code")
    values = np.frombuffer(payload, dtype="<f8", offset=_OWN.size)
    return OwnMeans(rank, index, _CODE_CLOCK[clock], tuple(values.tolist()))

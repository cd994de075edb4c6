"""Frames between a rankwatch process and a child it started: a 4-byte little-endian length,
then a pickle. Only a parent and its own child read them (the OTLP export child, the group's
aggregator), so pickle is safe here and nowhere else."""

from __future__ import annotations

import pickle
import struct
from typing import IO, Any

__all__ = ["FrameReader", "frame", "read_frame"]

_LENGTH = struct.Struct("<I")


def frame(obj: object) -> bytes:
    """``obj`` as one frame."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


def _read_exactly(stream: IO[bytes], size: int) -> bytes | None:
    parts, left = [], size
    while left:
        chunk = stream.read(left)  # an unbuffered stream may return less than asked
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_frame(stream: IO[bytes]) -> Any:
    """The next frame's object from a blocking stream (buffered or not: an unbuffered one
    reads no further than the frame); None once the other end closed."""
    head = _read_exactly(stream, _LENGTH.size)
    if head is None:
        return None
    (size,) = _LENGTH.unpack(head)
    payload = _read_exactly(stream, size)
    return None if payload is None else pickle.loads(payload)


class FrameReader:
    """Frames from chunks of a non-blocking stream: :meth:`feed` each chunk read, then take
    :meth:`frames` (every frame complete so far, in order)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> None:
        self._buffer += chunk

    def frames(self) -> list[Any]:
        out: list[Any] = []
        buf, start = self._buffer, 0
        while len(buf) - start >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buf, start)
            end = start + _LENGTH.size + size
            if len(buf) < end:
                break
            out.append(pickle.loads(memoryview(buf)[start + _LENGTH.size : end]))
            start = end
        if start:
            del buf[:start]
        return out

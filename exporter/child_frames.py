"""Frames between a rankwatch process and a child it started: a 4-byte little-endian length,
then a pickle. Only a parent and its own child read them (the OTLP export child, the group's
aggregator, the EP root's DeepEP child), so pickle is safe here and nowhere else."""

from __future__ import annotations

import logging
import os
import pickle
import struct
from typing import IO, Any

__all__ = ["ForwardLogs", "FrameReader", "frame", "read_exactly_into", "read_frame"]

_LENGTH = struct.Struct("<I")


def frame(obj: object) -> bytes:
    """``obj`` as one frame."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


def read_exactly_into(stream: IO[bytes], buffer: memoryview) -> bool:
    """Fill ``buffer`` from a blocking stream (raw bytes that follow a frame, read without a
    copy); False once the other end closed first."""
    view = buffer.cast("B")
    while view:
        got = stream.readinto(view)  # type: ignore[attr-defined]
        if not got:
            return False
        view = view[got:]
    return True


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


class ForwardLogs(logging.Handler):
    """A child's log records to its parent as ``("log", level, logger name, message)`` frames on
    ``fd``; the parent logs them through the job's own logging."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = frame(("log", record.levelno, record.name, record.getMessage()))
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError:  # the parent is gone
            pass

"""Reading files that may be hostile: saved windows are handed around and opened offline.

Every loader of a saved window goes through these helpers, so one rule holds everywhere: a
file is refused with an :class:`ArtifactError` (a ``ValueError``) that names the file, the
field and the value, before anything proportional to what the file *declares* is allocated.

- Only regular files are read. A FIFO, a device, a socket or a directory is refused from its
  ``stat`` without being opened, and the open itself is non-blocking, so a file swapped for a
  FIFO between the check and the open cannot hang the reader either.
- A file larger than the caller's byte budget is refused from its size.
- JSON is scanned before it is parsed: nesting deeper than :data:`MAX_JSON_DEPTH` or more than
  the caller's number of objects, arrays and strings is refused, integers longer than
  :data:`MAX_JSON_INT_DIGITS` digits, ``NaN``, ``Infinity`` and numbers that overflow to
  infinity are refused while parsing.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_JSON_INT_DIGITS",
    "ArtifactError",
    "open_regular_file",
    "parse_json",
    "read_text_file",
]

# Saved windows nest at most five levels (ranks -> rank -> clock -> signal -> list); a
# diagnosis dict a few more. Python's parser recurses once per level and gives up near 1,000.
MAX_JSON_DEPTH = 64
# A step id fits in 16 digits (float64 holds integers exactly up to 2**53); 20 digits cover
# every int64 with its sign. Longer integers cost quadratic time to convert.
MAX_JSON_INT_DIGITS = 20

# Opening a FIFO for reading blocks until a writer comes; non-blocking, it returns at once.
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_SCAN_CHUNK_BYTES = 1 << 18
_QUOTE = ord('"')
_BACKSLASH = ord("\\")
_OPEN = (ord("["), ord("{"))
_CLOSE = (ord("]"), ord("}"))


class ArtifactError(ValueError):
    """A saved window cannot be read: the message names the file, the field and the value."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _check_stat(path: Path, st: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ArtifactError(f"{path}: not a regular file ({_kind(st.st_mode)}); not read")
    if st.st_size > max_bytes:
        raise ArtifactError(
            f"{path}: file size {st.st_size} bytes is more than the {max_bytes} allowed"
        )


def open_regular_file(path: str | os.PathLike[str], *, max_bytes: int) -> BinaryIO:
    """Open ``path`` for reading in binary; refuse anything but a regular file of at most
    ``max_bytes`` without blocking. Symbolic links are followed (a loop is refused)."""
    p = Path(path)
    try:
        _check_stat(p, os.stat(p), max_bytes)
        fd = os.open(p, os.O_RDONLY | _NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no such file", str(p)) from None
    except OSError as exc:
        raise ArtifactError(f"{p}: cannot open ({exc.strerror or exc})") from None
    try:
        # The file may have been swapped since the stat: check what was really opened.
        _check_stat(p, os.fstat(fd), max_bytes)
        if _NONBLOCK:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_text_file(path: str | os.PathLike[str], *, max_bytes: int) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes``; :class:`ArtifactError` else."""
    with open_regular_file(path, max_bytes=max_bytes) as fh:
        # Asking for the size the file has (read() would allocate all it is asked for), and
        # one byte more, tells a file that grew since the check.
        size = os.fstat(fh.fileno()).st_size
        data = fh.read(size + 1)
    if len(data) > max_bytes:
        raise ArtifactError(f"{path}: more than the {max_bytes} bytes allowed")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ArtifactError(
            f"{path}: not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})"
        ) from None


def _structure(text: str, max_depth: int, max_items: int) -> tuple[int, int]:
    """(deepest nesting, objects + arrays + strings) of a JSON text, stopping once past
    either bound. Those are what costs the parser memory beyond the text's size: a two-letter
    string costs Python 51 bytes, an empty list 56.

    A vectorised scan in chunks, linear in the text whatever it holds: a quote opens or closes
    a string unless an odd run of backslashes precedes it; brackets outside strings add one
    level (opening) or remove one (closing). The parser sees the text only after this."""
    data = text.encode("utf-8", "surrogatepass")
    depth = deepest = containers = quotes = 0
    in_string = 0  # 1 while the scan is inside a string (carried from chunk to chunk)
    backslashes = 0  # the run of backslashes that ended the previous chunk
    for start in range(0, len(data), _SCAN_CHUNK_BYTES):
        chunk = np.frombuffer(data, np.uint8, min(_SCAN_CHUNK_BYTES, len(data) - start), start)
        at = np.arange(len(chunk))
        is_backslash = chunk == _BACKSLASH
        last_other = np.maximum.accumulate(np.where(is_backslash, -1, at))
        # The run of backslashes ending at each byte (0 where the byte is not one).
        run = at - last_other + np.where(last_other < 0, backslashes, 0)
        before = np.concatenate(([backslashes], run[:-1]))
        quote = (chunk == _QUOTE) & (before % 2 == 0)
        quotes_before = np.cumsum(quote) - quote + in_string
        outside = quotes_before % 2 == 0
        opens = np.isin(chunk, _OPEN) & outside
        steps = opens.astype(np.int64) - (np.isin(chunk, _CLOSE) & outside)
        in_string = int(quotes_before[-1] + quote[-1]) % 2
        backslashes = int(run[-1])
        quotes += int(quote.sum())
        if steps.any():
            running = np.cumsum(steps) + depth
            deepest = max(deepest, int(running.max()))
            containers += int(opens.sum())
            depth = int(running[-1])
        if deepest > max_depth or containers + (quotes + 1) // 2 > max_items:
            break
    return deepest, containers + (quotes + 1) // 2


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise ValueError(
            f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_JSON_INT_DIGITS}), "
            f"got {text[:24]}..."
        )
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"a number that is not finite as float64, got {text[:24]}")
    return value


def _no_constant(text: str) -> float:
    raise ValueError(f"{text} is not a JSON number, got {text}")


def parse_json(
    path: str | os.PathLike[str],
    field: str,
    text: str,
    *,
    max_items: int,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """Parse ``text`` (the JSON of ``field`` in file ``path``) within the bounds above:
    ``max_items`` objects, arrays and strings (keys included) at the most."""
    deepest, items = _structure(text, max_depth, max_items)
    if deepest > max_depth:
        raise ArtifactError(
            f"{path}: {field}: JSON nested more than {max_depth} levels deep (at least {deepest})"
        )
    if items > max_items:
        raise ArtifactError(
            f"{path}: {field}: more than {max_items} JSON objects, arrays and strings (at "
            f"least {items})"
        )
    try:
        return json.loads(
            text,
            parse_int=_bounded_int,
            parse_float=_finite_float,
            parse_constant=_no_constant,
        )
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path}: {field}: not valid JSON ({exc})") from None
    except (ValueError, RecursionError) as exc:
        raise ArtifactError(f"{path}: {field}: {exc}") from None

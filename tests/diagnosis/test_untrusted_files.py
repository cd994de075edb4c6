"""The helpers every window loader reads files through: the JSON scan must agree with the
parser on any document (or it would refuse good files, or let deep ones through), and the
opener must refuse what is not a regular file without blocking."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwatch.diagnosis import untrusted_files
from rankwatch.diagnosis.untrusted_files import (
    MAX_JSON_DEPTH,
    ArtifactError,
    open_regular_file,
    parse_json,
    read_text_file,
)

# Strings rich in what the scan must see through: quotes, backslashes, brackets.
_text = st.text(alphabet=st.sampled_from('ab"\\[]{}\u00e9\U0001f600'), max_size=12)
_documents = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**18), 10**18)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=40,
)


def _structure_of(value: Any) -> tuple[int, int]:
    """(depth, objects + arrays + strings) of a parsed document: what the scan must find."""
    if isinstance(value, list):
        parts = [_structure_of(v) for v in value]
    elif isinstance(value, dict):
        parts = [_structure_of(v) for v in value.values()] + [(0, 1)] * len(value)
    else:
        return 0, int(isinstance(value, str))
    return 1 + max((d for d, _ in parts), default=0), 1 + sum(c for _, c in parts)


@settings(max_examples=300, deadline=None)
@given(doc=_documents, ascii_only=st.booleans(), chunk=st.sampled_from([1, 2, 3, 7, 1 << 18]))
def test_the_scan_agrees_with_the_parser(doc: Any, ascii_only: bool, chunk: int) -> None:
    text = json.dumps(doc, ensure_ascii=ascii_only)
    old = untrusted_files._SCAN_CHUNK_BYTES
    untrusted_files._SCAN_CHUNK_BYTES = chunk  # small chunks put every boundary to the test
    try:
        assert untrusted_files._structure(text, 10**6, 10**6) == _structure_of(doc)
    finally:
        untrusted_files._SCAN_CHUNK_BYTES = old


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "nested more than 64 levels"),
        ('{"a": ' + "[" * 10**6, "nested more than 64 levels"),
        ("[" + ",".join(["[]"] * 11) + "]", "more than 10 JSON objects, arrays and strings"),
        ('["a",' + ",".join(['"\\"b"'] * 10) + "]", "more than 10 JSON objects, arrays and"),
        ('{"a": NaN}', "NaN is not a JSON number"),
        ("[Infinity]", "Infinity is not a JSON number"),
        ("[-1e999]", "not finite as float64"),
        ("[" + "9" * 21 + "]", "an integer of 21 digits (at most 20)"),
        ("[1, 2", "not valid JSON"),
        ("", "not valid JSON"),
    ],
)
def test_parse_json_refuses_by_name(text: str, says: str) -> None:
    with pytest.raises(ArtifactError, match=r"^f\.json: doc: ") as info:
        parse_json("f.json", "doc", text, max_items=10)
    assert says in str(info.value)


def test_parse_json_accepts_the_bounds_themselves() -> None:
    deepest = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json("f", "doc", deepest, max_items=MAX_JSON_DEPTH) is not None
    assert parse_json("f", "doc", "[" + "9" * 20 + "]", max_items=1) == [10**20 - 1]
    # Brackets and escaped quotes inside strings are text, not structure.
    assert parse_json("f", "doc", json.dumps(['\\"[[[', "{{{"]), max_items=3)


def test_non_regular_files_are_refused_without_opening(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)  # opening it for reading would block: no writer ever comes
    with pytest.raises(ArtifactError, match=r"pipe\.json: not a regular file \(a FIFO\)"):
        open_regular_file(fifo, max_bytes=10)
    with pytest.raises(ArtifactError, match=r"not a regular file \(a directory\)"):
        read_text_file(tmp_path, max_bytes=10)
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop.name)
    with pytest.raises(ArtifactError, match="cannot open"):
        read_text_file(loop, max_bytes=10)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_text_file(tmp_path / "absent.json", max_bytes=10)


def test_read_text_file_bounds_and_encoding(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    path.write_bytes(b"x" * 11)
    with pytest.raises(ArtifactError, match="file size 11 bytes is more than the 10 allowed"):
        read_text_file(path, max_bytes=10)
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ArtifactError, match=r"not UTF-8 text \(byte 0xff at offset 7\)"):
        read_text_file(path, max_bytes=100)
    path.write_text('{"a": "\u00e9"}', encoding="utf-8")
    assert read_text_file(path, max_bytes=100) == '{"a": "\u00e9"}'

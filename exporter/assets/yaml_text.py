"""A small YAML writer for the generated rule files and Kubernetes objects.

PyYAML is not a runtime dependency, and the files only need a subset: block mappings and
sequences of strings, ints, booleans and nulls. The output follows the layout of PyYAML's
``safe_dump(sort_keys=False, width=100)`` with multi-line strings as literal blocks, so the
committed files read like hand-written YAML and their diffs stay small: two-space indent,
sequences under a key not indented, a single-line string plain when it would read back as the
same string (quoted otherwise), and long single-line strings folded at spaces once a line
passes ``WIDTH`` columns (folding is lossless: a reader joins the lines with one space).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["WIDTH", "dump", "dump_all"]

# A line is folded at the first single space after it passes this column.
WIDTH = 100
_INDENT = 2

# Plain scalars a YAML 1.1 reader (Prometheus' and PyYAML's) would read as something other than
# a string: booleans, numbers, nulls, timestamps, merge and value keys. Those are quoted.
_NOT_A_STRING = re.compile(
    r"""(?x)^(?:
      yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF
    | ~|null|Null|NULL|
    | [-+]?0b[0-1_]+ | [-+]?0[0-7_]+ | [-+]?(?:0|[1-9][0-9_]*) | [-+]?0x[0-9a-fA-F_]+
    | [-+]?[1-9][0-9_]*(?::[0-5]?[0-9])+
    | [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)? | \.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
    | [-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]* | [-+]?\.(?:inf|Inf|INF) | \.(?:nan|NaN|NAN)
    | [0-9]{4}-[0-9]{2}-[0-9]{2}
    | [0-9]{4}-[0-9]{1,2}-[0-9]{1,2}(?:[Tt]|[\ \t]+)[0-9]{1,2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]*)?
      (?:[\ \t]*(?:Z|[-+][0-9]{1,2}(?::[0-9]{2})?))?
    | <<|=
    )$"""
)
# Characters that may not start a plain scalar, and those that may not when a space follows.
_INDICATORS = "#,[]{}&*!|>'\"%@`"
_INDICATORS_BEFORE_SPACE = "-?:"


def _printable(text: str) -> bool:
    """Only printable ASCII (and line breaks): anything else is written escaped."""
    return all(ch == "\n" or " " <= ch <= "~" for ch in text)


def _plain_allowed(text: str) -> bool:
    if not text or text != text.strip(" ") or "\n" in text or not _printable(text):
        return False
    if text.startswith(("---", "...")) or _NOT_A_STRING.match(text):
        return False
    first, rest = text[0], text[1:]
    if first in _INDICATORS or (first in _INDICATORS_BEFORE_SPACE and rest[:1] in ("", " ")):
        return False
    return ": " not in text and not text.endswith(":") and " #" not in text


def _literal_allowed(text: str) -> bool:
    """A ``|`` block keeps every line as is; no line may end in a space (it would be kept, but
    a reader cannot see it) and no character may need escaping."""
    return (
        _printable(text)
        and not text.endswith(" ")
        and all(line == line.rstrip(" ") for line in text.split("\n")[:-1])
    )


def _literal(text: str, indent: int) -> str:
    """``text`` as a literal block whose lines start at ``indent``. The header says how to read
    its ends: an indentation digit when the first line starts with a space or is empty, ``-``
    without a final newline, ``+`` to keep more than one."""
    header = str(_INDENT) if text.startswith((" ", "\n")) else ""
    lines = text.split("\n")
    if not text.endswith("\n"):
        header += "-"
    else:
        lines.pop()
        if text.endswith("\n\n") or text == "\n":
            header += "+"
    pad = " " * indent
    return f" |{header}\n" + "\n".join(pad + line if line else "" for line in lines)


def _folded(text: str, column: int, indent: int, quoted: bool) -> str:
    """``text`` written from ``column``: a single space after a line that has passed ``WIDTH``
    becomes a line break and ``indent`` (a quoted scalar never breaks at its first or last
    space run, which would lose the space)."""
    runs = re.findall(r" +|[^ ]+", text)
    out: list[str] = []
    for i, run in enumerate(runs):
        edge = quoted and i in (0, len(runs) - 1)
        if run == " " and not edge and column > WIDTH:
            out.append("\n" + " " * indent)
            column = indent
            continue
        written = run.replace("'", "''") if quoted else run
        out.append(written)
        column += len(written)
    return "".join(out)


def _scalar(value: Any, column: int, indent: int) -> str:
    """A scalar written after ``column`` characters (``key:`` or ``-``), continuation lines at
    ``indent``; returned with its leading space and without a final newline."""
    if value is None:
        return " null"
    if isinstance(value, bool):
        return " true" if value else " false"
    if isinstance(value, int):
        return f" {value}"
    if not isinstance(value, str):
        raise TypeError(f"yaml_text: cannot write a {type(value).__name__} ({value!r})")
    if "\n" in value:
        return _literal(value, indent) if _literal_allowed(value) else " " + json.dumps(value)
    if _plain_allowed(value):
        return " " + _folded(value, column + 1, indent, quoted=False)
    if _printable(value):
        return " '" + _folded(value, column + 2, indent, quoted=True) + "'"
    return " " + json.dumps(value)


def _node(value: Any, indent: int) -> list[str]:
    """The lines of a mapping or sequence whose entries start at column ``indent``."""
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str) or not _plain_allowed(key):
                raise ValueError(f"yaml_text: unsupported mapping key {key!r}")
            head = f"{pad}{key}:"
            if isinstance(item, Mapping) and item:
                lines.append(head)
                lines += _node(item, indent + _INDENT)
            elif _is_sequence(item) and item:
                lines.append(head)
                lines += _node(item, indent)  # a sequence under a key is not indented
            else:
                lines.append(head + _inline(item, len(head), indent + _INDENT))
        return lines
    for item in value:
        if isinstance(item, Mapping) and item:
            inner = _node(item, indent + _INDENT)
            lines.append(f"{pad}- {inner[0][indent + _INDENT :]}")
            lines += inner[1:]
        elif _is_sequence(item) and item:
            raise ValueError("yaml_text: a sequence directly inside a sequence is not supported")
        else:
            lines.append(f"{pad}-" + _inline(item, indent + 1, indent + _INDENT))
    return lines


def _is_sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str)


def _inline(value: Any, column: int, indent: int) -> str:
    if isinstance(value, Mapping):
        return " {}"
    if _is_sequence(value):
        return " []"
    return _scalar(value, column, indent)


def dump(document: Mapping[str, Any]) -> str:
    """One YAML document (a mapping), ending in a newline."""
    if not isinstance(document, Mapping):
        raise TypeError(f"yaml_text: a document must be a mapping, got {type(document).__name__}")
    return "\n".join(_node(document, 0)) + "\n"


def dump_all(documents: Sequence[Mapping[str, Any]]) -> str:
    """Several documents, separated by ``---`` lines."""
    return "---\n".join(dump(doc) for doc in documents)

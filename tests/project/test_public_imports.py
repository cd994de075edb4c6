"""Every import path the README and docs/*.md show must import.

Collected from README.md and docs/*.md:

* in fenced code blocks: ``from X import A, B`` (each name, as ``X.A``), ``import X`` and
  ``python -m X``, where X is in the ``rankwatch`` package;
* in inline code outside code blocks: a span that starts with a dotted ``rankwatch.`` name (or
  ``python -m`` and one) whose first two parts are a real package (``rankwatch.diagnosis``,
  ``rankwatch.exporter``). Other ``rankwatch.*`` names in inline code are not import paths:
  OTel attribute names, logger names, format names, file names.

The OTel instrument names of the metric catalogue (``rankwatch.diagnosis.info``,
``rankwatch.exporter.up``, ...) start with a real package too; they are skipped by name, read
from the catalogue.

Checks: ``from X import A`` imports module X and finds A as its attribute or submodule;
``import X`` imports module X; ``python -m X`` imports X and, for a package, finds its
``__main__``; an inline reference imports its longest importable module prefix and gets the
rest as attributes. A module that exists but fails to import (a missing dependency) fails.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from rankwatch.exporter.publish.catalogue import CATALOGUE
from tests.servers import REPO

ROOT = REPO
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

# OTel instrument names: dotted like module paths, some under a real package.
INSTRUMENT_NAMES = frozenset(spec.otel_name for spec in CATALOGUE)

_FENCE = re.compile(r"^\s*(```|~~~)")
_DOTTED = r"rankwatch(?:\.\w+)*"
_FROM = re.compile(rf"(?<![\w.])from\s+({_DOTTED})\s+import\s+(\(?)([^;#\"']*)")
_IMPORT = re.compile(r"(?:^|[;\"'])\s*import\s+([^;#\"']+)")
_RUN_MODULE = re.compile(rf"\bpython3?\s+-m\s+({_DOTTED})\b")
_INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")
_INLINE_REF = re.compile(r"^\s*(python3?\s+-m\s+)?(rankwatch(?:\.\w+)+)")


@dataclass(frozen=True)
class DocPath:
    file: str  # relative to the repository
    line: int
    kind: str  # "from", "import", "-m" or "ref"
    path: str  # dotted; for "from" the module and the name joined

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{self.path}"


def _names(text: str) -> list[str]:
    """``A, B as C, D`` -> ``[A, B, D]``."""
    out = []
    for item in text.replace("(", " ").replace(")", " ").split(","):
        words = item.split()
        if words and words[0].isidentifier():
            out.append(words[0])
    return out


def _code_paths(file: str, lines: list[tuple[int, str]]) -> list[DocPath]:
    found: list[DocPath] = []
    i = 0
    while i < len(lines):
        number, line = lines[i]
        for m in _FROM.finditer(line):
            module, paren, names = m.groups()
            if paren:  # from X import (A,\n B,\n)
                while ")" not in names and i + 1 < len(lines):
                    i += 1
                    names += "," + lines[i][1].split("#")[0]
                names = names.split(")")[0]
            found += [DocPath(file, number, "from", f"{module}.{n}") for n in _names(names)]
        for m in _IMPORT.finditer(line):
            for item in m.group(1).split(","):
                words = item.split()
                if words and (words[0] == "rankwatch" or words[0].startswith("rankwatch.")):
                    found.append(DocPath(file, number, "import", words[0]))
        found += [DocPath(file, number, "-m", m.group(1)) for m in _RUN_MODULE.finditer(line)]
        i += 1
    return found


def _is_package(name: str) -> bool:
    try:
        spec = importlib.util.find_spec(name)
    except ImportError:
        return False
    return spec is not None and spec.submodule_search_locations is not None


def _inline_paths(file: str, text: str) -> list[DocPath]:
    found = []
    for span in _INLINE.finditer(text):
        m = _INLINE_REF.match(span.group(1))
        if m is None:
            continue
        run, path = m.groups()
        line = text.count("\n", 0, span.start()) + 1
        if run:
            found.append(DocPath(file, line, "-m", path))
        elif path not in INSTRUMENT_NAMES and _is_package(".".join(path.split(".")[:2])):
            found.append(DocPath(file, line, "ref", path))
    return found


def collect(doc: Path, root: Path = ROOT) -> list[DocPath]:
    """The import paths of one Markdown file, in order, each once per line."""
    file = doc.relative_to(root).as_posix()
    code: list[tuple[int, str]] = []
    prose: list[str] = []
    fence = None
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            prose.append("")
        elif fence is not None:
            if m and m.group(1) == fence and line.strip() == fence:
                fence = None
            else:
                code.append((number, line))
            prose.append("")
        else:
            prose.append(line)
    paths = _code_paths(file, code) + _inline_paths(file, "\n".join(prose))
    return sorted(set(paths), key=lambda p: (p.line, p.id))


def _missing(exc: ModuleNotFoundError, name: str) -> bool:
    """True when ``name`` itself (or a parent of it) does not exist, rather than something it
    imports."""
    return exc.name is not None and (name == exc.name or name.startswith(exc.name + "."))


def resolve(kind: str, path: str) -> Any:
    """What ``path`` names, imported as ``kind`` says; raises when it does not import."""
    parts = path.split(".")
    if kind == "import":
        return importlib.import_module(path)
    if kind == "-m":
        module = importlib.import_module(path)
        if hasattr(module, "__path__") and importlib.util.find_spec(f"{path}.__main__") is None:
            raise ImportError(f"{path} is a package without __main__: cannot be run with -m")
        return module
    if kind == "from":
        module = importlib.import_module(".".join(parts[:-1]))
        if hasattr(module, parts[-1]):
            return getattr(module, parts[-1])
        return importlib.import_module(path)  # a submodule
    for cut in range(len(parts), 0, -1):  # "ref": the longest importable module prefix
        name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if cut > 1 and _missing(exc, name):
                continue
            raise
        for i, attr in enumerate(parts[cut:], cut):
            if not hasattr(obj, attr):
                what = "submodule or attribute" if isinstance(obj, ModuleType) else "attribute"
                raise AttributeError(f"{'.'.join(parts[:i])} has no {what} {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise AssertionError("unreachable")


PATHS = [p for doc in DOCS for p in collect(doc)]


@pytest.mark.parametrize("doc_path", [pytest.param(p, id=p.id) for p in PATHS])
def test_documented_path_imports(doc_path: DocPath) -> None:
    try:
        resolve(doc_path.kind, doc_path.path)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    else:
        return
    pytest.fail(
        f"{doc_path.file}:{doc_path.line}: `{doc_path.path}` ({doc_path.kind}) does not import: "
        f"{error}",
        pytrace=False,
    )


def test_collects_every_kind() -> None:
    assert {"from", "ref", "-m"} <= {p.kind for p in PATHS}
    assert len(PATHS) >= 20


def test_collector_and_resolver(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Inline `rankwatch.exporter.init()`, `rankwatch.diagnosis.info` (an instrument),\n"
        "`rankwatch.incident.id` (an attribute), `dashboards/rules/rankwatch.rules.yml`, and\n"
        "`python -m rankwatch.diagnosis.step_time.artifact --example w.json`.\n"
        "\n"
        "```python\n"
        "from rankwatch.exporter import (\n"
        "    init,\n"
        "    RankWatch as RW,  # comment\n"
        ")\n"
        "import rankwatch.exporter.cli, torch\n"
        "python -c \"from rankwatch.exporter.cli.heatmap import render_all; render_all('x')\"\n"
        "```\n",
        encoding="utf-8",
    )
    found = [(p.line, p.kind, p.path) for p in collect(doc, tmp_path)]
    assert found == [
        (1, "ref", "rankwatch.exporter.init"),
        (3, "-m", "rankwatch.diagnosis.step_time.artifact"),
        (6, "from", "rankwatch.exporter.RankWatch"),
        (6, "from", "rankwatch.exporter.init"),
        (10, "import", "rankwatch.exporter.cli"),
        (11, "from", "rankwatch.exporter.cli.heatmap.render_all"),
    ]
    assert isinstance(resolve("-m", "rankwatch.exporter.cli"), ModuleType)
    assert callable(resolve("ref", "rankwatch.exporter.cli.heatmap.render_all"))
    for kind, path in [
        ("ref", "rankwatch.exporter.no_such_module.Thing"),
        ("ref", "rankwatch.exporter.init.no_such_attribute"),
        ("from", "rankwatch.exporter.no_such_name"),
        ("import", "rankwatch.exporter.no_such_module"),
        ("-m", "rankwatch.exporter"),
    ]:
        with pytest.raises((ImportError, AttributeError)):
            resolve(kind, path)

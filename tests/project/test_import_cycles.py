"""No two modules of rankwatch import each other, directly or around a loop.

Every import counts, those inside functions too (a lazy import is still a dependency: two
modules that need each other are one idea split in two); only one under ``TYPE_CHECKING``
does not, since it never runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"rankwatch.diagnosis": ROOT / "diagnosis", "rankwatch.exporter": ROOT / "exporter"}


def _modules() -> dict[str, Path]:
    out = {}
    for prefix, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((prefix, *parts))] = path
    return out


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The rankwatch modules ``path`` imports, anywhere in it."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    found: set[str] = set()
    for node in [tree]:
        for sub in ast.walk(node):
            if id(sub) in skip:
                continue
            if isinstance(sub, ast.Import):
                found.update(a.name for a in sub.names)
            elif isinstance(sub, ast.ImportFrom):
                base = sub.module or ""
                if sub.level:
                    anchor = package.split(".")[: len(package.split(".")) - sub.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from package import module`` imports the module (its package is already
                # being imported); ``from module import name`` imports the module.
                subs = {f"{base}.{a.name}" for a in sub.names} & known
                found.update(subs if len(subs) == len(sub.names) else {base, *subs})
    return {m for m in found if m in known and m != name}


def test_no_module_level_import_cycle() -> None:
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(path, name, known) for name, path in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_the_cycle_check_sees_a_cycle(tmp_path: Path) -> None:
    # The walk above must find what it looks for: two modules that import each other.
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from rankwatch.exporter import b\n")
    b.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import rankwatch.exporter.c\n"
        "def late():\n    import rankwatch.exporter.a\n"
    )
    known = {"rankwatch.exporter.a", "rankwatch.exporter.b", "rankwatch.exporter.c"}
    assert _imports(a, "rankwatch.exporter.a", known) == {"rankwatch.exporter.b"}
    assert _imports(b, "rankwatch.exporter.b", known) == {"rankwatch.exporter.a"}

"""docs/configuration.md stays in step with the code: every variable, option and default."""

from __future__ import annotations

import re

import pytest

from rankwatch.diagnosis.config import DeclaredOption
from rankwatch.exporter.cli.demo_plan import SCENARIOS
from rankwatch.exporter.cli.main import build_parser, format_value
from rankwatch.exporter.config import all_env_variables, config_options
from tests.servers import REPO

DOC = REPO / "docs" / "configuration.md"


def _table_rows() -> dict[str, list[str]]:
    """Rows of every Markdown table whose first cell is a `VARIABLE` or `--option`."""
    rows: dict[str, list[str]] = {}
    for line in DOC.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`([A-Z0-9_]+|--[a-z-]+)(?: [A-Z]+)?`", cells[0])
        if match:
            rows[match.group(1)] = cells
    return rows


@pytest.mark.parametrize("env_name", sorted(all_env_variables()))
def test_every_variable_is_documented_with_its_option_and_default(env_name: str) -> None:
    rows = _table_rows()
    assert env_name in rows, f"{env_name} is missing from docs/configuration.md"
    path, default = all_env_variables()[env_name]
    _, option, doc_default, allowed, meaning = rows[env_name]
    assert option == f"`{path.split('.')[1]}`"
    assert doc_default == format_value(default), f"{env_name}: default differs from the code"
    assert allowed and meaning


@pytest.mark.parametrize("opt", [o for o in config_options() if o.allowed], ids=lambda o: o.env)
def test_every_documented_range_is_the_checked_one(opt: DeclaredOption) -> None:
    allowed = _table_rows()[opt.env][3]
    assert allowed == opt.allowed or allowed.startswith(opt.allowed + ", "), (opt.env, allowed)


def test_no_documented_variable_is_unknown() -> None:
    # The OpenTelemetry SDK's own variables are documented beside ours but read by the SDK.
    documented = {k for k in _table_rows() if not k.startswith(("--", "OTEL_"))}
    assert documented == set(all_env_variables())


def test_every_demo_option_is_documented() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    demo = subparsers.choices["demo"]  # type: ignore[attr-defined]
    options = {
        s for a in demo._actions for s in a.option_strings if s.startswith("--") and s != "--help"
    }
    documented = {k for k in _table_rows() if k.startswith("--")}
    assert options == documented


def test_every_scenario_is_documented() -> None:
    text = DOC.read_text()
    for name in SCENARIOS:
        assert f"| `{name}` |" in text, name


README = DOC.parent.parent / "README.md"


def test_readme_opens_with_the_name_what_it_does_then_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert lines[0] == "# rankwatch"
    block = lines.index("```")
    assert 2 <= block <= 6, "the two commands come right after a sentence or two"
    assert all(line and not line.startswith("#") for line in lines[2 : block - 1])
    assert lines[block : block + 4] == ["```", "make demo", "make test", "```"]


def test_readme_and_configuration_links_resolve() -> None:
    for page in (README, DOC):
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith("http"):
                continue
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"

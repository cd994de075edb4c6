"""``docs/metrics.md`` carries the catalogue table generated from ``publish/catalogue.py``."""

from __future__ import annotations

import pytest

from rankwatch.exporter.publish.catalogue import (
    CATALOGUE,
    DOC_BEGIN,
    DOC_END,
    markdown_table,
    render_doc,
)


def test_table_has_one_row_per_family_with_its_otel_instrument():
    rows = [line for line in markdown_table().splitlines() if line.startswith("| `")]
    assert len(rows) == len(CATALOGUE)
    for spec, row in zip(CATALOGUE, rows, strict=True):
        assert row.startswith(f"| `{spec.name}` | {spec.type} |")
        assert f"`{spec.otel_name}`" in row


def test_render_doc_replaces_only_between_the_markers():
    text = f"before\n{DOC_BEGIN}\nold table\n{DOC_END}\nafter\n"
    out = render_doc(text)
    assert out.startswith(f"before\n{DOC_BEGIN}\n| name |")
    assert out.endswith(f"{DOC_END}\nafter\n") and "old table" not in out
    assert render_doc(out) == out
    with pytest.raises(ValueError, match="markers"):
        render_doc("no markers here")

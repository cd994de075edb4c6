"""``python -m rankwatch.exporter.assets [ROOT]``: rewrite the generated files of a checkout
(``make generate``) with the default settings and thresholds; ROOT defaults to ``.``."""

from __future__ import annotations

import sys
from pathlib import Path

from rankwatch.exporter.assets.render import write


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"usage: python -m rankwatch.exporter.assets [ROOT], got {argv!r}", file=sys.stderr)
        return 2
    root = Path(argv[0] if argv else ".")
    if not (root / "dashboards").is_dir():
        print(f"ROOT {str(root)!r}: has no dashboards/ folder", file=sys.stderr)
        return 2
    for path in write(root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Print pip constraints pinning every runtime dependency (and the gRPC extra) to its floor.

``make test-floors`` installs rankwatch with these pins into a fresh environment and runs the
publishing tests there, so a floor declared in ``pyproject.toml`` is a floor that works. torch
is left out: only the CPU build on disk may be installed (its floor is not exercised).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
NOT_PINNED = {"torch"}


def floor_pins(pyproject: Path = PYPROJECT) -> list[str]:
    """``name==floor`` for every ``name>=floor`` runtime (and ``grpc`` extra) requirement."""
    project = tomllib.loads(pyproject.read_text())["project"]
    pins = []
    for req in [*project["dependencies"], *project["optional-dependencies"]["grpc"]]:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)>=([0-9][A-Za-z0-9.]*)", req.strip())
        if match is None:
            raise ValueError(f"pyproject.toml: {req!r} has no plain >= floor to test")
        if match[1] not in NOT_PINNED:
            pins.append(f"{match[1]}=={match[2]}")
    return pins


if __name__ == "__main__":
    sys.stdout.write("".join(pin + "\n" for pin in floor_pins()))

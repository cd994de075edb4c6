"""The ``rankwatch`` command's exit codes, and the one error every subcommand raises for bad
input from the user (printed as one line, exit code 2)."""

from __future__ import annotations

__all__ = ["EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "UsageError"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""

"""Folders rankwatch writes into (step-window artifacts, DeepEP logs and NPZ windows).

A folder that cannot be used never stops training: the caller logs one warning naming the
variable, its value and what is wrong (:func:`folder_problem`), and runs without that output.
"""

from __future__ import annotations

import errno
import logging
import os

__all__ = ["folder_problem", "usable_folder"]

log = logging.getLogger(__name__)


def folder_problem(path: str) -> str | None:
    """Create ``path`` (and its parents) if needed; None when files can be written in it,
    otherwise what is wrong, in words."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        return "exists and is not a folder"
    except NotADirectoryError:
        return "is under a file, not a folder"
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return f"cannot be created ({exc.strerror})"
        return f"cannot be used ({exc.strerror or exc})"
    if not os.path.isdir(path):  # a link to a file, or a device such as /dev/null
        return "exists and is not a folder"
    if not os.access(path, os.W_OK | os.X_OK):
        return "is not writable"
    return None


def usable_folder(path: str, variable: str, without: str) -> bool:
    """True when ``path`` (the value of ``variable``) can hold files; otherwise one warning
    naming the variable, the value and the problem, and what the job does ``without`` it."""
    problem = folder_problem(path)
    if problem is None:
        return True
    log.warning("rankwatch: %s=%r %s; %s", variable, path, problem, without)
    return False

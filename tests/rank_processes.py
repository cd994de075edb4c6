"""Start the rank processes of the test and matrix worlds, forked from a server that has
already imported torch.

A spawned rank is a fresh interpreter: it spends about 2 s of CPU importing torch before its
first line of work, and a world of 3 or 4 ranks on a 2-core machine waits about 3.5 s for
that; the timed worlds of ``make test`` start well over a hundred of them. Here each rank is
forked from multiprocessing's fork server, started once per parent process with torch and
``torch.distributed`` imported (and nothing else: no op has run, no thread pool exists, no
process group), so a world starts in a few hundredths of a second.

A rank started here otherwise begins and ends as a spawned one does, which is what the
worlds stand for (a process torchrun starts):

- its environment is the parent's as it is when the rank starts (a forked rank would
  otherwise have the server's, fixed when the server started);
- at the end it runs the interpreter's exit handlers (a fork-server child leaves with
  ``os._exit``, which skips them: logging's flush, rankwatch's own), after recording an
  uncaught error in ``sys.last_value`` as the interpreter does;
- torch was imported with ``OMP_NUM_THREADS=1``, the one thread count every world asks for
  (torch reads it once, at import): a rank that needs another calls
  ``torch.set_num_threads`` itself.

Its target and arguments are pickled, as for spawn. The server is the parent's for its whole
life; it runs no test code.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import sys
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["rank_process"]

PRELOAD = ["torch", "torch.distributed"]

_server_started = False


def rank_process(
    target: Callable[..., object], args: tuple[Any, ...], *, daemon: bool | None = None
) -> BaseProcess:
    """A process (not yet started) that runs ``target(*args)`` as a rank of a world."""
    ctx = mp.get_context("forkserver")
    _start_server(ctx)
    return ctx.Process(target=_run, args=(dict(os.environ), target, args), daemon=daemon)


def _start_server(ctx: Any) -> None:
    global _server_started
    if _server_started:
        return
    ctx.set_forkserver_preload(PRELOAD)
    # The server takes the environment of this moment: torch reads its thread count at import.
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        from multiprocessing import forkserver

        forkserver.ensure_running()
    finally:
        if previous is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = previous
    _server_started = True


def _run(environ: dict[str, str], target: Callable[..., object], args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    try:
        target(*args)
    except SystemExit:
        raise
    except BaseException as exc:
        # As the interpreter does for an uncaught error before its exit handlers run (they
        # may tell a normal end from a crash by it).
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        raise
    finally:
        atexit._run_exitfuncs()

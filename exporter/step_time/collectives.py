"""Every wait of the training thread for a collective, timed as a sync wait.

A rank that only waited for a peer (a tensor-parallel partner, the previous pipeline stage, a
data-parallel replica) must not look slow: its wait is timed where the host blocks and credited
through the timer's one sync-wait path (:meth:`StepTimer.sync_wait`): ``forward_wait`` (and
``forward`` when no forward is being timed, as a pre-forward wait), or ``backward_wait`` inside
a timed backward. :func:`install_collective_waits` is called by ``RankWatch.watch()``.

Where the host waits, and what is shadowed (torch 2.13, read in its source):

* ``torch.distributed.Work.wait`` (the class's method, so every work object is timed as it is,
  nothing of it wrapped or copied). Every blocking c10d Python function issues its collective
  and then calls ``work.wait()`` in Python (``torch.distributed.distributed_c10d``:
  ``all_reduce``, ``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter``,
  ``reduce_scatter_tensor``, ``broadcast``, ``reduce``, ``all_to_all``, ``all_to_all_single``,
  ``gather``, ``scatter``, ``barrier``, ``send``, ``recv`` and the ``*_object`` variants
  through them), so the name a caller uses (``torch.distributed.<fn>`` re-exports
  ``distributed_c10d.<fn>``, the same function objects) does not matter. ``async_op=True``
  calls, ``isend``/``irecv`` and ``batch_isend_irecv`` return works the caller waits on later:
  the pipelining schedules wait on them in ``_wait_batch_p2p``
  (``torch.distributed.pipelining.schedules``: the bubble, where a stage waits for its peer),
  FSDP2 waits on its all-gather work (``wait_for_unshard``), SyncBatchNorm calls
  ``all_gather``/``all_reduce`` with ``async_op=False`` (``torch.nn.modules._functions``).
* ``torch.distributed._functional_collectives.wait_tensor``: functional collectives and
  DTensor (``redistribute``, the ``ColwiseParallel``/``RowwiseParallel`` styles, sequence
  parallel) return an ``AsyncCollectiveTensor`` whose first use, ``.wait()`` and
  ``trigger_wait()`` call this module-level function; on Gloo the C++ op blocks in it.
* ``monitored_barrier`` (both names): it blocks in C++ without a work object.

Why it is sound: the shadows run the original with the same arguments and return its result
(exceptions pass through, the wait still credited); they time only on the thread that
installed them (the training thread: rankwatch's own Gloo traffic runs on its background
thread) and, while that thread's backward pass is timed, on the autograd engine's device
threads (threads Python did not start: on an accelerator the engine runs the backward there,
and a tensor-parallel gradient collective waits there for the step), never while
``torch.compile`` traces (the check comes first, so the traced graph is what it was), and
never inside a sync wait already open (a collective inside FSDP2's shadowed ``unshard``/
``post_backward``, inside a user's ``rw.sync_wait()`` block, or a wait inside another wait:
counted once), nor inside ``rw.untimed_collectives()`` (control traffic the user says is not
training). Each timer is credited once per wait however many times it was
installed (a second ``watch()``); a second ``RankWatch`` in the process has a timer of its own
and is credited too. The shadows are installed once per process and removed with the last
handle; a later replacement by someone else is left alone.

Not covered: DDP's reducer all-reduce and its buffer broadcast run in C++ (the DDP hooks of
:mod:`.hooks` time those waits); waits inside a compiled region (``wait_tensor`` compiled
into a graph runs as a C++ op; a wait dynamo runs between two graphs runs the shadow as dynamo
traced it, untimed); ``Work.get_future().wait()``, ``torch.futures.wait_all`` and polling
``is_completed()``; a Python ``Work`` subclass whose own ``wait`` does not call the base
class's. Issuing a collective is not a wait and is
not timed (on Gloo it only queues the work), with one exception: a pipeline schedule's sends
and receives, issued in ``_batch_p2p`` (:mod:`.pipeline`), which on Gloo take milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from sys import _getframe
from threading import _DummyThread, current_thread, get_ident
from typing import Any

import torch

from rankwatch.exporter.step_time.hooks import AttributeShadow
from rankwatch.exporter.step_time.timer import StepTimer, _SyncWait

__all__ = [
    "RegistryHandle",
    "ShadowRegistry",
    "collective_wait_targets",
    "install_collective_waits",
    "timed_wait",
]

_is_compiling = torch.compiler.is_compiling


def collective_wait_targets() -> list[tuple[Any, str]]:
    """``(owner, attribute)`` of every place the host waits for a collective (module doc);
    empty without ``torch.distributed``. A target this torch release lacks is skipped."""
    import torch.distributed as dist

    if not dist.is_available():
        return []
    from torch.distributed import distributed_c10d

    targets: list[tuple[Any, str]] = [(dist.Work, "wait")]
    try:
        import torch.distributed._functional_collectives as funcol

        targets.append((funcol, "wait_tensor"))
    except ImportError:  # a build without functional collectives
        pass
    targets += [(dist, "monitored_barrier"), (distributed_c10d, "monitored_barrier")]
    return [(owner, name) for owner, name in targets if callable(getattr(owner, name, None))]


class ShadowRegistry:
    """The process's subscribed timers and the shadows that serve them (installed with the
    first subscription, removed with the last).

    ``targets()`` lists the ``(owner, attribute)`` pairs to shadow; ``shadow(registry,
    original)`` returns what replaces each (reading ``registry.waits`` on every call).
    """

    def __init__(
        self,
        targets: Callable[[], list[tuple[Any, str]]],
        shadow: Callable[[ShadowRegistry, Callable[..., Any]], Callable[..., Any]],
    ) -> None:
        self._targets, self._shadow = targets, shadow
        # (sync wait, training thread) per subscribed timer; a tuple replaced, never mutated,
        # so the hot path reads it without a lock.
        self.waits: tuple[tuple[_SyncWait, int], ...] = ()
        self._counts: dict[int, int] = {}  # id(sync wait) -> subscriptions
        self._shadows: list[AttributeShadow] = []

    def subscribe(self, wait: _SyncWait, thread: int) -> None:
        key = id(wait)
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        if n == 0:
            self.waits = (*self.waits, (wait, thread))
        if not self._shadows:
            self._shadows = [
                AttributeShadow(owner, name, self._wrapped(getattr(owner, name)))
                for owner, name in self._targets()
            ]

    def install(self, timer: StepTimer, api: str) -> list[RegistryHandle]:
        """Subscribe ``timer`` for the calling thread (the training thread); ``api`` names the
        public call in the error for a bad ``timer``."""
        if not isinstance(timer, StepTimer):
            raise TypeError(
                f"{api}: field timer: expected a StepTimer, got {type(timer).__name__} {timer!r}"
            )
        wait = timer.sync_wait()
        self.subscribe(wait, get_ident())
        return [RegistryHandle(self, wait)]

    def unsubscribe(self, wait: _SyncWait) -> None:
        key = id(wait)
        n = self._counts.get(key, 0)
        if n == 0:
            return
        if n > 1:
            self._counts[key] = n - 1
            return
        del self._counts[key]
        self.waits = tuple(w for w in self.waits if w[0] is not wait)
        if not self.waits:
            for shadow in reversed(self._shadows):
                shadow.remove()
            self._shadows = []

    def _wrapped(self, original: Callable[..., Any]) -> Callable[..., Any]:
        shadow = self._shadow(self, original)
        shadow.__wrapped__ = original  # type: ignore[attr-defined]
        shadow.__doc__ = getattr(original, "__doc__", None)
        return shadow


class RegistryHandle:
    """One subscription of a timer to a :class:`ShadowRegistry`; ``remove()`` ends it
    (idempotent), like torch's hook handles."""

    def __init__(self, registry: ShadowRegistry, wait: _SyncWait) -> None:
        self._registry = registry
        self._wait: _SyncWait | None = wait

    def remove(self) -> None:
        if self._wait is not None:
            self._registry.unsubscribe(self._wait)
            self._wait = None


def timed_wait(registry: ShadowRegistry, original: Callable[..., Any]) -> Callable[..., Any]:
    """A collective's wait, credited to each subscribed timer (module doc): what replaces
    ``original`` in a :class:`ShadowRegistry` whose calls are waits."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        # The compile check first: while dynamo traces, nothing else here is looked at.
        if _is_compiling():
            return original(*args, **kwargs)
        waits = registry.waits
        if len(waits) == 1:  # the usual case: one RankWatch in the process
            wait, thread = waits[0]
            if get_ident() != thread and not _backward_worker(wait):
                return original(*args, **kwargs)
            if wait.busy:  # inside a sync wait already open: counted there
                try:
                    result = original(*args, **kwargs)
                except BaseException:
                    # The open wait's own exit sees only its caller's frame: the hang watcher
                    # reads the failed call here, while its frame is still on the stack.
                    failed = wait.timer.on_wait_error
                    if failed is not None:
                        failed(_getframe())
                    raise
            else:
                with wait:
                    result = original(*args, **kwargs)
            # The call finished: the hang watcher notes which (it reads the caller's frame).
            done = wait.timer.on_wait_done
            if done is not None:
                done(_getframe())
            return result
        return _timed_by_each(waits, original, args, kwargs)

    return timed


def _timed_by_each(
    waits: tuple[tuple[_SyncWait, int], ...],
    original: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Several timers (several ``RankWatch`` in the process), or none left: each timer of this
    thread whose sync wait is not already open is credited once."""
    me = get_ident()
    mine = [wait for wait, thread in waits if thread == me or _backward_worker(wait)]
    entered = [wait for wait in mine if not wait.busy]
    for wait in entered:
        wait.__enter__()
    try:
        result = original(*args, **kwargs)
    except BaseException as exc:
        for wait in reversed(entered):
            wait.__exit__(type(exc), exc, exc.__traceback__)
        for wait in mine:
            failed = wait.timer.on_wait_error
            if failed is not None and wait not in entered:
                failed(_getframe(1))
        raise
    for wait in reversed(entered):
        wait.__exit__(None, None, None)
    shadow = _getframe(1)  # the shadow's frame: its caller issued the call
    for wait in mine:
        done = wait.timer.on_wait_done
        if done is not None:
            done(shadow)
    return result


def _backward_worker(wait: _SyncWait) -> bool:
    """Called off the training thread: is this the autograd engine's device thread running
    the timed backward pass? On an accelerator the engine runs a backward on a thread of its
    own (a thread Python did not start), and a collective in it (a tensor-parallel layer's
    gradient all-reduce) is a wait of the training step; any thread Python started
    (rankwatch's own, a loader's) is not."""
    return wait.in_backward and isinstance(current_thread(), _DummyThread)


_REGISTRY = ShadowRegistry(collective_wait_targets, timed_wait)


def install_collective_waits(timer: StepTimer) -> list[RegistryHandle]:
    """Time every wait of the calling thread (the training thread) for a collective as a sync
    wait of ``timer`` (see the module docstring for where and what is not covered).

    Returns the handles (``remove()`` undoes it). Installing again for the same timer credits
    each wait once; the shadows stay until the last handle of the process is removed.
    """
    return _REGISTRY.install(timer, "install_collective_waits")

"""Framework integrations: one-line callbacks for the Hugging Face Trainer and Lightning.

``rankwatch.exporter.integrations.transformers.RankwatchCallback`` and
``rankwatch.exporter.integrations.lightning.RankwatchCallback`` start rankwatch when training
starts, watch what the framework trains with, and close rankwatch when training ends. Each
module imports its framework; nothing else in rankwatch does, so the core runs without them
(``pip install rankwatch[transformers]`` / ``rankwatch[lightning]``).

This package holds what both share: how the ``RankWatch`` is made, how wrapped optimizers are
unwrapped, how a loader that a framework already holds is made to time its fetches, and how a
framework's own collective is timed as a sync wait.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rankwatch.exporter.step_time.device_mesh import check_mesh_type
from rankwatch.exporter.step_time.hooks import time_as_sync_wait

if TYPE_CHECKING:
    from rankwatch.exporter.step_time.rank_watch import RankWatch

__all__ = [
    "RankwatchStarter",
    "in_sync_wait",
    "undo_in_reverse",
    "unwrap_optimizer",
    "watch_loader_in_place",
]

# Optimizer wrappers keep the real optimizer under one of these attributes:
# Accelerate's AcceleratedOptimizer (``optimizer``), Lightning's LightningOptimizer
# (``_optimizer``), DeepSpeed's and Accelerate's DeepSpeed wrappers (``optimizer``).
_WRAPPED_OPTIMIZER_ATTRS = ("optimizer", "_optimizer")


class RankwatchStarter:
    """What both callbacks share: make the ``RankWatch`` when training starts, close it at the
    end.

    ``rankwatch``: a function returning the ``RankWatch`` to use (called when each training
    run starts); default :func:`rankwatch.exporter.init` with ``overrides`` (e.g.
    ``metrics_port=9500``, ``on_incident=...``). ``mesh``: the job's device mesh, passed to
    ``watch(..., mesh=)`` (a ``DeviceMesh``, dimension sizes such as ``{"pp": 2, "dp": 2}``;
    without it, the mesh of the model's DTensor parameters, if any); a value of another type
    is refused here, one that does not fit the group when training starts.
    ``close_timeout_seconds`` bounds the close.
    The attribute ``rankwatch`` is the ``RankWatch`` of the latest run (still there, closed,
    after it).
    """

    def __init__(
        self,
        rankwatch: Callable[[], RankWatch] | None = None,
        *,
        close_timeout_seconds: float = 5.0,
        mesh: Any = None,
        **overrides: Any,
    ) -> None:
        check_mesh_type(mesh, "RankwatchCallback")
        if rankwatch is not None and not callable(rankwatch):
            raise TypeError(
                f"RankwatchCallback: field rankwatch: expected a function returning a "
                f"RankWatch, got {rankwatch!r}"
            )
        if rankwatch is not None and overrides:
            raise ValueError(
                f"RankwatchCallback: overrides {sorted(overrides)} apply to init() only, not "
                "to the RankWatch your rankwatch= function makes"
            )
        self._factory = rankwatch
        self._overrides = overrides
        self._close_timeout_seconds = close_timeout_seconds
        self.mesh = mesh
        self.rankwatch: RankWatch | None = None

    def _start_rankwatch(self) -> RankWatch:
        """Make the run's ``RankWatch``. Called when training starts, after the framework has
        initialised ``torch.distributed``: construction is collective, and every rank starts
        training together."""
        if self._factory is not None:
            self.rankwatch = self._factory()
        else:
            from rankwatch.exporter import init

            self.rankwatch = init(**self._overrides)
        return self.rankwatch

    def _close_rankwatch(self) -> None:
        if self.rankwatch is not None:  # kept after closing: ``latest_report`` stays readable
            self.rankwatch.close(self._close_timeout_seconds)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` inside framework wrappers, or None if there is none.

    The innermost one is returned: its ``step()`` is the update itself, and its step hooks run
    only when the wrapper really steps (Accelerate skips it while accumulating gradients, or
    when a gradient scaler found infs).
    """
    import torch

    seen: set[int] = set()
    current = optimizer
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        inner = next(
            (
                getattr(current, a)
                for a in _WRAPPED_OPTIMIZER_ATTRS
                if getattr(current, a, None) is not None and getattr(current, a) is not current
            ),
            None,
        )
        if inner is None:
            break
        current = inner
    return current if isinstance(current, torch.optim.Optimizer) else None


def in_sync_wait(rw: RankWatch, owner: Any, name: str) -> Callable[[], None]:
    """Shadow ``owner.<name>`` (an object's method, or a module's function) with a version run
    inside ``rw.sync_wait()``; returns the undo, which leaves a later replacement alone.

    For a framework's collectives outside the model (a loss all-reduce, a flag broadcast): the
    ranks that get there early wait for the late one, and the wait joins ``forward_wait``.
    Calls from other threads, and calls inside an open sync wait (one collective calling
    another), run as they are (:func:`~rankwatch.exporter.step_time.hooks.time_as_sync_wait`).
    A disabled RankWatch times nothing and shadows nothing.
    """
    if rw.timer is None:
        return lambda: None
    return time_as_sync_wait(rw.timer, owner, name).remove


def undo_in_reverse(undos: list[Callable[[], None]]) -> Callable[[], None]:
    """One undo for several: runs them last first (the latest shadow comes off first), once."""

    def undo_all() -> None:
        while undos:
            undos.pop()()

    return undo_all


class _OriginalIteration:
    """Iterates ``loader`` as its own class does (the patched class's parent)."""

    def __init__(self, loader: Any, cls: Any) -> None:
        self.loader, self.cls = loader, cls

    def __iter__(self) -> Iterator[Any]:
        it: Iterator[Any] = self.cls.__iter__(self.loader)
        return it

    def __len__(self) -> int:
        return len(self.loader)


def _set_type(obj: Any, cls: type) -> None:
    # Accelerate's loader adapters make ``__class__`` a read-only property (so that they pass
    # for a torch DataLoader); object's own descriptor still changes the real type.
    object.__dict__["__class__"].__set__(obj, cls)


def watch_loader_in_place(rw: RankWatch, loader: Any) -> Callable[[], None]:
    """Make iterating ``loader`` (the very object the framework iterates) time each fetch.

    A framework that builds its loader itself (the Trainer's Accelerate ``DataLoaderShard``)
    iterates it from a local variable, so handing back a wrapped loader (what
    ``RankWatch.watch`` returns) is not enough. Instead ``loader`` becomes an instance of a
    subclass of its own class whose ``__iter__`` goes through the wrapper ``watch`` returns:
    every ``next()`` the training loop waits on is timed as ``input_wait`` and opens the step.
    ``isinstance`` checks, attributes and ``len()`` stay as they were. The batch is not moved
    (the framework moves it itself), so no ``h2d`` is timed.

    Returns the function that restores the original class.
    """
    if not rw.active:
        return lambda: None
    original = type(loader)
    watched = rw.watch(None, None, _OriginalIteration(loader, original))

    def __iter__(self: Any) -> Iterator[Any]:
        return iter(watched)

    namespace = {"__iter__": __iter__, "__module__": original.__module__}
    patched = type(original.__name__, (original,), namespace)
    _set_type(loader, patched)

    def restore() -> None:
        if type(loader) is patched:
            _set_type(loader, original)

    return restore

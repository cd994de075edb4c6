"""Automatic step timing: hooks on the model and the optimizer, a wrapper around the loader.

``install(timer, model, optimizers)`` and :class:`WatchedLoader` produce the same rows as the
explicit ``step()``/``phase()`` calls, from PyTorch's public hook points only (nothing of torch
is replaced):

* the loader wrapper's ``__next__`` times ``input_wait`` (fetching the batch) and ``h2d``
  (moving it to the model's device) and opens the step if none is open, so the step's bracket
  starts where an explicit ``with step():`` around the fetch would start it;
* forward pre/post hooks on the top module time ``forward``, wrapped around any hooks a
  wrapper installed (FSDP's parameter all-gather runs in a pre hook);
* ``backward`` starts when the gradient of the module's output is computed (a tensor hook
  registered by the forward post hook) and ends in an autograd *final callback* queued twice:
  DDP and FSDP queue their own final callbacks (gradient reduction, waits on the reduction)
  while the backward pass runs, and a callback queued from a callback runs after all of them,
  so ``backward`` includes the reduction wait exactly as the wall time of ``loss.backward()``
  does;
* optimizer step pre/post hooks time ``optimizer``; the post hook of the last optimizer closes
  a step that a hook opened (a step opened by ``step()`` is closed by its ``with`` block).

The training strategy is read from the wrapper type: ``DistributedDataParallel`` is ``ddp``,
FSDP (``FullyShardedDataParallel`` or a module managed by ``fully_shard``) is ``fsdp``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .timer import BACKWARD, FORWARD, H2D, INPUT_WAIT, OPTIMIZER, StepTimer

__all__ = [
    "WatchedLoader",
    "detect_strategy",
    "install",
    "model_device",
    "move_to_device",
]


def detect_strategy(model: torch.nn.Module) -> str | None:
    """``"ddp"``/``"fsdp"`` from the wrapper around ``model``, or None for a plain module."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "ddp"
    fsdp_types: list[type] = []
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        fsdp_types.append(FullyShardedDataParallel)
    except ImportError:  # torch built without distributed
        pass
    try:
        from torch.distributed.fsdp import FSDPModule

        fsdp_types.append(FSDPModule)
    except ImportError:  # FSDP2 arrived in later releases
        pass
    if fsdp_types:
        kinds = tuple(fsdp_types)
        if any(isinstance(m, kinds) for m in model.modules()):
            return "fsdp"
    return None


def model_device(model: torch.nn.Module) -> torch.device | None:
    """Device of the model's first parameter (or buffer); None if it has neither."""
    for param in model.parameters():
        return param.device
    for buf in model.buffers():
        return buf.device
    return None


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor moved to ``device``: tensors, tuples (named too), lists,
    mappings, and any object with a ``to(device, non_blocking=...)`` method; the rest as is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, tuple):
        moved = [move_to_device(x, device, non_blocking) for x in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else tuple(moved)
    if isinstance(batch, list):
        return [move_to_device(x, device, non_blocking) for x in batch]
    if isinstance(batch, Mapping):
        return {k: move_to_device(v, device, non_blocking) for k, v in batch.items()}
    to = getattr(batch, "to", None)
    if callable(to):
        try:
            return to(device, non_blocking=non_blocking)
        except TypeError:  # a ``to`` without the keyword
            return to(device)
    return batch


class _WatchedIterator:
    """Iterator over a watched loader: times the fetch and the transfer of every batch."""

    __slots__ = ("_device", "_it", "_non_blocking", "_timer")

    def __init__(
        self, it: Iterator[Any], timer: StepTimer, device: torch.device | None, non_blocking: bool
    ) -> None:
        self._it = it
        self._timer = timer
        self._device = device
        self._non_blocking = non_blocking

    def __iter__(self) -> _WatchedIterator:
        return self

    def __next__(self) -> Any:
        timer = self._timer
        opened = False
        if not timer.in_step:
            timer.start_step(auto=True)
            opened = True
        timer.begin(INPUT_WAIT)
        try:
            batch = next(self._it)
        except BaseException:
            timer.end(INPUT_WAIT)
            if opened:  # the loader ran out (or failed): no step happened
                timer.abort_step()
            raise
        timer.end(INPUT_WAIT)
        if self._device is not None:
            timer.begin(H2D)
            batch = move_to_device(batch, self._device, self._non_blocking)
            timer.end(H2D)
        return batch


class WatchedLoader:
    """Wraps a data loader (any iterable): iterating it times ``input_wait`` and ``h2d``.

    Everything else (``len()``, ``.dataset``, ``.sampler.set_epoch``...) is the wrapped
    loader's. ``device=None`` leaves batches where they are and times no ``h2d``.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        timer: StepTimer,
        device: torch.device | None = None,
        non_blocking: bool | None = None,
    ) -> None:
        if not isinstance(loader, Iterable):
            raise TypeError(f"watch: field dataloader: expected an iterable, got {loader!r}")
        self.loader = loader
        self._timer = timer
        self.device = device
        # Non-blocking copies only make sense towards an accelerator.
        self._non_blocking = (
            (device is not None and device.type != "cpu") if non_blocking is None else non_blocking
        )

    def __iter__(self) -> _WatchedIterator:
        return _WatchedIterator(iter(self.loader), self._timer, self.device, self._non_blocking)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes this wrapper lacks: the loader's own API stays reachable.
        return getattr(self.__dict__["loader"], name)


class _BackwardTracker:
    """Opens ``backward`` at the first output gradient of a backward pass, closes it at the
    very end of the pass (after DDP/FSDP final callbacks)."""

    def __init__(self, timer: StepTimer) -> None:
        self._timer = timer
        self._active = False
        self._engine = torch.autograd.Variable._execution_engine

    def on_output_grad(self, grad: torch.Tensor) -> None:
        if self._active:
            return
        self._active = True
        self._timer.begin(BACKWARD)
        self._engine.queue_callback(self._requeue)

    def _requeue(self) -> None:
        # Runs among the final callbacks; queue once more to run after every callback that
        # DDP/FSDP queued during the pass (the engine runs callbacks added while it runs them).
        self._engine.queue_callback(self._finish)

    def _finish(self) -> None:
        self._active = False
        self._timer.end(BACKWARD)

    def watch_output(self, output: Any) -> None:
        """Register the gradient hook on every tensor of ``output`` that needs a gradient.

        Called after each forward, when no backward pass of this model is running: a pass
        that failed before its final callbacks ran must not keep the next one from timing.
        """
        self._active = False
        if isinstance(output, torch.Tensor):  # the common case, without the generator
            if output.requires_grad:
                output.register_hook(self.on_output_grad)
            return
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(self.on_output_grad)


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4:  # model outputs are shallow; do not walk arbitrary object graphs
        if isinstance(value, (tuple, list)):
            for v in value:
                yield from _tensors(v, depth + 1)
        elif isinstance(value, Mapping):
            for v in value.values():
                yield from _tensors(v, depth + 1)


def install(
    timer: StepTimer,
    model: torch.nn.Module | None,
    optimizers: Sequence[torch.optim.Optimizer],
) -> list[RemovableHandle]:
    """Install the model and optimizer hooks; returns the handles (``remove()`` undoes them)."""
    handles: list[RemovableHandle] = []
    if model is not None:
        tracker = _BackwardTracker(timer)

        def forward_pre(module: torch.nn.Module, args: Any) -> None:
            if not timer.in_step:
                # A forward outside any step is evaluation or inference: not a training step.
                if not (module.training and torch.is_grad_enabled()):
                    return
                timer.start_step(auto=True)
            timer.begin(FORWARD)

        def forward_post(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not timer.phase_open(FORWARD):
                return
            timer.end(FORWARD)
            if torch.is_grad_enabled():
                tracker.watch_output(output)

        # First of the pre hooks, last of the post hooks: the FSDP all-gather (its own pre
        # hook) and any wait in it belong to forward, as they do to the wall time of model(x).
        handles.append(model.register_forward_pre_hook(forward_pre, prepend=True))
        handles.append(model.register_forward_hook(forward_post, always_call=True))
    for k, opt in enumerate(optimizers):
        pre, post = _optimizer_hooks(timer, closes_step=k == len(optimizers) - 1)
        handles.append(opt.register_step_pre_hook(pre))
        handles.append(opt.register_step_post_hook(post))
    return handles


def _optimizer_hooks(
    timer: StepTimer, closes_step: bool
) -> tuple[Callable[..., None], Callable[..., None]]:
    """Pre/post step hooks that time the outermost ``step()`` only.

    A subclass whose ``step`` calls ``super().step()`` runs the instance's hooks twice, nested
    (torch wraps both methods once the base class has been instantiated); timing the inner
    call would drop the subclass's own work from the optimizer phase.
    """
    depth = [0]

    def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        depth[0] += 1
        if depth[0] == 1:
            timer.begin(OPTIMIZER)

    def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        depth[0] = max(0, depth[0] - 1)
        if depth[0]:
            return
        timer.end(OPTIMIZER)
        if closes_step and timer.auto_step:
            timer.end_step()

    return pre, post

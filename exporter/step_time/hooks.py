"""Automatic step timing: hooks on the model and the optimizer, a wrapper around the loader.

``install(timer, model, optimizers)`` and :class:`WatchedLoader` produce the same rows as the
explicit ``step()``/``phase()`` calls, from PyTorch's public hook points only (nothing of torch
is replaced):

* the loader wrapper's ``__next__`` times ``input_wait`` (fetching the batch) and ``h2d``
  (moving it to the model's device, the batch keeping its type). On the training thread a
  fetch closes the step a hook opened and opens the next: a step runs from one fetch to the
  next, so work after the optimizer (logging, checkpointing) is in it, as residual. A fetch
  on another thread (a prefetching producer) is not timed, and one warning says so;
* forward pre/post hooks on the top module time ``forward``, wrapped around any hooks a
  wrapper installed (FSDP's parameter all-gather runs in a pre hook);
* ``backward`` starts when the gradient of the module's output is computed (a pre hook on
  the output's autograd node, registered by the forward post hook) and ends in an autograd
  *final callback*. Under DDP and FSDP it is queued twice: they queue their own final
  callbacks (gradient reduction, waits on the reduction) while the backward pass runs, and a
  callback queued from a callback runs after all of them, so ``backward`` includes the
  reduction wait exactly as the wall time of ``loss.backward()`` does;
* under DDP, the waits at the synchronisation points: ``forward_wait`` (the wrapper's forward
  outside its module's: the buffer broadcast) and ``backward_wait`` (from the last parameter
  gradient, seen by post-accumulate-grad hooks, to the end of backward); under FSDP2
  (``fully_shard``) on collectives that block the host (Gloo on the CPU), each unit's
  parameter all-gather and gradient reduce-scatter, as ``forward_wait``/``backward_wait``;
* optimizer step pre/post hooks time ``optimizer``; without a watched loader the post hook of
  the last optimizer closes a step that a hook opened (a step opened by ``step()`` is closed
  by its ``with`` block).

Every hook returns at once while ``torch.compile`` traces (``torch.compiler.is_compiling()``),
so nothing of rankwatch enters a compiled graph and ``fullgraph=True`` keeps working. A
compiled DDP model (``torch.compile(ddp_model)``) has its waits timed on DDP's own pre- and
post-forward methods instead of its module's hooks, which run inside the graph
(:func:`_compiled_ddp_wait_hooks`). Every other collective wait of the training thread is
timed by :mod:`.collectives`.

The training strategy is read from the wrapper type, inside a ``torch.compile`` wrapper too:
``DistributedDataParallel`` is ``ddp``, FSDP (``FullyShardedDataParallel`` or a module managed
by ``fully_shard``) is ``fsdp``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from threading import get_ident
from typing import Any, cast

import torch
from torch.utils.hooks import RemovableHandle

from rankwatch.exporter.step_time.timer import (
    BACKWARD,
    BACKWARD_WAIT,
    FORWARD,
    FORWARD_WAIT,
    H2D,
    INPUT_WAIT,
    OPTIMIZER,
    StepTimer,
    _SyncWait,
)

__all__ = [
    "AttributeShadow",
    "WatchedLoader",
    "compiled_inner",
    "detect_strategy",
    "fsdp_param_groups",
    "install",
    "model_device",
    "move_to_device",
    "open_training_step",
    "time_as_sync_wait",
    "unwrap_optimizer",
]

log = logging.getLogger(__name__)
_is_compiling = torch.compiler.is_compiling


def compiled_inner(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module ``torch.compile`` wrapped (``OptimizedModule._orig_mod``), or None when
    ``model`` is not such a wrapper."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None


def detect_strategy(model: torch.nn.Module) -> str | None:
    """``"ddp"``/``"fsdp"`` from the wrapper around ``model`` (looked for inside a
    ``torch.compile`` wrapper too), or None for a plain module."""
    from torch.nn.parallel import DistributedDataParallel

    model = compiled_inner(model) or model
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
    """The one device of the model's parameters and buffers; None if it has neither.

    A model spread over several devices is refused (``ValueError`` naming them): the batch's
    transfer target and the GPU clock's stream would be a guess.
    """
    devices: dict[torch.device, None] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type != "meta":
            devices.setdefault(tensor.device)
    if len(devices) > 1:
        names = ", ".join(str(d) for d in devices)
        raise ValueError(
            f"watch: field model: parameters and buffers are on several devices ({names}); "
            "rankwatch times one device per process: watch a single-device model, or time "
            "the steps with step()/phase()"
        )
    return next(iter(devices), None)


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor moved to ``device``: tensors, tuples (named too), lists,
    mappings, and any object with a ``to(device, non_blocking=...)`` method; the rest as is.

    A batch whose tensors are all on ``device`` already is returned itself (same object, same
    type): on a CPU model the common batch costs a few device comparisons, not a rebuilt batch
    and a no-op ``.to()`` per tensor.
    """
    if _on_device(batch, device):
        return batch
    return _moved(batch, device, non_blocking)


def _on_device(batch: Any, device: torch.device, depth: int = 0) -> bool:
    """Every tensor of ``batch`` is on ``device`` (an object with its own ``to`` is not
    looked into: it decides for itself)."""
    if isinstance(batch, torch.Tensor):
        return batch.device == device
    if depth > 4:  # batches are shallow; do not walk arbitrary object graphs
        return False
    if isinstance(batch, (tuple, list, dict)):
        # A loop, not all(<generator>), and tensors checked in place, not by a call each:
        # this runs on every batch, inside the training loop.
        for x in batch.values() if isinstance(batch, dict) else batch:
            if isinstance(x, torch.Tensor):
                if x.device != device:
                    return False
            elif not _on_device(x, device, depth + 1):
                return False
        return True
    return not callable(getattr(batch, "to", None)) and not isinstance(batch, Mapping)


def _moved(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, tuple):
        moved = [_moved(x, device, non_blocking) for x in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else tuple(moved)
    if isinstance(batch, list):
        return [_moved(x, device, non_blocking) for x in batch]
    to = getattr(batch, "to", None)
    if callable(to) and not isinstance(batch, dict):
        # Its own ``to`` keeps the batch's type (a tokenizer's BatchEncoding is a Mapping).
        try:
            return to(device, non_blocking=non_blocking)
        except TypeError:  # a ``to`` without the keyword
            return to(device)
    if isinstance(batch, Mapping):
        items = {k: _moved(v, device, non_blocking) for k, v in batch.items()}
        if type(batch) is dict:
            return items
        try:  # a Mapping subclass keeps its type when it can be built from a dict
            return type(batch)(items)  # type: ignore[call-arg]
        except Exception:
            return items
    return batch


# Fetched batches after which a watched optimizer that never stepped earns a warning (the
# default of ``RankwatchConfig.optimizer_silent_batches``).
OPTIMIZER_SILENT_BATCHES = 50


class _WatchedIterator:
    """Iterator over a watched loader: times the fetch and the transfer of every batch.

    On the training thread a fetch also closes the step a hook opened (a step runs from one
    fetch to the next) and opens the next one. Fetched on any other thread (a prefetching
    pipeline) it times nothing: the producer's fetch is not what training waits for.
    """

    __slots__ = ("_device", "_it", "_loader", "_non_blocking", "_timer")

    def __init__(self, it: Iterator[Any], loader: WatchedLoader) -> None:
        self._it = it
        self._loader = loader
        self._timer = loader._timer
        self._device = loader.device
        self._non_blocking = loader._non_blocking

    def __iter__(self) -> _WatchedIterator:
        return self

    def __next__(self) -> Any:
        timer = self._timer
        if get_ident() != self._loader.training_thread:
            batch = self._loader._untimed(self._it)
            timer.first_fetch = False  # the loader has started (a prefetching producer)
            return batch
        timer.loader_steps = True
        # The previous batch's step ends where this fetch starts. A batch the loop skipped
        # (no forward) stays in the open step, as its input wait.
        opened = timer.turn_step()
        timer.begin(INPUT_WAIT)
        try:
            batch = next(self._it)
        except BaseException:
            timer.end(INPUT_WAIT)
            if opened:  # the loader ran out (or failed): no step happened
                timer.abort_step()
            raise
        timer.end(INPUT_WAIT)
        timer.first_fetch = False
        if self._device is not None:
            timer.begin(H2D)
            batch = move_to_device(batch, self._device, self._non_blocking)
            timer.end(H2D)
        self._loader._fetched += 1
        if self._loader._fetched == self._loader.optimizer_silent_batches:
            self._loader._check_optimizer()
        return batch


class WatchedLoader:
    """Wraps a data loader (any iterable): iterating it times ``input_wait`` and ``h2d``.

    Everything else (``len()``, ``.dataset``, ``.sampler.set_epoch``...) is the wrapped
    loader's. ``device=None`` leaves batches where they are and times no ``h2d``.
    ``training_thread`` is the thread that trains (default: the one creating the wrapper);
    iterated on another thread, the loader is a prefetching pipeline's producer and is not
    timed (one warning says so).
    """

    def __init__(
        self,
        loader: Iterable[Any],
        timer: StepTimer,
        device: torch.device | None = None,
        non_blocking: bool | None = None,
        *,
        training_thread: int | None = None,
        optimizers_watched: bool = False,
        optimizer_silent_batches: int = OPTIMIZER_SILENT_BATCHES,
    ) -> None:
        if not isinstance(loader, Iterable):
            raise TypeError(f"watch: field dataloader: expected an iterable, got {loader!r}")
        self.loader = loader
        self._timer = timer
        self.device = device
        self.training_thread = get_ident() if training_thread is None else training_thread
        self._optimizers_watched = optimizers_watched
        self.optimizer_silent_batches = optimizer_silent_batches
        self._fetched = 0
        self._warned_thread = False
        # Non-blocking copies only make sense towards an accelerator.
        self._non_blocking = (
            (device is not None and device.type != "cpu") if non_blocking is None else non_blocking
        )

    def __iter__(self) -> _WatchedIterator:
        # An epoch's first batch waits for the loader's workers to start: the hang watcher
        # gives it the warm-up budget.
        self._timer.first_fetch = True
        return _WatchedIterator(iter(self.loader), self)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes this wrapper lacks: the loader's own API stays reachable.
        return getattr(self.__dict__["loader"], name)

    def _untimed(self, it: Iterator[Any]) -> Any:
        if not self._warned_thread:
            self._warned_thread = True
            log.warning(
                "rankwatch: the watched loader is iterated on another thread than training "
                "(a prefetching pipeline?): input wait is not timed there, since the producer's "
                "fetch is not what training waits for. Watch the loader the training loop "
                "iterates (the queue's consumer) to time input wait."
            )
        batch = next(it)
        if self.device is not None:
            batch = move_to_device(batch, self.device, self._non_blocking)
        return batch

    def _check_optimizer(self) -> None:
        if self._optimizers_watched and self._timer.optimizer_steps == 0:
            log.warning(
                "rankwatch: %d batches fetched and the watched optimizer has not stepped: "
                "is the optimizer passed to watch() the one that steps (not a copy, not a "
                "second optimizer left out)? Steps still close at each fetch.",
                self.optimizer_silent_batches,
            )


class _BackwardTracker:
    """Opens ``backward`` at the first output gradient of a backward pass, closes it at the
    very end of the pass (after DDP/FSDP final callbacks).

    Where it watches the parameters (every model but FSDP's, whose collectives are timed where
    they run) it also credits ``backward_wait``: from the last local gradient (the last
    post-accumulate-grad hook of a parameter) to that end, the wait for the last gradient
    reduction and a wrapper's end-of-backward work (DDP's, or that of a wrapper a framework
    holds around the watched module), less the waits already credited in that stretch (a
    collective timed inside it is counted once).

    The end is a callback queued from a callback: a wrapper (DDP, FSDP) queues its own final
    callbacks during the pass, and a model that looks plain may be the inner module of a
    wrapper the framework holds (a Trainer watches its unwrapped model), so one callback
    would close backward before DDP's end-of-backward wait.
    """

    def __init__(self, timer: StepTimer) -> None:
        self._timer = timer
        self._active = False
        self._engine = torch.autograd.Variable._execution_engine
        self._clock = timer._clock
        self.last_grad_ns = -1
        self.waited_at_last_grad_ms = 0.0  # backward_wait credited when the last gradient came

    def on_output_grad(self, *grads: Any) -> None:
        # A pre hook of the output's autograd node (or, for an output without one, a tensor
        # hook): called when the output's gradient exists, i.e. when backward reaches it.
        if self._active:
            return
        self._active = True
        self.last_grad_ns = -1
        self._timer.begin(BACKWARD)
        self._engine.queue_callback(self._requeue)

    def on_param_grad(self, param: torch.Tensor) -> None:
        # One clock read per parameter per backward: the last one wins.
        timer = self._timer
        self.last_grad_ns = timer.last_grad(param)
        self.waited_at_last_grad_ms = timer.credited_ms(BACKWARD_WAIT)

    def _requeue(self) -> None:
        # Runs among the final callbacks; queue once more to run after every callback that
        # DDP/FSDP queued during the pass (the engine runs callbacks added while it runs them).
        self._engine.queue_callback(self._finish)

    def _finish(self) -> None:
        self._active = False
        last = self.last_grad_ns
        if last >= 0:
            timer = self._timer
            # Waits timed as sync waits after the last gradient are in the row already.
            since_ms = timer.credited_ms(BACKWARD_WAIT) - self.waited_at_last_grad_ms
            timer.add_backward_wait(max(0, self._clock() - last - int(since_ms * 1e6)))
            self.last_grad_ns = -1
        self._timer.end(BACKWARD)

    def watch_output(self, output: Any) -> None:
        """Hook the gradient of every tensor of ``output`` that needs a gradient.

        Called after each forward, when no backward pass of this model is running: a pass
        that failed before its final callbacks ran must not keep the next one from timing.
        The hook goes on the tensor's autograd node (``grad_fn.register_prehook``): the same
        moment as a tensor hook, at a quarter of the cost of ``Tensor.register_hook`` (its
        Python bookkeeping is what this saves, once per forward).
        """
        self._active = False
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:  # the common case
            output.grad_fn.register_prehook(self.on_output_grad)
            return
        for tensor in _tensors(output):
            self._hook(tensor)

    def _hook(self, tensor: torch.Tensor) -> None:
        node = tensor.grad_fn
        if node is not None:
            node.register_prehook(self.on_output_grad)
        elif tensor.requires_grad:  # a leaf returned as the output
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


def unwrap_optimizer(obj: Any) -> torch.optim.Optimizer | None:
    """The ``torch.optim.Optimizer`` of ``obj``: itself, or found through a chain of
    ``.optimizer`` attributes (framework wrappers: accelerate, Lightning, ...); else None."""
    for _ in range(8):
        if isinstance(obj, torch.optim.Optimizer):
            return obj
        obj = getattr(obj, "optimizer", None)
        if obj is None:
            return None
    return None


def install(
    timer: StepTimer,
    model: torch.nn.Module | None,
    optimizers: Sequence[torch.optim.Optimizer],
) -> list[RemovableHandle | AttributeShadow]:
    """Install the model and optimizer hooks; returns the handles (``remove()`` undoes them).

    Under DDP the waits at the synchronisation points are timed too: ``forward_wait`` is the
    DDP wrapper's forward outside its module's (the buffer broadcast), ``backward_wait`` the
    trailing wait of backward; under FSDP2 with collectives that block the host, each unit's
    all-gather and reduce-scatter (:func:`_fsdp_wait_hooks`). Every hook returns at once
    while ``torch.compile`` traces it: nothing of rankwatch enters a compiled graph.
    """
    handles: list[RemovableHandle | AttributeShadow] = []
    forward_seen = [model is None]  # (a model's forward hook ran outside a compiled graph)
    if model is not None:
        tracker = _BackwardTracker(timer)
        inner = _ddp_inner(model)
        sync = inner is not None
        # ``torch.compile(ddp_model)``: the hooks on the compiled wrapper run eagerly, DDP's
        # module's run inside the graph (no-ops), so its waits are timed differently.
        compiled = compiled_inner(model)
        compiled_ddp = compiled if compiled is not None and _ddp_inner(compiled) else None
        fsdp = inner is None and compiled_ddp is None and detect_strategy(model) == "fsdp"
        # The waits are columns of every step that ran a forward (0 when none was timed),
        # except under FSDP, whose own calls time them.
        zero_wait = not sync and not fsdp

        def forward_pre(module: torch.nn.Module, args: Any) -> None:
            if _is_compiling():
                return
            forward_seen[0] = True
            if not timer.in_step and not open_training_step(timer, module.training):
                return
            timer.begin(FORWARD)
            if sync:
                timer.begin(FORWARD_WAIT)
            elif zero_wait:
                timer.add(FORWARD_WAIT, 0)  # timed, even when no wait is credited below

        def forward_post(module: torch.nn.Module, args: Any, output: Any) -> None:
            if _is_compiling():
                return
            if sync:  # (open only inside an open forward)
                timer.end(FORWARD_WAIT)
            # A forward that did not open the phase (evaluation outside a step) ends nothing,
            # but is progress for the hang watcher.
            timer.marks += 1
            if timer.end(FORWARD) and torch.is_grad_enabled():
                tracker.watch_output(output)

        # First of the pre hooks, last of the post hooks: the FSDP all-gather (its own pre
        # hook) and any wait in it belong to forward, as they do to the wall time of model(x).
        handles.append(model.register_forward_pre_hook(forward_pre, prepend=True))
        handles.append(model.register_forward_hook(forward_post, always_call=True))
        if inner is not None:
            handles.extend(_sync_wait_hooks(timer, tracker, inner))
            handles.extend(_late_compiled_ddp_shadows(timer, tracker, model, forward_seen))
        elif compiled_ddp is not None:
            handles.extend(_compiled_ddp_wait_hooks(timer, tracker, compiled_ddp))
        elif fsdp:
            if not timer.async_collectives:
                handles.extend(_fsdp_wait_hooks(timer, model))
        else:
            # A plain module: a pipeline stage, a tensor-parallel model, a module whose
            # wrapper a framework holds. Its collectives are timed where they wait
            # (:mod:`.collectives`); the trailing wait of its backward is timed here.
            handles.extend(_last_grad_hooks(tracker, model))

    def check_forward_seen() -> None:
        if not forward_seen[0]:
            log.warning(
                "rankwatch: %d optimizer steps and the watched model's forward never ran "
                "outside a compiled graph: was it compiled after watch()? Its hooks then run "
                "inside the graph and time nothing (forward, backward and the waits stay "
                "absent). Watch the module the loop calls: watch(torch.compile(model)).",
                OPTIMIZER_SILENT_BATCHES,
            )

    for k, opt in enumerate(optimizers):
        last = k == len(optimizers) - 1
        pre, post = _optimizer_hooks(timer, last, check_forward_seen if last else None)
        handles.append(opt.register_step_pre_hook(pre))
        handles.append(opt.register_step_post_hook(post))
    return handles


def _ddp_inner(model: torch.nn.Module) -> torch.nn.Module | None:
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.module
    return None


def _sync_wait_hooks(
    timer: StepTimer, tracker: _BackwardTracker, inner: torch.nn.Module
) -> list[RemovableHandle]:
    """Hooks on DDP's module that split the waits out of forward and backward.

    ``forward_wait`` runs from the wrapper's pre hook to the module's first pre hook, and from
    the module's first post hook to the wrapper's post hook: DDP's pre-forward work (buffer
    broadcast, a collective that waits for the slowest rank) and post-forward work.
    ``backward_wait`` starts at the last parameter gradient accumulated (a post-accumulate
    hook per parameter, registered once: one clock read per parameter per backward).
    """

    def inner_pre(module: torch.nn.Module, args: Any) -> None:
        if not _is_compiling():
            timer.end(FORWARD_WAIT)

    def inner_post(module: torch.nn.Module, args: Any, output: Any) -> None:
        if not _is_compiling() and timer.phase_open(FORWARD):
            timer.begin(FORWARD_WAIT)

    handles = [
        inner.register_forward_pre_hook(inner_pre, prepend=True),
        inner.register_forward_hook(inner_post, prepend=True),
    ]
    return handles + _last_grad_hooks(tracker, inner)


def _last_grad_hooks(tracker: _BackwardTracker, module: torch.nn.Module) -> list[RemovableHandle]:
    """A post-accumulate-grad hook on every trainable parameter of ``module``: the last one of
    a backward pass starts ``backward_wait`` (one clock read per parameter per backward).
    Accumulation runs outside a compiled graph, so these run eagerly under compile too."""

    def param_grad(param: torch.Tensor) -> None:
        if not _is_compiling():
            tracker.on_param_grad(param)

    return [
        p.register_post_accumulate_grad_hook(param_grad)
        for p in module.parameters()
        if p.requires_grad
    ]


# DDP's own methods around its module's forward: the buffer broadcast and the reducer's
# preparation before it, the post-forward work after it.
DDP_FORWARD_SYNC = ("_pre_forward", "_post_forward")


def _late_compiled_ddp_shadows(
    timer: StepTimer, tracker: _BackwardTracker, ddp: torch.nn.Module, forward_seen: list[bool]
) -> list[AttributeShadow]:
    """A DDP model watched, then compiled (``torch.compile(ddp_model)`` after ``watch()``).

    The hooks of :func:`install` then run inside the compiled graph and time nothing; DDP's
    ``_pre_forward`` and ``_post_forward`` still run eagerly (dynamo cannot trace the reducer
    and breaks the graph there, with or without us: DDP does not compile with
    ``fullgraph=True``). Shadowed on this DDP object and never compiled, they open and close
    the forward (a training step's, as the hooks would) and time themselves as
    ``forward_wait``, as under :func:`_compiled_ddp_wait_hooks`. Eagerly, the hooks opened the
    forward already and the shadows pass through.
    """
    wait = timer.sync_wait()
    thread = get_ident()
    pre_forward: Callable[..., Any] = getattr(ddp, "_pre_forward")  # noqa: B009 - typed as Tensor
    post_forward: Callable[..., Any] = getattr(ddp, "_post_forward")  # noqa: B009
    opened = [False]  # this forward was opened by the shadow (the hooks were compiled)

    def pre(*args: Any, **kwargs: Any) -> Any:
        if timer.phase_open(FORWARD) or get_ident() != thread:
            return pre_forward(*args, **kwargs)
        if not timer.in_step and not open_training_step(timer, ddp.training):
            return pre_forward(*args, **kwargs)
        forward_seen[0] = opened[0] = True
        timer.begin(FORWARD)
        return _in_sync_wait(wait, pre_forward, args, kwargs)

    def post(*args: Any, **kwargs: Any) -> Any:
        if not opened[0] or get_ident() != thread:
            return post_forward(*args, **kwargs)
        opened[0] = False
        output = _in_sync_wait(wait, post_forward, args, kwargs)
        if timer.end(FORWARD) and torch.is_grad_enabled():
            tracker.watch_output(output)
        return output

    return [
        AttributeShadow(ddp, "_pre_forward", torch.compiler.disable(pre, recursive=False)),
        AttributeShadow(ddp, "_post_forward", torch.compiler.disable(post, recursive=False)),
    ]


def _compiled_ddp_wait_hooks(
    timer: StepTimer, tracker: _BackwardTracker, ddp: torch.nn.Module
) -> list[RemovableHandle | AttributeShadow]:
    """``torch.compile(ddp_model)``: the waits of :func:`_sync_wait_hooks` without hooks on
    DDP's module (dynamo traces those into the graph, where they do nothing).

    ``forward_wait``: DDP's ``_pre_forward`` and ``_post_forward`` (methods of this DDP
    object, shadowed on it, the shadows never compiled: a graph break around each, as DDP has
    around its module's forward already). ``backward_wait``: as under eager DDP.
    """
    handles: list[RemovableHandle | AttributeShadow] = [
        time_as_sync_wait(timer, ddp, name, never_compiled=True)
        for name in DDP_FORWARD_SYNC
        if callable(getattr(ddp, name, None))
    ]
    handles.extend(_last_grad_hooks(tracker, cast(torch.nn.Module, ddp.module)))
    return handles


class AttributeShadow:
    """``owner.<name>`` set to ``value`` over what was there (an instance's method, a module's
    function); ``remove()`` puts the previous state back if the attribute is still ``value``
    (a later replacement is left alone). A handle like torch's hook handles."""

    def __init__(self, owner: Any, name: str, value: Any) -> None:
        self._owner, self._name, self._value = owner, name, value
        self._had = name in vars(owner)  # a module's function; a method lives on the class
        self._before = vars(owner).get(name)
        setattr(owner, name, value)

    def remove(self) -> None:
        if vars(self._owner).get(self._name) is not self._value:
            return
        if self._had:
            setattr(self._owner, self._name, self._before)
        else:
            delattr(self._owner, self._name)


# The methods of an FSDP2 unit's parameter group that run its collectives: the parameter
# all-gather (``unshard``, before the unit's forward and, resharded, its backward) and the
# gradient reduce-scatter (``post_backward``).
FSDP_COLLECTIVES = ("unshard", "post_backward")


def _fsdp_wait_hooks(timer: StepTimer, model: torch.nn.Module) -> list[AttributeShadow]:
    """Under FSDP2 (``fully_shard``) on collectives that block the host (Gloo on the CPU):
    every unit's all-gather and reduce-scatter credited as sync waits (``forward_wait`` inside
    forward, ``backward_wait`` inside backward), so a rank slow in its forward or backward is
    told from its peers waiting for it (both are inside ``forward + backward``). Each call is
    timed whole: the collective and FSDP's copies around it. Relies on FSDP2's parameter
    groups (``_get_fsdp_state()._fsdp_param_group``): where they are missing nothing is timed
    and the diagnosis keeps the seed's FSDP definition.
    """
    groups = fsdp_param_groups(model, FSDP_COLLECTIVES)
    return [time_as_sync_wait(timer, group, name) for group in groups for name in FSDP_COLLECTIVES]


def fsdp_param_groups(model: torch.nn.Module, methods: tuple[str, ...]) -> list[Any]:
    """FSDP2 parameter groups (``_get_fsdp_state()._fsdp_param_group``) of ``model``'s units
    that have every one of ``methods``; none on a model without FSDP2 units."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    groups = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = getattr(module, "_get_fsdp_state", lambda: None)()
            group = getattr(state, "_fsdp_param_group", None)
            if all(callable(getattr(group, n, None)) for n in methods):
                groups.append(group)
    return groups


def time_as_sync_wait(
    timer: StepTimer, owner: Any, name: str, *, never_compiled: bool = False
) -> AttributeShadow:
    """Shadow ``owner.<name>`` (an object's method, a module's function) so that each call runs
    inside the timer's sync wait (:meth:`StepTimer.sync_wait`: the wait joins ``forward_wait``,
    or ``backward_wait`` inside backward); ``remove()`` on the result gives it back.

    Calls from another thread than the one shadowing it, calls inside an open sync wait (one
    collective calling another, or a user's ``sync_wait`` block around it) and calls while
    ``torch.compile`` traces run as they are. ``never_compiled``: dynamo skips the shadow's own
    frame (the call is a graph break, the original is compiled as before), for a method that
    runs eagerly after a graph break anyway: compiled, the shadow would keep only the branch
    taken while tracing, which times nothing.
    """
    original = getattr(owner, name)
    wait = timer.sync_wait()
    thread = get_ident()

    def timed(*args: Any, **kwargs: Any) -> Any:
        # The compile check first: while dynamo traces, nothing else here is looked at.
        if _is_compiling() or get_ident() != thread:
            return original(*args, **kwargs)
        return _in_sync_wait(wait, original, args, kwargs)

    if never_compiled:
        timed = torch.compiler.disable(timed, recursive=False)
    return AttributeShadow(owner, name, timed)


def _in_sync_wait(
    wait: _SyncWait, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``fn(*args, **kwargs)`` inside ``wait``, or as it is when a sync wait is open already
    (one collective calling another, a user's ``sync_wait`` block around it: counted once)."""
    if wait.open:
        return fn(*args, **kwargs)
    with wait:
        return fn(*args, **kwargs)


def open_training_step(timer: StepTimer, training: bool) -> bool:
    """A forward starts while no step is open: open one (closed later by the optimizer's hook or
    the loader) when it is a training forward (``training`` module, gradients on) and return
    True; a forward outside any step in evaluation or inference is not a step (False)."""
    if not (training and torch.is_grad_enabled()):
        return False
    timer.start_step(auto=True)
    return True


def _optimizer_hooks(
    timer: StepTimer, closes_step: bool, at_silent_steps: Callable[[], None] | None = None
) -> tuple[Callable[..., None], Callable[..., None]]:
    """Pre/post step hooks that time the outermost ``step()`` only; ``at_silent_steps`` runs
    once, after ``OPTIMIZER_SILENT_BATCHES`` outermost steps.

    A subclass whose ``step`` calls ``super().step()`` runs the instance's hooks twice, nested
    (torch wraps both methods once the base class has been instantiated); timing the inner
    call would drop the subclass's own work from the optimizer phase.
    """
    depth = [0]

    def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if _is_compiling():
            return
        depth[0] += 1
        if depth[0] == 1:
            timer.begin(OPTIMIZER)

    def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if _is_compiling():
            return
        depth[0] = max(0, depth[0] - 1)
        if depth[0]:
            return
        timer.end(OPTIMIZER)
        timer.optimizer_steps += 1
        timer.optimizer_end_ns = timer._clock()
        if timer.optimizer_steps == OPTIMIZER_SILENT_BATCHES and at_silent_steps is not None:
            at_silent_steps()
        # With a watched loader the next fetch closes the step (post-step work included).
        if closes_step and not timer.loader_steps and timer.auto_step:
            timer.end_step()

    return pre, post

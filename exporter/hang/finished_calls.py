"""The last c10d call this rank finished in each process group: the call it agreed to.

Two ranks left inside one call with different shapes or dtypes, one against one, do not say
which call was the odd one; the ranks that went past that call do: what they finished at that
sequence number agrees with one side (a 3-float all-reduce against 2-float ones: the two ranks
that finished did so with 2 floats, so the 3-float rank is the odd one). The hang rules count
them with that side (:func:`rankwatch.diagnosis.hang.classify.classify_hang`).

Noted on the training thread when the wait of a c10d function's collective returns (the
collective shadows of :mod:`.collectives` call :attr:`StepTimer.on_wait_done`, inside a sync
wait the user opened too): a look-up of the calling code object, the group's
sequence number and the tensors' shape and dtype objects, nothing of the tensors kept. Turned
into :class:`~rankwatch.diagnosis.hang.Collective` objects by the background thread, on
suspicion only. The cost per collective is measured in ``bench/bench_hang_watch.py``.
"""

from __future__ import annotations

from types import CodeType, FrameType
from typing import Any

from rankwatch.diagnosis.hang import Collective
from rankwatch.diagnosis.hang.records import MAX_DIMS, MAX_GROUPS, MAX_SHAPES
from rankwatch.exporter.hang.record import C10D_OPS, TENSOR_ARGS

__all__ = ["FinishedCalls"]

_C10D_FILE = "distributed_c10d.py"
_MAX_CODES = 256


# A code object's entry: (the code, op, the local that holds the group, the locals that hold
# tensors); op "" for a code that is not a c10d call.
_Entry = tuple[CodeType, str, str, tuple[str, ...]]


class FinishedCalls:
    """Per process group, the last c10d call this rank finished: ``(op, seq, tensors)``.

    :meth:`note` runs on the training thread (the timer's ``on_wait_done``); :meth:`calls`
    on the background thread. A group is keyed by its object (the default group by None);
    at most ``MAX_GROUPS`` are kept (the oldest dropped)."""

    def __init__(self) -> None:
        self._last: dict[Any, tuple[str, int, tuple[tuple[Any, Any], ...]]] = {}
        # Code objects seen as a timed wait's callers, learnt once each (bounded), by id: a
        # code object's own hash is computed anew on every look-up, over its constants.
        self._codes: dict[int, _Entry] = {}

    def note(self, frame: FrameType) -> None:
        """A collective's wait returned; ``frame``: the collective shadow's (its caller is the
        one that waited: a c10d function, or not). Never raises: an argument it cannot read
        leaves the group's entry as it was."""
        f = frame.f_back  # the caller of the work's wait: a c10d function, or not
        if f is None:
            return
        code = f.f_code
        entry = self._codes.get(id(code))
        if entry is None or entry[0] is not code:
            entry = self._learn(code)
        op = entry[1]
        if not op:
            return
        try:
            local_vars = f.f_locals
            group = local_vars.get(entry[2])
            seq = (
                group if group is not None else _world().default_pg
            )._get_sequence_number_for_group()
            tensor_vars = entry[3]
            if len(tensor_vars) == 1:  # most calls: one tensor argument
                value: Any = local_vars.get(tensor_vars[0])
                if type(value) is _TENSOR[0]:  # the common case first: one plain tensor
                    tensors: tuple[tuple[Any, Any], ...] = ((value.shape, value.dtype),)
                elif value is None or isinstance(value, (list, tuple)):
                    tensors = _raw(value)
                else:
                    tensors = ((value.shape, value.dtype),)
            else:
                tensors = tuple(t for name in tensor_vars for t in _raw(local_vars.get(name)))
        except Exception:  # torn down, a fake group, an odd argument: nothing noted
            return
        last = self._last
        if len(last) >= MAX_GROUPS and group not in last:
            last.pop(next(iter(last)))
        last[group] = (op, seq, tensors)

    def _learn(self, code: CodeType) -> _Entry:
        entry: _Entry = (code, "", "", ())
        if code.co_name in C10D_OPS and code.co_filename.endswith(_C10D_FILE):
            if _TENSOR[0] is None:
                import torch

                _TENSOR[0] = torch.Tensor
            names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            group_var = "group" if "group" in names else "process_group"
            tensor_vars = tuple(n for n in TENSOR_ARGS if n in names)
            entry = (code, code.co_name, group_var, tensor_vars)
        if len(self._codes) < _MAX_CODES:
            self._codes[id(code)] = entry
        return entry

    def calls(self, skip: frozenset[str] = frozenset()) -> tuple[Collective, ...]:
        """The last finished call of every group (groups named in ``skip`` left out), as the
        records carry them; groups that cannot be named any more (destroyed) are left out."""
        for _ in range(3):  # the training thread may add a group while this copies
            try:
                items = list(self._last.items())
                break
            except RuntimeError:
                continue
        else:
            return ()
        out = []
        for group, (op, seq, noted) in items:
            tensors = noted[:MAX_SHAPES]  # as many as a record may carry (several arguments)
            try:
                name = str((group if group is not None else _world().default_pg).group_name)
            except Exception:
                continue
            if name in skip:
                continue
            out.append(
                Collective(
                    group=name,
                    op=op,
                    seq=int(seq),
                    shapes=tuple(tuple(int(d) for d in shape)[:MAX_DIMS] for shape, _ in tensors),
                    dtypes=tuple(str(dtype).removeprefix("torch.") for _, dtype in tensors),
                )
            )
        return tuple(out)


def _raw(value: Any) -> tuple[tuple[Any, Any], ...]:
    """``(shape, dtype)`` objects of a tensor argument (a tensor or a list of them)."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(
            (item.shape, item.dtype) for item in value[:MAX_SHAPES] if hasattr(item, "dtype")
        )
    return ((value.shape, value.dtype),)


_WORLD: list[Any] = []
# torch.Tensor, once torch is imported (this module imports nothing of torch at import time).
_TENSOR: list[Any] = [None]


def _world() -> Any:
    """torch.distributed's table of groups (its default group is ``default_pg``)."""
    if not _WORLD:
        import torch.distributed as dist

        _WORLD.append(dist.distributed_c10d._world)
    return _WORLD[0]

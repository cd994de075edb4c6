"""What one rank's training thread is doing, read by its background thread for the hang watcher.

The training thread pays almost nothing for it: the step timer already keeps, as plain
attributes, when each phase was entered (``StepTimer._start``) and when the open sync wait
began (the wait of every collective the shadows of :mod:`.collectives` time); it adds a
progress counter (``StepTimer.marks``: a phase left, a wait ended, a step written, a forward
without a step), the stack of phases the user declared long (``StepTimer.declared``) and
whether the loader's first batch of an epoch is still awaited (``StepTimer.first_fetch``).
Everything else is read by the background thread, only on suspicion: the training thread's
Python frames (``sys._current_frames()``), and from them the c10d call it is blocked in (its
op, group and tensors, read from the frame's arguments) and where the training code called
it; each group's sequence number (``ProcessGroup._get_sequence_number_for_group()``, which
counts every collective issued on the group, those DDP's reducer issues in C++ included).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from rankwatch.diagnosis.hang import Collective
from rankwatch.diagnosis.hang.records import MAX_SHAPES
from rankwatch.exporter.gloo import own_group_names
from rankwatch.exporter.step_time.timer import PHASES, StepTimer

__all__ = [
    "C10D_OPS",
    "OUTSIDE_STEP",
    "PHASE_NAMES",
    "TENSOR_ARGS",
    "CallsInFlight",
    "DeclaredPhase",
    "GroupSeqs",
    "collective_in_frames",
    "current_phase",
    "frame_lines",
    "install_checkpoint_phases",
]

OUTSIDE_STEP = "outside_step"
# The timer's phases as a hang record names them.
PHASE_NAMES: tuple[str, ...] = tuple("input" if p == "input_wait" else p for p in PHASES)
# c10d's blocking calls a training thread waits in (torch.distributed.distributed_c10d, torch
# 2.13's names and the older ones it keeps: all_gather_into_tensor calls all_gather_single) and the
# functional collectives' wait (torch.distributed._functional_collectives.wait_tensor).
C10D_OPS = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_single",
        "all_reduce_coalesced",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "monitored_barrier",
        "recv",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "recv_object_list",
        "send",
        "send_object_list",
    }
)
TENSOR_ARGS = (
    "tensor",
    "tensors",
    "tensor_list",
    "output_tensor",
    "input_tensor",
    "output",
    "input",
    "output_tensor_list",
    "input_tensor_list",
    "scatter_list",
    "object_list",
)
_PIPELINE_SCHEDULES = os.path.join("pipelining", "schedules.py")
# Locals of a pipeline schedule's frame scanned for the P2POps it waits on, and their length.
_P2P_LOCALS = 64
_P2P_OPS = 64
_RANKWATCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_MARK = os.sep + "torch" + os.sep


def current_phase(timer: StepTimer, now_ns: int, progress_ns: int) -> tuple[str, float]:
    """(the phase the training thread is in, seconds in it): the innermost declared long phase
    or timed phase (the one entered last), else ``outside_step`` since the last progress."""
    name, since = OUTSIDE_STEP, progress_ns
    best = -1
    starts = timer._start
    for i, phase in enumerate(PHASE_NAMES):
        start = starts[i]
        if start > best:
            best, name, since = start, phase, start
    declared = timer.declared
    if declared:
        dname, _, dsince = declared[-1]
        if dsince >= best:
            name, since = dname, dsince
    return name, max(0.0, (now_ns - since) / 1e9)


class DeclaredPhase:
    """``with rw.phase("checkpoint", budget_seconds=600):``: a phase the user declares long.
    While it is open this rank's hang budget is at least ``budget_seconds``; a phase name the
    timer times (``forward``...) is timed as well. Reused; nests."""

    __slots__ = ("_budget", "_name", "_timed", "_timer")

    def __init__(self, timer: StepTimer, name: str, budget_seconds: float, timed: Any) -> None:
        self._timer, self._name, self._budget, self._timed = timer, name, budget_seconds, timed

    def __enter__(self) -> DeclaredPhase:
        self._timer.declared.append((self._name, self._budget, time.perf_counter_ns()))
        if self._timed is not None:
            self._timed.__enter__()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._timed is not None:
            self._timed.__exit__(exc_type, exc, tb)
        declared = self._timer.declared
        if declared:
            declared.pop()
        self._timer.marks += 1


def _short(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:])


def _own(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_RANKWATCH_DIR)


def _frames(frame: FrameType | None) -> Iterator[FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


def frame_lines(frame: FrameType | None, limit: int) -> list[str]:
    """The top ``limit`` frames (innermost first) as ``file:line function``, rankwatch's own
    shadows left out."""
    out: list[str] = []
    for f in _frames(frame):
        if _own(f):
            continue
        out.append(f"{_short(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}")
        if len(out) >= limit:
            break
    return out


def _describe(value: Any) -> tuple[list[tuple[int, ...]], list[str]]:
    """Shapes and dtypes of a tensor argument (a tensor or a list of them), bounded."""
    shapes: list[tuple[int, ...]] = []
    dtypes: list[str] = []
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items[:16]:
        shape = getattr(item, "shape", None)
        dtype = getattr(item, "dtype", None)
        if shape is None or dtype is None:
            continue
        shapes.append(tuple(int(d) for d in shape)[:8])
        dtypes.append(str(dtype).removeprefix("torch."))
    return shapes, dtypes


def collective_in_frames(
    frame: FrameType | None,
    seq_of: Callable[[Any], tuple[str, int] | None],
    entered_seconds: float | None,
    in_flight: Callable[[FrameType, dict[str, Any]], bool] | None = None,
) -> Collective | None:
    """The c10d call the stack is blocked in (innermost first), or None: its op (the
    function's name), group and tensors (its arguments), the group's sequence number
    (``seq_of(group)``: (name, seq), None when unreadable) and the training code's call site
    (the first frame outside torch and rankwatch). ``in_flight(frame, locals)``: whether a
    c10d function's call counts (None: every one does; see :class:`CallsInFlight`)."""
    frames = list(_frames(frame))
    for i, f in enumerate(frames):
        code = f.f_code
        name = code.co_name
        file = code.co_filename
        if name == "_wait_batch_p2p" and file.endswith(_PIPELINE_SCHEDULES):
            caller = frames[i + 1] if i + 1 < len(frames) else None
            return _pipeline_wait(caller, seq_of, entered_seconds)
        if name == "wait_tensor" and file.endswith("_functional_collectives.py"):
            op, local_vars = "wait_tensor", f.f_locals
        elif name in C10D_OPS and file.endswith("distributed_c10d.py"):
            op, local_vars = name, f.f_locals
            if in_flight is not None and not in_flight(f, local_vars):
                return None
        else:
            continue
        found = seq_of(local_vars.get("group", local_vars.get("process_group")))
        if found is None:
            return None
        group, seq = found
        shapes: list[tuple[int, ...]] = []
        dtypes: list[str] = []
        for arg in TENSOR_ARGS:
            if arg in local_vars:
                s, d = _describe(local_vars[arg])
                shapes += s
                dtypes += d
        site = _site(frames[i + 1] if i + 1 < len(frames) else None)
        return Collective(
            group=group,
            op=op,
            seq=seq,
            shapes=tuple(shapes[:16]),
            dtypes=tuple(dtypes[:16]),
            site=site,
            seconds=entered_seconds,
        )
    return None


class CallsInFlight:
    """Tells a c10d call in flight from one being entered or left, for a look at the frames
    taken outside a timed wait (inside one, the call is in flight).

    A c10d function is on the stack a little before it issues its work and a little after its
    wait returned; the group's sequence number read then is the call before's or the call's
    own, not the one the others wait in, so two ranks at the same point would seem to disagree
    (a mismatch, which is reported on sight). The call counts when its ``work`` was issued and
    is not finished, or when the same frame at the same instruction was seen at the look
    before (blocked where no wait is timed, as in a communicator's set-up). ``refused_look``:
    the last look at which a call did not count (the rank was crossing a call's edge)."""

    def __init__(self) -> None:
        self._seen: tuple[int, int, int] | None = None  # (look, frame id, instruction)
        self.refused_look = -1

    def check(self, look: int, frame: FrameType, local_vars: dict[str, Any]) -> bool:
        """Whether the call of ``frame`` (whose locals are ``local_vars``) counts at look
        number ``look`` (one more at each look)."""
        work = local_vars.get("work")
        if work is not None:
            try:
                if not work.is_completed():
                    return True
            except Exception:  # not a Work, or torn down: the frame alone decides
                pass
        before, self._seen = self._seen, (look, id(frame), frame.f_lasti)
        if before == (look - 1, id(frame), frame.f_lasti):
            return True
        self.refused_look = look
        return False


class GroupSeqs:
    """The process groups this rank's hang records report: each group's sequence number and
    size, for every group this process belongs to (``torch.distributed``'s own table of them,
    read on suspicion only; bounded), rankwatch's own groups left out. Background thread
    only, but for :meth:`seq_of`."""

    MAX_GROUPS = 64

    def seq_of(self, group: Any) -> tuple[str, int] | None:
        """(name, sequence number) of ``group`` (None: the default group); None when
        torch.distributed is not initialised or the group cannot say."""
        try:
            import torch.distributed as dist

            if not dist.is_initialized():
                return None
            pg = dist.distributed_c10d._get_default_group() if group is None else group
            return str(pg.group_name), int(pg._get_sequence_number_for_group())  # type: ignore[union-attr]
        except Exception:  # a fake or torn-down group: no sequence number
            return None

    def read(self) -> tuple[dict[str, int], dict[str, int]]:
        """``(sequence numbers, sizes)`` of every group of this process, by group name."""
        seqs: dict[str, int] = {}
        sizes: dict[str, int] = {}
        try:
            import torch.distributed as dist

            if not dist.is_initialized():
                return seqs, sizes
            # A copy first: the training thread may be creating a group right now.
            groups = list(dist.distributed_c10d._world.pg_names.items())
        except Exception:  # torn down, or a torch without the table: nothing to report
            return seqs, sizes
        own = own_group_names()
        for pg, name in groups:
            if name in own or len(seqs) >= self.MAX_GROUPS:
                continue
            try:
                seqs[name] = int(pg._get_sequence_number_for_group())  # type: ignore[attr-defined]
                sizes[name] = int(pg.size())
            except Exception:  # destroyed since: left out
                seqs.pop(name, None)
        return seqs, sizes


def _checkpoint_shadow(timer: StepTimer, budget_seconds: float, original: Any) -> Any:
    def saving(*args: Any, **kwargs: Any) -> Any:
        with DeclaredPhase(timer, "checkpoint", budget_seconds, None):
            return original(*args, **kwargs)

    saving.__wrapped__ = original  # type: ignore[attr-defined]
    saving.__doc__ = getattr(original, "__doc__", None)
    saving._rankwatch_checkpoint = True  # type: ignore[attr-defined]
    return saving


def install_checkpoint_phases(timer: StepTimer, budget_seconds: float) -> list[Any]:
    """``torch.distributed.checkpoint``'s ``save``/``async_save`` (its package names and
    ``state_dict_saver``'s) held as the declared phase ``checkpoint`` with
    ``budget_seconds``, when the job has imported the package (nothing imported for a job
    that does not checkpoint with it). Returns the shadows (``remove()`` undoes them)."""
    from rankwatch.exporter.step_time.hooks import AttributeShadow

    if "torch.distributed.checkpoint" not in sys.modules:
        return []
    import torch.distributed.checkpoint as dcp

    owners = [dcp, sys.modules.get("torch.distributed.checkpoint.state_dict_saver")]
    shadows: list[Any] = []
    for owner in owners:
        if owner is None:
            continue
        for name in ("save", "async_save"):
            original = getattr(owner, name, None)
            if callable(original) and not getattr(original, "_rankwatch_checkpoint", False):
                shadows.append(
                    AttributeShadow(
                        owner, name, _checkpoint_shadow(timer, budget_seconds, original)
                    )
                )
    return shadows


class DeviceWaitClock:
    """How long the device has been inside a collective (the GPU clock: the host does not
    block there). A sync wait whose start marker the device has passed and whose end marker it
    has not is one it is inside; the clock starts when this watcher first sees it so (polled
    with ``query()``, never synchronising). Background thread only."""

    MAX_TRACKED = 256

    def __init__(self) -> None:
        self._since: dict[int, float] = {}

    def seconds(self, markers: list[tuple[Any, Any]], now: float) -> float | None:
        """Seconds the device has been inside its oldest unfinished wait, None when it is in
        none (or a marker cannot be asked)."""
        inside: dict[int, float] = {}
        try:
            for start, stop in markers[: self.MAX_TRACKED]:
                if stop.query() or not start.query():
                    continue
                key = id(stop)
                inside[key] = self._since.get(key, now)
        except Exception:  # a device error: no answer from the device clock
            return None
        self._since = inside
        return max((now - t for t in inside.values()), default=None)


# Long work recognised in a suspect rank's frames (only read on suspicion, nothing on the hot
# path): a checkpoint being written (``torch.save``, ``torch.distributed.checkpoint``) and
# torch.compile compiling (a recompilation after the first steps). (path part, phase name).
_LONG_WORK: tuple[tuple[str, str], ...] = (
    ("torch/distributed/checkpoint/", "checkpoint"),
    ("torch/serialization.py", "checkpoint"),
    # Compiling, not running compiled code: every Dynamo compile enters through
    # convert_frame.py and every Inductor one (the lazy backward's too) through compile_fx.py.
    # Any torch/_dynamo/ frame would not do: FSDP2's hooks run under torch._dynamo.disable
    # (eval_frame.py), so every rank waiting in its all-gather would read as compiling.
    ("torch/_dynamo/convert_frame.py", "compile"),
    ("torch/_inductor/compile_fx.py", "compile"),
)


def long_work_in_frames(frame: FrameType | None) -> str:
    """``checkpoint`` or ``compile`` when the stack is inside such work (its innermost
    frame of it), else ``""``."""
    for f in _frames(frame):
        path = f.f_code.co_filename.replace("\\", "/")
        for part, name in _LONG_WORK:
            if part in path:
                return name
    return ""


def _is_p2p_op(value: Any) -> bool:
    return (
        hasattr(value, "peer") and hasattr(value, "group") and callable(getattr(value, "op", None))
    )


def _pipeline_wait(
    caller: FrameType | None,
    seq_of: Callable[[Any], tuple[str, int] | None],
    entered_seconds: float | None,
) -> Collective:
    """A pipeline stage waiting on its peers (``schedules._wait_batch_p2p``): the P2POps of
    the batch it waits on, read from the schedule's frame (the lists of ops it built; where it
    waits per peer, ``works[peer]``, that peer's only). The peers are what the hang rules
    follow; with no ops in sight (popped already) the op is ``p2p_wait`` and no peer is known."""
    ops: list[Any] = []
    if caller is not None:
        local_vars = caller.f_locals
        for value in list(local_vars.values())[:_P2P_LOCALS]:
            items = value if isinstance(value, (list, tuple)) else [value]
            ops += [v for v in items[:_P2P_OPS] if _is_p2p_op(v)]
        works, work = local_vars.get("works"), local_vars.get("work")
        if isinstance(works, dict) and work is not None:
            peers_waited = [peer for peer, w in works.items() if w is work]
            # (a work of an earlier batch, as the forward sends waited for at the end: the
            # ops in sight are the last batch's, to the same peers)
            ops = [o for o in ops if o.peer in peers_waited] or ops
    if not ops:
        found = seq_of(None)
        group, seq = found if found is not None else ("", 0)
        return Collective(group=group, op="p2p_wait", seq=seq, seconds=entered_seconds)
    names = {getattr(o.op, "__name__", "") for o in ops}
    op = "recv" if names == {"irecv"} else "send" if names == {"isend"} else "send_recv"
    found = seq_of(ops[0].group)
    group, seq = found if found is not None else ("", 0)
    shapes: list[tuple[int, ...]] = []
    dtypes: list[str] = []
    for o in ops[:MAX_SHAPES]:
        sh, dt = _describe(getattr(o, "tensor", None))
        shapes += sh
        dtypes += dt
    return Collective(
        group=group,
        op=op,
        seq=seq,
        shapes=tuple(shapes[:MAX_SHAPES]),
        dtypes=tuple(dtypes[:MAX_SHAPES]),
        site=_site(caller),
        seconds=entered_seconds,
        peers=tuple(sorted({int(o.peer) for o in ops})),
    )


def _site(frame: FrameType | None) -> str:
    """The training code's call site: the first frame from ``frame`` outward outside torch and
    rankwatch (``file:line function``), or empty."""
    for caller in _frames(frame):
        cfile = caller.f_code.co_filename
        if _TORCH_MARK in cfile or cfile.startswith(_RANKWATCH_DIR):
            continue
        return f"{_short(cfile)}:{caller.f_lineno} {caller.f_code.co_name}"
    return ""

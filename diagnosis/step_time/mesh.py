"""The device mesh of a multi-dimensional parallel job, and which of its ranks do equal work.

A :class:`MeshLayout` is the job's mesh as ``torch.distributed.device_mesh.DeviceMesh`` holds
it: dimension names (``("pp", "dp", "tp")``) and the global ranks laid out in an n-d array of
that shape, row-major (``mesh.mesh`` flattened). Pure data: nothing here knows torch.

Ranks are compared with ranks that should do equal work: its *comparison groups*. Pipeline
stages run different layers and differ by design, so a rank is compared only with the ranks of
its own pipeline stage (the dimension named ``pp``, as torchtitan names it, or ``pipeline``);
every other dimension (``dp``, ``tp``, ``cp``, ``ep``, ``dp_shard``, ``dp_replicate``, ...)
splits equal work and joins the comparison. A mesh without a pipeline dimension is one group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from rankwatch.diagnosis.step_time.table import validate_rank_id

__all__ = [
    "PIPELINE_DIMS",
    "ComparisonGroup",
    "MeshLayout",
    "ranks_text",
]

# Names of the pipeline dimension, first match wins (torchtitan's name first).
PIPELINE_DIMS: tuple[str, ...] = ("pp", "pipeline")
_MAX_NAME_CHARS = 64


def ranks_text(ranks: Sequence[int]) -> str:
    """``"ranks 2, 3"`` (``"rank 2"`` for one)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


@dataclass(frozen=True)
class ComparisonGroup:
    """Ranks that should do equal work: one pipeline stage (``stage``), or every rank of a
    mesh without a pipeline dimension (``stage`` None)."""

    ranks: tuple[int, ...]
    stage: int | None = None

    @property
    def text(self) -> str:
        """``"pipeline stage 1 (ranks 2, 3)"``, or ``"all ranks (ranks 0, 1, 2, 3)"``."""
        head = "all ranks" if self.stage is None else f"pipeline stage {self.stage}"
        return f"{head} ({ranks_text(self.ranks)})"


@dataclass(frozen=True)
class MeshLayout:
    """A device mesh: ``dim_names``, its ``shape`` and its global ``ranks`` (row-major).

    Build it with :meth:`from_nested` (the ``mesh.mesh`` array of a ``DeviceMesh``, as nested
    lists or an array) or :meth:`from_sizes` (``{"pp": 2, "dp": 2}`` over a list of ranks).
    Invalid input raises ``ValueError`` naming the field and the value.
    """

    dim_names: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        names, shape, ranks = self.dim_names, self.shape, self.ranks
        if not isinstance(names, tuple) or not names:
            raise ValueError(f"field dim_names: value {names!r} is not a non-empty tuple of names")
        for name in names:
            if not isinstance(name, str) or not name.strip() or len(name) > _MAX_NAME_CHARS:
                raise ValueError(
                    f"field dim_names: value {name!r} in {names!r} is not a non-empty name of "
                    f"at most {_MAX_NAME_CHARS} characters"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"field dim_names: value {names!r} repeats a name")
        if not isinstance(shape, tuple) or len(shape) != len(names):
            raise ValueError(
                f"field shape: value {shape!r} does not have one size per dimension {names!r}"
            )
        for size in shape:
            if type(size) is not int or size < 1:
                raise ValueError(f"field shape: value {shape!r} has a size that is not an int >= 1")
        if not isinstance(ranks, tuple):
            raise ValueError(f"field ranks: value of type {type(ranks).__name__} is not a tuple")
        for rank in ranks:
            if type(rank) is not int:
                raise ValueError(f"field ranks: value {rank!r} is not an int rank")
            validate_rank_id(rank)
        if len(ranks) != int(np.prod(shape)):
            raise ValueError(
                f"field ranks: {len(ranks)} ranks do not fill the shape {shape!r} "
                f"({int(np.prod(shape))} ranks)"
            )
        if len(set(ranks)) != len(ranks):
            values, counts = np.unique(np.asarray(ranks), return_counts=True)
            raise ValueError(
                f"field ranks: value {int(values[counts > 1][0])} appears more than once"
            )

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_nested(cls, dim_names: Sequence[str], ranks: Any) -> MeshLayout:
        """From the mesh's rank array (nested lists, a numpy array or a tensor's ``tolist()``)
        in DeviceMesh order, one axis per name."""
        names = _names(dim_names)
        try:
            arr = np.asarray(ranks, dtype=object)
        except (TypeError, ValueError) as exc:  # ragged nesting
            raise ValueError(f"field ranks: value {ranks!r} is not an n-d array ({exc})") from None
        if arr.ndim != len(names):
            raise ValueError(
                f"field ranks: value {ranks!r} has {arr.ndim} dimension(s), not one per name "
                f"{names!r}"
            )
        flat = tuple(_rank(r) for r in arr.reshape(-1).tolist())
        return cls(names, tuple(int(s) for s in arr.shape), flat)

    @classmethod
    def from_sizes(cls, sizes: Mapping[str, int], ranks: Sequence[int]) -> MeshLayout:
        """From dimension sizes in order (``{"pp": 2, "dp": 2, "tp": 1}``) over ``ranks``
        filled row-major (the last dimension varies fastest, as ``init_device_mesh`` does)."""
        if not isinstance(sizes, Mapping) or not sizes:
            raise ValueError(
                f"field mesh: value {sizes!r} is not a non-empty mapping {{dimension: size}}"
            )
        names = _names(tuple(sizes))
        shape = []
        for name in names:
            size = sizes[name]
            if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
                raise ValueError(f"field mesh: size of {name!r}: value {size!r} is not an int >= 1")
            shape.append(int(size))
        flat = tuple(_rank(r) for r in ranks)
        if len(flat) != int(np.prod(shape)):
            raise ValueError(
                f"field mesh: value {dict(sizes)!r} holds {int(np.prod(shape))} ranks, but the "
                f"group has {len(flat)} ({ranks_text(flat)})"
            )
        return cls(names, tuple(shape), flat)

    # ---- reading -------------------------------------------------------------------------------

    @property
    def pipeline_dim(self) -> int | None:
        """Index of the pipeline dimension (``pp``, else ``pipeline``), None without one."""
        for name in PIPELINE_DIMS:
            if name in self.dim_names:
                return self.dim_names.index(name)
        return None

    @cached_property
    def _coords(self) -> dict[int, tuple[int, ...]]:
        grid = np.arange(len(self.ranks)).reshape(self.shape)
        return {self.ranks[int(i)]: tuple(int(c) for c in idx) for idx, i in np.ndenumerate(grid)}

    def coordinates(self, rank: int) -> tuple[int, ...]:
        """The rank's index along each dimension; ``ValueError`` for a rank not in the mesh."""
        try:
            return self._coords[rank]
        except (KeyError, TypeError):
            raise ValueError(f"field rank: value {rank!r} is not a rank of the mesh") from None

    def position_text(self, rank: int) -> str:
        """``"rank 3: pp 1, dp 1, tp 0"``."""
        coords = self.coordinates(rank)
        return f"rank {rank}: " + ", ".join(
            f"{n} {c}" for n, c in zip(self.dim_names, coords, strict=True)
        )

    def comparison_groups(self) -> tuple[ComparisonGroup, ...]:
        """Ranks compared with each other: one group per pipeline stage (ascending ranks), or
        one group of every rank without a pipeline dimension."""
        axis = self.pipeline_dim
        if axis is None:
            return (ComparisonGroup(tuple(sorted(self.ranks))),)
        grid = np.asarray(self.ranks, dtype=np.int64).reshape(self.shape)
        return tuple(
            ComparisonGroup(tuple(sorted(int(r) for r in np.take(grid, s, axis=axis).ravel())), s)
            for s in range(self.shape[axis])
        )

    def pipeline_replica(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s pipeline (same index in every dimension but the pipeline
        one), ascending; ``(rank,)`` without a pipeline dimension."""
        axis = self.pipeline_dim
        coords = self.coordinates(rank)
        if axis is None:
            return (rank,)
        return tuple(
            sorted(
                r
                for r, c in self._coords.items()
                if c[:axis] + c[axis + 1 :] == coords[:axis] + coords[axis + 1 :]
            )
        )

    def replica_text(self, rank: int) -> str:
        """``"pipeline replica dp 1 (ranks 1, 3)"``: the pipeline ``rank`` belongs to."""
        axis = self.pipeline_dim
        coords = self.coordinates(rank)
        where = ", ".join(
            f"{n} {c}"
            for k, (n, c) in enumerate(zip(self.dim_names, coords, strict=True))
            if k != axis
        )
        head = f"pipeline replica {where}" if where else "pipeline replica"
        return f"{head} ({ranks_text(self.pipeline_replica(rank))})"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"dim_names": [...], "shape": [...], "ranks": [...]}`` (row-major)."""
        return {
            "dim_names": list(self.dim_names),
            "shape": list(self.shape),
            "ranks": list(self.ranks),
        }

    @classmethod
    def from_dict(cls, obj: object) -> MeshLayout:
        """The inverse of :meth:`to_dict`; ``ValueError`` naming the field otherwise."""
        if not isinstance(obj, Mapping) or set(obj) != {"dim_names", "shape", "ranks"}:
            raise ValueError(
                f"field mesh: value {obj!r} is not an object with dim_names, shape and ranks"
            )
        names, shape, ranks = obj["dim_names"], obj["shape"], obj["ranks"]
        for key, value in (("dim_names", names), ("shape", shape), ("ranks", ranks)):
            if not isinstance(value, list):
                raise ValueError(f"field {key}: value {value!r} is not a list")
        return cls(tuple(names), tuple(shape), tuple(ranks))


def _names(dim_names: object) -> tuple[str, ...]:
    if isinstance(dim_names, str) or not isinstance(dim_names, Sequence):
        raise ValueError(f"field dim_names: value {dim_names!r} is not a sequence of names")
    return tuple(dim_names)


def _rank(value: object) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"field ranks: value {value!r} is not an int rank")
    return int(value)

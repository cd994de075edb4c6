"""The job's device mesh for the diagnosis: from a ``DeviceMesh``, a mapping of dimension sizes,
or the watched model's DTensor parameters.

``torch.distributed.device_mesh.DeviceMesh`` holds the whole layout on every rank: its root
mesh's ``mesh`` (the global ranks as an n-d tensor) and ``mesh_dim_names``. A submesh
(``world_mesh["tp"]``) keeps its root (``DeviceMesh._get_root_mesh()``, the call torch's own
``tensor.parallel.fsdp`` makes); its own ``mesh`` holds only this rank's slice. Every rank
calls ``watch`` with the same mesh, so the group's root knows every rank's coordinates without
any rank shipping them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from rankwatch.diagnosis.step_time.mesh import MeshLayout, ranks_text

__all__ = ["check_mesh_type", "mesh_layout", "model_mesh"]

log = logging.getLogger(__name__)


def _is_device_mesh(value: object) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(value, DeviceMesh)


def _from_device_mesh(mesh: Any) -> MeshLayout:
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    names = root.mesh_dim_names
    ranks = root.mesh.tolist()
    if names is None:  # a mesh built without names: its dimensions by position
        names = tuple(f"dim{k}" for k in range(root.mesh.ndim))
    return MeshLayout.from_nested(tuple(names), ranks)


def check_mesh_type(mesh: object, api: str) -> None:
    """``TypeError`` naming ``api``'s ``mesh`` field and the value unless ``mesh`` is of a type
    ``watch(mesh=)`` takes: a ``DeviceMesh``, a mapping of dimension sizes, a ``MeshLayout``,
    or None (whether it fits the group is :func:`mesh_layout`'s to say)."""
    if mesh is None or isinstance(mesh, (Mapping, MeshLayout)) or _is_device_mesh(mesh):
        return
    raise TypeError(
        f"{api}: field mesh: expected a DeviceMesh, a mapping of dimension sizes such as "
        f'{{"pp": 2, "dp": 2}}, or None, got {type(mesh).__name__} {mesh!r}'
    )


def mesh_layout(mesh: object, group_ranks: Sequence[int]) -> MeshLayout | None:
    """The ``mesh`` argument of ``watch`` as a :class:`MeshLayout` holding every rank of the
    group (``group_ranks``): a ``DeviceMesh`` (its root mesh), a mapping of dimension sizes
    over the group's ranks in row-major order (``{"pp": 2, "dp": 2}``), a ``MeshLayout``, or
    None. ``TypeError``/``ValueError`` naming ``mesh`` and the value otherwise."""
    if mesh is None:
        return None
    check_mesh_type(mesh, "watch")
    if isinstance(mesh, MeshLayout):
        layout = mesh
    elif isinstance(mesh, Mapping):
        try:
            layout = MeshLayout.from_sizes(mesh, tuple(group_ranks))
        except ValueError as exc:
            raise ValueError(f"watch: field mesh: value {dict(mesh)!r}: {exc}") from None
    else:
        try:
            layout = _from_device_mesh(mesh)
        except ValueError as exc:
            raise ValueError(f"watch: field mesh: value {mesh!r}: {exc}") from None
    outside = sorted(set(group_ranks) - set(layout.ranks))
    if outside:
        raise ValueError(
            f"watch: field mesh: value {layout.dim_names!r} of shape {layout.shape!r} "
            f"({ranks_text(layout.ranks)}) does not hold {ranks_text(outside)} of the watched "
            "group"
        )
    return layout


def model_mesh(model: Any, group_ranks: Sequence[int]) -> MeshLayout | None:
    """The root mesh of the first DTensor parameter of ``model`` when it has more than one
    dimension and holds every rank of the group; None otherwise (a model without DTensor
    parameters, FSDP2 alone on a 1-D mesh, which says nothing the ranks do not, a mesh of
    another group). Never raises: a mesh that cannot be read leaves the diagnosis without one."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    try:
        for param in model.parameters():
            if isinstance(param, DTensor):
                layout = _from_device_mesh(param.device_mesh)
                if len(layout.shape) == 1:
                    return None
                if set(group_ranks) <= set(layout.ranks):
                    return layout
                log.warning(
                    "rankwatch: the model's device mesh %s does not hold every watched rank "
                    "(%s); ranks are compared without a mesh (pass mesh= to watch)",
                    layout.dim_names,
                    ranks_text(tuple(group_ranks)),
                )
                return None
    except Exception:  # reading the mesh must never break training
        log.warning("rankwatch: cannot read the model's device mesh", exc_info=True)
    return None

"""What only the torch frontend can see about a call, handed to the spec: which process group a ``group=``
argument names (a ProcessGroup, None, a DeviceMesh or ``(mesh, dim)``), whether the operand is a tensor, whether
this rank is in the group, and which dtypes the group's backend carries (`commlib.dtypes` picks the wire dtype or
refuses). The messages are the spec's (`commlib.frontend_errors.mesh_dim`, `wrong_type`, `not_a_member`). Also the
group's size and this rank in it as a call reads them: from the group itself (`group_size`, `group_rank`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from commlib import frontend_errors
from commlib_torch._compat import default_group

__all__ = [
    "BACKEND_DTYPES",
    "COMMON_DTYPES",
    "GroupArgument",
    "ResolvedGroup",
    "backend_dtypes",
    "check_tensor",
    "default_group",
    "global_rank",
    "group_rank",
    "group_size",
    "resolve_group",
    "world_size",
]

#: What a public ``group=`` argument takes: a process group, None (WORLD), a 1-D DeviceMesh, or a mesh and one of
#: its dims (a dim name such as "tp", or an index). `resolve_group` turns it into a `ResolvedGroup`.
GroupArgument = dist.ProcessGroup | DeviceMesh | tuple[DeviceMesh, str | int] | None
#: The process group a call runs over, None meaning WORLD: what the walks, c10d calls and autograd Functions take.
ResolvedGroup = dist.ProcessGroup | None

_GLOO = frozenset(
    {
        "bool",
        "int8",
        "uint8",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex32",
        "complex64",
        "complex128",
    }
)  # measured on torch 2.13: the rest is "Invalid scalar type"
#: dtypes each c10d backend carries, by backend name. NCCL: ProcessGroupNCCL's ncclDataType map (float8 as
#: bytes, or as NCCL's own float8 where it has them; complex as its real view, as everywhere in c10d).
BACKEND_DTYPES = {
    "gloo": _GLOO,
    "nccl": _GLOO | {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"},
}
_EVERYWHERE = frozenset.intersection(*BACKEND_DTYPES.values())
#: The torch dtypes every backend carries: for these, `backend_dtypes` asks the group nothing (a set look-up per
#: call).
COMMON_DTYPES = frozenset(getattr(torch, name) for name in _EVERYWHERE if hasattr(torch, name))


def resolve_group(op_name: str, group: object) -> ResolvedGroup:
    """The process group `group` names: a ProcessGroup or None as it is; a 1-D DeviceMesh's group; for
    ``(mesh, dim)`` the group of that mesh dim (``mesh.get_group(dim)``: the ranks that differ only along it).
    The spec's CommError for a mesh that is not 1-D given without a dim or an unknown dim, its TypeError for
    anything else. (``new_group`` gives the ranks outside the group ``GroupMember.NON_GROUP_MEMBER``: it passes,
    for `world_size` to refuse with the spec's not-a-member error.)"""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if group == dist.GroupMember.NON_GROUP_MEMBER:  # torch's stubs type new_group's result ProcessGroup, this
        return group  # type: ignore[return-value]  # int included: it stands for a group this rank is not in
    mesh, dim = group if isinstance(group, tuple) and len(group) == 2 else (group, None)
    if not isinstance(mesh, DeviceMesh):
        raise frontend_errors.wrong_type(op_name, "group", group, "ProcessGroup, DeviceMesh, (DeviceMesh, dim) or None")
    shape = tuple(mesh.size(axis) for axis in range(mesh.ndim))  # (torch 2.11's Dynamo traces size, not shape)
    return mesh.get_group(frontend_errors.mesh_dim(op_name, shape, mesh.mesh_dim_names, dim))


def check_tensor(op_name: str, x: object, name: str = "x") -> torch.Tensor:
    """`x` itself if it is a tensor; else the spec's TypeError naming the op and the type received."""
    if not isinstance(x, torch.Tensor):
        raise frontend_errors.wrong_type(op_name, name, x, "torch.Tensor")
    return x


def world_size(op_name: str, group: ResolvedGroup) -> int:
    """The group's size; the spec's CommError on a rank outside the group (where torch answers -1)."""
    size = dist.get_world_size(group)
    if size < 0:
        raise frontend_errors.not_a_member(op_name, dist.get_rank(), dist.get_process_group_ranks(group))
    return size


def _backend_name(group: ResolvedGroup, device: torch.device) -> str:
    """The backend that carries tensors on `device` ("cpu:gloo,cuda:nccl" configurations name one per device)."""
    config = dist.get_backend_config(group)
    by_device = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    return by_device.get(device.type, str(dist.get_backend(group)))


def backend_dtypes(group: ResolvedGroup, x: torch.Tensor) -> frozenset[str] | None:
    """The dtypes the backend carrying `x` carries (None: every dtype, or a backend commlib does not know)."""
    if x.dtype in COMMON_DTYPES:  # the common case asks the group nothing
        return None
    return BACKEND_DTYPES.get(_backend_name(group, x.device))


def group_size(group: ResolvedGroup) -> int:
    """`dist.get_world_size(group)`; for a process group this rank belongs to (or WORLD), read directly
    (get_world_size's checks cost a few microseconds per call)."""
    process_group = default_group() if group is None else group
    if type(process_group) is dist.ProcessGroup:
        return process_group.size()
    return dist.get_world_size(group)  # a rank outside `group` (-1), or no default group yet (raises)


def group_rank(group: ResolvedGroup) -> int:
    """`dist.get_rank(group)`, the same way as `group_size`."""
    process_group = default_group() if group is None else group
    if type(process_group) is dist.ProcessGroup:
        return process_group.rank()
    return dist.get_rank(group)  # a rank outside `group` (-1), or no default group yet (raises)


def global_rank(group: ResolvedGroup, rank: int) -> int:
    """The global rank of group-local `rank`."""
    return rank if group is None else dist.get_global_rank(group, rank)

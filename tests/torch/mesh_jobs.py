"""Pool jobs for test_meshes.py: ops called with ``group=`` a DeviceMesh dim, on a 2 x 2 mesh of a world-4 pool.

``init_device_mesh("cpu", (2, 2), mesh_dim_names=("sp", "tp"))`` puts global rank ``2 * s + t`` at (s, t): the
"tp" groups are the rows {0, 1} and {2, 3}, the "sp" groups the columns {0, 2} and {1, 3}. Each job passes the
group in one of two forms, ``(mesh, name)`` or the 1-D sub-mesh ``mesh[name]``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import commlib_torch
from commlib.errors import CommError
from commlib.tools import cases
from commlib_torch.attention import ulysses_attention
from commlib_torch.tools.parity_jobs import run_case
from commlib_torch.tools.pool import WorkerContext

NAMES = ("sp", "tp")
_MESHES: dict[tuple, DeviceMesh] = {}


def mesh(shape=(2, 2), names=NAMES) -> DeviceMesh:
    """The mesh of `shape` over the pool's ranks, made once per process (every rank makes it, in order)."""
    key = (tuple(shape), names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)
    return _MESHES[key]


def partition(dim: str) -> tuple[tuple[int, ...], ...]:
    """The global ranks of each group along mesh dim `dim`, in the order `group_index` numbers them."""
    return ((0, 2), (1, 3)) if dim == "sp" else ((0, 1), (2, 3))


def group_form(dim: str, form: str):
    """What the job passes as ``group=``: ``(mesh, dim)`` ("tuple") or the 1-D sub-mesh ``mesh[dim]`` ("1-D")."""
    return (mesh(), dim) if form == "tuple" else mesh()[dim]


def run_case_on_mesh(ctx: WorkerContext, dim: str, form: str, case: cases.Case, arrays_per_group):
    """`run_case` with ``group=`` this rank's group along mesh dim `dim`, given in `form`, on that group's arrays;
    (index of the group in `partition(dim)`, the reply)."""
    index = next(i for i, members in enumerate(partition(dim)) if ctx.rank in members)
    local = partition(dim)[index].index(ctx.rank)
    assert mesh().get_local_rank(dim) == local
    grouped = dataclasses.replace(case, kwargs=(*case.kwargs, ("group", group_form(dim, form))))
    return index, run_case(WorkerContext(local, case.world_size, None), grouped, arrays_per_group[index])


def _error(call) -> str:
    try:
        call()
    except (CommError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def rejected(ctx: WorkerContext, op: str, group_spec: str) -> str:
    """The error `op` raises on this rank for a bad ``group=``: "2-D" (the whole mesh, no dim), "unknown" (a dim
    name the mesh lacks), "index" (an index out of range) or "list" (a list of ranks: not a group kind)."""
    group = {
        "2-D": lambda: mesh(),
        "unknown": lambda: (mesh(), "dp"),
        "index": lambda: (mesh(), 2),
        "list": lambda: [0, 1],
    }[group_spec]()
    x = torch.ones(2, 4)
    if op == "DeviceCommunicator":
        return _error(lambda: commlib_torch.DeviceCommunicator(group))
    if op == "ulysses_attention":
        q = torch.ones(1, 2, 4, 2)
        return _error(lambda: ulysses_attention(q, q, q, group))
    required = {"all_to_all": dict(scatter_dim=1, gather_dim=0), "permute": dict(perm=[(0, 1)])}.get(op, {})
    return _error(lambda: getattr(commlib_torch, op)(x, group=group, **required))


def communicator_on_mesh(ctx: WorkerContext, dim: str, form: str):
    """A DeviceCommunicator over a mesh dim: its rank and size, and an all_gather's value."""
    communicator = commlib_torch.DeviceCommunicator(group_form(dim, form))
    assert communicator.cpu_group is mesh().get_group(dim) and communicator.device_group is communicator.cpu_group
    out = communicator.all_gather(torch.tensor([float(ctx.rank)]), dim=0)
    return communicator.rank, communicator.world_size, out.tolist()


def attention_on_mesh(ctx: WorkerContext, form: str):
    """ulysses_attention over the "sp" dim against the same call with the process group: max |difference| of
    the outputs and of q's gradients."""
    generator = torch.Generator().manual_seed(ctx.rank)
    results = []
    for group in (group_form("sp", form), mesh().get_group("sp")):
        q = torch.randn(1, 2, 4, 3, generator=generator.manual_seed(ctx.rank)).requires_grad_()
        out = ulysses_attention(q, q * 2, q * 3, group)
        out.pow(2).sum().backward()
        results.append((out.detach(), q.grad))
    (out, grad), (out_pg, grad_pg) = results
    return (
        float((out - out_pg).abs().max()),
        float((grad - grad_pg).abs().max()),
        dist.get_world_size(mesh().get_group("sp")),
    )

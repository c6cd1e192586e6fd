"""The errors a frontend raises at its boundary, before any plan: a wrong array type, a rank outside the group,
``torch.func.vmap``, JAX axis names that are not names or not bound, the dim of a device mesh.

Like every message of commlib they are the spec's, so both frontends (and their tests) quote the same text;
the plan builders' own checks are `commlib.plans`'.
"""

from __future__ import annotations

from collections.abc import Iterable

from commlib.errors import CommError, comm_error, kind_error
from commlib.plans import check_dim

__all__ = [
    "check_axis_names",
    "mesh_dim",
    "modified_before_wait",
    "no_vmap",
    "not_a_member",
    "unbound_axis",
    "wrong_type",
]


def not_a_member(op_name: str, rank: int, group_ranks: Iterable[int]) -> CommError:
    """The error of a collective called on a rank outside its group (torch: the group's world size is -1 there).

    >>> not_a_member("all_reduce", 2, [0, 1])
    CommError('all_reduce: this rank (global rank 2) is not a member of the group (global ranks [0, 1]): only its members may call its collectives. Received: rank=2, group_ranks=[0, 1]')
    """
    ranks = [int(member) for member in group_ranks]
    message = (
        f"this rank (global rank {rank}) is not a member of the group (global ranks {ranks}): only its "
        f"members may call its collectives"
    )
    return comm_error(op_name, message, rank=rank, group_ranks=ranks)


def wrong_type(op_name: str, name: str, value: object, expected: str) -> TypeError:
    """The error of an op given something that is not the frontend's array type (a numpy array or a list given
    to a torch op, a list given to a JAX op).

    >>> wrong_type("all_reduce", "x", [1.0], "torch.Tensor")
    TypeError("all_reduce: x must be a torch.Tensor, not list. Received: type='list'")
    """
    cls = type(value)
    type_name = (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__.split('.')[0]}.{cls.__qualname__}"
    )
    return kind_error(op_name, f"{name} must be a {expected}, not {type_name}", type=type_name)


def modified_before_wait(op_name: str, version_at_call: int, version_at_wait: int) -> CommError:
    """The error of an op called with ``async_op=True`` whose input was modified in place before ``wait()``:
    the collective may have sent the modified values (torch.distributed's async_op has the same rule).

    >>> error = modified_before_wait("all_gather", 0, 1)
    >>> str(error).split(": the ")[0]
    'all_gather: x was modified in place between the call with async_op=True and wait()'
    >>> str(error).split(". ")[-1]
    'Received: version_at_call=0, version_at_wait=1'
    """
    return comm_error(
        op_name,
        "x was modified in place between the call with async_op=True and wait(): the "
        "collective may have sent the modified values to the other ranks; modify x only after "
        "wait()",
        version_at_call=version_at_call,
        version_at_wait=version_at_wait,
    )


def wait_without_grad(op_name: str) -> CommError:
    """The error of an op called with ``async_op=True`` on an x that requires grad, waited with gradients
    disabled (``torch.no_grad()``): the result would carry no gradient back to x, silently.

    >>> str(wait_without_grad("all_gather")).split(": the ")[0]
    'all_gather: wait() ran with gradients disabled for an x that requires grad'
    """
    return comm_error(
        op_name,
        "wait() ran with gradients disabled for an x that requires grad: the result "
        "would give x no gradient; call wait() where gradients are enabled (the call's mode), or "
        "call the op on x.detach()",
        requires_grad=True,
        grad_enabled=False,
    )


def no_vmap(op_name: str) -> TypeError:
    """The error of a torch op under ``torch.func.vmap`` (JAX's vmap is supported: its batch rules see the
    axis names).

    >>> print(no_vmap("all_reduce"))  # doctest: +ELLIPSIS
    all_reduce: torch.func.vmap is not supported: each rank runs the collective once, not once per batch ...
    """
    message = (
        "torch.func.vmap is not supported: each rank runs the collective once, not once per batch element; "
        "put the batch in the tensor (a leading dim) or loop over it. torch.func.grad, vjp and "
        "functional_call work"
    )
    return kind_error(op_name, message, transform="vmap")


def check_axis_names(op_name: str, axes: tuple) -> None:
    """Raise unless `axes` (a JAX op's ``axis_name`` as a tuple) is one or more distinct mesh axis names (str).

    >>> check_axis_names("all_reduce", ("sp", "sp"))
    Traceback (most recent call last):
    commlib.errors.CommError: all_reduce: axis_name (('sp', 'sp')) names 'sp' twice. Received: axis_name=('sp', 'sp')
    """
    shown = axes if len(axes) != 1 else axes[0]
    for axis in axes:
        if not isinstance(axis, str):
            message = f"axis_name must be a mesh axis name (str) or a tuple of them, not {type(axis).__name__}"
            raise kind_error(op_name, message, axis_name=shown)
    if not axes:
        raise comm_error(op_name, "axis_name (()) must name at least one mesh axis", axis_name=shown)
    for axis in axes:
        if axes.count(axis) > 1:
            raise comm_error(op_name, f"axis_name ({shown!r}) names {axis!r} twice", axis_name=shown)


def unbound_axis(op_name: str, axis_name: object, bound: tuple[str, ...] = ()) -> CommError:
    """The error of a JAX op whose axis name no enclosing ``jax.shard_map`` / ``jax.pmap`` binds (JAX's own is
    ``NameError: unbound axis name``); `bound`: the names the enclosing maps do bind (none: outside every map).

    >>> unbound_axis("all_reduce", "i")
    CommError("all_reduce: axis_name ('i') is not bound here: commlib_jax ops run inside jax.shard_map (over a mesh with that axis) or jax.pmap (axis_name=...), not outside them. Received: axis_name='i'")
    >>> unbound_axis("all_reduce", "j", ("i",))
    CommError("all_reduce: axis_name ('j') is not bound here: the enclosing jax.shard_map / jax.pmap bind ('i',). Received: axis_name='j'")
    """
    message = (
        f"axis_name ({axis_name!r}) is not bound here: commlib_jax ops run inside jax.shard_map (over a "
        f"mesh with that axis) or jax.pmap (axis_name=...), not outside them"
    )
    if bound:
        message = f"axis_name ({axis_name!r}) is not bound here: the enclosing jax.shard_map / jax.pmap bind {bound!r}"
    return comm_error(op_name, message, axis_name=axis_name)


def mesh_dim(op_name: str, mesh_shape: Iterable[int], dim_names: Iterable[str] | None, dim: object = None) -> int:
    """The dim of a device mesh a collective runs over (torch: ``group=mesh`` or ``group=(mesh, dim)``): `dim`, a
    dim name or an index, found in the mesh's `dim_names`; without one the mesh must be 1-D.

    >>> mesh_dim("all_reduce", (2, 2), ("sp", "tp"), "tp")
    1
    >>> mesh_dim("all_reduce", (2, 2), ("sp", "tp"))
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: all_reduce: mesh ndim (2) must be 1 when group is a mesh without a dim: pass (mesh, name) with name one of ('sp', 'tp'). Received: mesh_shape=(2, 2), mesh_dim_names=('sp', 'tp')
    """
    shape, names = tuple(int(size) for size in mesh_shape), None if dim_names is None else tuple(dim_names)
    received: dict[str, object] = dict(mesh_shape=shape, mesh_dim_names=names)
    if dim is None:
        if len(shape) != 1:
            how = (
                f"(mesh, name) with name one of {names}"
                if names
                else (f"(mesh, index) with index in [0, {len(shape)}) (the mesh has no dim names)")
            )
            raise comm_error(
                op_name,
                f"mesh ndim ({len(shape)}) must be 1 when group is a mesh without a dim: pass {how}",
                **received,
            )
        return 0
    received["dim"] = dim
    if isinstance(dim, str):
        if not names:
            raise comm_error(
                op_name,
                f"mesh dim ({dim!r}) must be an index in [0, {len(shape)}): the mesh has no dim names",
                **received,
            )
        if dim not in names:
            raise comm_error(op_name, f"mesh dim ({dim!r}) must be one of the mesh's dim names {names}", **received)
        return names.index(dim)
    if isinstance(dim, bool) or not hasattr(dim, "__index__"):
        raise kind_error(
            op_name, f"mesh dim must be a dim name (str) or an index (int), not {type(dim).__name__}", **received
        )
    return check_dim(op_name, "mesh dim", dim, len(shape), received)

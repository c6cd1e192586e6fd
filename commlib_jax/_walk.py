"""Run a `commlib.Plan` with `jax.lax` collectives (XLA chooses the layout; the plan gives the dims).

Rooted ops are written with masks so every rank runs the same program: broadcast = psum of the source's
value, scatter = psum_scatter of it, gather = all_gather kept on the destination; zeros elsewhere.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from commlib import Plan
from commlib_jax._vma import axis_arg, mesh_order, to_varying

__all__ = ["dtype_name", "run", "rank"]


def dtype_name(dtype) -> str:
    """``jnp.bfloat16 -> "bfloat16"``: the spelling the spec uses (names pass through)."""
    return dtype if isinstance(dtype, str) else jnp.dtype(dtype).name


def rank(axes: tuple):
    """This device's rank along `axes` (row-major over a tuple of names)."""
    return lax.axis_index(axis_arg(axes))


def _on_root(plan: Plan, axes: tuple, x):
    return jnp.where(rank(axes) == plan.root, x, jnp.zeros_like(x))


def _reduce(plan: Plan, axes: tuple, x):
    name = axis_arg(axes)
    if plan.reduce_op in ("sum", "avg"):
        return lax.psum(x, name)
    if plan.reduce_op == "max":
        return lax.pmax(x, name)
    if plan.reduce_op == "min":
        return lax.pmin(x, name)
    return jnp.prod(lax.all_gather(x, name), axis=0, dtype=x.dtype)  # product: no lax primitive


def _collective(plan: Plan, axes: tuple, x):
    name, kind = axis_arg(axes), plan.collective
    if kind == "all_reduce":
        return _reduce(plan, axes, x)
    if kind == "reduce":
        return _on_root(plan, axes, lax.psum(x, name))
    if kind == "broadcast":
        return lax.psum(_on_root(plan, axes, x), name)
    if kind in ("all_gather", "gather"):
        (dim,) = plan.dims
        gathered = lax.all_gather(x, name, axis=dim, tiled=True)
        return gathered if kind == "all_gather" else _on_root(plan, axes, gathered)
    if kind in ("reduce_scatter", "scatter"):
        (dim,) = plan.dims
        source = x if kind == "reduce_scatter" else _on_root(plan, axes, x)
        return lax.psum_scatter(source, name, scatter_dimension=dim, tiled=True)
    if kind == "all_to_all":
        scatter, gather = plan.dims
        return lax.all_to_all(x, name, split_axis=scatter, concat_axis=gather, tiled=True)
    if kind == "permute":
        return _ppermute(plan, axes, x)
    if kind == "identity":
        return x
    raise NotImplementedError(kind)


def _ppermute(plan: Plan, axes: tuple, x):
    """``lax.ppermute`` with commlib's ranks (row-major over `axes` in the order given, as ``axis_index``).

    jax numbers a tuple of axes' ranks for ppermute row-major in the *mesh's* axis order, whatever the
    order of the tuple (its lowering sorts the replica groups), so on a ("x", "y") mesh the ranks of
    ("y", "x") differ. Permuting over the axes in mesh order with the pairs renumbered agrees with either.
    """
    order = mesh_order(axes)
    if order == axes:
        return lax.ppermute(x, axis_arg(axes), perm=plan.pairs)
    sizes = {axis: lax.axis_size(axis) for axis in axes}

    def renumber(rank: int) -> int:
        coordinates = {}
        for axis in reversed(axes):
            rank, coordinates[axis] = divmod(rank, sizes[axis])
        index = 0
        for axis in order:
            index = index * sizes[axis] + coordinates[axis]
        return index

    pairs = [(renumber(source), renumber(destination)) for source, destination in plan.pairs]
    return lax.ppermute(x, axis_arg(order), perm=pairs)


def run(plan: Plan, axes: tuple, x):
    """This rank's output of `plan` for input `x`, typed varying over `axes`, in x's dtype."""
    buffer = x if plan.accum_dtype is None else x.astype(plan.accum_dtype)
    out = _collective(plan, axes, buffer)
    if plan.scale != 1.0:
        out = out * jnp.asarray(plan.scale, out.dtype)
    return to_varying(out.astype(x.dtype), axes)

"""Run a `commlib.Plan` with `jax.lax` collectives (XLA chooses the layout; the plan gives the dims).

Rooted ops are written with masks so every rank runs the same program: broadcast = psum of the source's
value, scatter = psum_scatter of it, gather = all_gather kept on the destination, reduce = psum kept on it;
zeros elsewhere. The local steps of gradient plans (identity, slice, pad) move no data between ranks.

Uneven sizes are held padded (`commlib.uneven`): every device's sharded dim has the largest size; the plan's
static index maps (`commlib.layout.Take`) run before and after the even collective on the padded shapes, as one
``jnp.take`` each (rows that map nowhere become zeros); an uneven local step is its map alone.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from commlib import Collective, Plan, ReduceOp
from commlib.layout import Take, reorder_pairs
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
    if plan.reduce_op in (ReduceOp.SUM, ReduceOp.AVG):
        return lax.psum(x, name)
    if plan.reduce_op is ReduceOp.MAX:
        return lax.pmax(x, name)
    if plan.reduce_op is ReduceOp.MIN:
        return lax.pmin(x, name)
    return jnp.prod(lax.all_gather(x, name), axis=0, dtype=x.dtype)  # product: no lax primitive


def _collective(plan: Plan, axes: tuple, x):
    name, kind = axis_arg(axes), plan.collective
    if kind is Collective.ALL_REDUCE:
        return _reduce(plan, axes, x)
    if kind is Collective.REDUCE:
        return _on_root(plan, axes, lax.psum(x, name))
    if kind is Collective.BROADCAST:
        return lax.psum(_on_root(plan, axes, x), name)
    if kind in (Collective.ALL_GATHER, Collective.GATHER):
        (dim,) = plan.dims
        gathered = lax.all_gather(x, name, axis=dim, tiled=True)
        return gathered if kind is Collective.ALL_GATHER else _on_root(plan, axes, gathered)
    if kind in (Collective.REDUCE_SCATTER, Collective.SCATTER):
        (dim,) = plan.dims
        source = x if kind is Collective.REDUCE_SCATTER else _on_root(plan, axes, x)
        return lax.psum_scatter(source, name, scatter_dimension=dim, tiled=True)
    if kind is Collective.ALL_TO_ALL:
        scatter_dim, gather_dim = plan.dims
        return lax.all_to_all(x, name, split_axis=scatter_dim, concat_axis=gather_dim, tiled=True)
    if kind is Collective.PERMUTE:
        return _ppermute(plan, axes, x)
    return _local(plan, axes, x)


def _local(plan: Plan, axes: tuple, x):
    """identity, slice (this rank's block) or pad (this rank's block of zeros)."""
    if plan.collective is Collective.IDENTITY:
        return x
    (dim,) = plan.dims
    if plan.collective is Collective.SLICE:
        block = plan.out_shape[dim]
        return lax.dynamic_slice_in_dim(x, rank(axes) * block, block, axis=dim)
    block = x.shape[dim]
    return lax.dynamic_update_slice_in_dim(jnp.zeros(plan.out_shape, x.dtype), x, rank(axes) * block, axis=dim)


def _ppermute(plan: Plan, axes: tuple, x):
    """``lax.ppermute`` with commlib's ranks (row-major over `axes` in the order given, as ``axis_index``).

    jax numbers a tuple of axes' ranks for ppermute row-major in the *mesh's* axis order, whatever the
    order of the tuple (its lowering sorts the replica groups): permute over the axes in mesh order with the
    pairs renumbered by the spec (`commlib.layout.reorder_pairs`).
    """
    order = mesh_order(axes)
    if order == axes:
        return lax.ppermute(x, axis_arg(axes), perm=plan.pairs)
    sizes = tuple(lax.axis_size(axis) for axis in axes)
    pairs = reorder_pairs(plan.pairs, sizes, tuple(axes.index(axis) for axis in order))
    return lax.ppermute(x, axis_arg(order), perm=pairs)


def _take(step: Take | None, axes: tuple, x):
    """The padded layout's static index map along ``step.dim`` (zeros where it maps nowhere): a shared map as
    the concatenation of its runs (static slices and zeros: one fused pass), a per-rank map as a gather of
    this rank's row of the table."""
    if step is None:
        return x
    if step.per_rank:
        index = jnp.asarray(step.table())[rank(axes)]
        return jnp.take(x, index, axis=step.dim, mode="fill", fill_value=0)
    zeros = lambda rows: jnp.zeros((*x.shape[:step.dim], rows, *x.shape[step.dim + 1:]), x.dtype)  # noqa: E731
    parts = [zeros(rows) if start is None else lax.slice_in_dim(x, start, start + rows, axis=step.dim)
             for start, rows in step.runs()]
    return jnp.concatenate(parts, axis=step.dim) if parts else zeros(0)


def run(plan: Plan, axes: tuple, x):
    """This rank's output of `plan` for input `x`, typed varying over `axes`, in x's dtype."""
    buffer = _take(plan.before, axes, x if plan.accum_dtype is None else x.astype(plan.accum_dtype))
    scale = jnp.asarray(plan.scale, buffer.dtype)
    if plan.scale_first and plan.scale != 1.0:  # half-precision avg: scale before the sum, which could overflow
        buffer = buffer * scale
    uneven_local = plan.is_uneven and plan.collective.is_local  # the map was the step
    out = _take(plan.after, axes, buffer if uneven_local else _collective(plan, axes, buffer))
    if plan.scale != 1.0 and not plan.scale_first:
        out = out * scale
    return to_varying(out.astype(x.dtype), axes)

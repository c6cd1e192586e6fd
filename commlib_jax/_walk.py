"""Run a `commlib.Plan` with `jax.lax` collectives (XLA chooses the layout; the plan gives the dims).

Rooted ops are written with masks so every rank runs the same program: broadcast = psum of the source's
value, scatter = psum_scatter of it, gather = all_gather kept on the destination, reduce = psum kept on it;
zeros elsewhere. The local steps of gradient plans (identity, slice, pad) move no data between ranks.

Uneven sizes are held padded (`commlib.uneven`): every device's sharded dim has the largest size; the plan's
static index maps (`commlib.layout.Take`) run before and after the even collective on the padded shapes, as one
``jnp.take`` each (rows that map nowhere become zeros); an uneven local step is its map alone.
"""

from __future__ import annotations

from typing import assert_never

import jax
import jax.numpy as jnp
from jax import lax

from commlib import Plan, ReduceOp
from commlib.layout import Padded, Take, completed_pairs, reorder_pairs
from commlib.steps import (
    AllGather,
    AllReduce,
    AllToAll,
    Broadcast,
    Gather,
    Identity,
    Pad,
    Permute,
    Reduce,
    ReduceScatter,
    Scatter,
    Slice,
)
from commlib_jax._compat import manual_axes
from commlib_jax._vma import axis_arg, mesh_order, rank, to_varying

__all__ = ["run"]


def _on_root(root: int, axes: tuple[str, ...], x: jax.Array) -> jax.Array:
    return jnp.where(rank(axes) == root, x, jnp.zeros_like(x))


def _reduce(op: ReduceOp, axes: tuple[str, ...], x: jax.Array) -> jax.Array:
    name = axis_arg(axes)
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return lax.psum(x, name)
    if op is ReduceOp.MAX:
        return lax.pmax(x, name)
    if op is ReduceOp.MIN:
        return lax.pmin(x, name)
    return jnp.prod(lax.all_gather(x, name), axis=0, dtype=x.dtype)  # product: no lax primitive


def _step(plan: Plan, axes: tuple[str, ...], x: jax.Array) -> jax.Array:
    """The plan's step on this rank's buffer."""
    name, step = axis_arg(axes), plan.step
    match step:
        case AllReduce(op=op):
            return _reduce(op, axes, x)
        case Reduce(root=root):
            return _on_root(root, axes, lax.psum(x, name))
        case Broadcast(root=root):
            return lax.psum(_on_root(root, axes, x), name)
        case AllGather(dim=dim):
            return lax.all_gather(x, name, axis=dim, tiled=True)
        case Gather(dim=dim, root=root):
            return _on_root(root, axes, lax.all_gather(x, name, axis=dim, tiled=True))
        case ReduceScatter(dim=dim):
            return lax.psum_scatter(x, name, scatter_dimension=dim, tiled=True)
        case Scatter(dim=dim, root=root):
            return _scatter_sum(_on_root(root, axes, x), name, dim)
        case AllToAll(scatter_dim=scatter_dim, gather_dim=gather_dim):
            return lax.all_to_all(x, name, split_axis=scatter_dim, concat_axis=gather_dim, tiled=True)
        case Permute(pairs=pairs):
            return _ppermute(pairs, axes, x)
        case Identity():
            return x
        case Slice(dim=dim):  # this rank's block
            block = plan.out_shape[dim]
            return lax.dynamic_slice_in_dim(x, rank(axes) * block, block, axis=dim)
        case Pad(dim=dim):  # this rank's block of zeros
            block = x.shape[dim]
            return lax.dynamic_update_slice_in_dim(jnp.zeros(plan.out_shape, x.dtype), x, rank(axes) * block, axis=dim)
        case _:
            assert_never(step)


def _scatter_sum(x: jax.Array, name: str | tuple[str, ...], dim: int) -> jax.Array:
    """``psum_scatter`` of the masked source, which has no bool: bool travels as uint8 (one rank's value and
    zeros: the sum is that value) and comes back as bool."""
    if x.dtype != jnp.bool_:
        return lax.psum_scatter(x, name, scatter_dimension=dim, tiled=True)
    return lax.psum_scatter(x.astype(jnp.uint8), name, scatter_dimension=dim, tiled=True).astype(jnp.bool_)


def _ppermute(pairs: tuple[tuple[int, int], ...], axes: tuple[str, ...], x: jax.Array) -> jax.Array:
    """``lax.ppermute`` with commlib's ranks (row-major over `axes` in the order given, as ``axis_index``).

    jax numbers a tuple of axes' ranks for ppermute row-major in the *mesh's* axis order, whatever the
    order of the tuple (its lowering sorts the replica groups): permute over the axes in mesh order with the
    pairs renumbered by the spec (`commlib.layout.reorder_pairs`).
    """
    order = mesh_order(axes)
    if order != axes:
        sizes = tuple(lax.axis_size(axis) for axis in axes)
        pairs, axes = reorder_pairs(pairs, sizes, tuple(axes.index(axis) for axis in order)), order
    if len(pairs) < lax.axis_size(axis_arg(axes)) and not set(axes) <= set(manual_axes()):
        # jax.vmap's batching rule takes full permutations only (jax 0.10.2: a raw "AssertionError: Permutation
        # doesn't match the axis size!", raised after tracing); outside shard_map vmap and pmap look alike
        return _full_ppermute(pairs, axes, x)
    return lax.ppermute(x, axis_arg(axes), perm=pairs)


def _full_ppermute(pairs: tuple[tuple[int, int], ...], axes: tuple[str, ...], x: jax.Array) -> jax.Array:
    """A partial permute as the completed permutation (`commlib.layout.completed_pairs`) with zeros at the
    ranks that are no destination of `pairs`."""
    name = axis_arg(axes)
    moved = lax.ppermute(x, name, perm=completed_pairs(pairs, lax.axis_size(name)))
    destinations = jnp.asarray(sorted({destination for _, destination in pairs}), dtype=jnp.int32)
    return jnp.where(jnp.isin(lax.axis_index(name), destinations), moved, jnp.zeros_like(moved))


def _take(step: Take | None, axes: tuple[str, ...], x: jax.Array) -> jax.Array:
    """The padded layout's static index map along ``step.dim`` (zeros where it maps nowhere): a shared map as
    the concatenation of its runs (static slices and zeros: one fused pass), a per-rank map as a gather of
    this rank's row of the table."""
    if step is None:
        return x
    if step.per_rank:
        index = jnp.asarray(step.table())[rank(axes)]
        return jnp.take(x, index, axis=step.dim, mode="fill", fill_value=0)
    zeros = lambda rows: jnp.zeros((*x.shape[: step.dim], rows, *x.shape[step.dim + 1 :]), x.dtype)  # noqa: E731
    parts = [
        zeros(rows) if start is None else lax.slice_in_dim(x, start, start + rows, axis=step.dim)
        for start, rows in step.runs()
    ]
    return jnp.concatenate(parts, axis=step.dim) if parts else zeros(0)


def run(plan: Plan, axes: tuple[str, ...], x: jax.Array) -> jax.Array:
    """This rank's output of `plan` for input `x`, typed varying over `axes`, in x's dtype."""
    arithmetic, sized = plan.arithmetic, plan.uneven
    before, after = (sized.before, sized.after) if isinstance(sized, Padded) else (None, None)
    buffer = _take(before, axes, x if arithmetic.accum_dtype is None else x.astype(arithmetic.accum_dtype))
    scale = jnp.asarray(arithmetic.scale, buffer.dtype)
    if arithmetic.scale_first and arithmetic.scale != 1.0:  # half-precision avg: scale before the sum, which could
        buffer = buffer * scale  # overflow
    uneven_local = sized is not None and plan.step.is_local  # the map was the step
    out = _take(after, axes, buffer if uneven_local else _step(plan, axes, buffer))
    if arithmetic.scale != 1.0 and not arithmetic.scale_first:
        out = out * scale
    return to_varying(out.astype(x.dtype), axes)

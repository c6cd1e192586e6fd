"""CFG parallelism over `jax.lax` (inside ``shard_map`` / ``pmap``): `cfg_split` and `cfg_combine`, the spec's
formulas (`commlib.cfg`) on commlib's ``shard`` and ``all_gather``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from commlib import cfg as spec
from commlib.frontend_errors import wrong_type
from commlib_jax._op import axis_size
from commlib_jax._types import ARRAY_NAME, ARRAY_TYPES, Array, AxisName
from commlib_jax._vma import axes_of, rank, shared_axes
from commlib_jax.functional import all_gather, shard

__all__ = ["cfg_split", "cfg_combine"]


def _arrays(op_name: str, **arrays: object) -> None:
    for name, value in arrays.items():
        if not isinstance(value, ARRAY_TYPES):
            raise wrong_type(op_name, name, value, ARRAY_NAME)


def cfg_split(uncond: Array, cond: Array, axis_name: AxisName, *, dim: int = 0) -> jax.Array:
    """This rank's pass of classifier-free guidance: over a cfg axis of 2 ranks, rank 0 gets `uncond` and rank 1
    `cond`; over 1 rank, ``concatenate([uncond, cond], dim)`` (the batch of both passes). One formula,
    ``shard(concatenate([uncond, cond], dim), axis_name, dim)``: no communication forward; gradient: the
    cotangents all-gathered (both ranks get the full gradient of `uncond` and `cond`, replicated over the axis).
    Inputs typed invariant over the axis (``in_specs=P()`` under ``check_vma=True``), whose gradient JAX sums
    over the ranks itself, are sliced at ``lax.axis_index`` instead (no second sum): the same full gradient.

    Args:
        uncond, cond: the same shape and dtype on both ranks.
        axis_name: the cfg mesh axis (1 or 2 ranks) of the enclosing ``shard_map`` / ``pmap``.
        dim: the batch dim the passes are stacked along at W = 1.

    Raises:
        CommError: an axis of more than 2 ranks, shapes that differ, `dim` out of range.
        TypeError: uncond or cond not arrays, dim not an int.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:2], ("cfg",))
        >>> f = jax.shard_map(lambda u, c: cfg_split(u, c, "cfg"), mesh=mesh, in_specs=P(), out_specs=P("cfg"))
        >>> f(jnp.zeros((1, 3)), jnp.ones((1, 3)))  # rank 0's row, then rank 1's
        Array([[0., 0., 0.],
               [1., 1., 1.]], dtype=float32)
    """
    _arrays(spec.SPLIT_OP, uncond=uncond, cond=cond)
    size = axis_size(spec.SPLIT_OP, axes_of(axis_name))
    axis = spec.check_split(spec.SPLIT_OP, uncond.shape, cond.shape, size, dim)
    both, axes = jnp.concatenate([uncond, cond], axis=axis), axes_of(axis_name)
    if size > 1 and shared_axes(both, axes) == tuple(name for name in axes if lax.axis_size(name) > 1):
        # typed invariant (check_vma=True): JAX sums the gradient of a shared value itself, so take the slice
        rows = both.shape[axis] // size
        return lax.dynamic_slice_in_dim(both, rank(axes) * rows, rows, axis)
    return shard(both, axis_name, axis)


def cfg_combine(
    out: Array, guidance_scale: float, axis_name: AxisName, *, dim: int = 0, convention: str = "sum"
) -> jax.Array:
    """The guided result ``uncond + guidance_scale * (cond - uncond)`` of this rank's pass `out`: over 2 ranks the
    two ranks' outputs all-gathered once along `dim` (``shape[dim]`` as `out`'s, the same value on both ranks);
    over 1 rank the two halves of `out` along `dim` (``shape[dim] / 2``). Equal, value for value, to the
    one-group step.

    Args:
        out: this rank's output (both passes' batch at W = 1), any floating dtype.
        guidance_scale: the guidance weight (a finite number).
        axis_name: the cfg mesh axis, as `cfg_split`'s.
        dim: the dim `cfg_split` stacked the passes along.
        convention: the all_gather's gradient convention: "sum" (each rank's loss is its own) or "replicated"
            (both ranks compute the same loss from the guided output: it counts once).

    Raises:
        CommError: an axis of more than 2 ranks, `dim` out of range, an odd ``shape[dim]`` at W = 1, a scale
            that is not finite, an unknown convention.
        TypeError: out not an array, guidance_scale not a number.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:2], ("cfg",))
        >>> f = jax.shard_map(lambda out: cfg_combine(out, 2.0, "cfg"), mesh=mesh, in_specs=P("cfg"),
        ...                   out_specs=P("cfg"))
        >>> f(jnp.array([[1.0, 2.0], [3.0, 5.0]]))  # rank 0: uncond, rank 1: cond; both ranks get the result
        Array([[5., 8.],
               [5., 8.]], dtype=float32)
    """
    _arrays(spec.COMBINE_OP, out=out)
    size = axis_size(spec.COMBINE_OP, axes_of(axis_name))
    axis, scale = spec.check_combine(spec.COMBINE_OP, out.shape, size, dim, guidance_scale)
    both = all_gather(out, axis_name, axis, convention=convention)  # W = 1: `out` itself, no communication
    uncond, cond = jnp.split(both, 2, axis=axis)
    return spec.guide(uncond, cond, scale)

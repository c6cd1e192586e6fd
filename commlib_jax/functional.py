"""Differentiable collectives over `jax.lax`, for use inside `jax.shard_map` (check_vma True or False)
and `jax.pmap`.

Each public function validates through the spec (`commlib.ops`) at trace time -- the same `CommError` /
`TypeError` text as the torch frontend -- then applies `_collective`, a `jax.custom_vjp` whose backward
walks the transposed plan (so higher derivatives work); all_reduce max/min/product get their true VJPs.
`axis_name` is a mesh axis name or a tuple of them (rank order row-major). Ranks (`src`, `dst`, `perm`)
are indices along it. Where the op is the identity (world size 1) it returns its input.

Gradients follow ``convention="sum"`` -- rank r's loss is its own and the objective is their sum, as in
torch.distributed -- in every mode: outputs and cotangents are typed varying (see `commlib_jax._vma`).
``convention="replicated"`` is accepted where the op has it; see docs/gradients.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from commlib import ops
from commlib.layout import Plan
from commlib_jax._vma import axes_of, axis_arg, to_varying
from commlib_jax._walk import dtype_name, rank, run

__all__ = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_4d",
    "broadcast",
    "gather",
    "scatter",
    "permute",
    "sum_grad",
]

_NONLINEAR = ("max", "min", "product")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _collective(plan: Plan, axes: tuple, x):
    return run(plan, axes, x)


def _forward(plan: Plan, axes: tuple, x):
    # `_collective`, not `run`: differentiating the VJP again (a gradient penalty) differentiates this
    # forward too, and must use commlib's rules -- lax has none for pmax/pmin, and its own for the rest.
    out = _collective(plan, axes, x)
    return out, ((x, out) if plan.reduce_op in _NONLINEAR else None)


def _backward(plan: Plan, axes: tuple, residuals, cotangent):
    return (to_varying(_vjp(plan, axes, residuals, cotangent), axes),)


_collective.defvjp(_forward, _backward)


def _vjp(plan: Plan, axes: tuple, residuals, cotangent):
    if plan.reduce_op in _NONLINEAR and plan.collective == "all_reduce":
        return _nonlinear_vjp(plan, axes, residuals, cotangent)
    if plan.convention == "replicated" and plan.collective == "all_reduce":
        return cotangent if plan.scale == 1.0 else cotangent * jnp.asarray(plan.scale, cotangent.dtype)
    if plan.convention == "replicated" and plan.collective == "all_gather":
        (dim,) = plan.dims
        size = cotangent.shape[dim] // plan.world_size
        return lax.dynamic_slice_in_dim(cotangent, rank(axes) * size, size, axis=dim)
    return _collective(ops.transpose(plan), axes, cotangent)


def _nonlinear_vjp(plan: Plan, axes: tuple, residuals, cotangent):
    """max/min: incoming cotangent on the rank(s) holding the extremum, split among ties; product:
    incoming times the product of the other ranks' values (exact at zeros)."""
    x, out = residuals
    name = axis_arg(axes)
    incoming = cotangent if plan.convention == "replicated" else lax.psum(cotangent, name)
    if plan.reduce_op == "product":
        everyone = lax.all_gather(x, name)
        own = jnp.arange(plan.world_size).reshape((-1,) + (1,) * x.ndim) == rank(axes)
        return incoming * jnp.prod(jnp.where(own, jnp.ones_like(everyone), everyone), axis=0)
    hits = (x == out).astype(cotangent.dtype)
    return incoming * hits / lax.psum(hits, name)


def _apply(plan: Plan, axes: tuple, x):
    if plan.is_empty:  # XLA rejects zero-size all_gather / reduce_scatter dims, and nothing moves anyway
        return to_varying(x, axes).reshape(plan.out_shape)
    return x if plan.is_trivial else _collective(plan, axes, to_varying(x, axes))


def _world_size(axes: tuple) -> int:
    return lax.axis_size(axis_arg(axes))


def all_reduce(x, axis_name, op="sum", *, convention="sum", accum_dtype=None):
    """Reduce `x` over `axis_name`; every rank gets the result. ``[*s] -> [*s]``.

    Args:
        op: "sum" | "avg" (= sum / W) | "max" | "min" | "product" (or a `commlib.ReduceOp`). Integer and
            bool arrays: forward only.
        convention: "sum": the incoming cotangent is the sum of all ranks' cotangents; "replicated": it is
            this rank's own (Megatron's g). sum: grad = incoming; avg: incoming / W; max/min: incoming on
            the rank(s) holding the extremum, split equally among ties; product: incoming times the product
            of the other ranks' values.
        accum_dtype: e.g. ``jnp.float32`` for bf16 input: reduce in that dtype, return x's dtype.

    Raises:
        CommError: unknown op, avg on an integer dtype, non-floating accum_dtype. TypeError: wrong kinds.
    """
    axes = axes_of(axis_name)
    accum = None if accum_dtype is None else dtype_name(accum_dtype)
    plan = ops.all_reduce(
        x.shape, _world_size(axes), op, dtype=dtype_name(x.dtype), convention=convention, accum_dtype=accum
    )
    return _apply(plan, axes, x)


def all_gather(x, axis_name, dim=-1, *, convention="sum"):
    """Concatenate every rank's `x` along `dim` in rank order: ``shape[dim] *= W``.

    Backward: "sum" -> reduce_scatter(sum) of the cotangent; "replicated" -> this rank's block of it.
    Same value as ``lax.all_gather(x, axis_name, axis=dim, tiled=True)``.

    Raises:
        CommError: `dim` out of range.
    """
    axes = axes_of(axis_name)
    return _apply(ops.all_gather(x.shape, _world_size(axes), dim, convention=convention), axes, x)


def reduce_scatter(x, axis_name, dim=0, op="sum", *, accum_dtype=None):
    """Reduce over ranks and keep block `rank` of `dim`: ``shape[dim] /= W``; op in {"sum", "avg"}.

    Same value as ``lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)`` (/ W for avg).
    Backward: all_gather of the cotangent (/ W for avg).

    Raises:
        CommError: ``shape[dim]`` not divisible by W, op not sum/avg, avg on integers.
    """
    axes = axes_of(axis_name)
    accum = None if accum_dtype is None else dtype_name(accum_dtype)
    plan = ops.reduce_scatter(x.shape, _world_size(axes), dim, op, dtype=dtype_name(x.dtype), accum_dtype=accum)
    return _apply(plan, axes, x)


def all_to_all(x, axis_name, scatter_dim, gather_dim):
    """Block j of `scatter_dim` goes to rank j; received blocks are concatenated along `gather_dim` in rank
    order: ``shape[scatter_dim] /= W``, ``shape[gather_dim] *= W`` (``lax.all_to_all(..., tiled=True)``).

    Backward: all_to_all of the cotangent with the dims swapped.

    Raises:
        CommError: dims out of range or equal, ``shape[scatter_dim]`` not divisible by W.
    """
    axes = axes_of(axis_name)
    return _apply(ops.all_to_all(x.shape, _world_size(axes), scatter_dim, gather_dim), axes, x)


def all_to_all_4d(x, axis_name, scatter_dim=2, gather_dim=1):
    """Ulysses all-to-all on ``[batch, seq, heads, head_dim]``.

    ``(2, 1)``: ``[B, S/W, H, D] -> [B, S, H/W, D]``; ``(1, 2)``: ``[B, S, H/W, D] -> [B, S/W, H, D]``.
    Backward: the other direction.

    Raises:
        CommError: ndim != 4, other dim pairs, heads (or seq) not divisible by W.
    """
    axes = axes_of(axis_name)
    return _apply(ops.all_to_all_4d(x.shape, _world_size(axes), scatter_dim, gather_dim), axes, x)


def broadcast(x, axis_name, src=0):
    """Every rank gets rank `src`'s `x`. Backward: the cotangents summed on `src`, zeros elsewhere.

    Raises:
        CommError: `src` not in [0, W).
    """
    axes = axes_of(axis_name)
    return _apply(ops.broadcast(x.shape, _world_size(axes), src), axes, x)


def gather(x, axis_name, dst=0, dim=-1):
    """Rank `dst` gets every rank's `x` concatenated along `dim` (``shape[dim] *= W``); other ranks get
    zeros of that shape. Backward: scatter of `dst`'s cotangent.

    Raises:
        CommError: `dst` not in [0, W), `dim` out of range.
    """
    axes = axes_of(axis_name)
    return _apply(ops.gather(x.shape, _world_size(axes), dst, dim), axes, x)


def scatter(x, axis_name, src=0, dim=0):
    """Rank r gets block r of rank `src`'s `x` along `dim` (``shape[dim] /= W``); the other ranks' `x` is
    not read. Backward: gather of the cotangents to `src`.

    Raises:
        CommError: `src` not in [0, W), `dim` out of range, ``shape[dim]`` not divisible by W.
    """
    axes = axes_of(axis_name)
    return _apply(ops.scatter(x.shape, _world_size(axes), src, dim), axes, x)


def permute(x, axis_name, perm):
    """For each ``(src, dst)`` in `perm`, rank dst gets rank src's `x` (``lax.ppermute``); a rank that is no
    destination gets zeros. Backward: the inverse permutation.

    Raises:
        CommError: a rank out of range, a repeated source or destination. TypeError: `perm` not pairs.
    """
    axes = axes_of(axis_name)
    return _apply(ops.permute(x.shape, _world_size(axes), perm), axes, x)


def sum_grad(x, axis_name):
    """Identity forward; backward all_reduce(sum) of the cotangent (Megatron's f, the conjugate of
    ``all_reduce(..., convention="replicated")``)."""
    axes = axes_of(axis_name)
    return _apply(ops.sum_grad(x.shape, _world_size(axes)), axes, x)

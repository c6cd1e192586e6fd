"""The JAX side of commlib's one autograd rule: `collective`, the `jax.custom_vjp` every public op applies.

Its forward walks the plan (`commlib.gradients.forward`), its backward is the spec's VJP
(`commlib.gradients.vjp`) whose collectives are `collective`s again, so higher derivatives follow the same
rules; outputs and cotangents are typed varying over the op's axes (`commlib_jax._vma`). `world_size` checks
what only JAX can see (an array, a bound axis name) before the plan builder runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from commlib import frontend_errors, gradients
from commlib.layout import Plan
from commlib_jax._compat import bound_axis_names
from commlib_jax._dtypes import dtype_name
from commlib_jax._types import ARRAY_NAME, ARRAY_TYPES, Array
from commlib_jax._vma import axis_arg, rank, to_varying
from commlib_jax._walk import run
from commlib_jax.testing_trace import ACTIVE, recorded_op

__all__ = ["collective", "apply", "axis_size", "world_size", "accum"]


class _Backend:
    """`commlib.gradients.Backend` on jax arrays over `axes`: the plan walked (`differentiable` False: inside
    a forward) or `collective` again (inside a VJP, so higher derivatives follow the same rules)."""

    def __init__(self, axes: tuple[str, ...], differentiable: bool) -> None:
        self.axes, self.differentiable = axes, differentiable

    def collective(self, plan: Plan, x: jax.Array) -> jax.Array:
        return _apply(plan, self.axes, x) if self.differentiable else run(plan, self.axes, x)

    def isnan(self, x: jax.Array) -> jax.Array:
        return jnp.isnan(x)

    def astype(self, x: jax.Array, dtype: str | jax.Array) -> jax.Array:  # (a name, or an array's dtype)
        return x.astype(dtype if isinstance(dtype, str) else dtype.dtype)

    def where(self, condition: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.where(condition, x, y)

    def prod(self, x: jax.Array, axis: int) -> jax.Array:
        return jnp.prod(x, axis=axis)

    def expand_dims(self, x: jax.Array, axis: int) -> jax.Array:
        return jnp.expand_dims(x, axis)

    def own_rank(self, world_size: int, ndim: int) -> jax.Array:
        return jnp.arange(world_size).reshape((world_size,) + (1,) * (ndim - 1)) == rank(self.axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def collective(plan: Plan, axes: tuple[str, ...], x: Array) -> jax.Array:
    return gradients.forward(_Backend(axes, differentiable=False), plan, x)


def _forward(plan: Plan, axes: tuple[str, ...], x: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    # `collective`, not `run`: differentiating the VJP again (a gradient penalty) differentiates this
    # forward too, and must use commlib's rules -- lax has none for pmax/pmin, and its own for the rest.
    out = collective(plan, axes, x)
    return out, ((x, out) if gradients.needs_primal(plan) else None)


def _backward(
    plan: Plan, axes: tuple[str, ...], residuals: tuple[jax.Array, jax.Array] | None, cotangent: jax.Array
) -> tuple[jax.Array]:
    x, out = residuals if residuals is not None else (None, None)
    backend = _Backend(axes, differentiable=True)
    return (to_varying(gradients.vjp(backend, plan, x, out, cotangent), axes),)


collective.defvjp(_forward, _backward)


def apply(plan: Plan, axes: tuple[str, ...], x: Array) -> jax.Array:
    """`plan` applied to `x` through `collective`; recorded while `commlib_jax.testing_trace.record()` is active
    (outside every recorded call; the backward's collectives, `_apply`, are not)."""
    if ACTIVE and not ACTIVE[-1].depth:
        return recorded_op(plan, axes, x, _apply)
    return _apply(plan, axes, x)


def _apply(plan: Plan, axes: tuple[str, ...], x: Array) -> jax.Array:
    if plan.is_empty:  # XLA rejects zero-size all_gather / reduce_scatter dims, and nothing moves anyway
        return jnp.reshape(to_varying(x, axes), plan.out_shape)
    # (a numpy x is taken as a jax array: `jnp.asarray` of a jax array is that array)
    return jnp.asarray(x) if plan.is_trivial else collective(plan, axes, to_varying(x, axes))


def axis_size(op_name: str, axes: tuple[str, ...]) -> int:
    """The size of `axes`, after the spec's checks of what only JAX can see: `axes` names of mesh axes, bound
    by an enclosing shard_map / pmap (JAX's own error is ``NameError: unbound axis name``)."""
    frontend_errors.check_axis_names(op_name, axes)
    try:
        return lax.axis_size(axis_arg(axes))
    except NameError:
        raise frontend_errors.unbound_axis(op_name, axis_arg(axes), bound_axis_names()) from None


def world_size(op_name: str, x: object, axes: tuple[str, ...]) -> int:
    """`axis_size`, after checking that `x` is an array."""
    if not isinstance(x, (*ARRAY_TYPES, np.generic)):
        raise frontend_errors.wrong_type(op_name, "x", x, ARRAY_NAME)
    return axis_size(op_name, axes)


def accum(accum_dtype: DTypeLike | None) -> str | None:
    return None if accum_dtype is None else dtype_name(accum_dtype)

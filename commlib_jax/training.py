"""The torch training step, ported line for line: `value_and_grad` (see docs/training.md).

In torch every rank's parameters are its own tensors: ``loss.backward()`` gives each rank its gradient under
commlib's rules (Megatron f = `sum_grad`, g = ``all_reduce(..., convention="replicated")``, Ulysses
all-to-alls), and the gradients are then all_reduced over the data / sequence ranks. JAX differs in one place:
under ``shard_map(check_vma=True)`` a parameter given with ``in_specs=P()`` (or closed over) is one value
shared by all ranks, and JAX's transpose sums its gradient over every rank -- over the TP copies too, which
f and g already account for -- so the same program gives 2x or 4x the gradient (docs/training.md has the
table). `value_and_grad` takes the gradient the torch way in every mode, and returns it typed like the
parameter, so it can leave the shard_map with the parameter's own spec.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax

from commlib import training
from commlib_jax._compat import JitKeyedState, manual_axes
from commlib_jax._types import AxisName
from commlib_jax._vma import axes_of, axis_arg, checked_axes, to_varying, varying_axes

__all__ = ["value_and_grad"]

#: The axes the `value_and_grad` being traced sums over (None outside one): read by `cross_entropy` when traced,
#: and part of jit's cache key, so a function jitted outside `value_and_grad` and called inside it (or the
#: reverse) is traced again rather than keeping the other mode's `cross_entropy`.
_SUMMED_AXES = JitKeyedState("commlib_value_and_grad_axes")


def _mesh_axes() -> tuple:
    """The manual axes of the enclosing shard_map whose types are checked (none under pmap / vmap)."""
    return checked_axes(manual_axes())


def _reduce(x: jax.Array, total: tuple, mean: tuple) -> jax.Array:
    """Sum `x` over `total` and average it over `mean` (one all-reduce over both)."""
    axes = total + mean
    if not axes:
        return x
    x = lax.psum(x, axis_arg(axes))
    return x / lax.axis_size(axis_arg(mean)) if mean else x


def summed_axes() -> tuple | None:
    """The data / sequence axes the innermost `value_and_grad` being traced sums the losses over (None outside
    one): `commlib_jax.sequence.cross_entropy` returns each rank's share of the mean there."""
    return _SUMMED_AXES.get()


def _own_copies(args: tuple, numbers: tuple[int, ...], mesh_axes: tuple) -> tuple:
    """`args` with every argument differentiated (`numbers`) cast to each rank's own copy, as in torch."""
    own = list(args)
    for number in numbers:
        own[number] = jax.tree.map(lambda p: to_varying(p, mesh_axes), args[number])
    return tuple(own)


def value_and_grad(
    fun: Callable[..., Any], axis_name: AxisName, *, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """``fun(*args) -> loss`` (or ``(loss, aux)`` with `has_aux`) -> ``step(*args) -> (loss, grads)`` (or
    ``((loss, aux), grads)``), to call inside ``jax.shard_map`` (check_vma True or False) or ``jax.pmap``:
    torch's ``loss.backward()`` on every rank followed by ``all_reduce(p.grad)`` over the data / sequence axes
    `axis_name`. The signature of ``jax.value_and_grad``: `argnums` picks the arguments differentiated (an
    int: grads like that argument; a sequence: a tuple of them), `has_aux` returns fun's aux, this rank's own
    (not reduced).

    Args:
        fun: this rank's loss (a scalar) from the arguments, written as in torch: commlib's f/g and attention
            layers over the model-parallel axes, the loss of this rank's tokens, or
            `commlib_jax.sequence.cross_entropy` (the mean over every rank's tokens).
        axis_name: the data / sequence axis name or tuple of names: the gradients are summed over them.

    Returns:
        `step`. Its loss is the sum over `axis_name` of the ranks' losses: the unsharded loss when each rank's
        loss covers its own tokens (a per-rank share, such as a sum over its tokens divided by the global
        count), and the global mean for `commlib_jax.sequence.cross_entropy` (not W times it: inside `step` it
        returns each rank's share). Its grads are the unsharded gradients of the differentiated arguments:
        each rank's gradient of its own copy, summed over `axis_name`. Under check_vma=True they are typed like
        the arguments -- a parameter replicated over a model-parallel axis has equal gradient copies there,
        and they are averaged over it in the same all-reduce so JAX sees one value -- and the loss is
        invariant, so ``out_specs=P()`` takes it. Call it once: its reduction is the all-reduce; do not psum
        again.

    Raises:
        CommError: a parameter split over an axis of `axis_name` (check_vma=True, where that is visible); a
            `cross_entropy` over axes not all in `axis_name`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> from commlib_jax.sequence import cross_entropy
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4, one token per rank
        >>> loss = lambda w, x, y: cross_entropy(x * w, y, "x")  # the mean over the 4 tokens
        >>> step = jax.shard_map(value_and_grad(loss, "x"), mesh=mesh, in_specs=(P(), P("x"), P("x")),
        ...                      out_specs=(P(), P()))
        >>> value, grad = step(jnp.ones(3), jnp.eye(4, 3), jnp.array([0, 1, 2, 0]))
        >>> value.round(6), grad.round(6)  # the unsharded loss and gradient
        (Array(0.688237, dtype=float32), Array([-0.105971, -0.105971, -0.105971], dtype=float32))
    """
    data_axes = axes_of(axis_name)
    numbers = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    differentiate = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    def step(*args):
        mesh_axes = _mesh_axes()
        with _SUMMED_AXES.bound(data_axes):
            value, grads = differentiate(*_own_copies(args, numbers, mesh_axes))
        params = args[argnums] if isinstance(argnums, int) else tuple(args[number] for number in numbers)

        def reduce(path, grad, param):
            sharded = tuple(axis for axis in mesh_axes if axis in varying_axes(param))
            name = jax.tree_util.keystr(path) or "params"
            return _reduce(grad, *training.reduction_axes(name, data_axes, sharded, mesh_axes))

        grads = jax.tree_util.tree_map_with_path(reduce, grads, params)
        loss, aux = value if has_aux else (value, None)
        loss = _reduce(loss, *training.reduction_axes("loss", data_axes, (), mesh_axes))
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return step

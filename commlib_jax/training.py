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

import jax
from jax import lax

from commlib import training
from commlib_jax._compat import manual_axes
from commlib_jax._vma import axes_of, axis_arg, checked_axes, to_varying, varying_axes

__all__ = ["value_and_grad"]


def _mesh_axes() -> tuple:
    """The manual axes of the enclosing shard_map whose types are checked (none under pmap / vmap)."""
    return checked_axes(manual_axes())


def _reduce(x, total: tuple, mean: tuple):
    """Sum `x` over `total` and average it over `mean` (one all-reduce over both)."""
    axes = total + mean
    if not axes:
        return x
    x = lax.psum(x, axis_arg(axes))
    return x / lax.axis_size(axis_arg(mean)) if mean else x


def value_and_grad(fun, axis_name):
    """``fun(params, *args) -> loss`` -> ``step(params, *args) -> (loss, grads)``, to call inside
    ``jax.shard_map`` (check_vma True or False) or ``jax.pmap``: torch's ``loss.backward()`` on every rank
    followed by ``all_reduce(p.grad)`` over the data / sequence axes `axis_name`.

    Args:
        fun: this rank's loss (a scalar) from `params` (a pytree) and the other arguments, written as in torch:
            commlib's f/g and attention layers over the model-parallel axes, the loss of this rank's tokens.
        axis_name: the data / sequence axis name or tuple of names: the gradients are summed over them.

    Returns:
        `step`. Its loss is the sum over `axis_name` of the ranks' losses (the unsharded loss when each rank's
        loss covers its own tokens) and its grads are the unsharded gradients of `params`: each rank's gradient
        of its own copy of every parameter, summed over `axis_name`. Under check_vma=True they are typed like
        `params` -- a parameter replicated over a model-parallel axis has equal gradient copies there, and
        they are averaged over it in the same all-reduce so JAX sees one value -- and the loss is invariant,
        so ``out_specs=P()`` takes it. Call it once: its reduction is the all-reduce; do not psum again.

    Raises:
        CommError: a parameter split over an axis of `axis_name` (check_vma=True, where that is visible).
    """
    data_axes = axes_of(axis_name)

    def step(params, *args):
        mesh_axes = _mesh_axes()
        own = jax.tree.map(lambda p: to_varying(p, mesh_axes), params)  # every rank's own copy, as in torch
        loss, grads = jax.value_and_grad(fun)(own, *args)

        def reduce(path, grad, param):
            sharded = tuple(axis for axis in mesh_axes if axis in varying_axes(param))
            name = jax.tree_util.keystr(path) or "params"
            return _reduce(grad, *training.reduction_axes(name, data_axes, sharded, mesh_axes))

        grads = jax.tree_util.tree_map_with_path(reduce, grads, params)
        return _reduce(loss, *training.reduction_axes("loss", data_axes, (), mesh_axes)), grads

    return step

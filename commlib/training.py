"""The rules of JAX's training helpers: how `commlib_jax.training.value_and_grad` turns every rank's own
gradient into the unsharded one (`reduction_axes`), and the error of Megatron's f or split on an input JAX types
as shared (`shared_input_error`, raised by `commlib_jax`'s `sum_grad` and `shard`). See docs/training.md; the
training block itself is tooling (`commlib.tools.train_block`).
"""

from __future__ import annotations

from commlib.errors import CommError, comm_error

__all__ = ["reduction_axes", "shared_input_error"]


def reduction_axes(
    name: str, data_axes: tuple[str, ...], sharded_axes: tuple[str, ...], copy_candidates: tuple[str, ...]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """How a gradient taken on every rank's own copy of parameter `name` becomes the unsharded gradient.

    `data_axes`: the data / sequence axes (each rank's loss covers its own tokens: sum over them).
    `sharded_axes`: the axes the parameter is split over. `copy_candidates`: the other axes whose ranks hold
    copies of the parameter that JAX must see as one value (shard_map with check_vma=True; empty otherwise).
    Returns (axes to sum over, axes to average over); the copies along the second are equal in a correct
    model (f/g make every TP rank's gradient of a replicated parameter the whole one), so their mean is it.

    >>> reduction_axes("wq", ("sp",), (), ("sp", "tp"))
    (('sp',), ('tp',))
    >>> reduction_axes("w_in", ("sp",), ("tp",), ("sp", "tp"))
    (('sp',), ())
    """
    both = [axis for axis in sharded_axes if axis in data_axes]
    if both:
        raise comm_error(
            "value_and_grad",
            f"parameter {name} is split over the data axes {tuple(both)}, so its "
            "gradient must not be summed over them; take the gradient of a parameter replicated over "
            "the data axes",
            parameter=name,
            axis_name=data_axes,
            sharded_over=sharded_axes,
        )
    copies = tuple(axis for axis in copy_candidates if axis not in data_axes and axis not in sharded_axes)
    return data_axes, copies


def shared_input_error(
    op_name: str, shape: tuple[int, ...], axis_name: object, shared: tuple[str, ...], copies: int
) -> CommError:
    """`CommError` for Megatron's f (`sum_grad`) or split (`shard`) on an input JAX types as one value shared by
    the ranks of `shared` (invariant under shard_map(check_vma=True)): JAX's own transpose of that sharing
    already sums the gradient over those ranks, so the op's backward would sum it again -- `copies` times the
    gradient."""
    instead = (
        f"slice the shared x with lax.dynamic_slice_in_dim at lax.axis_index({axis_name!r}), whose "
        f"gradient JAX sums once"
        if op_name == "shard"
        else f"use lax.pcast(x, {shared!r}, to='varying') as f"
    )
    return comm_error(
        op_name,
        f"x is one value shared by the {copies} ranks of {shared} (typed invariant under "
        f"check_vma=True), and JAX already sums a shared value's gradient over them, so {op_name} would sum it "
        f"again ({copies} times the gradient). Take the gradient with commlib_jax.training.value_and_grad, "
        f"which gives every rank its own copy of the parameters as torch does, or {instead}",
        shape=tuple(shape),
        axis_name=axis_name,
    )

"""Varying-type bookkeeping for `shard_map(check_vma=True)` (a no-op under check_vma=False and pmap).

Every commlib op takes and returns values typed *varying* over its axes, and its backward returns varying
cotangents. That is what makes the gradient the torch answer (``convention="sum"``) in every mode: an
invariant output (psum's) would let JAX sum the ranks' cotangents before our backward runs (W times the
answer), and an invariant input shared by all ranks gets its per-rank gradients summed by pcast's transpose.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

import jax
from jax import lax

from commlib_jax._compat import manual_axes, mesh_axis_names, varying_axes

if TYPE_CHECKING:
    from commlib_jax._types import Array, AxisName

__all__ = ["axes_of", "axis_arg", "checked_axes", "mesh_order", "rank", "shared_axes", "to_varying", "varying_axes"]


def axes_of(axis_name: AxisName | list[str]) -> tuple[str, ...]:
    """``"x" -> ("x",)``; a tuple or list of names stays in order (row-major rank order)."""
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def axis_arg(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    """The form lax takes: one name, or the tuple of names."""
    return axes if len(axes) > 1 else axes[0]


def rank(axes: tuple[str, ...]) -> jax.Array:
    """This device's rank along `axes` (row-major over a tuple of names)."""
    return lax.axis_index(axis_arg(axes))


def mesh_order(axes: tuple[str, ...]) -> tuple[str, ...]:
    """`axes` sorted in the order of the enclosing mesh's axis names (as given under pmap, which has none)."""
    names = mesh_axis_names()
    return tuple(sorted(axes, key=names.index)) if set(axes) <= set(names) else axes


@overload
def to_varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array: ...
@overload
def to_varying(x: Array, axes: tuple[str, ...]) -> Array: ...
def to_varying(x: Array, axes: tuple[str, ...]) -> Array:
    """`x` cast to varying over the manual axes among `axes` it is not varying over yet (pcast of an
    already varying axis raises, so only the missing ones are cast)."""
    have, manual = varying_axes(x), frozenset(manual_axes())
    missing = tuple(axis for axis in axes if axis in manual and axis not in have)
    return lax.pcast(x, missing, to="varying") if missing else x


def checked_axes(axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes among `axes` whose varying types JAX checks: manual axes of a ``shard_map(check_vma=True)``
    (none under check_vma=False, pmap and vmap, where every value is per rank). ``lax.axis_index`` is typed
    varying exactly where types are checked; the probe is dead code that jit removes."""
    manual = frozenset(manual_axes())
    return tuple(axis for axis in axes if axis in manual and axis in varying_axes(lax.axis_index(axis)))


def shared_axes(x: Array, axes: tuple[str, ...]) -> tuple[str, ...]:
    """The checked axes among `axes` (of more than one rank) over which `x` is typed invariant: one value
    shared by those ranks, whose gradient JAX itself sums over them."""
    have = varying_axes(x)
    return tuple(axis for axis in checked_axes(axes) if axis not in have and lax.axis_size(axis) > 1)

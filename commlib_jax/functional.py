"""Differentiable collectives over `jax.lax`, for use inside `jax.shard_map` (check_vma True or False)
and `jax.pmap`.

Each public function asks the spec for the call's plan (`commlib.plans`) at trace time -- the same
`CommError` / `TypeError` text as the torch frontend -- then applies `commlib_jax._op.collective`, a
`jax.custom_vjp` whose forward walks the plan (`commlib.gradients.forward`) and whose backward applies the
spec's VJP rule (`commlib.gradients.vjp`) with `collective`s again, so higher derivatives follow the same
rules.
`axis_name` is a mesh axis name or a tuple of them (rank order row-major). Ranks (`src`, `dst`, `perm`)
are indices along it. Where the op is the identity (world size 1) it returns its input.

Gradients follow ``convention="sum"`` -- rank r's loss is its own and the objective is their sum, as in
torch.distributed -- in every mode: outputs and cotangents are typed varying (see `commlib_jax._vma`).
``convention="replicated"`` is accepted where the op has it; see docs/gradients.md.

Every op raises ``TypeError`` when `x` is not an array (a list) and `CommError` when `axis_name` is not bound
by an enclosing shard_map / pmap (JAX's own error is ``NameError: unbound axis name``), at trace time.

Uneven sizes (``sizes=``, ``scatter_sizes=``, ``gather_sizes=``; `commlib.split_sizes` gives the balanced
split) are held padded, one shape on every device: a sharded dim has ``max(sizes)`` rows; rows past
``sizes[rank]`` are ignored on input (their gradient is exactly 0) and zeros on output (`commlib.uneven`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax import lax
from jax.typing import DTypeLike

from commlib import ReduceOp, plans, training
from commlib_jax._dtypes import dtype_name
from commlib_jax._op import accum, apply, world_size
from commlib_jax._types import Array, AxisName
from commlib_jax._vma import axes_of, axis_arg, shared_axes

#: What ``op=`` takes: a name ("sum", "avg", "max", "min", "product") or a `commlib.ReduceOp`.
ReduceOpArgument = str | ReduceOp
#: Uneven sizes: W ints (rank r's valid rows along the sharded dim); None: the even rule.
Sizes = Sequence[int] | None

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
    "shard",
    "reduce",
]


def all_reduce(
    x: Array,
    axis_name: AxisName,
    op: ReduceOpArgument = "sum",
    *,
    convention: str = "sum",
    accum_dtype: DTypeLike | None = None,
) -> jax.Array:
    """Reduce `x` over `axis_name`; every rank gets the result: ``[*s] -> [*s]``, x's dtype.

    Args:
        x: this rank's block; floating (differentiable), integer or bool (forward only).
        axis_name: a mesh axis name of the enclosing ``shard_map`` / ``pmap``, or a tuple of them (ranks
            row-major in the order given).
        op: "sum" | "avg" (= sum / W; float16/bfloat16 scale by 1/W before the sum, so an average whose sum
            overflows does not) | "max" | "min" | "product" (or a `commlib.ReduceOp`). A NaN on any rank
            makes max/min NaN (as numpy).
        convention: "sum" or "replicated" (the code after the op is replicated: Megatron's g).
        accum_dtype: e.g. ``jnp.float32`` for bf16 input: reduce in that dtype, return x's dtype.

    Gradient: let g be the sum of every rank's cotangent ("sum") or this rank's own ("replicated"). sum: g;
    avg: g / W; max/min: g on the rank(s) holding the result, split equally among ties (NaN results: among
    the ranks holding a NaN); product: g times the other ranks' product.

    Raises:
        CommError: unknown op, avg on an integer dtype, sum of bools, max/min/product of complex,
            accum_dtype not floating or narrower than x. TypeError: wrong kinds.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> f = jax.shard_map(lambda x: all_reduce(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.arange(4.0))  # rank r holds [r]; every rank gets 0 + 1 + 2 + 3
        Array([6., 6., 6., 6.], dtype=float32)
        >>> jax.grad(lambda x: f(x).sum())(jnp.arange(4.0))  # "sum": every rank's cotangent summed
        Array([4., 4., 4., 4.], dtype=float32)
    """
    axes = axes_of(axis_name)
    size = world_size("all_reduce", x, axes)
    plan = plans.all_reduce(
        x.shape, size, op, dtype=dtype_name(x.dtype), convention=convention, accum_dtype=accum(accum_dtype)
    )
    return apply(plan, axes, x)


def all_gather(
    x: Array, axis_name: AxisName, dim: int = -1, *, convention: str = "sum", sizes: Sizes = None
) -> jax.Array:
    """Concatenate every rank's `x` along `dim` in rank order over `axis_name` (a mesh axis name or a tuple
    of them): ``shape[dim] *= W``, x's dtype.

    `sizes` (uneven): rank r contributes the first ``sizes[r]`` of its ``max(sizes)`` rows; the output has
    ``sum(sizes)``. Same value as ``lax.all_gather(x, axis_name, axis=dim, tiled=True)``. Gradient: "sum" ->
    reduce_scatter (sum) of the cotangent; "replicated" -> this rank's block of it.

    Raises:
        CommError: `dim` out of range, unknown convention; `sizes` not W ints >= 0, or
            ``x.shape[dim] != max(sizes)``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> f = jax.shard_map(lambda x: all_gather(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.arange(8.0)).reshape(4, 8)[3]  # rank r holds [2r, 2r + 1]; rank 3's output
        Array([0., 1., 2., 3., 4., 5., 6., 7.], dtype=float32)
    """
    axes = axes_of(axis_name)
    size = world_size("all_gather", x, axes)
    plan = plans.all_gather(x.shape, size, dim, dtype=dtype_name(x.dtype), convention=convention, sizes=sizes)
    return apply(plan, axes, x)


def reduce_scatter(
    x: Array,
    axis_name: AxisName,
    dim: int = 0,
    op: ReduceOpArgument = "sum",
    *,
    accum_dtype: DTypeLike | None = None,
    sizes: Sizes = None,
) -> jax.Array:
    """Reduce over `axis_name` (a mesh axis name or a tuple of them) and keep block `rank` of `dim`:
    ``shape[dim] /= W``; op in {"sum", "avg"}; x's dtype (`accum_dtype` as in `all_reduce`). `sizes`
    (uneven): rank r keeps ``sizes[r]`` rows (``sum(sizes) == shape[dim]``), padded to ``max(sizes)`` with zeros.

    Same value as ``lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)`` (/ W for avg).
    Gradient: all_gather of the cotangent (/ W for avg).

    Raises:
        CommError: ``shape[dim]`` not divisible by W (no `sizes`) or not ``sum(sizes)``, op not sum/avg, avg on
            integers.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> f = jax.shard_map(lambda x: reduce_scatter(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.tile(jnp.arange(4.0), 4))  # every rank holds [0, 1, 2, 3]; rank r keeps block r of the sum
        Array([ 0.,  4.,  8., 12.], dtype=float32)
    """
    axes = axes_of(axis_name)
    size = world_size("reduce_scatter", x, axes)
    plan = plans.reduce_scatter(
        x.shape, size, dim, op, dtype=dtype_name(x.dtype), accum_dtype=accum(accum_dtype), sizes=sizes
    )
    return apply(plan, axes, x)


def all_to_all(
    x: Array,
    axis_name: AxisName,
    scatter_dim: int,
    gather_dim: int,
    *,
    scatter_sizes: Sizes = None,
    gather_sizes: Sizes = None,
) -> jax.Array:
    """Block j of `scatter_dim` goes to rank j of `axis_name` (a mesh axis name or a tuple of them); the
    received blocks are concatenated along `gather_dim` in rank order: ``shape[scatter_dim] /= W``,
    ``shape[gather_dim] *= W``, any ndim, x's dtype (``lax.all_to_all(..., tiled=True)``).
    ``scatter_dim == gather_dim`` keeps the shape: block s of rank r's dim goes to rank s, at position r.

    Uneven (distinct dims): rank r receives ``scatter_sizes[r]`` rows of `scatter_dim` (output padded to the
    largest) and contributes the first ``gather_sizes[r]`` of its ``max(gather_sizes)`` rows of `gather_dim`
    (output ``sum(gather_sizes)``). Gradient: all_to_all of the cotangent with the dims (and the sizes)
    swapped (for equal dims: the same op).

    Raises:
        CommError: dims out of range (or equal, with sizes), ``shape[scatter_dim]`` not divisible by W (no
            scatter_sizes) or not ``sum(scatter_sizes)``, ``shape[gather_dim] != max(gather_sizes)``, sizes not W
            ints >= 0.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> f = jax.shard_map(lambda x: all_to_all(x, "x", 0, 0), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.arange(16.0)).reshape(4, 4)  # row r: rank r's output (block s of rank r's x went to rank s)
        Array([[ 0.,  4.,  8., 12.],
               [ 1.,  5.,  9., 13.],
               [ 2.,  6., 10., 14.],
               [ 3.,  7., 11., 15.]], dtype=float32)
    """
    axes = axes_of(axis_name)
    size = world_size("all_to_all", x, axes)
    plan = plans.all_to_all(
        x.shape,
        size,
        scatter_dim,
        gather_dim,
        dtype=dtype_name(x.dtype),
        scatter_sizes=scatter_sizes,
        gather_sizes=gather_sizes,
    )
    return apply(plan, axes, x)


def all_to_all_4d(
    x: Array,
    axis_name: AxisName,
    scatter_dim: int = 2,
    gather_dim: int = 1,
    *,
    scatter_sizes: Sizes = None,
    gather_sizes: Sizes = None,
) -> jax.Array:
    """Ulysses all-to-all on ``[batch, seq, heads, head_dim]`` over `axis_name` (a mesh axis name or a tuple
    of them), x's dtype.

    ``(2, 1)``: ``[B, S/W, H, D] -> [B, S, H/W, D]``; ``(1, 2)``: ``[B, S, H/W, D] -> [B, S/W, H, D]``.
    Uneven (any S, any H), padded: ``(2, 1)`` is ``[B, max S_r, H, D] -> [B, S, max H_r, D]`` with
    ``gather_sizes=(S_0, ...)``, ``scatter_sizes=(H_0, ...)``; ``(1, 2)`` the reverse with the two swapped.
    Gradient: the other direction.

    Raises:
        CommError: ndim != 4, other dim pairs, heads (or seq) not divisible by W (without sizes), sizes not W
            ints >= 0, a sum that is not the whole dim, a sharded dim that is not ``max(gather_sizes)``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> x = jnp.arange(64.0).reshape(1, 8, 4, 2)  # [B, S, H, D]
        >>> f = jax.shard_map(lambda x: all_to_all_4d(x, "x"), mesh=mesh, in_specs=P(None, "x"),
        ...                   out_specs=P(None, None, "x"))  # [1, 2, 4, 2] per rank in, [1, 8, 1, 2] out
        >>> bool((f(x) == x).all())  # rank r: every position of head r
        True
    """
    axes = axes_of(axis_name)
    size = world_size("all_to_all_4d", x, axes)
    plan = plans.all_to_all_4d(
        x.shape,
        size,
        scatter_dim,
        gather_dim,
        dtype=dtype_name(x.dtype),
        scatter_sizes=scatter_sizes,
        gather_sizes=gather_sizes,
    )
    return apply(plan, axes, x)


def broadcast(x: Array, axis_name: AxisName, src: int = 0) -> jax.Array:
    """Every rank of `axis_name` (a mesh axis name or a tuple of them) gets rank `src`'s `x`:
    ``[*s] -> [*s]``, x's dtype. Gradient: the cotangents summed on `src`, zeros elsewhere.

    Raises:
        CommError: `src` not in [0, W).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> f = jax.shard_map(lambda x: broadcast(x, "x", src=2), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.arange(4.0))  # rank r holds [r]
        Array([2., 2., 2., 2.], dtype=float32)
    """
    axes = axes_of(axis_name)
    size = world_size("broadcast", x, axes)
    return apply(plans.broadcast(x.shape, size, src, dtype=dtype_name(x.dtype)), axes, x)


def gather(x: Array, axis_name: AxisName, dst: int = 0, dim: int = -1, *, sizes: Sizes = None) -> jax.Array:
    """Rank `dst` of `axis_name` (a mesh axis name or a tuple of them) gets every rank's `x` concatenated
    along `dim` (``shape[dim] *= W``); other ranks get zeros of that shape. x's dtype. `sizes` (uneven): as in
    `all_gather`. Gradient: scatter of `dst`'s cotangent.

    Raises:
        CommError: `dst` not in [0, W), `dim` out of range, `sizes` not W ints >= 0 or not matching x.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> f = jax.shard_map(lambda x: gather(x, "x", dst=0), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.arange(8.0)).reshape(4, 8)  # row r: rank r's output
        Array([[0., 1., 2., 3., 4., 5., 6., 7.],
               [0., 0., 0., 0., 0., 0., 0., 0.],
               [0., 0., 0., 0., 0., 0., 0., 0.],
               [0., 0., 0., 0., 0., 0., 0., 0.]], dtype=float32)
    """
    axes = axes_of(axis_name)
    size = world_size("gather", x, axes)
    plan = plans.gather(x.shape, size, dst, dim, dtype=dtype_name(x.dtype), sizes=sizes)
    return apply(plan, axes, x)


def scatter(x: Array, axis_name: AxisName, src: int = 0, dim: int = 0, *, sizes: Sizes = None) -> jax.Array:
    """Rank r of `axis_name` (a mesh axis name or a tuple of them) gets block r of rank `src`'s `x` along
    `dim` (``shape[dim] /= W``); the other ranks' `x` is not read. x's dtype. `sizes` (uneven): rank r gets
    ``sizes[r]`` rows, padded to ``max(sizes)`` with zeros. Gradient: gather of the cotangents to `src`.

    Raises:
        CommError: `src` not in [0, W), `dim` out of range, ``shape[dim]`` not divisible by W (no `sizes`) or not
            ``sum(sizes)``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> f = jax.shard_map(lambda x: scatter(x, "x", src=1), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.arange(16.0))  # rank 1 holds [4, 5, 6, 7]; rank r gets its block r
        Array([4., 5., 6., 7.], dtype=float32)
    """
    axes = axes_of(axis_name)
    size = world_size("scatter", x, axes)
    plan = plans.scatter(x.shape, size, src, dim, dtype=dtype_name(x.dtype), sizes=sizes)
    return apply(plan, axes, x)


def permute(x: Array, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> jax.Array:
    """For each ``(src, dst)`` in `perm` (ranks of `axis_name`, a mesh axis name or a tuple of them), rank dst
    gets rank src's `x` (``lax.ppermute``); a rank that is no destination gets zeros. ``[*s] -> [*s]``,
    x's dtype. Gradient: the inverse permutation.

    Raises:
        CommError: a rank out of range, a repeated source or destination. TypeError: `perm` not pairs.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> ring = [(r, (r + 1) % 4) for r in range(4)]
        >>> f = jax.shard_map(lambda x: permute(x, "x", ring), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.arange(4.0))  # rank r gets rank r - 1's [r - 1]
        Array([3., 0., 1., 2.], dtype=float32)
    """
    axes = axes_of(axis_name)
    size = world_size("permute", x, axes)
    return apply(plans.permute(x.shape, size, perm, dtype=dtype_name(x.dtype)), axes, x)


def sum_grad(x: Array, axis_name: AxisName) -> jax.Array:
    """Identity forward; backward all_reduce(sum) of the cotangent over `axis_name` (a mesh axis name or a
    tuple of them): Megatron's f, the conjugate of ``all_reduce(..., convention="replicated")``.

    `x` is each rank's own copy (as in torch). Under ``shard_map(check_vma=True)`` an `x` typed invariant over
    an axis of `axis_name` is one value shared by its ranks, whose gradient JAX's transpose already sums over
    them; f would sum it again, so that is refused (see docs/training.md).

    Raises:
        CommError: `x` invariant over an axis of `axis_name` with more than one rank, under check_vma=True.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> f = jax.shard_map(lambda x: sum_grad(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.arange(4.0))
        Array([0., 1., 2., 3.], dtype=float32)
        >>> jax.grad(lambda x: f(x).sum())(jnp.arange(4.0))  # every rank's cotangent (1) summed
        Array([4., 4., 4., 4.], dtype=float32)
    """
    axes = axes_of(axis_name)
    size = world_size("sum_grad", x, axes)
    plan = plans.sum_grad(x.shape, size, dtype=dtype_name(x.dtype))
    shared = shared_axes(x, axes)
    if shared:
        raise training.shared_input_error("sum_grad", x.shape, axis_name, shared, lax.axis_size(axis_arg(shared)))
    return apply(plan, axes, x)


def shard(x: Array, axis_name: AxisName, dim: int = -1, *, scale_grad: bool = False) -> jax.Array:
    """Rank r of `axis_name` (a mesh axis name or a tuple of them) keeps block r of its replicated `x` along
    `dim`: ``shape[dim] /= W`` (``[B, S, H, D] -> [B, S/W, H, D]`` on dim 1), x's dtype; no communication
    forward (Megatron's split, FastVideo's ``slice``).

    Gradient: all_gather of the cotangents along `dim` -- every rank gets the gradient of the one replicated
    input -- divided by W when `scale_grad`. The conjugate of ``all_gather(..., convention="replicated")``.

    `x` is each rank's own copy (as in torch); an `x` typed invariant under ``shard_map(check_vma=True)`` is
    refused as in `sum_grad` (JAX already sums its gradient over the ranks).

    Raises:
        CommError: `dim` out of range, ``shape[dim]`` not divisible by W, `x` invariant over an axis of
            `axis_name` under check_vma=True. TypeError: `scale_grad` not a bool.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> f = jax.shard_map(lambda x: shard(x, "x"), mesh=mesh, in_specs=P(), out_specs=P("x"), check_vma=False)
        >>> f(jnp.arange(8.0))  # every rank holds all 8; rank r keeps [2r, 2r + 1]
        Array([0., 1., 2., 3., 4., 5., 6., 7.], dtype=float32)
    """
    axes = axes_of(axis_name)
    size = world_size("shard", x, axes)
    plan = plans.shard(x.shape, size, dim, scale_grad=scale_grad, dtype=dtype_name(x.dtype))
    shared = shared_axes(x, axes)
    if shared:
        raise training.shared_input_error("shard", x.shape, axis_name, shared, lax.axis_size(axis_arg(shared)))
    return apply(plan, axes, x)


def reduce(x: Array, axis_name: AxisName, dst: int = 0, op: ReduceOpArgument = "sum") -> jax.Array:
    """Rank `dst` of `axis_name` (a mesh axis name or a tuple of them) gets the reduction of every rank's `x`;
    the other ranks get zeros. ``[*s] -> [*s]``, x's dtype. op in {"sum", "avg"} (avg = sum / W, half
    precision scaled before the sum as in `all_reduce`).

    Gradient: broadcast of `dst`'s cotangent (/ W for avg); the other ranks' cotangents are unused.

    Raises:
        CommError: `dst` not in [0, W), op not sum/avg, avg on integers, sum of bools.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> f = jax.shard_map(lambda x: reduce(x, "x", dst=0), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.arange(4.0))  # rank r holds [r]
        Array([6., 0., 0., 0.], dtype=float32)
    """
    axes = axes_of(axis_name)
    size = world_size("reduce", x, axes)
    return apply(plans.reduce(x.shape, size, dst, op, dtype=dtype_name(x.dtype)), axes, x)

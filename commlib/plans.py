"""The plan builders: one function per public op, from what a frontend knows to a validated `Plan`.

`commlib.plans.all_reduce(shape, world_size, op, ...)` is not the collective: it takes what a frontend knows
at call (or trace) time -- this rank's input shape, its dtype name, the world size and the user's arguments
-- and returns the `Plan` of that call on this rank, or raises `CommError` / `TypeError` before any
communication. `commlib_torch.all_reduce` and `commlib_jax.all_reduce` call it and walk the plan;
`commlib.reference.all_reduce` is the same op on W simulated numpy ranks. Both frontends therefore raise the
same text for the same mistake.

Shapes below: W = world_size; ``s`` = this rank's input shape.

>>> plan = all_to_all_4d((2, 8, 12, 64), 4, scatter_dim=2, gather_dim=1)
>>> plan.out_shape, plan.step, plan.copies
((2, 32, 3, 64), AllToAll(scatter_dim=2, gather_dim=1), 2)
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Sequence

import numpy as np

from commlib import uneven
from commlib.dtypes import kind, wire_dtypes
from commlib.errors import comm_error, kind_error
from commlib.layout import (
    PLAIN,
    Arithmetic,
    Convention,
    Exact,
    Layout,
    Padded,
    Plan,
    all_gather_layout,
    all_to_all_layout,
    flat_layout,
    local_layout,
    reduce_scatter_layout,
)
from commlib.plan_cache import cached_plan
from commlib.reduce_op import FLOAT_FORMATS, ReduceOp, is_floating, parse_reduce_op
from commlib.steps import (
    AllGather,
    AllReduce,
    AllToAll,
    Broadcast,
    Gather,
    Identity,
    Permute,
    Reduce,
    ReduceScatter,
    Scatter,
    Slice,
    Step,
)
from commlib.validators import check_int, iterable

__all__ = [
    "CONVENTIONS",
    "OP_NAMES",
    "ULYSSES_DIMS",
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
    "check_dim",
    "check_rank",
    "point_to_point",
    "HALF_DTYPES",
]

#: Dtypes whose sum overflows long before their average does (float16: 40000 + 40000): their avg scales each
#: rank's value by 1/W before the sum (as NCCL's own ncclAvg does for floats), so an average that fits never
#: overflows, in the forward and in the summed cotangent of its backward.
HALF_DTYPES = frozenset({"float16", "bfloat16", "complex32"})

#: The values of the ``convention`` keyword (`Convention.REPLICATED_INPUT` is set by the ops, not passed).
CONVENTIONS = (Convention.SUM.value, Convention.REPLICATED.value)
#: Names of the public ops both frontends export.
OP_NAMES = (
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
)
#: Names of the four axes of `all_to_all_4d`.
ULYSSES_DIMS = ("batch", "seq", "heads", "head_dim")


def _check_shape(op_name: str, shape: object) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(size) for size in iterable(shape))
    except TypeError:
        raise kind_error(op_name, "shape must be a sequence of ints", shape=shape) from None
    if any(size < 0 for size in dims):
        raise comm_error(op_name, "shape sizes must be >= 0", shape=dims)
    return dims


def _check_world_size(op_name: str, world_size: object, received: dict) -> int:
    size = check_int(op_name, "world_size", world_size, received)
    if size < 1:
        raise comm_error(op_name, f"world_size ({size}) must be >= 1", **received)
    return size


def check_dim(op_name: str, name: str, dim: object, ndim: int, received: dict) -> int:
    """Normalise a possibly negative dim into [0, ndim)."""
    value = check_int(op_name, name, dim, received)
    if not -ndim <= value < ndim:
        raise comm_error(op_name, f"{name} ({value}) must be in [{-ndim}, {ndim}) for ndim {ndim}", **received)
    return value % ndim


def _check_divisible(op_name: str, quantity: str, size: int, world_size: int, received: dict) -> None:
    if size % world_size:
        raise comm_error(op_name, f"{quantity} ({size}) must be divisible by world_size ({world_size})", **received)


def _check_convention(op_name: str, convention: object, received: dict) -> Convention:
    if convention not in CONVENTIONS:
        message = f"convention ({convention!r}) must be one of {', '.join(CONVENTIONS)}"
        raise comm_error(op_name, message, **received, convention=convention)
    return Convention(convention)


def _check_dtype(op_name: str, name: str, dtype: object, received: dict) -> str:
    if not isinstance(dtype, str):
        raise kind_error(op_name, f"{name} must be a dtype name string, not {type(dtype).__name__}", **received)
    return dtype


def _check_reduction(op_name: str, reduce_op: ReduceOp, dtype: str, accum_dtype: object, received: dict) -> str | None:
    """Dtype rules of a reduction; returns the accumulation dtype (None = the input's)."""
    if reduce_op is ReduceOp.AVG and kind(dtype) not in ("float", "complex", "float8"):  # float8: `wire_dtypes` says
        message = f"op ('avg') needs a floating or complex dtype, not {dtype}"
        raise comm_error(op_name, message, **received, dtype=dtype)
    if reduce_op is ReduceOp.SUM and dtype == "bool":  # gloo gives the OR, numpy the count: say which
        message = "op ('sum') on bool is ambiguous: use 'max' (any) or 'min' (all)"
        raise comm_error(op_name, message, **received, dtype=dtype)
    if reduce_op in (ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT) and dtype.startswith("complex"):
        raise comm_error(op_name, f"op ({reduce_op.value!r}) needs a real dtype, not {dtype}", **received, dtype=dtype)
    if accum_dtype is None:
        return None
    accum = _check_dtype(op_name, "accum_dtype", accum_dtype, received)
    received = {**received, "dtype": dtype, "accum_dtype": accum}
    if not is_floating(accum) or not is_floating(dtype):
        raise comm_error(op_name, f"accum_dtype ({accum}) and the input dtype ({dtype}) must be floating", **received)
    (exponent, mantissa), (exponent_in, mantissa_in) = FLOAT_FORMATS[accum], FLOAT_FORMATS[dtype]
    if exponent < exponent_in or mantissa < mantissa_in:  # float16 <-> bfloat16: each loses the other's values
        message = (
            f"accum_dtype ({accum}: {exponent} exponent, {mantissa} mantissa bits) must hold every value of "
            f"the input dtype ({dtype}: {exponent_in}, {mantissa_in})"
        )
        raise comm_error(op_name, message, **received)
    return None if accum == dtype else accum


def _reduction(
    op_name: str,
    reduce_op: ReduceOp,
    dtype: str,
    accum_dtype: object,
    backend_dtypes: Collection[str] | None,
    received: dict,
    world_size: int,
) -> tuple[Arithmetic, str | None]:
    """A reduction's arithmetic -- the accumulation dtype (the user's, or a wider one the backend carries), the
    scale (1/W for avg) and whether it applies before the sum -- and its wire view (`Plan.wire_view`)."""
    accum = _check_reduction(op_name, reduce_op, dtype, accum_dtype, received)
    view, cast = wire_dtypes(op_name, dtype, reduce_op, backend_dtypes, received)
    is_avg = reduce_op is ReduceOp.AVG
    arithmetic = Arithmetic(
        scale=1.0 / world_size if is_avg else 1.0,
        scale_first=is_avg and dtype in HALF_DTYPES,
        accum_dtype=cast or accum,
    )
    return arithmetic, view


def _wire_view(op_name: str, dtype: str, backend_dtypes: Collection[str] | None, received: dict) -> str | None:
    """Data movement's `Plan.wire_view`: the same-size dtype the backend moves `dtype`'s bits as, if any."""
    view, _ = wire_dtypes(op_name, dtype, None, backend_dtypes, received)
    return view


def check_rank(op_name: str, name: str, rank: object, world_size: int, received: dict | None = None) -> int:
    """A group-local rank argument (`src`, `dst`) in [0, world_size).

    >>> check_rank("broadcast", "src", 4, 4)
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: broadcast: src (4) must be in [0, 4) for world_size 4. Received: src=4
    """
    received = received if received is not None else {name: rank}
    value = check_int(op_name, name, rank, received)
    if not 0 <= value < world_size:
        message = f"{name} ({value}) must be in [0, {world_size}) for world_size {world_size}"
        raise comm_error(op_name, message, **received)
    return value


def _check_pairs(op_name: str, perm: object, world_size: int, received: dict) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple((source, destination) for source, destination in iterable(perm))
    except (TypeError, ValueError):
        raise kind_error(op_name, "perm must be a sequence of (src, dst) pairs", **received) from None
    for source, destination in pairs:
        check_rank(op_name, "src", source, world_size, received)
        check_rank(op_name, "dst", destination, world_size, received)
    for role, index in (("source", 0), ("destination", 1)):
        ranks = [pair[index] for pair in pairs]
        repeated = sorted({rank for rank in ranks if ranks.count(rank) > 1})
        if repeated:
            message = f"perm repeats {role} rank {repeated[0]} ({ranks.count(repeated[0])} times)"
            raise comm_error(op_name, message, **received)
    return tuple((int(source), int(destination)) for source, destination in pairs)


def _uneven(
    op_name: str,
    step: Step,
    shape: tuple[int, ...],
    world_size: int,
    rank: object,
    received: dict,
    *,
    scatter: uneven.Sizes | None = None,
    gather: uneven.Sizes | None = None,
) -> tuple[Layout, Exact | Padded] | None:
    """The layout and sizes of a call with uneven sizes (`commlib.uneven.plan`), None where they are all equal:
    exact on `rank`, padded where `rank` is None."""
    arguments = {key: value for key, value in received.items() if key != "shape"}  # the same on every rank
    arguments.update({sizes.keyword: sizes.shown for sizes in (scatter, gather) if sizes is not None})
    if rank is not None:
        rank = check_rank(op_name, "rank", rank, world_size, {**arguments, "rank": rank})
    return uneven.plan(op_name, step, shape, world_size, scatter=scatter, gather=gather, rank=rank, received=arguments)


def _common(
    op_name: str, shape: object, world_size: object, dtype: object, received: dict
) -> tuple[tuple[int, ...], int, str]:
    """The checks every op makes first: (shape, world_size, dtype)."""
    checked_shape = _check_shape(op_name, shape)
    return (
        checked_shape,
        _check_world_size(op_name, world_size, received),
        _check_dtype(op_name, "dtype", dtype, received),
    )


@cached_plan
def all_reduce(
    shape: Sequence[int],
    world_size: int,
    op: object = "sum",
    *,
    dtype: str = "float32",
    convention: str = "sum",
    accum_dtype: str | None = None,
    op_name: str = "all_reduce",
    backend_dtypes: Collection[str] | None = None,
) -> Plan:
    """``s -> s``: every rank gets the reduction over ranks (avg = sum / W).

    >>> all_reduce((3,), 4, "avg").arithmetic.scale
    0.25
    """
    received = dict(shape=tuple(shape), op=op)
    shape, world_size, dtype = _common(op_name, shape, world_size, dtype, received)
    reduce_op = parse_reduce_op(op, op_name=op_name, received=received)
    arithmetic, view = _reduction(op_name, reduce_op, dtype, accum_dtype, backend_dtypes, received, world_size)
    return Plan(
        op_name=op_name,
        step=AllReduce(reduce_op),
        world_size=world_size,
        in_shape=shape,
        layout=flat_layout(shape, in_place=True),
        dtype=dtype,
        convention=_check_convention(op_name, convention, received),
        arithmetic=arithmetic,
        wire_view=view,
    )


@cached_plan
def all_gather(
    shape: Sequence[int],
    world_size: int,
    dim: int = -1,
    *,
    sizes: Sequence[int] | None = None,
    rank: int | None = None,
    dtype: str = "float32",
    convention: str = "sum",
    op_name: str = "all_gather",
    backend_dtypes: Collection[str] | None = None,
) -> Plan:
    """``s -> s`` with ``s[dim] *= W``, rank r's input at block r of `dim`.

    `sizes` (uneven, see `commlib.uneven`): rank r contributes ``sizes[r]`` rows, ``s[dim] = sum(sizes)`` on
    output; its input has ``sizes[rank]`` rows (exact layout, `rank` given) or ``max(sizes)`` (padded, None).

    >>> all_gather((3, 5), 4, dim=0).out_shape
    (12, 5)
    >>> all_gather((3, 5), 4, dim=0, sizes=(3, 3, 2, 0), rank=0).out_shape
    (8, 5)
    """
    received = dict(shape=tuple(shape), dim=dim)
    shape, world_size, dtype = _common(op_name, shape, world_size, dtype, received)
    dim = check_dim(op_name, "dim", dim, len(shape), received)
    step, checked = AllGather(dim), _check_convention(op_name, convention, received)
    view = _wire_view(op_name, dtype, backend_dtypes, received)
    sized = sizes is not None and _uneven(
        op_name, step, shape, world_size, rank, received, gather=uneven.Sizes("sizes", sizes, f"size of dim {dim}")
    )
    layout, held = sized or (all_gather_layout(shape, world_size, dim), None)
    return Plan(
        op_name=op_name,
        step=step,
        world_size=world_size,
        in_shape=shape,
        layout=layout,
        arithmetic=PLAIN,
        dtype=dtype,
        convention=checked,
        wire_view=view,
        uneven=held,
    )


@cached_plan
def reduce_scatter(
    shape: Sequence[int],
    world_size: int,
    dim: int = 0,
    op: object = "sum",
    *,
    sizes: Sequence[int] | None = None,
    rank: int | None = None,
    dtype: str = "float32",
    accum_dtype: str | None = None,
    op_name: str = "reduce_scatter",
    backend_dtypes: Collection[str] | None = None,
) -> Plan:
    """``s -> s`` with ``s[dim] /= W``; rank r gets block r of the reduction. op in {sum, avg}.

    `sizes` (uneven): rank r gets ``sizes[r]`` rows (``sum(sizes) = s[dim]``), exactly (`rank` given) or
    padded to ``max(sizes)`` with zeros (`rank` None).

    >>> reduce_scatter((8, 3), 4).out_shape
    (2, 3)
    >>> reduce_scatter((7, 3), 4, sizes=(2, 2, 2, 1)).out_shape  # padded
    (2, 3)
    """
    received = dict(shape=tuple(shape), dim=dim, op=op)
    shape, world_size, dtype = _common(op_name, shape, world_size, dtype, received)
    dim = check_dim(op_name, "dim", dim, len(shape), received)
    reduce_op = parse_reduce_op(op, op_name=op_name, received=received)
    if reduce_op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise comm_error(op_name, f"op ({reduce_op.value!r}) must be one of sum, avg", **received)
    step = ReduceScatter(dim, reduce_op)
    arithmetic, view = _reduction(op_name, reduce_op, dtype, accum_dtype, backend_dtypes, received, world_size)
    sized = sizes is not None and _uneven(
        op_name, step, shape, world_size, rank, received, scatter=uneven.Sizes("sizes", sizes, f"size of dim {dim}")
    )
    if not sized:
        _check_divisible(op_name, f"size of dim {dim}", shape[dim], world_size, received)
    layout, held = sized or (reduce_scatter_layout(shape, world_size, dim), None)
    return Plan(
        op_name=op_name,
        step=step,
        world_size=world_size,
        in_shape=shape,
        layout=layout,
        dtype=dtype,
        arithmetic=arithmetic,
        wire_view=view,
        uneven=held,
    )


@cached_plan
def all_to_all(
    shape: Sequence[int],
    world_size: int,
    scatter_dim: int,
    gather_dim: int,
    *,
    scatter_sizes: Sequence[int] | None = None,
    gather_sizes: Sequence[int] | None = None,
    rank: int | None = None,
    dtype: str = "float32",
    op_name: str = "all_to_all",
    dim_names: Sequence[str] | None = None,
    backend_dtypes: Collection[str] | None = None,
) -> Plan:
    """``s -> s`` with ``s[scatter_dim] /= W`` and ``s[gather_dim] *= W``.

    Block j of `scatter_dim` goes to rank j; the blocks received are concatenated along `gather_dim` in
    source-rank order (``lax.all_to_all(..., tiled=True)`` semantics). With ``scatter_dim == gather_dim``
    the shape is unchanged: block s of rank r's dim goes to rank s, at position r (torch's
    ``all_to_all_single``, lax's ``split_axis == concat_axis``). Uneven (distinct dims only): rank r receives
    ``scatter_sizes[r]`` rows of `scatter_dim` and contributes ``gather_sizes[r]`` rows of `gather_dim`
    (exact layout with `rank`, padded to the largest without; see `commlib.uneven`).

    >>> all_to_all((8, 3), 4, scatter_dim=0, gather_dim=1).out_shape
    (2, 12)
    >>> plan = all_to_all((8, 3), 4, scatter_dim=0, gather_dim=-2)
    >>> plan.out_shape, plan.copies
    ((8, 3), 0)
    >>> all_to_all((7, 1), 4, 0, 1, scatter_sizes=(2, 2, 2, 1), gather_sizes=(3, 3, 3, 1), rank=3).out_shape
    (1, 10)
    """
    received = dict(shape=tuple(shape), scatter_dim=scatter_dim, gather_dim=gather_dim)
    shape, world_size, dtype = _common(op_name, shape, world_size, dtype, received)
    scatter_axis = check_dim(op_name, "scatter_dim", scatter_dim, len(shape), received)
    gather_axis = check_dim(op_name, "gather_dim", gather_dim, len(shape), received)
    if scatter_axis == gather_axis and (scatter_sizes is not None or gather_sizes is not None):
        message = f"scatter_dim ({scatter_axis}) must differ from gather_dim ({gather_axis}) with uneven sizes"
        raise comm_error(op_name, message, **received)
    quantity = dim_names[scatter_axis] if dim_names else f"size of scatter_dim {scatter_axis}"
    if scatter_sizes is None:
        _check_divisible(op_name, quantity, shape[scatter_axis], world_size, received)
    step, view = AllToAll(scatter_axis, gather_axis), _wire_view(op_name, dtype, backend_dtypes, received)
    sized = None
    if scatter_sizes is not None or gather_sizes is not None:
        gathered = dim_names[gather_axis] if dim_names else f"size of gather_dim {gather_axis}"
        sized = _uneven(
            op_name,
            step,
            shape,
            world_size,
            rank,
            received,
            scatter=None if scatter_sizes is None else uneven.Sizes("scatter_sizes", scatter_sizes, quantity),
            gather=None if gather_sizes is None else uneven.Sizes("gather_sizes", gather_sizes, gathered),
        )
    layout, held = sized or (all_to_all_layout(shape, world_size, scatter_axis, gather_axis), None)
    return Plan(
        op_name=op_name,
        step=step,
        world_size=world_size,
        in_shape=shape,
        layout=layout,
        arithmetic=PLAIN,
        dtype=dtype,
        wire_view=view,
        uneven=held,
    )


@cached_plan
def all_to_all_4d(
    shape: Sequence[int],
    world_size: int,
    scatter_dim: int = 2,
    gather_dim: int = 1,
    *,
    scatter_sizes: Sequence[int] | None = None,
    gather_sizes: Sequence[int] | None = None,
    rank: int | None = None,
    dtype: str = "float32",
    backend_dtypes: Collection[str] | None = None,
) -> Plan:
    """Ulysses all-to-all on ``[batch, seq, heads, head_dim]``.

    ``(scatter_dim, gather_dim) = (2, 1)``: ``[B, S/W, H, D] -> [B, S, H/W, D]``; ``(1, 2)``: the reverse.
    Uneven (any S, any H): ``[B, S_r, H, D] -> [B, S, H_r, D]`` with ``gather_sizes = (S_0, ...)`` and
    ``scatter_sizes = (H_0, ...)`` (e.g. `commlib.split_sizes`), as in `all_to_all`.

    >>> all_to_all_4d((2, 8, 6, 64), 4)
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: all_to_all_4d: heads (6) must be divisible by world_size (4). Received: shape=(2, 8, 6, 64), scatter_dim=2, gather_dim=1
    """
    op_name = "all_to_all_4d"
    received = dict(shape=tuple(shape), scatter_dim=scatter_dim, gather_dim=gather_dim)
    dims = _check_shape(op_name, shape)
    if len(dims) != 4:
        raise comm_error(op_name, f"ndim ({len(dims)}) must be 4 ([batch, seq, heads, head_dim])", **received)
    scatter_axis = check_dim(op_name, "scatter_dim", scatter_dim, 4, received)
    gather_axis = check_dim(op_name, "gather_dim", gather_dim, 4, received)
    if (scatter_axis, gather_axis) not in ((2, 1), (1, 2)):
        message = f"(scatter_dim, gather_dim) ({scatter_axis}, {gather_axis}) must be (2, 1) or (1, 2)"
        raise comm_error(op_name, message, **received)
    return all_to_all(
        dims,
        world_size,
        scatter_dim,
        gather_dim,
        scatter_sizes=scatter_sizes,
        gather_sizes=gather_sizes,
        rank=rank,
        dtype=dtype,
        op_name=op_name,
        dim_names=ULYSSES_DIMS,
        backend_dtypes=backend_dtypes,
    )


@cached_plan
def broadcast(
    shape: Sequence[int],
    world_size: int,
    src: int = 0,
    *,
    dtype: str = "float32",
    op_name: str = "broadcast",
    backend_dtypes: Collection[str] | None = None,
) -> Plan:
    """``s -> s``: every rank gets rank `src`'s input. Backward: sum of the cotangents on `src`, zeros elsewhere.

    >>> broadcast((3,), 2, src=1).step.root
    1
    """
    received = dict(shape=tuple(shape), src=src)
    shape, world_size, dtype = _common(op_name, shape, world_size, dtype, received)
    root = check_rank(op_name, "src", src, world_size, received)
    return Plan(
        op_name=op_name,
        step=Broadcast(root),
        world_size=world_size,
        in_shape=shape,
        layout=flat_layout(shape, in_place=True),
        arithmetic=PLAIN,
        dtype=dtype,
        wire_view=_wire_view(op_name, dtype, backend_dtypes, received),
    )


@cached_plan
def gather(
    shape: Sequence[int],
    world_size: int,
    dst: int = 0,
    dim: int = -1,
    *,
    sizes: Sequence[int] | None = None,
    rank: int | None = None,
    dtype: str = "float32",
    op_name: str = "gather",
    backend_dtypes: Collection[str] | None = None,
) -> Plan:
    """``s -> s`` with ``s[dim] *= W`` on rank `dst` (rank order); other ranks get zeros of that shape.
    `sizes` (uneven): as in `all_gather`.

    >>> gather((2, 3), 4, dst=3).out_shape
    (2, 12)
    """
    received = dict(shape=tuple(shape), dst=dst, dim=dim)
    shape, world_size, dtype = _common(op_name, shape, world_size, dtype, received)
    root = check_rank(op_name, "dst", dst, world_size, received)
    dim = check_dim(op_name, "dim", dim, len(shape), received)
    step, view = Gather(dim, root), _wire_view(op_name, dtype, backend_dtypes, received)
    sized = sizes is not None and _uneven(
        op_name, step, shape, world_size, rank, received, gather=uneven.Sizes("sizes", sizes, f"size of dim {dim}")
    )
    layout, held = sized or (all_gather_layout(shape, world_size, dim), None)
    return Plan(
        op_name=op_name,
        step=step,
        world_size=world_size,
        in_shape=shape,
        layout=layout,
        arithmetic=PLAIN,
        dtype=dtype,
        wire_view=view,
        uneven=held,
    )


@cached_plan
def scatter(
    shape: Sequence[int],
    world_size: int,
    src: int = 0,
    dim: int = 0,
    *,
    sizes: Sequence[int] | None = None,
    rank: int | None = None,
    dtype: str = "float32",
    op_name: str = "scatter",
    backend_dtypes: Collection[str] | None = None,
) -> Plan:
    """``s -> s`` with ``s[dim] /= W``: rank r gets block r of rank `src`'s input (others' inputs unused).
    `sizes` (uneven): as in `reduce_scatter`.

    >>> scatter((8, 2), 4).out_shape
    (2, 2)
    """
    received = dict(shape=tuple(shape), src=src, dim=dim)
    shape, world_size, dtype = _common(op_name, shape, world_size, dtype, received)
    root = check_rank(op_name, "src", src, world_size, received)
    dim = check_dim(op_name, "dim", dim, len(shape), received)
    step, view = Scatter(dim, root), _wire_view(op_name, dtype, backend_dtypes, received)
    sized = sizes is not None and _uneven(
        op_name, step, shape, world_size, rank, received, scatter=uneven.Sizes("sizes", sizes, f"size of dim {dim}")
    )
    if not sized:
        _check_divisible(op_name, f"size of dim {dim}", shape[dim], world_size, received)
    layout, held = sized or (reduce_scatter_layout(shape, world_size, dim), None)
    return Plan(
        op_name=op_name,
        step=step,
        world_size=world_size,
        in_shape=shape,
        layout=layout,
        arithmetic=PLAIN,
        dtype=dtype,
        wire_view=view,
        uneven=held,
    )


@cached_plan
def permute(
    shape: Sequence[int],
    world_size: int,
    perm: object,
    *,
    dtype: str = "float32",
    op_name: str = "permute",
    backend_dtypes: Collection[str] | None = None,
) -> Plan:
    """``s -> s``: for each (src, dst) in `perm` rank dst gets rank src's input (``lax.ppermute``); a rank
    that is no destination gets zeros. Backward: the inverse permutation of the cotangents.

    >>> permute((3,), 4, [(0, 1), (1, 0)]).step.pairs
    ((0, 1), (1, 0))
    """
    received = dict(shape=tuple(shape), perm=perm)
    shape, world_size, dtype = _common(op_name, shape, world_size, dtype, received)
    pairs = _check_pairs(op_name, perm, world_size, received)
    return Plan(
        op_name=op_name,
        step=Permute(pairs),
        world_size=world_size,
        in_shape=shape,
        layout=flat_layout(shape, in_place=False),
        arithmetic=PLAIN,
        dtype=dtype,
        wire_view=_wire_view(op_name, dtype, backend_dtypes, received),
    )


@cached_plan
def sum_grad(
    shape: Sequence[int],
    world_size: int,
    *,
    dtype: str = "float32",
    op_name: str = "sum_grad",
    backend_dtypes: Collection[str] | None = None,
) -> Plan:
    """``s -> s`` identity forward on a replicated input; backward all_reduce(sum) of the cotangent
    (Megatron's f).

    >>> sum_grad((3,), 4).convention
    'replicated_input'
    """
    received = dict(shape=tuple(shape))
    shape, world_size, dtype = _common(op_name, shape, world_size, dtype, received)
    return Plan(
        op_name=op_name,
        step=Identity(),
        world_size=world_size,
        in_shape=shape,
        layout=flat_layout(shape, in_place=False),
        arithmetic=PLAIN,
        dtype=dtype,
        convention=Convention.REPLICATED_INPUT,
    )


@cached_plan
def point_to_point(
    shape: Sequence[int],
    world_size: int,
    src: int,
    dst: int,
    *,
    dtype: str = "float32",
    op_name: str = "send",
    backend_dtypes: Collection[str] | None = None,
) -> Plan:
    """One transfer of ``s`` from rank `src` to rank `dst` (`DeviceCommunicator.send` / `recv`, each end naming
    the other): the permute of the single pair (src, dst), so both ends build the same plan and checked mode
    compares them.

    >>> point_to_point((3,), 2, 0, 1, op_name="recv").step.pairs
    ((0, 1),)
    """
    received = dict(shape=tuple(shape), src=src, dst=dst)
    shape, world_size, dtype = _common(op_name, shape, world_size, dtype, received)
    source = check_rank(op_name, "src", src, world_size, received)
    destination = check_rank(op_name, "dst", dst, world_size, received)
    if source == destination:
        raise comm_error(
            op_name, f"dst ({destination}) must differ from src ({source}): a rank cannot send to itself", **received
        )
    return Plan(
        op_name=op_name,
        step=Permute(((source, destination),)),
        world_size=world_size,
        in_shape=shape,
        layout=flat_layout(shape, in_place=False),
        arithmetic=PLAIN,
        dtype=dtype,
        wire_view=_wire_view(op_name, dtype, backend_dtypes, received),
    )


@cached_plan
def shard(
    shape: Sequence[int],
    world_size: int,
    dim: int = -1,
    *,
    scale_grad: bool = False,
    dtype: str = "float32",
    op_name: str = "shard",
    backend_dtypes: Collection[str] | None = None,
) -> Plan:
    """``s -> s`` with ``s[dim] /= W``: a replicated input, rank r keeps block r of `dim` (Megatron's split,
    FastVideo's ``slice``). Backward: all_gather of the cotangents along `dim` -- the gradient of the one
    replicated input -- divided by W when `scale_grad`.

    >>> plan = shard((2, 8), 4, scale_grad=True)
    >>> plan.out_shape, plan.step.name, plan.convention, plan.arithmetic.grad_scale
    ((2, 2), 'slice', 'replicated_input', 0.25)
    """
    received = dict(shape=tuple(shape), dim=dim)
    shape, world_size, dtype = _common(op_name, shape, world_size, dtype, received)
    dim = check_dim(op_name, "dim", dim, len(shape), received)
    if not isinstance(scale_grad, (bool, np.bool_)):
        raise kind_error(op_name, f"scale_grad must be a bool, not {type(scale_grad).__name__}", **received)
    _check_divisible(op_name, f"size of dim {dim}", shape[dim], world_size, received)
    chunk = (*shape[:dim], shape[dim] // world_size, *shape[dim + 1 :])
    return Plan(
        op_name=op_name,
        step=Slice(dim),
        world_size=world_size,
        in_shape=shape,
        layout=local_layout(shape, chunk),
        dtype=dtype,
        convention=Convention.REPLICATED_INPUT,
        arithmetic=Arithmetic(grad_scale=1.0 / world_size if scale_grad else 1.0),
        wire_view=_wire_view(op_name, dtype, backend_dtypes, received),
    )


@cached_plan
def reduce(
    shape: Sequence[int],
    world_size: int,
    dst: int = 0,
    op: object = "sum",
    *,
    dtype: str = "float32",
    op_name: str = "reduce",
    backend_dtypes: Collection[str] | None = None,
) -> Plan:
    """``s -> s``: rank `dst` gets the reduction over ranks (avg = sum / W), the other ranks zeros. op in
    {sum, avg}. Backward: broadcast of `dst`'s cotangent (/ W for avg); the other ranks' cotangents are unused.

    >>> plan = reduce((3,), 4, dst=2, op="avg")
    >>> plan.step.root, plan.arithmetic.scale
    (2, 0.25)
    >>> reduce((3,), 4, op="max")
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: reduce: op ('max') must be one of sum, avg. Received: shape=(3,), dst=0, op='max'
    """
    received = dict(shape=tuple(shape), dst=dst, op=op)
    shape, world_size, dtype = _common(op_name, shape, world_size, dtype, received)
    root = check_rank(op_name, "dst", dst, world_size, received)
    reduce_op = parse_reduce_op(op, op_name=op_name, received=received)
    if reduce_op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise comm_error(op_name, f"op ({reduce_op.value!r}) must be one of sum, avg", **received)
    arithmetic, view = _reduction(op_name, reduce_op, dtype, None, backend_dtypes, received, world_size)
    return Plan(
        op_name=op_name,
        step=Reduce(reduce_op, root),
        world_size=world_size,
        in_shape=shape,
        layout=flat_layout(shape, in_place=True),
        dtype=dtype,
        arithmetic=arithmetic,
        wire_view=view,
    )

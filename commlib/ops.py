"""Op catalogue: argument validation and the layout plan of each public op.

Each function takes what a frontend knows at call (or trace) time -- this rank's input shape, its dtype
name, the world size and the user's arguments -- and returns a `Plan`, or raises `CommError` /
`TypeError` before any communication. Both frontends call these, so both raise the same text.

Shapes below: W = world_size; ``s`` = this rank's input shape.
"""

from __future__ import annotations

import operator

from commlib.errors import comm_error, kind_error
from commlib.layout import Plan, all_gather_layout, all_to_all_layout, flat_layout, reduce_scatter_layout
from commlib.reduce_op import FLOAT_BITS, ReduceOp, is_floating, parse_reduce_op

__all__ = [
    "CONVENTIONS",
    "OP_NAMES",
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
    "check_rank",
    "transpose",
    "ULYSSES_DIMS",
]

#: Gradient conventions, see docs/gradients.md.
CONVENTIONS = ("sum", "replicated")
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
)
#: Names of the four axes of `all_to_all_4d`.
ULYSSES_DIMS = ("batch", "seq", "heads", "head_dim")


def _check_int(op: str, name: str, value: object, received: dict) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise kind_error(op, f"{name} must be an int, not {type(value).__name__}", **received)
    return operator.index(value)


def _check_shape(op: str, shape: object) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(size) for size in shape)  # type: ignore[union-attr]
    except TypeError:
        raise kind_error(op, "shape must be a sequence of ints", shape=shape) from None
    if any(size < 0 for size in dims):
        raise comm_error(op, "shape sizes must be >= 0", shape=dims)
    return dims


def _check_world_size(op: str, world_size: object, received: dict) -> int:
    size = _check_int(op, "world_size", world_size, received)
    if size < 1:
        raise comm_error(op, f"world_size ({size}) must be >= 1", **received)
    return size


def _check_dim(op: str, name: str, dim: object, ndim: int, received: dict) -> int:
    """Normalise a possibly negative dim into [0, ndim)."""
    value = _check_int(op, name, dim, received)
    if not -ndim <= value < ndim:
        raise comm_error(op, f"{name} ({value}) must be in [{-ndim}, {ndim}) for ndim {ndim}", **received)
    return value % ndim


def _check_divisible(op: str, quantity: str, size: int, world_size: int, received: dict) -> None:
    if size % world_size:
        raise comm_error(op, f"{quantity} ({size}) must be divisible by world_size ({world_size})", **received)


def _check_convention(op: str, convention: object, received: dict) -> str:
    if convention not in CONVENTIONS:
        message = f"convention ({convention!r}) must be one of {', '.join(CONVENTIONS)}"
        raise comm_error(op, message, **received, convention=convention)
    return str(convention)


def _check_dtype(op: str, name: str, dtype: object, received: dict) -> str:
    if not isinstance(dtype, str):
        raise kind_error(op, f"{name} must be a dtype name string, not {type(dtype).__name__}", **received)
    return dtype


def _check_reduction(op: str, reduce_op: ReduceOp, dtype: str, accum_dtype: object, received: dict) -> str | None:
    """Dtype rules of a reduction; returns the accumulation dtype (None = the input's)."""
    if reduce_op is ReduceOp.AVG and not is_floating(dtype):
        raise comm_error(op, f"op ('avg') needs a floating dtype, not {dtype}", **received, dtype=dtype)
    if reduce_op is ReduceOp.SUM and dtype == "bool":  # gloo gives the OR, numpy the count: say which
        raise comm_error(op, "op ('sum') on bool is ambiguous: use 'max' (any) or 'min' (all)", **received, dtype=dtype)
    if reduce_op in (ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT) and dtype.startswith("complex"):
        raise comm_error(op, f"op ({reduce_op.value!r}) needs a real dtype, not {dtype}", **received, dtype=dtype)
    if accum_dtype is None:
        return None
    accum = _check_dtype(op, "accum_dtype", accum_dtype, received)
    received = {**received, "dtype": dtype, "accum_dtype": accum}
    if not is_floating(accum) or not is_floating(dtype):
        raise comm_error(op, f"accum_dtype ({accum}) and the input dtype ({dtype}) must be floating", **received)
    if FLOAT_BITS[accum] < FLOAT_BITS[dtype]:
        message = f"accum_dtype ({accum}, {FLOAT_BITS[accum]} bits) must be at least as wide as the input ({dtype})"
        raise comm_error(op, message, **received)
    return None if accum == dtype else accum


def check_rank(op: str, name: str, rank: object, world_size: int, received: dict | None = None) -> int:
    """A group-local rank argument (`src`, `dst`) in [0, world_size)."""
    received = received if received is not None else {name: rank}
    value = _check_int(op, name, rank, received)
    if not 0 <= value < world_size:
        raise comm_error(op, f"{name} ({value}) must be in [0, {world_size}) for world_size {world_size}", **received)
    return value


def gather(shape, world_size, dst=0, dim=-1, *, op_name="gather") -> Plan:
    """``s -> s`` with ``s[dim] *= W`` on rank `dst` (rank order); other ranks get zeros of that shape."""
    received = dict(shape=tuple(shape), dst=dst, dim=dim)
    shape = _check_shape(op_name, shape)
    world_size = _check_world_size(op_name, world_size, received)
    root = check_rank(op_name, "dst", dst, world_size, received)
    dim = _check_dim(op_name, "dim", dim, len(shape), received)
    return Plan(
        op=op_name,
        collective="gather",
        world_size=world_size,
        in_shape=shape,
        dims=(dim,),
        root=root,
        **all_gather_layout(shape, world_size, dim),
    )


def scatter(shape, world_size, src=0, dim=0, *, op_name="scatter") -> Plan:
    """``s -> s`` with ``s[dim] /= W``: rank r gets block r of rank `src`'s input (others' inputs unused)."""
    received = dict(shape=tuple(shape), src=src, dim=dim)
    shape = _check_shape(op_name, shape)
    world_size = _check_world_size(op_name, world_size, received)
    root = check_rank(op_name, "src", src, world_size, received)
    dim = _check_dim(op_name, "dim", dim, len(shape), received)
    _check_divisible(op_name, f"size of dim {dim}", shape[dim], world_size, received)
    return Plan(
        op=op_name,
        collective="scatter",
        world_size=world_size,
        in_shape=shape,
        dims=(dim,),
        root=root,
        **reduce_scatter_layout(shape, world_size, dim),
    )


def broadcast(shape, world_size, src=0, *, op_name="broadcast") -> Plan:
    """``s -> s``: every rank gets rank `src`'s input. Backward: sum of the cotangents on `src`, zeros elsewhere."""
    received = dict(shape=tuple(shape), src=src)
    shape = _check_shape(op_name, shape)
    world_size = _check_world_size(op_name, world_size, received)
    root = check_rank(op_name, "src", src, world_size, received)
    return Plan(
        op=op_name,
        collective="broadcast",
        world_size=world_size,
        in_shape=shape,
        dims=(),
        root=root,
        **flat_layout(shape, in_place=True),
    )


def _check_pairs(op: str, perm: object, world_size: int, received: dict) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple((source, destination) for source, destination in perm)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise kind_error(op, "perm must be a sequence of (src, dst) pairs", **received) from None
    for source, destination in pairs:
        check_rank(op, "src", source, world_size, received)
        check_rank(op, "dst", destination, world_size, received)
    for role, index in (("source", 0), ("destination", 1)):
        ranks = [pair[index] for pair in pairs]
        repeated = sorted({rank for rank in ranks if ranks.count(rank) > 1})
        if repeated:
            raise comm_error(op, f"perm repeats {role} rank {repeated[0]} ({ranks.count(repeated[0])} times)", **received)
    return tuple((int(source), int(destination)) for source, destination in pairs)


def permute(shape, world_size, perm, *, op_name="permute") -> Plan:
    """``s -> s``: for each (src, dst) in `perm` rank dst gets rank src's input (``lax.ppermute``); a rank
    that is no destination gets zeros. Backward: the inverse permutation of the cotangents."""
    received = dict(shape=tuple(shape), perm=perm)
    shape = _check_shape(op_name, shape)
    world_size = _check_world_size(op_name, world_size, received)
    pairs = _check_pairs(op_name, perm, world_size, received)
    return Plan(
        op=op_name,
        collective="permute",
        world_size=world_size,
        in_shape=shape,
        dims=(),
        pairs=pairs,
        **flat_layout(shape, in_place=False),
    )


def sum_grad(shape, world_size, *, op_name="sum_grad") -> Plan:
    """``s -> s`` identity forward; backward all_reduce(sum) of the cotangent (Megatron's f)."""
    received = dict(shape=tuple(shape))
    shape = _check_shape(op_name, shape)
    world_size = _check_world_size(op_name, world_size, received)
    return Plan(
        op=op_name,
        collective="identity",
        world_size=world_size,
        in_shape=shape,
        dims=(),
        **flat_layout(shape, in_place=False),
    )


def all_reduce(
    shape, world_size, op="sum", *, dtype="float32", convention="sum", accum_dtype=None, op_name="all_reduce"
) -> Plan:
    """``s -> s``: every rank gets the reduction over ranks. avg = sum / W."""
    received = dict(shape=tuple(shape), op=op)
    shape = _check_shape(op_name, shape)
    world_size = _check_world_size(op_name, world_size, received)
    reduce_op = parse_reduce_op(op, op_name=op_name, received=received)
    dtype = _check_dtype(op_name, "dtype", dtype, received)
    accum = _check_reduction(op_name, reduce_op, dtype, accum_dtype, received)
    return Plan(
        op=op_name,
        collective="all_reduce",
        world_size=world_size,
        in_shape=shape,
        dims=(),
        reduce_op=reduce_op.value,
        scale=1.0 / world_size if reduce_op is ReduceOp.AVG else 1.0,
        convention=_check_convention(op_name, convention, received),
        accum_dtype=accum,
        **flat_layout(shape, in_place=True),
    )


def all_gather(shape, world_size, dim=-1, *, convention="sum", op_name="all_gather") -> Plan:
    """``s -> s`` with ``s[dim] *= W``, rank r's input at block r of `dim`."""
    received = dict(shape=tuple(shape), dim=dim)
    shape = _check_shape(op_name, shape)
    world_size = _check_world_size(op_name, world_size, received)
    dim = _check_dim(op_name, "dim", dim, len(shape), received)
    return Plan(
        op=op_name,
        collective="all_gather",
        world_size=world_size,
        in_shape=shape,
        dims=(dim,),
        convention=_check_convention(op_name, convention, received),
        **all_gather_layout(shape, world_size, dim),
    )


def reduce_scatter(
    shape, world_size, dim=0, op="sum", *, dtype="float32", accum_dtype=None, op_name="reduce_scatter"
) -> Plan:
    """``s -> s`` with ``s[dim] /= W``; rank r gets block r of the reduction. op in {sum, avg}."""
    received = dict(shape=tuple(shape), dim=dim, op=op)
    shape = _check_shape(op_name, shape)
    world_size = _check_world_size(op_name, world_size, received)
    dim = _check_dim(op_name, "dim", dim, len(shape), received)
    reduce_op = parse_reduce_op(op, op_name=op_name, received=received)
    if reduce_op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise comm_error(op_name, f"op ({reduce_op.value!r}) must be one of sum, avg", **received)
    dtype = _check_dtype(op_name, "dtype", dtype, received)
    accum = _check_reduction(op_name, reduce_op, dtype, accum_dtype, received)
    _check_divisible(op_name, f"size of dim {dim}", shape[dim], world_size, received)
    return Plan(
        op=op_name,
        collective="reduce_scatter",
        world_size=world_size,
        in_shape=shape,
        dims=(dim,),
        reduce_op=reduce_op.value,
        scale=1.0 / world_size if reduce_op is ReduceOp.AVG else 1.0,
        accum_dtype=accum,
        **reduce_scatter_layout(shape, world_size, dim),
    )


def all_to_all(shape, world_size, scatter_dim, gather_dim, *, op_name="all_to_all", dim_names=None) -> Plan:
    """``s -> s`` with ``s[scatter_dim] /= W`` and ``s[gather_dim] *= W``.

    Block j of `scatter_dim` goes to rank j; the blocks received are concatenated along `gather_dim` in
    source-rank order (``lax.all_to_all(..., tiled=True)`` semantics).
    """
    received = dict(shape=tuple(shape), scatter_dim=scatter_dim, gather_dim=gather_dim)
    shape = _check_shape(op_name, shape)
    world_size = _check_world_size(op_name, world_size, received)
    scatter = _check_dim(op_name, "scatter_dim", scatter_dim, len(shape), received)
    gather = _check_dim(op_name, "gather_dim", gather_dim, len(shape), received)
    if scatter == gather:
        raise comm_error(op_name, f"scatter_dim ({scatter}) must differ from gather_dim ({gather})", **received)
    quantity = dim_names[scatter] if dim_names else f"size of scatter_dim {scatter}"
    _check_divisible(op_name, quantity, shape[scatter], world_size, received)
    return Plan(
        op=op_name,
        collective="all_to_all",
        world_size=world_size,
        in_shape=shape,
        dims=(scatter, gather),
        **all_to_all_layout(shape, world_size, scatter, gather),
    )


def all_to_all_4d(shape, world_size, scatter_dim=2, gather_dim=1) -> Plan:
    """Ulysses all-to-all on ``[batch, seq, heads, head_dim]``.

    ``(scatter_dim, gather_dim) = (2, 1)``: ``[B, S/W, H, D] -> [B, S, H/W, D]``; ``(1, 2)``: the reverse.
    """
    op = "all_to_all_4d"
    received = dict(shape=tuple(shape), scatter_dim=scatter_dim, gather_dim=gather_dim)
    dims = _check_shape(op, shape)
    if len(dims) != 4:
        raise comm_error(op, f"ndim ({len(dims)}) must be 4 ([batch, seq, heads, head_dim])", **received)
    scatter = _check_dim(op, "scatter_dim", scatter_dim, 4, received)
    gather = _check_dim(op, "gather_dim", gather_dim, 4, received)
    if (scatter, gather) not in ((2, 1), (1, 2)):
        raise comm_error(op, f"(scatter_dim, gather_dim) ({scatter}, {gather}) must be (2, 1) or (1, 2)", **received)
    return all_to_all(dims, world_size, scatter_dim, gather_dim, op_name=op, dim_names=ULYSSES_DIMS)


def transpose(plan: Plan) -> Plan:
    """The plan of the VJP under ``convention="sum"``: the dual collective on the output shape.

    all_reduce(sum/avg) -> itself; all_gather <-> reduce_scatter(sum) (scale kept); all_to_all -> the dims
    swapped; broadcast <-> reduce to the same root; gather <-> scatter (same root, dim); permute -> the
    inverse pairs; sum_grad (identity) <-> all_reduce(sum). max/min/product are not linear: see the
    reference's `vjp`.
    """
    W, shape, kind = plan.world_size, plan.out_shape, plan.collective
    if kind == "all_reduce":
        if plan.reduce_op not in ("sum", "avg"):
            raise NotImplementedError(f"{plan.op}: op {plan.reduce_op!r} has no linear transpose")
        return plan
    if kind in ("all_gather", "gather"):
        (dim,) = plan.dims
        dual = "reduce_scatter" if kind == "all_gather" else "scatter"
        return plan.replace(collective=dual, in_shape=shape, reduce_op="sum" if dual == "reduce_scatter" else None,
                            **reduce_scatter_layout(shape, W, dim))
    if kind in ("reduce_scatter", "scatter"):
        (dim,) = plan.dims
        dual = "all_gather" if kind == "reduce_scatter" else "gather"
        return plan.replace(collective=dual, in_shape=shape, reduce_op=None, **all_gather_layout(shape, W, dim))
    if kind == "all_to_all":
        scatter, gather = plan.dims
        return plan.replace(in_shape=shape, dims=(gather, scatter), **all_to_all_layout(shape, W, gather, scatter))
    duals = {"broadcast": "reduce", "reduce": "broadcast", "identity": "all_reduce"}
    if kind == "permute":
        return plan.replace(pairs=tuple((dst, src) for src, dst in plan.pairs))
    if kind in duals:
        dual = duals[kind]
        reduce_op = "sum" if dual in ("reduce", "all_reduce") else None
        return plan.replace(collective=dual, reduce_op=reduce_op, **flat_layout(shape, in_place=dual != "identity"))
    raise NotImplementedError(kind)

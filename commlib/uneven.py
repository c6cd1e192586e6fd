"""Uneven sizes: any sequence length and head count at any world size, in the two layouts both frontends walk.

Two lists describe an uneven call (W = world_size; either may be None = the even rule):

- ``scatter_sizes``: the scattered dim is whole on input; rank r keeps ``scatter_sizes[r]`` rows of it
  (rows ``[offset_r, offset_r + scatter_sizes[r])``, offsets = running sums): reduce_scatter, scatter and the
  scatter side of all_to_all (the user's keyword is ``sizes`` where the op has one dim).
- ``gather_sizes``: rank r contributes ``gather_sizes[r]`` rows of the gathered dim, whole on output (rank
  order): all_gather, gather and the gather side of all_to_all.

The two layouts of a sharded dim (a full dim is exact in both):

- **exact** (torch, a plan for one `rank`): rank r's tensor has exactly ``sizes[r]`` rows. Pack and unpack are
  `Blocks` (W slices of the tensor laid out one after another in a flat buffer: one pass each, or a view) and
  every collective is one ``all_to_all_single`` with the split sizes `Blocks.counts` gives (no padding on the
  wire); the reduce of reduce_scatter is the unpack's sum of the W received blocks.
- **padded** (JAX: SPMD, one shape on every device; a plan for every rank, ``rank=None``): a sharded dim has
  ``max(sizes)`` rows on every rank. Input rows past ``sizes[r]`` are ignored (their gradient is exactly 0)
  and output rows past it are zeros. The collective is the even one on padded shapes, with a static index map
  (`Take`) before it (whole dim -> W blocks of ``max`` rows) and after it (W padded blocks -> whole dim).

`layout` gives a plan's layout and sizes record (`Exact` or `Padded`) in either layout, `for_rank` / `padded`
convert a plan between them (the reference simulates both), `rows` says which rows of a padded array are valid on
a rank.

>>> split_sizes(63, 4)
(16, 16, 16, 15)
>>> from commlib import plans
>>> plan = plans.all_to_all_4d((2, 16, 6, 3), 4, 2, 1, scatter_sizes=(2, 2, 1, 1), gather_sizes=split_sizes(63, 4))
>>> plan.out_shape, plan.uneven.before.kind, plan.uneven.after.kind  # padded: [B, 16, H, D] -> [B, 63, 2, D]
((2, 63, 2, 3), 'pad', 'unpad')
>>> exact = for_rank(plan, 3)  # torch on rank 3: [B, 15, H, D] -> [B, 63, 1, D]
>>> exact.in_shape, exact.out_shape, exact.layout.pack.counts, exact.layout.unpack.counts
((2, 15, 6, 3), (2, 63, 1, 3), (180, 180, 90, 90), (96, 96, 96, 90))
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import assert_never

from commlib.errors import comm_error, kind_error
from commlib.layout import (
    Blocks,
    Exact,
    Layout,
    Padded,
    Plan,
    Shape,
    Take,
    all_gather_layout,
    all_to_all_layout,
    local_layout,
    offsets,
    reduce_scatter_layout,
    resized,
)
from commlib.steps import (
    AllGather,
    AllReduce,
    AllToAll,
    Broadcast,
    Gather,
    Identity,
    Pad,
    Permute,
    Reduce,
    ReduceScatter,
    Scatter,
    Slice,
    Step,
    gathered_dim,
    scattered_dim,
)
from commlib.validators import iterable

__all__ = [
    "Sizes",
    "check_sizes",
    "for_rank",
    "layout",
    "padded",
    "plan",
    "rows",
    "sent_elements",
    "split_sizes",
]


def split_sizes(n: int, world_size: int) -> tuple[int, ...]:
    """The balanced split of `n` rows over `world_size` ranks: the first ``n % world_size`` ranks get one row
    more (``numpy.array_split``'s rule). The default way to shard an uneven dim.

    >>> split_sizes(6, 4), split_sizes(3, 4)
    ((2, 2, 1, 1), (1, 1, 1, 0))
    """
    received: dict[str, object] = dict(n=n, world_size=world_size)
    for name, value in received.items():
        if isinstance(value, bool) or not hasattr(value, "__index__"):  # (a bool is an int to operator.index)
            raise kind_error("split_sizes", f"{name} must be an int, not {type(value).__name__}", **received)
    n, world_size = operator.index(n), operator.index(world_size)
    if n < 0 or world_size < 1:
        raise comm_error(
            "split_sizes", f"n ({n}) must be >= 0 and world_size ({world_size}) >= 1", n=n, world_size=world_size
        )
    base, extra = divmod(n, world_size)
    return tuple(base + (rank < extra) for rank in range(world_size))


def _take(dim: int, kind: str, sizes: tuple[int, ...]) -> Take | None:
    """The map, or None where it is the identity (a shared map over equal sizes)."""
    return None if kind in ("pad", "unpad") and len(set(sizes)) <= 1 else Take(dim, kind, sizes)


def _one_hot(world_size: int, index: int, value: int) -> tuple[int, ...]:
    return tuple(value if rank == index else 0 for rank in range(world_size))


Sizes_ = tuple[int, ...]


def _blocks(
    step: Step, shape: Shape, world_size: int, scatter: Sizes_, gather: Sizes_, rank: int
) -> tuple[Blocks, Blocks, Shape]:
    """(pack, unpack, output shape) of the exact layout on `rank` (`shape`: this rank's input)."""
    none = (0,) * world_size
    match step:
        case AllToAll(scatter_dim=scatter_dim, gather_dim=gather_dim):
            out = resized(resized(shape, scatter_dim, scatter[rank]), gather_dim, sum(gather))
            return (
                Blocks(shape, scatter_dim, offsets(scatter), scatter),
                Blocks(out, gather_dim, offsets(gather), gather),
                out,
            )
        case AllGather(dim=dim):
            out = resized(shape, dim, sum(gather))
            sends = (gather[rank],) * world_size
            return Blocks(shape, dim, none, sends), Blocks(out, dim, offsets(gather), gather), out
        case Gather(dim=dim, root=root):
            out = resized(shape, dim, sum(gather))
            received = gather if rank == root else none
            return (
                Blocks(shape, dim, none, _one_hot(world_size, root, gather[rank])),
                Blocks(out, dim, offsets(gather), received),
                out,
            )
        case ReduceScatter(dim=dim):
            out = resized(shape, dim, scatter[rank])
            return (
                Blocks(shape, dim, offsets(scatter), scatter),
                Blocks(out, dim, none, (scatter[rank],) * world_size, reduce=True),
                out,
            )
        case Scatter(dim=dim, root=root):
            out = resized(shape, dim, scatter[rank])
            return (
                Blocks(shape, dim, offsets(scatter), scatter if rank == root else none),
                Blocks(out, dim, none, _one_hot(world_size, root, scatter[rank])),
                out,
            )
        case Slice(dim=dim):  # keep this rank's rows of the whole dim
            out, rows = resized(shape, dim, scatter[rank]), (scatter[rank],)
            return Blocks(shape, dim, (offsets(scatter)[rank],), rows), Blocks(out, dim, (0,), rows), out
        case Pad(dim=dim):  # this rank's rows in place in the whole dim, zeros elsewhere
            out, rows = resized(shape, dim, sum(gather)), (gather[rank],)
            return Blocks(shape, dim, (0,), rows), Blocks(out, dim, (offsets(gather)[rank],), rows), out
        case AllReduce() | Reduce() | Broadcast() | Permute() | Identity():
            raise NotImplementedError(f"no uneven layout for {step.name}")
        case _:
            assert_never(step)


def _exact(step: Step, shape: Shape, world_size: int, scatter: Sizes_, gather: Sizes_, rank: int) -> Layout:
    """The exact layout on `rank` (`shape`: this rank's input)."""
    pack, unpack, out = _blocks(step, shape, world_size, scatter, gather, rank)
    return Layout(pack=pack, send_shape=(pack.numel,), recv_shape=(unpack.numel,), unpack=unpack, out_shape=out)


def _padded(
    step: Step, shape: Shape, world_size: int, scatter: Sizes_, gather: Sizes_
) -> tuple[Layout, Take | None, Take | None]:
    """The padded layout (`shape`: every rank's input): the even layout on the padded shapes, and the `Take`
    maps before and after it."""
    W = world_size
    match step:
        case AllToAll(scatter_dim=scatter_dim, gather_dim=gather_dim):
            layout = all_to_all_layout(resized(shape, scatter_dim, W * max(scatter)), W, scatter_dim, gather_dim)
            return layout, _take(scatter_dim, "pad", scatter), _take(gather_dim, "unpad", gather)
        case AllGather(dim=dim) | Gather(dim=dim):
            return all_gather_layout(shape, W, dim), None, _take(dim, "unpad", gather)
        case ReduceScatter(dim=dim) | Scatter(dim=dim):
            layout = reduce_scatter_layout(resized(shape, dim, W * max(scatter)), W, dim)
            return layout, _take(dim, "pad", scatter), None
        case Slice(dim=dim):
            out = resized(shape, dim, max(scatter))
            return local_layout(out, out), Take(dim, "slice", scatter), None
        case Pad(dim=dim):
            out = resized(shape, dim, sum(gather))
            return local_layout(out, out), Take(dim, "place", gather), None
        case AllReduce() | Reduce() | Broadcast() | Permute() | Identity():
            raise NotImplementedError(f"no uneven layout for {step.name}")
        case _:
            assert_never(step)


def layout(
    step: Step,
    shape: Shape,
    world_size: int,
    scatter_sizes: Sizes_ | None,
    gather_sizes: Sizes_ | None,
    rank: int | None = None,
) -> tuple[Layout, Exact | Padded]:
    """The layout of an uneven plan and its sizes record, for valid, normalised arguments: `Exact` on `rank`,
    `Padded` when `rank` is None. `shape` is the input's."""
    # A side with no sizes (None) is one `step` has no sharded dim for: its case of `_padded` / `_blocks`
    # never reads it, so () stands in there.
    scatter, gather = scatter_sizes or (), gather_sizes or ()
    if rank is None:
        padded_layout, before, after = _padded(step, shape, world_size, scatter, gather)
        return padded_layout, Padded(scatter_sizes, gather_sizes, before, after)
    return (
        _exact(step, shape, world_size, scatter, gather, rank),
        Exact(scatter_sizes, gather_sizes, rank),
    )


def for_rank(plan: Plan, rank: int) -> Plan:
    """`plan` (exact on any rank, or padded) as the exact plan of `rank`: the plan torch builds there (an even
    plan is the same on every rank)."""
    sized = plan.uneven
    if sized is None:
        return plan
    shape = plan.shared_in_shape
    if sized.gather_sizes is not None:
        shape = resized(shape, gathered_dim(plan.step), sized.gather_sizes[rank])  # type: ignore[arg-type]
    exact, held = layout(plan.step, shape, plan.world_size, sized.scatter_sizes, sized.gather_sizes, rank)
    return plan.replace(in_shape=shape, layout=exact, uneven=held)


def padded(plan: Plan) -> Plan:
    """`plan` in the padded layout: the plan JAX builds (an even plan is its own)."""
    sized = plan.uneven
    if sized is None:
        return plan
    shape = plan.shared_in_shape
    padded_layout, held = layout(plan.step, shape, plan.world_size, sized.scatter_sizes, sized.gather_sizes)
    return plan.replace(in_shape=shape, layout=padded_layout, uneven=held)


def rows(plan: Plan, rank: int) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """``(input, output)``: ``(dim, rows)`` of the sharded dim rank `rank` holds exactly (the valid rows of
    the padded layout), or None where that side has no sharded dim.

    >>> from commlib import plans
    >>> rows(plans.all_to_all((6, 4), 4, 0, 1, scatter_sizes=(2, 2, 1, 1), gather_sizes=(4, 4, 3, 0)), 2)
    ((1, 3), (0, 1))
    """
    sized = plan.uneven
    if sized is None:
        return None, None
    gathered, scattered = gathered_dim(plan.step), scattered_dim(plan.step)
    before = None if sized.gather_sizes is None else (gathered, sized.gather_sizes[rank])
    after = None if sized.scatter_sizes is None else (scattered, sized.scatter_sizes[rank])
    return before, after  # type: ignore[return-value]


def sent_elements(plan: Plan, rank: int) -> int:
    """Elements rank `rank` sends to the other ranks in a pairwise exchange (what the wire carries from it):
    the exact layout's split sizes, or the even collective on the (padded) shapes.

    >>> from commlib import plans
    >>> sent_elements(plans.all_to_all_4d((1, 4, 8, 2), 4), 0)  # 3 of the 4 blocks of 16
    48
    """
    if isinstance(plan.uneven, Exact):
        pack = (plan if plan.uneven.rank == rank else for_rank(plan, rank)).layout.pack
        assert isinstance(pack, Blocks), pack
        return pack.numel - (pack.counts[rank] if len(pack.counts) == plan.world_size else 0)
    W, sent = plan.world_size, math.prod(plan.layout.send_shape)
    match plan.step:
        case AllGather():
            return (W - 1) * sent
        case AllToAll() | ReduceScatter():
            return sent * (W - 1) // W
        case Gather() | Scatter() | Slice() | Pad() | AllReduce() | Reduce() | Broadcast() | Permute() | Identity():
            raise NotImplementedError(f"sent_elements: {plan.step.name}")
        case _:
            assert_never(plan.step)


# ---- validation and the plan builder ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sizes:
    """One sizes argument of a public op, as the user gave it."""

    keyword: str  # "sizes", "scatter_sizes" or "gather_sizes": the name in messages
    value: object
    quantity: str  # the sharded dim in messages: "size of dim 0", "heads", ...

    @property
    def shown(self) -> object:
        """The value as messages show it: a tuple of ints where it is one."""
        try:
            return tuple(operator.index(value) for value in iterable(self.value))
        except TypeError:
            return self.value


def check_sizes(op_name: str, sizes: Sizes, world_size: int, received: dict) -> tuple[int, ...]:
    """`sizes` as W ints >= 0, or `CommError` / ``TypeError`` in `op_name`'s words (`commlib.attention` checks
    ``seq_sizes`` with it too).

    >>> check_sizes("all_gather", Sizes("sizes", (3, -1), "size of dim 0"), 2, {})
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: all_gather: sizes[1] (-1) must be >= 0.
    """
    try:
        if any(isinstance(value, bool) for value in iterable(sizes.value)):
            raise TypeError
        values = tuple(operator.index(value) for value in iterable(sizes.value))
    except TypeError:
        raise kind_error(op_name, f"{sizes.keyword} must be a sequence of ints", **received) from None
    if len(values) != world_size:
        raise comm_error(
            op_name, f"len({sizes.keyword}) ({len(values)}) must equal world_size ({world_size})", **received
        )
    for index, value in enumerate(values):
        if value < 0:
            raise comm_error(op_name, f"{sizes.keyword}[{index}] ({value}) must be >= 0", **received)
    return values


def plan(
    op_name: str,
    step: Step,
    shape: Shape,
    world_size: int,
    *,
    scatter: Sizes | None = None,
    gather: Sizes | None = None,
    rank: int | None = None,
    received: dict,
) -> tuple[Layout, Exact | Padded] | None:
    """The layout and sizes record of a validated uneven call (`step`'s dims normalised), or None when the sizes
    are all equal (the even plan is the same op).

    `rank` (checked by the caller): this rank, for the exact layout; None for the padded one. Raises `CommError`
    / ``TypeError`` before any communication: sizes not ints, not W of them, negative, a scattered dim whose
    size is not ``sum(sizes)``, a gathered dim whose size is not ``sizes[rank]`` (exact layout) or
    ``max(sizes)`` (padded layout). `received` holds the op's arguments other than the shape (the same on
    every rank in both layouts, the sizes as `Sizes.shown` included).
    """
    given = [sizes for sizes in (scatter, gather) if sizes is not None]
    values = {sizes.keyword: check_sizes(op_name, sizes, world_size, received) for sizes in given}
    scatter_sizes = gather_sizes = None
    if scatter is not None:
        scatter_sizes = values[scatter.keyword]
        total = shape[scattered_dim(step)]  # type: ignore[index]
        if sum(scatter_sizes) != total:
            whole = f"the {scatter.quantity}" if scatter.quantity.startswith("size of") else scatter.quantity
            message = f"sum({scatter.keyword}) ({sum(scatter_sizes)}) must equal {whole} ({total})"
            raise comm_error(op_name, message, **received)
    if gather is not None:
        gather_sizes = values[gather.keyword]
        have = shape[gathered_dim(step)]  # type: ignore[index]
        if rank is None:
            want, which = max(gather_sizes), f"max({gather.keyword}) ({max(gather_sizes)}) in the padded layout"
        else:
            want, which = gather_sizes[rank], f"{gather.keyword}[{rank}] ({gather_sizes[rank]}) on rank {rank}"
        if have != want:
            raise comm_error(op_name, f"{gather.quantity} ({have}) must equal {which}", shape=shape, **received)
    if all(len(set(sizes)) <= 1 for sizes in (scatter_sizes, gather_sizes) if sizes is not None):
        return None
    if isinstance(step, AllToAll):  # the side left None is even: make it explicit
        scatter_sizes = scatter_sizes or (shape[step.scatter_dim] // world_size,) * world_size
        gather_sizes = gather_sizes or (shape[step.gather_dim],) * world_size
    return layout(step, shape, world_size, scatter_sizes, gather_sizes, rank)

"""Expert parallelism (MoE), the spec: the routing walk, both layouts and the three VJP rules, once, over a
small `MoeBackend` that torch, JAX and the numpy reference (`simulate_moe`) implement.

The routing walk, on each rank (`route_plan` validates, `local_routing` sorts, `rank_tables` indexes):

1. each rank's token copies ``(t, k)`` with ``indices[t, k] != -1`` are sorted by expert (stable: within an
   expert, token-major ``(t, k)`` order); `capacity` keeps the first ``capacity`` copies per (source rank,
   expert) in that order and drops the rest;
2. the per-expert counts are exchanged once (every rank sends each rank the counts of that rank's experts);
   receive sizes are derived from them, never passed;
3. rows move by one uneven all-to-all (`exact`), their receive order is (source rank, expert, (t, k));
4. they are reordered expert-major: expert, then source rank, then (t, k). `padded` appends zero rows up to
   the static `RoutePlan.padded_rows`.

Combine runs it backwards and sums each token's top-k at the source, weighted, in fixed k order.

VJP rules (`dispatch_vjp`, `combine_vjp`): dispatch is a 0/1 selection, so its VJP is an unweighted combine;
combine is bilinear: ``y_bar = dispatch(w * out_bar)`` and ``w_bar[t, k] = <out_bar[t], row(t, k)>`` at the
source, with no extra communication. Dropped and -1 routes get exactly 0, and so do padded rows (their input
values, NaN included, are never read).

>>> plan = route_plan((3, 2), "int64", 4, 2)
>>> plan.experts_per_rank, plan.expert_offsets
((2, 2), (0, 2, 4))
>>> order, counts, dropped = local_routing(np.array([[1, 0], [0, -1], [3, 0]]), plan)
>>> order.tolist(), counts.tolist(), dropped  # flat t * K + k, expert-major
([1, 2, 5, 0, 4], [3, 1, 0, 1], 0)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import numpy as np

from commlib import layer_names
from commlib.errors import CommError, comm_error, kind_error

__all__ = [
    "ROUTE_OP",
    "DISPATCH_OP",
    "COMBINE_OP",
    "LAYOUTS",
    "RoutePlan",
    "route_plan",
    "bad_route",
    "bad_route_error",
    "BAD_WHY",
    "padded_bad_route",
    "check_indices",
    "local_routing",
    "RankTables",
    "rank_tables",
    "TableMath",
    "NumpyTableMath",
    "padded_routing",
    "padded_tables",
    "padded_tokens_error",
    "check_weights",
    "check_rows",
    "MoeBackend",
    "dispatch",
    "combine",
    "combine_rows",
    "dispatch_vjp",
    "combine_vjp",
]

ROUTE_OP, DISPATCH_OP, COMBINE_OP = layer_names.ROUTE, layer_names.DISPATCH, layer_names.COMBINE
#: The layouts of the dispatched rows: only valid rows (`exact`), or static shapes padded with zeros (`padded`).
LAYOUTS = ("exact", "padded")
Layout = Literal["exact", "padded"]


@dataclasses.dataclass(frozen=True)
class RoutePlan:
    """What every rank agrees on before routing (no split sizes: those are runtime values)."""

    num_experts: int  # E
    top_k: int  # K, the columns of `indices`
    tokens: int  # T, this rank's rows of `indices`
    world_size: int  # W
    experts_per_rank: tuple[int, ...]  # W ints summing to E, contiguous blocks in rank order
    capacity: int | None  # most routes kept per (source rank, expert); None: dropless
    layout: Layout

    @property
    def expert_offsets(self) -> tuple[int, ...]:
        """The first expert of each rank, then E (W + 1 ints)."""
        return (0, *itertools.accumulate(self.experts_per_rank))  # pure Python: torch.compile traces it

    @property
    def slot(self) -> int:
        """Rows a (source rank, expert) pair may send: `capacity`, or T when dropless (an expert at most once
        per token)."""
        return self.tokens if self.capacity is None else self.capacity

    @property
    def padded_rows(self) -> int:
        """The `padded` layout's static rows: ``max(experts_per_rank) * W * slot`` (the same on every rank)."""
        return max(self.experts_per_rank) * self.world_size * self.slot


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _placement(num_experts: int, world_size: int, experts_per_rank: Sequence[int] | None) -> tuple[int, ...]:
    received: dict[str, object] = dict(num_experts=num_experts, world_size=world_size)
    if experts_per_rank is None:
        if num_experts % world_size:
            raise comm_error(
                ROUTE_OP,
                f"num_experts ({num_experts}) must be divisible by world_size ({world_size}) "
                f"when experts_per_rank is None; pass experts_per_rank=split_sizes({num_experts}, "
                f"{world_size}) for an uneven placement",
                **received,
            )
        return (num_experts // world_size,) * world_size
    sizes = tuple(experts_per_rank)
    received["experts_per_rank"] = experts_per_rank
    if not all(_is_int(size) for size in sizes):
        raise kind_error(ROUTE_OP, "experts_per_rank must hold ints", **received)
    if len(sizes) != world_size:
        raise comm_error(
            ROUTE_OP, f"experts_per_rank has {len(sizes)} entries, not world_size ({world_size})", **received
        )
    if min(sizes) < 0 or sum(sizes) != num_experts:
        raise comm_error(
            ROUTE_OP, f"experts_per_rank must be >= 0 and sum ({sum(sizes)}) to num_experts ({num_experts})", **received
        )
    return tuple(int(size) for size in sizes)


def _capacity(
    tokens: int, top_k: int, num_experts: int, capacity: int | None, capacity_factor: float | None
) -> int | None:
    received: dict[str, object] = dict(capacity=capacity, capacity_factor=capacity_factor)
    if capacity is not None and capacity_factor is not None:
        raise comm_error(
            ROUTE_OP, "capacity and capacity_factor are exclusive: pass one (or neither: dropless)", **received
        )
    if capacity is not None:
        if not _is_int(capacity):
            raise kind_error(ROUTE_OP, f"capacity must be an int, not {type(capacity).__name__}", **received)
        if capacity < 0:
            raise comm_error(ROUTE_OP, f"capacity ({capacity}) must be >= 0", **received)
        return int(capacity)
    if capacity_factor is not None:
        if not isinstance(capacity_factor, numbers.Real) or isinstance(capacity_factor, bool):
            raise kind_error(
                ROUTE_OP, f"capacity_factor must be a number, not {type(capacity_factor).__name__}", **received
            )
        if not capacity_factor > 0 or not math.isfinite(capacity_factor):
            raise comm_error(ROUTE_OP, f"capacity_factor ({capacity_factor}) must be finite and > 0", **received)
        return math.ceil(tokens * top_k / num_experts * capacity_factor)
    return None


def route_plan(
    shape: Sequence[int],
    dtype: str,
    num_experts: int,
    world_size: int,
    *,
    capacity: int | None = None,
    capacity_factor: float | None = None,
    experts_per_rank: Sequence[int] | None = None,
    layout: str = "exact",
) -> RoutePlan:
    """Validate `route`'s arguments (indices of `shape` and `dtype`, a numpy dtype name) before any
    communication and give the `RoutePlan`. `capacity_factor` f gives ``ceil(T * K / E * f)``.

    >>> route_plan((4, 2), "int32", 8, 3, experts_per_rank=(3, 3, 2), capacity_factor=1.0).capacity
    1
    >>> try:
    ...     route_plan((4, 2), "int32", 8, 3)
    ... except ValueError as error:
    ...     print(str(error)[:88])
    route: num_experts (8) must be divisible by world_size (3) when experts_per_rank is None
    """
    shape = tuple(shape)
    if not np.issubdtype(np.dtype(dtype), np.integer):
        raise kind_error(ROUTE_OP, f"indices must be an integer array, not {dtype}", shape=shape, dtype=dtype)
    if len(shape) != 2:
        raise comm_error(ROUTE_OP, f"indices must be [T, K] (ndim 2), not ndim {len(shape)}", shape=shape)
    if not _is_int(num_experts) or not _is_int(world_size):
        raise kind_error(
            ROUTE_OP, "num_experts and world_size must be ints", num_experts=num_experts, world_size=world_size
        )
    if num_experts < 1 or world_size < 1:
        raise comm_error(
            ROUTE_OP,
            f"num_experts ({num_experts}) and world_size ({world_size}) must be >= 1",
            num_experts=num_experts,
            world_size=world_size,
        )
    if shape[1] > num_experts:
        raise comm_error(
            ROUTE_OP,
            f"K ({shape[1]}) must be <= num_experts ({num_experts}): an expert at most once per token",
            shape=shape,
            num_experts=num_experts,
        )
    if layout not in LAYOUTS:
        raise comm_error(ROUTE_OP, f"layout must be one of {LAYOUTS}, not {layout!r}", layout=layout)
    placement = _placement(num_experts, world_size, experts_per_rank)
    kept = _capacity(shape[0], shape[1], num_experts, capacity, capacity_factor)
    return RoutePlan(num_experts, shape[1], shape[0], world_size, placement, kept, layout)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------
# Bad indices are data: found on each rank, raised the same on every rank (frontends carry a flag)
# ---------------------------------------------------------------------------------------------------------


def bad_route(indices: np.ndarray, num_experts: int) -> tuple[int, int, str] | None:
    """The first bad row of `indices` ``[T, K]`` in token order: ``(token, value, why)``, why ``"range"`` (a
    value outside [-1, E)) or ``"twice"`` (one expert twice in the row); None when every row is good."""
    indices = np.asarray(indices)
    outside = (indices < -1) | (indices >= num_experts)
    ordered = np.sort(indices, axis=1)
    twice = np.zeros(indices.shape, dtype=bool)
    twice[:, 1:] = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] != -1)
    for token in np.flatnonzero(outside.any(axis=1) | twice.any(axis=1))[:1]:
        if outside[token].any():
            return int(token), int(indices[token][outside[token]][0]), "range"
        return int(token), int(ordered[token][twice[token]][0]), "twice"
    return None


def bad_route_error(rank: int, token: int, value: int, why: str, num_experts: int) -> CommError:
    """The `CommError` every rank raises for rank `rank`'s first bad row (what `bad_route` found): the
    frontends exchange ``(rank, token, value, why)`` with the counts so that no rank hangs.

    >>> print(bad_route_error(1, 3, 9, "range", 8))
    route: indices[3] on rank 1 holds expert 9, outside [-1, 8). Received: rank=1, token=3, value=9
    >>> print(bad_route_error(0, 2, 5, "twice", 8))
    route: indices[2] on rank 0 routes to expert 5 twice. Received: rank=0, token=2, value=5
    """
    what = f"holds expert {value}, outside [-1, {num_experts})" if why == "range" else f"routes to expert {value} twice"
    return comm_error(ROUTE_OP, f"indices[{token}] on rank {rank} {what}", rank=rank, token=token, value=value)


def check_indices(indices: np.ndarray, num_experts: int, rank: int) -> None:
    """Raise `bad_route_error` for this rank's first bad row (the reference; frontends exchange the flag)."""
    found = bad_route(indices, num_experts)
    if found is not None:
        raise bad_route_error(rank, *found, num_experts)


# ---------------------------------------------------------------------------------------------------------
# The routing walk
# ---------------------------------------------------------------------------------------------------------


def local_routing(indices: np.ndarray, plan: RoutePlan) -> tuple[np.ndarray, np.ndarray, int]:
    """This rank's kept copies: ``(order, counts, dropped)``: the flat copies ``t * K + k`` sorted by expert
    (token-major within one), the first `capacity` per expert kept; per-expert counts ``[E]`` after capacity;
    the number of routes dropped by capacity (-1 entries are not routes)."""
    flat = np.asarray(indices, dtype=np.int64).reshape(-1)
    routed = np.flatnonzero(flat >= 0)
    order = routed[np.argsort(flat[routed], kind="stable")]
    experts = flat[order]
    counts = np.bincount(experts, minlength=plan.num_experts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank_in_expert = np.arange(order.size) - starts[experts]
    keep = rank_in_expert < (order.size if plan.capacity is None else plan.capacity)
    kept_counts = np.bincount(experts[keep], minlength=plan.num_experts)
    return order[keep], kept_counts.astype(np.int64), int((~keep).sum())


@dataclasses.dataclass(frozen=True)
class RankTables:
    """One rank's index tables, built from the counts exchange (`rank_tables`). Index -1 reads a zero row.
    For the numpy reference the array fields hold W arrays, one per rank (`stack`)."""

    send_copy: Any  # [S] flat copies t * K + k in send order (destination, expert, (t, k))
    send_token: Any  # [S] the token t of each sent row (send_copy // K): dispatch gathers x's rows straight
    send_sizes: Any  # [W] rows sent to each rank
    recv_sizes: Any  # [W] rows received from each rank
    unpack: Any  # [R or padded_rows] receive-order position of each expert-major row, -1 past `rows`
    pack_back: Any  # [sum recv_sizes] expert-major row of each receive-order position
    token_slot: Any  # [T, K] send-order position of copy (t, k), -1 for dropped and -1 routes
    tokens_per_expert: Any  # [this rank's experts] rows received per local expert
    rows: Any  # valid rows of the dispatched output
    dropped: Any  # routes this rank dropped by capacity


def rank_tables(
    plan: RoutePlan, rank: int, order: np.ndarray, send_counts: np.ndarray, dropped: int, received_counts: np.ndarray
) -> RankTables:
    """Rank `rank`'s tables from its `local_routing` and `received_counts` ``[W, E_r]``: source s's kept
    counts for each of this rank's experts (what the counts exchange delivers)."""
    offsets, world = plan.expert_offsets, plan.world_size
    send_sizes = np.array([send_counts[offsets[d] : offsets[d + 1]].sum() for d in range(world)], dtype=np.int64)
    counts = np.asarray(received_counts, dtype=np.int64).reshape(world, plan.experts_per_rank[rank])
    recv_sizes = counts.sum(axis=1)
    # receive position of (source s, expert e, j): source-major; expert-major position: expert, source, j
    flat = counts.reshape(-1)  # exclusive sums: a rank may own no experts (counts [W, 0])
    receive_start = (np.cumsum(flat) - flat).reshape(counts.shape)
    expert_major = counts.T.reshape(-1)
    major_start = (np.cumsum(expert_major) - expert_major).reshape(counts.T.shape).T
    rows = int(counts.sum())
    pack_back = np.empty(rows, dtype=np.int64)
    for (source, expert), count in np.ndenumerate(counts):
        pack_back[receive_start[source, expert] : receive_start[source, expert] + count] = major_start[
            source, expert
        ] + np.arange(count)
    length = rows if plan.layout == "exact" else plan.padded_rows
    unpack = np.full(length, -1, dtype=np.int64)
    unpack[pack_back] = np.arange(rows)
    token_slot = np.full(plan.tokens * plan.top_k, -1, dtype=np.int64)
    token_slot[order] = np.arange(order.size)
    return RankTables(
        order,
        order // plan.top_k,
        send_sizes,
        recv_sizes,
        unpack,
        pack_back,
        token_slot.reshape(plan.tokens, plan.top_k),
        counts.sum(axis=0),
        rows,
        dropped,
    )


# ---------------------------------------------------------------------------------------------------------
# The padded layout's tables with static shapes, on device (JAX, torch's `padded`): no host read
# ---------------------------------------------------------------------------------------------------------


class TableMath(Protocol):
    """The array operations `padded_routing` and `padded_tables` need beyond Python's operators (comparisons,
    ``& | ~ + - * // %``, integer-array indexing, ``reshape``, ``.T``), bound by each frontend (`NumpyTableMath`
    here); integers are the frontend's index dtype."""

    def constant(self, values: Sequence[Any]) -> Any:
        """Nested lists of Python ints as an array on the frontend's device, in its index dtype."""

    def as_int(self, values: Any) -> Any:
        """`values` in the index dtype."""

    def arange(self, size: int) -> Any: ...

    def argsort(self, values: Any) -> Any:
        """Stable ascending argsort of a 1-D array."""

    def searchsorted(self, ordered: Any, values: Any) -> Any:
        """``side="right"`` positions of `values` in the ascending 1-D `ordered`."""

    def cumsum(self, values: Any, axis: int) -> Any: ...

    def concatenate(self, arrays: Sequence[Any]) -> Any: ...

    def where(self, condition: Any, a: Any, b: Any) -> Any: ...

    def minimum(self, a: Any, b: Any) -> Any: ...

    def total(self, values: Any, axis: int | None = None) -> Any:
        """Sum over `axis` (None: all), in the index dtype (bool arrays count their True entries)."""

    def any(self, values: Any, axis: int) -> Any: ...

    def scatter(self, size: int, index: Any, values: Any) -> Any:
        """``[size]``: -1 everywhere, then ``out[index] = values``; entries with ``index == size`` are dropped
        (`index` otherwise distinct)."""


class NumpyTableMath:
    """`TableMath` on numpy int64 arrays (the spec's tests of `padded_routing` / `padded_tables`)."""

    def constant(self, values: Sequence[Any]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64)

    def as_int(self, values: Any) -> np.ndarray:
        return np.asarray(values).astype(np.int64)

    def arange(self, size: int) -> np.ndarray:
        return np.arange(size, dtype=np.int64)

    def argsort(self, values: Any) -> np.ndarray:
        return np.argsort(values, kind="stable")

    def searchsorted(self, ordered: Any, values: Any) -> np.ndarray:
        return np.searchsorted(ordered, values, side="right").astype(np.int64)

    def cumsum(self, values: Any, axis: int) -> np.ndarray:
        return np.cumsum(values, axis=axis)

    def concatenate(self, arrays: Sequence[Any]) -> np.ndarray:
        return np.concatenate(arrays)

    def where(self, condition: Any, a: Any, b: Any) -> np.ndarray:
        return np.where(condition, a, b)

    def minimum(self, a: Any, b: Any) -> np.ndarray:
        return np.minimum(a, b)

    def total(self, values: Any, axis: int | None = None) -> np.ndarray:
        return np.sum(values, axis=axis).astype(np.int64)

    def any(self, values: Any, axis: int) -> np.ndarray:
        return np.any(values, axis=axis)

    def scatter(self, size: int, index: Any, values: Any) -> np.ndarray:
        out = np.full(size + 1, -1, dtype=np.int64)
        out[index] = values
        return out[:size]


def _exclusive(math: TableMath, counts: Any, axis: int = -1) -> Any:
    return math.cumsum(counts, axis) - counts


#: `bad_route`'s reasons, by the index `padded_bad_route` gives.
BAD_WHY = ("range", "twice")


def _bad_entries(math: TableMath, index: Any, plan: RoutePlan) -> tuple[Any, Any]:
    """``(outside, twice)`` ``[T, K]``: entries outside [-1, E), and entries in [0, E) given earlier in their
    row (the later copy)."""
    top_k = plan.top_k
    outside = (index < -1) | (index >= plan.num_experts)
    earlier = math.constant([[int(j < k) for j in range(top_k)] for k in range(top_k)]) > 0  # [k, j]: j < k
    twice = math.any((index[:, :, None] == index[:, None, :]) & earlier, -1) & (index >= 0) & ~outside
    return outside, twice


def _first(math: TableMath, flags: Any) -> Any:
    """The position of the first True of the 1-D bool `flags` (its length when none): the leading False."""
    return math.total(math.cumsum(math.as_int(flags), 0) == 0)


def padded_bad_route(math: TableMath, indices: Any, plan: RoutePlan) -> Any:
    """`bad_route` with static shapes, on the indices' device: ``[found, token, value, why]`` (index dtype;
    why indexes `BAD_WHY`; all 0 when every row is good), so that a frontend sends it with the counts and
    reads only what it receives (torch's eager `padded` route).

    >>> plan = route_plan((3, 3), "int64", 4, 1)
    >>> padded_bad_route(NumpyTableMath(), np.array([[0, 1, -1], [3, 1, 3], [9, 0, 0]]), plan).tolist()
    [1, 1, 3, 1]
    >>> bad_route(np.array([[0, 1, -1], [3, 1, 3], [9, 0, 0]]), 4)
    (1, 3, 'twice')
    """
    if plan.tokens == 0 or plan.top_k == 0:  # static: nothing to find
        return math.constant([0, 0, 0, 0])
    index = math.as_int(indices)
    outside, twice = _bad_entries(math, index, plan)
    token = _first(math, math.any(outside | twice, 1))
    found = token < plan.tokens
    row = math.minimum(token, plan.tokens - 1)  # a good row when none is found (masked below)
    values, outside_row = index[row], outside[row]
    in_range = values[math.minimum(_first(math, outside_row), plan.top_k - 1)]  # the first outside, k order
    repeated = math.where(twice[row], values, plan.num_experts)  # bad_route's: the smallest repeated expert
    given_twice = repeated[math.argsort(repeated)[0]]
    is_range = math.any(outside_row, 0)
    value = math.where(is_range, in_range, given_twice)
    why = math.where(is_range, 0, 1)
    parts = [found, math.where(found, token, 0), math.where(found, value, 0), math.where(found, why, 0)]
    return math.concatenate([math.as_int(part).reshape(1) for part in parts])


def padded_routing(math: TableMath, indices: Any, plan: RoutePlan) -> dict[str, Any]:
    """`local_routing` with static shapes, for indices ``[T, K]`` on a device: ``order`` (``[T * K]``, the flat
    copies sorted by expert, not-routed last), ``keep`` (``[T * K]``, in that order: the kept copies, so
    ``order[keep]`` is `local_routing`'s order), ``position`` (``[T * K]``: the kept copy's send-buffer
    position, ``W * C`` for the others), ``counts`` (``[E]`` after capacity), ``send`` (``[W,
    max(experts_per_rank)]``: the counts rank d receives, zero-padded), ``dropped`` and ``invalid`` (bad
    entries: outside [-1, E), or an expert again in its row, the later copy; dropped). The send buffer holds W
    chunks of ``C = max(experts_per_rank) * slot`` rows, destination d's rows first in its chunk.

    >>> plan = route_plan((3, 2), "int64", 4, 2)
    >>> local = padded_routing(NumpyTableMath(), np.array([[1, 0], [0, -1], [3, 0]]), plan)
    >>> local["order"][local["keep"]].tolist(), local["counts"].tolist(), int(local["invalid"])
    ([1, 2, 5, 0, 4], [3, 1, 0, 1], 0)
    """
    tokens, top_k, experts, world = plan.tokens, plan.top_k, plan.num_experts, plan.world_size
    offsets, most = plan.expert_offsets, max(plan.experts_per_rank)
    chunk = most * plan.slot
    # host constants as Python lists (torch.compile traces this function: no numpy in it)
    destination = [d for d in range(world) for _ in range(plan.experts_per_rank[d])] + [0]  # of each expert
    table = [  # [d, local expert] -> expert (E: a zero count)
        [offsets[d] + e if e < plan.experts_per_rank[d] else experts for e in range(most)] for d in range(world)
    ]
    index = math.as_int(indices)
    outside, twice = _bad_entries(math, index, plan)
    bad = outside | twice
    flat = math.where(bad | (index < 0), experts, index).reshape(-1)  # E: not routed
    order = math.argsort(flat)
    sorted_experts = flat[order]
    ends = math.searchsorted(sorted_experts, math.arange(experts + 1))  # copies with expert <= e
    zero = math.constant([0])
    counts = (ends - math.concatenate([zero, ends[:-1]]))[:experts]
    starts = math.concatenate([_exclusive(math, counts), zero])
    within = math.arange(tokens * top_k) - starts[sorted_experts]
    keep = (sorted_experts < experts) & (within < plan.slot)
    kept = math.minimum(counts, plan.slot)
    before = math.concatenate([_exclusive(math, kept), zero])
    first = math.constant([offsets[d] for d in destination])[sorted_experts]  # the first expert of its destination
    in_chunk = before[sorted_experts] - before[first] + within
    position = math.where(
        keep, math.constant([d * chunk for d in destination])[sorted_experts] + in_chunk, world * chunk
    )
    send = math.concatenate([kept, zero])[math.constant(table)]
    return dict(
        order=order,
        keep=keep,
        position=math.as_int(position),
        counts=kept,
        send=send,
        dropped=math.total(counts - kept),
        invalid=math.total(bad),
    )


def padded_tables(math: TableMath, plan: RoutePlan, local: dict[str, Any], received: Any) -> dict[str, Any]:
    """`rank_tables` with static shapes, in the padded layout (`padded_routing`'s chunks; receive position
    ``s * C + j`` is source s's j-th row), from `padded_routing` and `received` ``[W, max(experts_per_rank)]``
    (source s's kept counts of this rank's experts, zero-padded: what the counts exchange delivers). The
    `RankTables` fields by name; index -1 reads a zero row.

    >>> plan = route_plan((3, 1), "int64", 2, 1)
    >>> local = padded_routing(NumpyTableMath(), np.array([[1], [0], [1]]), plan)
    >>> tables = padded_tables(NumpyTableMath(), plan, local, local["send"])
    >>> tables["send_copy"].tolist(), tables["unpack"].tolist(), tables["token_slot"][:, 0].tolist()
    ([1, 0, 2, -1, -1, -1], [0, 1, 2, -1, -1, -1], [1, 0, 2])
    """
    world, most, tokens, top_k = plan.world_size, max(plan.experts_per_rank), plan.tokens, plan.top_k
    chunk, length = most * plan.slot, plan.padded_rows
    send_copy = math.scatter(world * chunk, local["position"], local["order"])
    slot = math.where(local["keep"], local["position"], -1)
    token_slot = math.scatter(tokens * top_k, local["order"], slot).reshape(tokens, top_k)
    received = math.as_int(received)
    recv_start = _exclusive(math, received, 1)  # [s, e]: within source s's chunk
    major = received.T.reshape(-1)  # expert-major: expert, then source
    major_end = math.cumsum(major, 0)
    rows = major_end[-1]
    row = math.arange(length)
    group = math.minimum(math.searchsorted(major_end, row), most * world - 1)
    expert, source = group // world, group % world
    valid = row < rows
    unpack = math.where(valid, source * chunk + recv_start[source, expert] + row - (major_end - major)[group], -1)
    pack_back = math.scatter(world * chunk, math.where(valid, unpack, world * chunk), row)
    return dict(
        send_copy=send_copy,
        send_token=math.where(send_copy >= 0, send_copy // top_k, -1),
        send_sizes=math.total(local["send"], 1),
        recv_sizes=math.total(received, 1),
        unpack=math.as_int(unpack),
        pack_back=pack_back,
        token_slot=token_slot,
        tokens_per_expert=math.total(received, 0),
        rows=rows,
    )


def padded_tokens_error(tokens: Sequence[int]) -> CommError:
    """The `padded` layout's static rows hold T (dropless: a slot of T rows per (source, expert)), so every
    rank must route as many tokens; checked mode compares T there (`commlib.layer_check.moe_call`).

    >>> print(padded_tokens_error([4, 3]))  # doctest: +ELLIPSIS
    route: layout='padded' needs the same T on every rank (...); ranks have T = (4, 3); use layout='exact'...
    """
    return comm_error(
        ROUTE_OP,
        "layout='padded' needs the same T on every rank (its static rows are "
        f"max(experts_per_rank) * W * (capacity or T)); ranks have T = {tuple(tokens)}; use "
        "layout='exact'",
        tokens=tuple(tokens),
    )


def ranks_differ_error(what: str, values: Sequence[object]) -> CommError:
    """A quantity every rank's call must share (K, the feature shape, the number of ranks given) differs: the
    routing of one rank would be walked with another's.

    >>> print(ranks_differ_error("top_k K", [2, 1]))  # doctest: +ELLIPSIS
    route: every rank must have the same top_k K; ranks have (2, 1). Received: values=(2, 1)
    """
    return comm_error(
        ROUTE_OP, f"every rank must have the same {what}; ranks have {tuple(values)}", values=tuple(values)
    )


def check_weights(weights_shape: Sequence[int] | None, plan: RoutePlan) -> None:
    """`combine`'s `weights` must be ``[T, K]`` as the routing's indices."""
    if weights_shape is not None and tuple(weights_shape) != (plan.tokens, plan.top_k):
        raise comm_error(
            COMBINE_OP,
            f"weights shape {tuple(weights_shape)} must be the indices' [T, K] ({plan.tokens}, {plan.top_k})",
            weights_shape=tuple(weights_shape),
        )


def check_rows(op_name: str, argument: str, shape: Sequence[int], expected: int, what: str) -> None:
    """`argument` of `op_name` must have `expected` rows (dim 0): T for dispatch's x, the routing's rows (exact)
    or padded rows (padded) for combine's y."""
    shape = tuple(shape)
    if len(shape) < 1 or shape[0] != expected:
        raise comm_error(
            op_name,
            f"{argument} has {shape[0] if shape else None} rows, not the routing's {what} ({expected})",
            shape=shape,
        )


# ---------------------------------------------------------------------------------------------------------
# The walk over a backend: dispatch, combine and their VJPs
# ---------------------------------------------------------------------------------------------------------


class MoeBackend(Protocol):
    """What a walker of the MoE exchange implements on one rank's arrays (or the reference's W ranks at once).
    Rows are dim 0; index -1 reads a zero row."""

    def take(self, x: Any, index: Any) -> Any:
        """``x[index]`` (rows, of `index`'s shape), zeros where ``index == -1`` (never reading them)."""

    def exchange(self, x: Any, send_sizes: Any, recv_sizes: Any) -> Any:
        """The uneven all-to-all of rows: chunk d of `x` (``send_sizes[d]`` rows) to rank d."""

    def k_sum(self, rows: Any, weights: Any | None) -> Any:
        """``[T, K, *F] -> [T, *F]``: ``sum_k weights[t, k] * rows[t, k]`` (weights None: 1), k in order 0..K-1."""

    def spread(self, out_bar: Any, weights: Any | None) -> Any:
        """``[T, *F] -> [T * K, *F]``: row ``t * K + k`` is ``weights[t, k] * out_bar[t]`` (None: 1)."""

    def inner(self, out_bar: Any, rows: Any) -> Any:
        """``[T, K]``: ``<out_bar[t], rows[t, k]>`` over the features."""


def _send(backend: MoeBackend, send: Any, tables: RankTables) -> Any:
    """The send buffer's rows exchanged and reordered expert-major."""
    return backend.take(backend.exchange(send, tables.send_sizes, tables.recv_sizes), tables.unpack)


def _returned(backend: MoeBackend, y: Any, tables: RankTables) -> Any:
    """``[T, K, *F]``: each copy's row of `y` back at its source (zero for dropped and -1 routes; padded rows
    are never read)."""
    back = backend.take(y, tables.pack_back)
    return backend.take(backend.exchange(back, tables.recv_sizes, tables.send_sizes), tables.token_slot)


def dispatch(backend: MoeBackend, x: Any, tables: RankTables, top_k: int) -> Any:
    """``x [T, *F] -> [R, *F]`` expert-major (padded: zero rows past `rows`). The send buffer is one gather of
    x's rows (`RankTables.send_token`), never K copies of x."""
    return _send(backend, backend.take(x, tables.send_token), tables)


def combine(backend: MoeBackend, y: Any, tables: RankTables, weights: Any | None) -> Any:
    """``y [R, *F] -> [T, *F]``: the weighted k-sum of each token's rows at its source."""
    return combine_rows(backend, y, tables, weights)[0]


def combine_rows(backend: MoeBackend, y: Any, tables: RankTables, weights: Any | None) -> tuple[Any, Any]:
    """``(out, returned)``: `combine`'s output and the rows it brought back (``[T, K, *F]``, each copy's row at
    its source), which `combine_vjp` takes as `returned` so the weights' gradient needs no second exchange."""
    returned = _returned(backend, y, tables)
    return backend.k_sum(returned, weights), returned


def dispatch_vjp(backend: MoeBackend, out_bar: Any, tables: RankTables) -> Any:
    """x's cotangent: an unweighted combine of the dispatched rows' cotangent (padded rows ignored)."""
    return combine(backend, out_bar, tables, None)


def combine_vjp(
    backend: MoeBackend,
    out_bar: Any,
    y: Any,
    tables: RankTables,
    weights: Any | None,
    returned: Any | None = None,
    *,
    weights_grad: bool = True,
) -> tuple[Any, Any | None]:
    """``(y_bar, w_bar)``: ``y_bar = dispatch(w * out_bar)`` (padded rows 0), ``w_bar[t, k] = <out_bar[t],
    row(t, k)>`` at the source (0 for dropped and -1 routes), None without weights or when `weights_grad` is
    False. `returned`: the rows the forward brought back (`combine_rows`): no exchange for w_bar; None brings
    `y`'s rows back again (one more exchange)."""
    y_bar = _send(backend, backend.take(backend.spread(out_bar, weights), tables.send_copy), tables)
    if weights is None or not weights_grad:
        return y_bar, None
    return y_bar, backend.inner(out_bar, _returned(backend, y, tables) if returned is None else returned)

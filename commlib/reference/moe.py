"""The float64 reference of expert parallelism: `commlib.moe`'s walk on W simulated numpy ranks
(`simulate_moe` over `SimulatedMoeRanks`), both layouts, so the routing and the VJP rules are tested without a
framework.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from commlib import moe

__all__ = ["SimulatedMoeRanks", "MoeSimulation", "simulate_moe"]


class SimulatedMoeRanks:
    """A `commlib.moe.MoeBackend` over W ranks at once: every array is a list of W float64 arrays, every
    table a list of W index arrays."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k

    def take(self, x: list[np.ndarray], index: list[np.ndarray]) -> list[np.ndarray]:
        out = []
        for rows, where in zip(x, index, strict=True):
            taken = np.zeros((*where.shape, *rows.shape[1:]), dtype=np.float64)
            valid = where >= 0
            taken[valid] = rows[where[valid]]
            out.append(taken)
        return out

    def exchange(
        self, x: list[np.ndarray], send_sizes: list[np.ndarray], recv_sizes: list[np.ndarray]
    ) -> list[np.ndarray]:
        chunks = [np.split(rows, np.cumsum(sizes)[:-1]) for rows, sizes in zip(x, send_sizes, strict=True)]
        out = [np.concatenate([chunks[source][rank] for source in range(len(x))]) for rank in range(len(x))]
        for rows, sizes in zip(out, recv_sizes, strict=True):
            assert rows.shape[0] == int(np.sum(sizes))  # derived from the counts exchange, never passed
        return out

    def k_sum(self, rows: list[np.ndarray], weights: list[np.ndarray] | None) -> list[np.ndarray]:
        out = []
        for rank, copies in enumerate(rows):
            total = np.zeros((copies.shape[0], *copies.shape[2:]), dtype=np.float64)
            for k in range(copies.shape[1]):  # fixed k order
                scale = 1.0 if weights is None else _column(weights[rank][:, k], copies.ndim - 1)
                total = total + scale * copies[:, k]
            out.append(total)
        return out

    def spread(self, out_bar: list[np.ndarray], weights: list[np.ndarray] | None) -> list[np.ndarray]:
        out = []
        for rank, rows in enumerate(out_bar):
            k = weights[rank].shape[1] if weights is not None else self.top_k
            w = np.ones((rows.shape[0], k)) if weights is None else weights[rank]
            copies = _column(w, rows.ndim + 1) * rows[:, None]
            out.append(copies.reshape(rows.shape[0] * k, *rows.shape[1:]))
        return out

    def inner(self, out_bar: list[np.ndarray], rows: list[np.ndarray]) -> list[np.ndarray]:
        features = [tuple(range(2, r.ndim)) for r in rows]
        return [np.sum(o[:, None] * r, axis=axes) for o, r, axes in zip(out_bar, rows, features, strict=True)]


def _column(values: np.ndarray, ndim: int) -> np.ndarray:
    """`values` (``[T]`` or ``[T, K]``) with trailing 1s up to `ndim` dims, to scale rows."""
    return values.reshape(*values.shape, *[1] * (ndim - values.ndim))


@dataclasses.dataclass(frozen=True)
class MoeSimulation:
    """Per rank (lists of W arrays, float64): the routing's tables, the dispatched rows, the combined output,
    and the VJPs: ``x_bar`` (the dispatch VJP of ``y_bar``: x's gradient through combine(dispatch(x)) when
    y is the dispatched rows), ``y_bar`` and ``weights_bar`` (None without weights)."""

    plans: list[moe.RoutePlan]
    tables: list[moe.RankTables]
    dispatched: list[np.ndarray]
    combined: list[np.ndarray]
    x_bar: list[np.ndarray]
    y_bar: list[np.ndarray]
    weights_bar: list[np.ndarray] | None


def _stack(tables: Sequence[moe.RankTables]) -> moe.RankTables:
    fields = [field.name for field in dataclasses.fields(moe.RankTables)]
    return moe.RankTables(**{name: [getattr(table, name) for table in tables] for name in fields})


def simulate_moe(
    xs: Sequence[np.ndarray],
    indices: Sequence[np.ndarray],
    num_experts: int,
    *,
    weights: Sequence[np.ndarray] | None = None,
    ys: Sequence[np.ndarray] | None = None,
    out_bars: Sequence[np.ndarray] | None = None,
    capacity: int | None = None,
    capacity_factor: float | None = None,
    experts_per_rank: Sequence[int] | None = None,
    layout: str = "exact",
) -> MoeSimulation:
    """route, dispatch, combine and the VJPs on W = ``len(xs)`` simulated ranks, float64. `ys`: the rows given
    to combine (default: the dispatched rows); `out_bars`: combine's output cotangents (default: ones).

    >>> sim = simulate_moe([np.ones((2, 3)), 2 * np.ones((1, 3))], [np.array([[0], [1]]), np.array([[0]])], 2)
    >>> [d[:, 0].tolist() for d in sim.dispatched], [c[:, 0].tolist() for c in sim.combined]
    ([[1.0, 2.0], [1.0]], [[1.0, 1.0], [2.0]])
    """
    world = len(xs)
    if len(indices) != world:
        raise moe.ranks_differ_error("number of ranks in xs and indices", [world, len(indices)])
    plans, found = [], []
    for rank, rank_indices in enumerate(indices):
        rank_indices = np.asarray(rank_indices)
        plan = moe.route_plan(
            rank_indices.shape,
            str(rank_indices.dtype),
            num_experts,
            world,
            capacity=capacity,
            capacity_factor=capacity_factor,
            experts_per_rank=experts_per_rank,
            layout=layout,
        )
        moe.check_rows(moe.DISPATCH_OP, "x", np.shape(xs[rank]), plan.tokens, "tokens T")
        moe.check_weights(None if weights is None else np.shape(weights[rank]), plan)
        plans.append(plan)
        found.append(moe.bad_route(rank_indices, num_experts))
    if len({plan.top_k for plan in plans}) > 1:
        raise moe.ranks_differ_error("top_k K", [plan.top_k for plan in plans])
    if len({np.shape(x)[1:] for x in xs}) > 1:
        raise moe.ranks_differ_error("feature shape", [np.shape(x)[1:] for x in xs])
    if layout == "padded" and len({plan.tokens for plan in plans}) > 1:
        raise moe.padded_tokens_error([plan.tokens for plan in plans])
    for rank, bad in enumerate(found):  # every rank raises the first bad rank's error
        if bad is not None:
            raise moe.bad_route_error(rank, *bad, num_experts)
    local = [moe.local_routing(np.asarray(i), plan) for i, plan in zip(indices, plans, strict=True)]
    offsets = plans[0].expert_offsets
    counts = np.stack([send_counts for _, send_counts, _ in local])  # the counts exchange: [W, E]
    tables = [
        moe.rank_tables(plan, rank, order, send_counts, dropped, counts[:, offsets[rank] : offsets[rank + 1]])
        for rank, (plan, (order, send_counts, dropped)) in enumerate(zip(plans, local, strict=True))
    ]
    stacked, backend = _stack(tables), SimulatedMoeRanks(plans[0].top_k)
    x64 = [np.asarray(x, dtype=np.float64) for x in xs]
    w64 = None if weights is None else [np.asarray(w, dtype=np.float64) for w in weights]
    dispatched = moe.dispatch(backend, x64, stacked, plans[0].top_k)
    y64 = dispatched if ys is None else [np.asarray(y, dtype=np.float64) for y in ys]
    for plan, table, y in zip(plans, tables, y64, strict=True):
        expected = table.rows if layout == "exact" else plan.padded_rows
        moe.check_rows(moe.COMBINE_OP, "y", y.shape, expected, "rows" if layout == "exact" else "padded rows")
    combined = moe.combine(backend, y64, stacked, w64)
    bars = [np.ones_like(c) for c in combined] if out_bars is None else [np.asarray(o, np.float64) for o in out_bars]
    y_bar, w_bar = moe.combine_vjp(backend, bars, y64, stacked, w64)
    x_bar = moe.dispatch_vjp(backend, y_bar, stacked)
    return MoeSimulation(plans, tables, dispatched, combined, x_bar, y_bar, w_bar)

"""The MoE spec (`commlib.moe`, `commlib.reference.moe.simulate_moe`) against a brute-force float64 routing
written here from the rules alone: ordering, capacity, layouts, the three VJP rules and every message."""

from __future__ import annotations

import math
import re
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from commlib import CommError, layer_check, moe, split_sizes
from commlib.reference.moe import SimulatedMoeRanks, _stack, simulate_moe

Case = tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], int, tuple[int, ...]]


def _indices(rng: np.random.Generator, tokens: int, top_k: int, num_experts: int, unrouted: float) -> np.ndarray:
    rows = [rng.permutation(num_experts)[:top_k] for _ in range(tokens)]
    out = np.array(rows, dtype=np.int64).reshape(tokens, top_k)
    out[rng.random(out.shape) < unrouted] = -1
    return out


def _case(
    seed: int,
    world: int,
    num_experts: int,
    top_k: int,
    tokens: list[int],
    features: tuple[int, ...],
    unrouted: float = 0.15,
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((t, *features)) for t in tokens]
    indices = [_indices(rng, t, top_k, num_experts, unrouted) for t in tokens]
    weights = [rng.random((t, top_k)) for t in tokens]
    return xs, indices, weights


def _brute(
    indices: list[np.ndarray], num_experts: int, placement: tuple[int, ...], capacity: int | None
) -> list[list[tuple[int, int, int, int]]]:
    """Per destination rank, its rows as (expert, source, t, k), from the rules alone."""
    offsets = np.concatenate([[0], np.cumsum(placement)])
    out = []
    for rank in range(len(placement)):
        rows = []
        for expert in range(offsets[rank], offsets[rank + 1]):
            for source, routes in enumerate(indices):
                kept = [
                    (expert, source, t, k)
                    for t in range(routes.shape[0])
                    for k in range(routes.shape[1])
                    if routes[t, k] == expert
                ]
                rows += kept if capacity is None else kept[:capacity]
        out.append(rows)
    return out


def _expert(expert: int, rows: np.ndarray) -> np.ndarray:
    """A per-expert nonlinear function, so that a row at the wrong expert or in the wrong order shows."""
    return np.tanh((expert + 1) * rows) + 0.1 * expert


def _expert_grad(expert: int, rows: np.ndarray) -> np.ndarray:
    return (expert + 1) * (1 - np.tanh((expert + 1) * rows) ** 2)


def _row_experts(sim_tables: moe.RankTables, length: int) -> np.ndarray:
    experts = np.repeat(np.arange(len(sim_tables.tokens_per_expert)), sim_tables.tokens_per_expert)
    return np.concatenate([experts, np.full(length - experts.size, -1)])


def _walk(
    xs: list[np.ndarray], weights: list[np.ndarray], indices: list[np.ndarray], num_experts: int, **options: object
) -> tuple[float, list[np.ndarray], list[np.ndarray]]:
    """loss = sum over ranks of <o_r, combine(f(dispatch(x)), w)>, and its gradients in x and w by the VJP rules."""
    sim = simulate_moe(xs, indices, num_experts, weights=weights, **options)  # type: ignore[arg-type]
    backend, tables = SimulatedMoeRanks(indices[0].shape[1]), _stack(sim.tables)
    offsets = sim.plans[0].expert_offsets
    experts = [_row_experts(table, d.shape[0]) for table, d in zip(sim.tables, sim.dispatched, strict=True)]
    ys, slopes = [], []
    for rank, (rows, local) in enumerate(zip(sim.dispatched, experts, strict=True)):
        y, slope = np.zeros_like(rows), np.zeros_like(rows)
        for row, expert in enumerate(local):
            if expert >= 0:
                y[row] = _expert(offsets[rank] + expert, rows[row])
                slope[row] = _expert_grad(offsets[rank] + expert, rows[row])
        ys.append(y)
        slopes.append(slope)
    out = moe.combine(backend, ys, tables, weights)
    bars = [np.cos(np.arange(o.size).reshape(o.shape)) for o in out]
    loss = sum(float(np.sum(o * b)) for o, b in zip(out, bars, strict=True))
    y_bar, w_bar = moe.combine_vjp(backend, bars, ys, tables, weights)
    x_bar = moe.dispatch_vjp(backend, [g * s for g, s in zip(y_bar, slopes, strict=True)], tables)
    assert w_bar is not None
    return float(loss), x_bar, w_bar


OPTIONS = st.fixed_dictionaries(
    {
        "world": st.integers(1, 3),
        "per_rank": st.integers(1, 3),
        "top_k": st.integers(1, 3),
        "capacity": st.sampled_from([None, 0, 1, 2, 99]),
        "layout": st.sampled_from(moe.LAYOUTS),
        "features": st.sampled_from([(3,), (2, 3)]),
        "seed": st.integers(0, 2**16),
        "tokens": st.integers(0, 4),
    }
)


def _from(options: dict[str, object]) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], int]:
    world, per_rank, seed = int(options["world"]), int(options["per_rank"]), int(options["seed"])  # type: ignore[call-overload]
    num_experts = world * per_rank
    top_k = min(int(options["top_k"]), num_experts)  # type: ignore[call-overload]
    uneven = options["layout"] == "exact"  # padded: the same T on every rank
    tokens = [(int(options["tokens"]) + uneven * r) % 5 for r in range(world)]  # type: ignore[call-overload]
    xs, indices, weights = _case(seed, world, num_experts, top_k, tokens, options["features"])  # type: ignore[arg-type]
    return xs, indices, weights, num_experts


@settings(max_examples=40, deadline=None)
@given(OPTIONS)
def test_dispatch_and_combine_match_the_brute_force_routing(options: dict[str, object]) -> None:
    xs, indices, weights, num_experts = _from(options)
    capacity, layout = options["capacity"], options["layout"]
    sim = simulate_moe(xs, indices, num_experts, weights=weights, capacity=capacity, layout=layout)  # type: ignore[arg-type]
    placement = sim.plans[0].experts_per_rank
    for rank, rows in enumerate(_brute(indices, num_experts, placement, capacity)):  # type: ignore[arg-type]
        expected = np.stack([xs[s][t] for _, s, t, _ in rows]) if rows else np.zeros((0, *xs[0].shape[1:]))
        got = sim.dispatched[rank]
        assert sim.tables[rank].rows == len(rows)
        np.testing.assert_array_equal(got[: len(rows)], expected)
        assert got.shape[0] == (len(rows) if layout == "exact" else sim.plans[rank].padded_rows)
        assert not got[len(rows) :].any()
    for source, x in enumerate(xs):  # dispatched rows come back unchanged: combine(dispatch(x)) = sum_k w x
        kept = sim.tables[source].token_slot >= 0
        scale = (weights[source] * kept).sum(axis=1).reshape(-1, *[1] * (x.ndim - 1))
        np.testing.assert_allclose(sim.combined[source], scale * x, rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(OPTIONS)
def test_adjoint_identities_summed_over_ranks(options: dict[str, object]) -> None:
    xs, indices, weights, num_experts = _from(options)
    sim = simulate_moe(
        xs,
        indices,
        num_experts,
        weights=weights,
        capacity=options["capacity"],  # type: ignore[arg-type]
        layout=options["layout"],
    )  # type: ignore[arg-type]
    rng = np.random.default_rng(1)
    backend, tables = SimulatedMoeRanks(indices[0].shape[1]), _stack(sim.tables)
    ys = [rng.standard_normal(d.shape) for d in sim.dispatched]
    bars = [rng.standard_normal(x.shape) for x in xs]
    # <dispatch(x), y> == <x, dispatch_vjp(y)>
    left = sum(np.sum(d * y) for d, y in zip(sim.dispatched, ys, strict=True))
    right = sum(np.sum(x * g) for x, g in zip(xs, moe.dispatch_vjp(backend, ys, tables), strict=True))
    assert math.isclose(left, right, rel_tol=1e-10, abs_tol=1e-10)
    # <combine(y, w), o> == <y, y_bar>, and bilinear: == <w, w_bar>
    out = moe.combine(backend, ys, tables, weights)
    y_bar, w_bar = moe.combine_vjp(backend, bars, ys, tables, weights)
    left = sum(np.sum(o * b) for o, b in zip(out, bars, strict=True))
    assert math.isclose(left, sum(np.sum(y * g) for y, g in zip(ys, y_bar, strict=True)), rel_tol=1e-10, abs_tol=1e-10)
    assert w_bar is not None
    assert math.isclose(
        left, sum(np.sum(w * g) for w, g in zip(weights, w_bar, strict=True)), rel_tol=1e-10, abs_tol=1e-10
    )


@pytest.mark.parametrize("layout", moe.LAYOUTS)
@pytest.mark.parametrize(
    ("num_experts", "placement", "top_k", "capacity"),
    [(8, split_sizes(8, 3), 2, None), (6, None, 1, 1), (6, None, 6, None), (6, None, 2, 2), (6, None, 3, 0)],
)
def test_finite_differences_of_weights_and_x(
    layout: str, num_experts: int, placement: tuple[int, ...] | None, top_k: int, capacity: int | None
) -> None:
    xs, indices, weights = _case(3, 3, num_experts, top_k, [4, 0, 3] if layout == "exact" else [3] * 3, (2, 3))
    options = dict(experts_per_rank=placement, capacity=capacity, layout=layout)
    _, x_bar, w_bar = _walk(xs, weights, indices, num_experts, **options)
    step = 1e-6
    for values, grads in ((weights, w_bar), (xs, x_bar)):
        for rank, array in enumerate(values):
            for where in np.ndindex(array.shape):
                saved = array[where]
                array[where] = saved + step
                up = _walk(xs, weights, indices, num_experts, **options)[0]
                array[where] = saved - step
                down = _walk(xs, weights, indices, num_experts, **options)[0]
                array[where] = saved
                assert abs((up - down) / (2 * step) - grads[rank][where]) < 1e-7, (rank, where)


def test_exact_equals_padded_on_valid_rows_and_padding_reads_nothing() -> None:
    xs, indices, weights = _case(5, 2, 4, 2, [4, 4], (3,))
    exact = simulate_moe(xs, indices, 4, weights=weights, capacity=2)
    ys = [np.full((p.padded_rows, 3), np.nan) for p in exact.plans]
    for y, d in zip(ys, exact.dispatched, strict=True):
        y[: d.shape[0]] = 2 * d
    padded = simulate_moe(xs, indices, 4, weights=weights, capacity=2, layout="padded", ys=ys)
    exact2 = simulate_moe(xs, indices, 4, weights=weights, capacity=2, ys=[2 * d for d in exact.dispatched])
    for rank in range(2):
        rows = exact.tables[rank].rows
        np.testing.assert_array_equal(padded.dispatched[rank][:rows], exact.dispatched[rank])
        assert not padded.dispatched[rank][rows:].any()
        np.testing.assert_array_equal(padded.combined[rank], exact2.combined[rank])
        np.testing.assert_array_equal(padded.weights_bar[rank], exact2.weights_bar[rank])  # type: ignore[index]
        np.testing.assert_array_equal(padded.y_bar[rank][:rows], exact2.y_bar[rank])
        assert not padded.y_bar[rank][rows:].any()  # gradient exactly 0 on padding, NaN input or not
        assert np.isfinite(padded.combined[rank]).all()


def test_capacity_keeps_routes_in_token_major_order() -> None:
    indices = [np.array([[1, 0], [0, 1], [0, -1], [1, 0]]), np.array([[0, 1]])]
    xs = [np.arange(4.0)[:, None], np.array([[10.0]])]
    sim = simulate_moe(xs, indices, 2, capacity=2)
    # expert 0 on rank 0: rank 0's copies (0,1), (1,0) kept, (2,0), (3,1) dropped; then rank 1's (0,0)
    assert sim.dispatched[0][:, 0].tolist() == [0.0, 1.0, 10.0]
    assert sim.dispatched[1][:, 0].tolist() == [0.0, 1.0, 10.0]  # expert 1: (0,0), (1,1); (3,0) dropped
    assert [t.dropped for t in sim.tables] == [3, 0]
    assert sim.tables[0].token_slot.tolist() == [[2, 0], [1, 3], [-1, -1], [-1, -1]]
    assert simulate_moe(xs, indices, 2, capacity=0).tables[0].rows == 0
    weighted = simulate_moe(xs, indices, 2, capacity=2, weights=[np.ones((4, 2)), np.ones((1, 2))])
    assert weighted.weights_bar is not None
    assert weighted.weights_bar[0][2:].tolist() == [[0.0, 0.0], [0.0, 0.0]]  # dropped and -1: exactly 0
    assert weighted.x_bar[0][2:].tolist() == [[0.0], [0.0]]


def test_capacity_factor_is_ceil_of_tokens_times_k_over_experts() -> None:
    assert moe.route_plan((5, 2), "int64", 4, 2, capacity_factor=1.25).capacity == math.ceil(5 * 2 / 4 * 1.25)
    assert moe.route_plan((5, 2), "int64", 4, 2).capacity is None
    dropless = moe.route_plan((5, 2), "int64", 4, 2, layout="padded")
    assert dropless.padded_rows == 2 * 2 * 5


@pytest.mark.parametrize("layout", moe.LAYOUTS)
def test_unrouted_everywhere_one_rank_routing_nothing_and_one_expert(layout: str) -> None:
    xs, _, weights = _case(7, 2, 4, 2, [3, 3], (2,))
    none = [np.full((3, 2), -1), np.full((3, 2), -1)]
    sim = simulate_moe(xs, none, 4, weights=weights, layout=layout)
    assert all(not c.any() for c in sim.combined) and all(not g.any() for g in sim.weights_bar)  # type: ignore[union-attr]
    assert [t.rows for t in sim.tables] == [0, 0]
    one = [np.array([[3, -1]] * 3), np.full((3, 2), -1)]  # everything to expert 3; rank 1 routes nothing
    sim = simulate_moe(xs, one, 4, weights=weights, layout=layout)
    assert [t.rows for t in sim.tables] == [0, 3]
    assert sim.tables[1].tokens_per_expert.tolist() == [0, 3]
    np.testing.assert_array_equal(sim.dispatched[1][:3], xs[0])
    np.testing.assert_array_equal(sim.combined[0], weights[0][:, :1] * xs[0])
    assert not sim.combined[1].any()


def _raises(kind: type[BaseException], text: str) -> Any:
    return pytest.raises(kind, match="^" + re.escape(text) + "$")


def test_validation_messages() -> None:
    plan = moe.route_plan
    with _raises(
        TypeError, "route: indices must be an integer array, not float32. Received: shape=(2, 2), dtype='float32'"
    ):
        plan((2, 2), "float32", 4, 2)
    with _raises(CommError, "route: indices must be [T, K] (ndim 2), not ndim 1. Received: shape=(4,)"):
        plan((4,), "int64", 4, 2)
    with _raises(
        CommError,
        "route: K (5) must be <= num_experts (4): an expert at most once per token. "
        "Received: shape=(2, 5), num_experts=4",
    ):
        plan((2, 5), "int64", 4, 2)
    with _raises(
        CommError,
        "route: num_experts (8) must be divisible by world_size (3) when experts_per_rank is "
        "None; pass experts_per_rank=split_sizes(8, 3) for an uneven placement. Received: num_experts=8, "
        "world_size=3",
    ):
        plan((2, 2), "int64", 8, 3)
    with _raises(
        CommError,
        "route: experts_per_rank has 2 entries, not world_size (3). Received: num_experts=8, "
        "world_size=3, experts_per_rank=(4, 4)",
    ):
        plan((2, 2), "int64", 8, 3, experts_per_rank=(4, 4))
    with _raises(
        CommError,
        "route: experts_per_rank must be >= 0 and sum (7) to num_experts (8). Received: "
        "num_experts=8, world_size=3, experts_per_rank=(3, 3, 1)",
    ):
        plan((2, 2), "int64", 8, 3, experts_per_rank=(3, 3, 1))
    with _raises(
        CommError,
        "route: capacity and capacity_factor are exclusive: pass one (or neither: dropless). "
        "Received: capacity=2, capacity_factor=1.0",
    ):
        plan((2, 2), "int64", 4, 2, capacity=2, capacity_factor=1.0)
    with _raises(CommError, "route: capacity (-1) must be >= 0. Received: capacity=-1, capacity_factor=None"):
        plan((2, 2), "int64", 4, 2, capacity=-1)
    with _raises(
        CommError, "route: capacity_factor (0.0) must be finite and > 0. Received: capacity=None, capacity_factor=0.0"
    ):
        plan((2, 2), "int64", 4, 2, capacity_factor=0.0)
    with _raises(
        CommError, "route: layout must be one of ('exact', 'padded'), not 'ragged'. Received: layout='ragged'"
    ):
        plan((2, 2), "int64", 4, 2, layout="ragged")
    with _raises(
        TypeError,
        "route: experts_per_rank must hold ints. Received: num_experts=4, world_size=2, experts_per_rank=(2.0, 2)",
    ):
        plan((2, 2), "int64", 4, 2, experts_per_rank=(2.0, 2))
    with _raises(TypeError, "route: capacity must be an int, not float. Received: capacity=2.0, capacity_factor=None"):
        plan((2, 2), "int64", 4, 2, capacity=2.0)  # type: ignore[arg-type]
    routed = plan((2, 2), "int64", 4, 2)
    with _raises(
        CommError, "combine: weights shape (2, 3) must be the indices' [T, K] (2, 2). Received: weights_shape=(2, 3)"
    ):
        moe.check_weights((2, 3), routed)
    with _raises(CommError, "combine: y has 5 rows, not the routing's rows (4). Received: shape=(5, 3)"):
        moe.check_rows(moe.COMBINE_OP, "y", (5, 3), 4, "rows")


def test_bad_indices_are_data_and_every_rank_raises_the_first() -> None:
    xs = [np.zeros((2, 1)), np.zeros((3, 1))]
    with _raises(
        CommError, "route: indices[2] on rank 1 holds expert 4, outside [-1, 4). Received: rank=1, token=2, value=4"
    ):
        simulate_moe(xs, [np.array([[0], [1]]), np.array([[0], [1], [4]])], 4)
    with _raises(
        CommError, "route: indices[0] on rank 0 holds expert -2, outside [-1, 4). Received: rank=0, token=0, value=-2"
    ):
        simulate_moe(xs, [np.array([[-2], [1]]), np.array([[0], [1], [9]])], 4)
    with _raises(CommError, "route: indices[1] on rank 0 routes to expert 3 twice. Received: rank=0, token=1, value=3"):
        simulate_moe(xs, [np.array([[0, 1], [3, 3]]), np.array([[-1, -1], [0, -1], [1, 2]])], 4)
    assert moe.bad_route(np.array([[-1, -1], [2, 1]]), 4) is None


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 5),
    st.integers(0, 4),
    st.integers(0, 3),
    st.data(),
)
def test_padded_bad_route_finds_what_bad_route_finds(tokens: int, top_k: int, extra: int, data: Any) -> None:
    """torch's eager padded route sends `padded_bad_route` (static shapes, on the device) with the counts: it must
    name the same first bad row, value and reason as `bad_route` (values < -1, >= E, repeats, or none)."""
    num_experts = max(top_k, 1) + extra
    values = st.integers(-3, num_experts + 1)
    rows = data.draw(st.lists(st.lists(values, min_size=top_k, max_size=top_k), min_size=tokens, max_size=tokens))
    indices = np.array(rows, dtype=np.int64).reshape(tokens, top_k)
    plan = moe.route_plan((tokens, top_k), "int64", num_experts, 1)
    found = moe.bad_route(indices, num_experts)
    want = [0, 0, 0, 0] if found is None else [1, found[0], found[1], moe.BAD_WHY.index(found[2])]
    assert moe.padded_bad_route(moe.NumpyTableMath(), indices, plan).tolist() == want


def test_padded_needs_the_same_tokens_on_every_rank() -> None:
    xs, indices, _ = _case(2, 2, 4, 1, [4, 3], (2,))
    with _raises(
        CommError,
        "route: layout='padded' needs the same T on every rank (its static rows are "
        "max(experts_per_rank) * W * (capacity or T)); ranks have T = (4, 3); use layout='exact'. "
        "Received: tokens=(4, 3)",
    ):
        simulate_moe(xs, indices, 4, layout="padded")


def test_simulation_refuses_a_y_of_another_routing() -> None:
    xs, indices, _ = _case(2, 2, 4, 1, [3, 3], (2,))
    sim = simulate_moe(xs, indices, 4)
    wrong = [np.zeros((d.shape[0] + 1, 2)) for d in sim.dispatched]
    with pytest.raises(CommError, match=r"^combine: y has \d+ rows, not the routing's rows \(\d+\)"):
        simulate_moe(xs, indices, 4, ys=wrong)


def test_checked_mode_fingerprint_names_what_differs() -> None:
    plan = moe.route_plan((4, 2), "int64", 4, 2, capacity=2)
    calls = [
        layer_check.moe_call("dispatch", plan, (4, 8), "float32"),
        layer_check.moe_call("dispatch", moe.route_plan((4, 2), "int64", 4, 2, capacity=3), (4, 8), "float32"),
    ]
    rows = np.stack([call.fingerprint() for call in calls])
    assert layer_check.layers_differ(rows)
    with _raises(
        CommError, "dispatch: ranks disagree on capacity: rank 0 has 2, rank 1 has 3. Received: rank=1, capacity=3"
    ):
        layer_check.compare_layers(calls, rank=1)
    same = layer_check.moe_call("dispatch", plan, (7, 8), "float32")  # T may differ by rank, features may not
    assert not layer_check.layers_differ(np.stack([calls[0].fingerprint(), same.fingerprint()]))
    other = layer_check.moe_call("dispatch", plan, (4, 9), "float32")
    with pytest.raises(CommError, match="ranks disagree on feature shape"):
        layer_check.compare_layers([calls[0], other], rank=0)


def test_ranks_that_differ_in_k_features_or_count_are_refused():
    """Every rank's call shares K and the feature shape (rank 1 walked with rank 0's K gave combined [10, 10]
    where the rules give [10, 20])."""
    two = [np.array([[0, 1], [2, 3]]), np.array([[1], [3]])]
    with pytest.raises(CommError, match=r"same top_k K; ranks have \(2, 1\)"):
        simulate_moe([np.ones((2, 1)), np.ones((2, 1))], two, 4)
    with pytest.raises(CommError, match=r"same feature shape; ranks have \(\(1,\), \(2,\)\)"):
        simulate_moe([np.ones((2, 1)), np.ones((2, 2))], [np.array([[0], [1]]), np.array([[2], [3]])], 4)
    with pytest.raises(CommError, match=r"number of ranks in xs and indices; ranks have \(2, 1\)"):
        simulate_moe([np.ones((2, 1)), np.ones((2, 1))], [np.array([[0], [1]])], 4)


def test_a_rank_that_owns_no_experts():
    """experts_per_rank may hold a 0 (route_plan accepts it): rank_tables crashed with a raw ValueError
    (an exclusive cumsum of no counts), found by a newcomer's try. The rank receives nothing, sends its rows."""
    xs = [np.arange(2.0)[:, None] + 1, np.arange(1.0)[:, None] + 5, np.arange(2.0)[:, None] + 7]
    indices = [np.array([[0, 1], [5, 6]]), np.array([[2, 3]]), np.array([[0, 4], [5, -1]])]
    sim = simulate_moe(xs, indices, 7, experts_per_rank=(3, 0, 4))
    assert int(sim.tables[1].rows) == 0
    for rank, (x, index) in enumerate(zip(xs, indices, strict=True)):  # identity experts: each row x K routes
        np.testing.assert_array_equal(sim.combined[rank], x * (index >= 0).sum(1, keepdims=True))

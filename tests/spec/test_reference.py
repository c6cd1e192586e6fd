"""The numpy reference (`commlib.reference`) against naive definitions written here from the docs.

The naive definitions use np.split / np.concatenate / sums and explicit index loops, never a plan, so
they check the plans the reference walks. VJPs are checked by the dot-product identity
``sum_r <A x, c>_r == sum_r <x, A^T c>_r`` and by central finite differences on float64.
"""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from commlib import ReduceOp, gradients, plans, reference, steps

WORLD_SIZES = (1, 2, 3, 4)


def _integers(shape, world_size, seed=0):
    """Per-rank float64 inputs holding small integers: every sum and product below is exact."""
    rng = np.random.default_rng(seed)
    return [rng.integers(-9, 10, size=shape).astype(np.float64) for _ in range(world_size)]


def _distinct(shape, world_size):
    """Per-rank inputs whose every element differs, so any misplaced element shows."""
    size = math.prod(shape)
    return [np.arange(size, dtype=np.float64).reshape(shape) + 1000 * rank for rank in range(world_size)]


def _normal(shapes, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for shape in shapes]


def _assert_ranks_equal(actual, expected):
    assert len(actual) == len(expected)
    for rank, (out, want) in enumerate(zip(actual, expected, strict=True)):
        assert out.shape == want.shape, f"rank {rank}"
        assert np.array_equal(out, want), f"rank {rank}: {out} != {want}"


# ---------------------------------------------------------------- naive definitions


def naive_all_reduce(xs, op):
    stacked = np.stack(xs)
    total = {
        "sum": lambda: stacked.sum(axis=0),
        "avg": lambda: stacked.sum(axis=0) / len(xs),
        "max": lambda: stacked.max(axis=0),
        "min": lambda: stacked.min(axis=0),
        "product": lambda: stacked.prod(axis=0),
    }[op]()
    return [total for _ in xs]


def naive_all_gather(xs, dim):
    return [np.concatenate(xs, axis=dim) for _ in xs]


def naive_reduce_scatter(xs, dim, op):
    total = sum(xs) / (len(xs) if op == "avg" else 1)
    return np.split(total, len(xs), axis=dim)


def naive_all_to_all(xs, scatter_dim, gather_dim):
    world_size = len(xs)
    blocks = [np.split(x, world_size, axis=scatter_dim) for x in xs]  # blocks[source][destination]
    return [
        np.concatenate([blocks[source][rank] for source in range(world_size)], axis=gather_dim)
        for rank in range(world_size)
    ]


def naive_ulysses(xs, scatter_dim, gather_dim):
    """Explicit index loops: (2, 1) [B, S/W, H, D] -> [B, S, H/W, D]; (1, 2) the reverse."""
    world_size = len(xs)
    batch, seq, heads, head_dim = xs[0].shape
    if (scatter_dim, gather_dim) == (2, 1):
        local_heads = heads // world_size
        outs = [np.zeros((batch, seq * world_size, local_heads, head_dim)) for _ in xs]
        for rank in range(world_size):
            for source in range(world_size):
                for s in range(seq):
                    for h in range(local_heads):
                        outs[rank][:, source * seq + s, h, :] = xs[source][:, s, rank * local_heads + h, :]
        return outs
    local_seq = seq // world_size
    outs = [np.zeros((batch, local_seq, heads * world_size, head_dim)) for _ in xs]
    for rank in range(world_size):
        for source in range(world_size):
            for s in range(local_seq):
                for h in range(heads):
                    outs[rank][:, s, source * heads + h, :] = xs[source][:, rank * local_seq + s, h, :]
    return outs


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("op", ["sum", "max", "min", "product"])
def test_all_reduce(world_size, op):
    xs = _integers((3, 4), world_size)
    _assert_ranks_equal(reference.all_reduce(xs, op), naive_all_reduce(xs, op))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_avg(world_size):
    xs = _integers((3, 4), world_size)
    for out, want in zip(reference.all_reduce(xs, "avg"), naive_all_reduce(xs, "avg"), strict=True):
        np.testing.assert_allclose(out, want, rtol=1e-15, atol=0)


@pytest.mark.parametrize("op", [ReduceOp.MAX, "MAX", "Max"])
def test_all_reduce_op_spellings(op):
    xs = _integers((5,), 3)
    _assert_ranks_equal(reference.all_reduce(xs, op), naive_all_reduce(xs, "max"))


def test_all_reduce_duck_typed_op():
    class TorchLikeOp:  # torch.distributed.ReduceOp.MIN has .name == "MIN"
        name = "MIN"

    xs = _integers((5,), 3)
    _assert_ranks_equal(reference.all_reduce(xs, TorchLikeOp()), naive_all_reduce(xs, "min"))


@pytest.mark.parametrize("op", ["sum", "max", "product"])
def test_all_reduce_integers_are_exact(op):
    xs = [x.astype(np.int32) for x in _integers((4,), 3)]
    outs = reference.all_reduce(xs, op)
    assert all(out.dtype.kind == "i" for out in outs)
    _assert_ranks_equal(outs, naive_all_reduce([x.astype(np.int64) for x in xs], op))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dim", [-3, -2, -1, 0, 1, 2])
def test_all_gather(world_size, dim):
    xs = _distinct((2, 3, 4), world_size)
    _assert_ranks_equal(reference.all_gather(xs, dim), naive_all_gather(xs, dim))


def test_all_gather_default_dim_is_last():
    xs = _distinct((2, 3), 3)
    _assert_ranks_equal(reference.all_gather(xs), naive_all_gather(xs, -1))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dim", [-3, -2, -1, 0, 1, 2])
def test_reduce_scatter_sum(world_size, dim):
    shape = [2, 3, 2]
    shape[dim] *= world_size
    xs = _integers(tuple(shape), world_size, seed=world_size)
    _assert_ranks_equal(reference.reduce_scatter(xs, dim, "sum"), naive_reduce_scatter(xs, dim, "sum"))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dim", [0, -1])
def test_reduce_scatter_avg(world_size, dim):
    shape = [2, 3]
    shape[dim] *= world_size
    xs = _integers(tuple(shape), world_size, seed=world_size)
    outs = reference.reduce_scatter(xs, dim, "avg")
    for out, want in zip(outs, naive_reduce_scatter(xs, dim, "avg"), strict=True):
        assert out.shape == want.shape
        np.testing.assert_allclose(out, want, rtol=1e-15, atol=0)


def test_reduce_scatter_default_dim_is_0():
    xs = _integers((6, 2), 3)
    _assert_ranks_equal(reference.reduce_scatter(xs), naive_reduce_scatter(xs, 0, "sum"))


@st.composite
def all_to_all_cases(draw, min_ndim=2, max_ndim=4):
    """(per-rank inputs, scatter_dim, gather_dim) with size-1 dims and negative dims; W in 1..4."""
    world_size = draw(st.integers(1, 4))
    ndim = draw(st.integers(min_ndim, max_ndim))
    shape = draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim))
    scatter = draw(st.integers(0, ndim - 1))
    gather = draw(st.integers(0, ndim - 1))  # equal dims too: torch's all_to_all_single
    shape[scatter] *= world_size
    scatter_dim = scatter - ndim if draw(st.booleans()) else scatter
    gather_dim = gather - ndim if draw(st.booleans()) else gather
    return _distinct(tuple(shape), world_size), scatter_dim, gather_dim


@given(all_to_all_cases())
def test_all_to_all(case):
    xs, scatter_dim, gather_dim = case
    expected = naive_all_to_all(xs, scatter_dim, gather_dim)
    _assert_ranks_equal(reference.all_to_all(xs, scatter_dim, gather_dim), expected)


@given(all_to_all_cases())
def test_all_to_all_round_trip(case):
    xs, scatter_dim, gather_dim = case
    there = reference.all_to_all(xs, scatter_dim, gather_dim)
    _assert_ranks_equal(reference.all_to_all(there, gather_dim, scatter_dim), xs)


def test_all_to_all_on_one_dim_is_all_to_all_single():
    """Block s of rank r's dim goes to rank s, at position r; with W = 2 on [a, b] it swaps b of rank 0 and a
    of rank 1; its own inverse."""
    xs = [np.array([1.0, 2.0]), np.array([10.0, 20.0])]
    _assert_ranks_equal(reference.all_to_all(xs, 0, 0), [np.array([1.0, 10.0]), np.array([2.0, 20.0])])
    xs = _distinct((2, 3 * 4), 4)
    _assert_ranks_equal(reference.all_to_all(reference.all_to_all(xs, 1, -1), -1, 1), xs)


def naive_shard(xs, dim):
    return [np.split(x, len(xs), axis=dim)[rank] for rank, x in enumerate(xs)]


def naive_reduce(xs, dst, op):
    total = naive_all_reduce(xs, op)[0]
    return [total if rank == dst else np.zeros_like(total) for rank in range(len(xs))]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_shard(world_size, dim):
    xs = [_distinct((2 * world_size, 3 * world_size), 1)[0]] * world_size  # replicated
    _assert_ranks_equal(reference.shard(xs, dim), naive_shard(xs, dim))


def test_shard_worked_example():
    """W=4, every rank holding arange(8), cotangent (r+1)*[1, 10] on rank r: rank r gets [2r, 2r+1]; every rank's
    gradient is [1, 10, 2, 20, 3, 30, 4, 40] (a quarter of that with scale_grad)."""
    xs = [np.arange(8.0)] * 4
    cotangents = [(rank + 1) * np.array([1.0, 10.0]) for rank in range(4)]
    _assert_ranks_equal(reference.shard(xs), [np.array([2.0 * rank, 2.0 * rank + 1]) for rank in range(4)])
    want = np.array([1.0, 10.0, 2.0, 20.0, 3.0, 30.0, 4.0, 40.0])
    for scale_grad, factor in ((False, 1.0), (True, 0.25)):
        plan = plans.shard((8,), 4, scale_grad=scale_grad, dtype="float64")
        _assert_ranks_equal(reference.vjp(plan, xs, cotangents), [want * factor] * 4)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce(world_size, op):
    xs = _integers((2, 3), world_size)
    for dst in range(world_size):
        _assert_ranks_equal(reference.reduce(xs, dst, op), naive_reduce(xs, dst, op))


def test_reduce_vjp_broadcasts_the_cotangent_of_dst():
    xs = _integers((2,), 3)
    cotangents = [np.array([1.0, 2.0]), np.array([4.0, 8.0]), np.array([16.0, 32.0])]
    for op, factor in (("sum", 1.0), ("avg", 1 / 3)):
        plan = plans.reduce((2,), 3, dst=1, op=op, dtype="float64")
        _assert_ranks_equal(reference.vjp(plan, xs, cotangents), [np.array([4.0, 8.0]) * factor] * 3)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("batch", [1, 2])
def test_all_to_all_4d_forward(world_size, batch):
    xs = _distinct((batch, 3, 2 * world_size, 2), world_size)  # [B, S/W, H, D]
    outs = reference.all_to_all_4d(xs, 2, 1)
    assert outs[0].shape == (batch, 3 * world_size, 2, 2)
    _assert_ranks_equal(outs, naive_ulysses(xs, 2, 1))
    _assert_ranks_equal(reference.all_to_all_4d(xs), outs)  # (2, 1) is the default


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("batch", [1, 2])
def test_all_to_all_4d_reverse(world_size, batch):
    xs = _distinct((batch, 3 * world_size, 2, 2), world_size)  # [B, S, H/W, D]
    outs = reference.all_to_all_4d(xs, 1, 2)
    assert outs[0].shape == (batch, 3, 2 * world_size, 2)
    _assert_ranks_equal(outs, naive_ulysses(xs, 1, 2))
    _assert_ranks_equal(reference.all_to_all_4d(xs, -3, -2), outs)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("batch", [1, 3])
def test_all_to_all_4d_round_trip(world_size, batch):
    xs = _distinct((batch, 2, 3 * world_size, 2), world_size)
    _assert_ranks_equal(reference.all_to_all_4d(reference.all_to_all_4d(xs, 2, 1), 1, 2), xs)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_reduce_scatter_of_all_gather_is_world_size_times_x(world_size, dim):
    xs = _integers((2, 3), world_size)
    gathered = reference.all_gather(xs, dim)
    _assert_ranks_equal(reference.reduce_scatter(gathered, dim), [world_size * x for x in xs])


def test_world_size_1_returns_the_input():
    (x,) = _integers((2, 4, 2, 3), 1)
    for out in (
        reference.all_reduce([x], "max"),
        reference.all_gather([x], 1),
        reference.reduce_scatter([x], 2, "avg"),
        reference.all_to_all([x], 0, 3),
        reference.all_to_all_4d([x], 2, 1),
        reference.all_to_all_4d([x], 1, 2),
    ):
        _assert_ranks_equal(out, [x])


def test_run_rejects_the_wrong_number_of_ranks():
    plan = plans.all_gather((2,), 3, 0)
    with pytest.raises(ValueError, match="3"):
        reference.run(plan, _integers((2,), 2))


# ---------------------------------------------------------------- VJPs


def _linear_plans():
    """(id, plan) for every linear op and both directions of every dim pair worth checking."""
    cases = []
    for world_size in (1, 2, 3):
        for op in ("sum", "avg"):
            cases.append((f"all_reduce-{op}-W{world_size}", plans.all_reduce((2, 3), world_size, op, dtype="float64")))
            cases.append(
                (
                    f"reduce_scatter-{op}-W{world_size}",
                    plans.reduce_scatter((2, 3 * world_size), world_size, -1, op, dtype="float64"),
                )
            )
        for dim in (0, 1, -1):
            cases.append((f"all_gather-d{dim}-W{world_size}", plans.all_gather((2, 3), world_size, dim)))
        cases.append((f"all_to_all-W{world_size}", plans.all_to_all((2, 3, 2 * world_size), world_size, 2, 0)))
        for dim in (0, 2):
            cases.append(
                (
                    f"all_to_all-same-d{dim}-W{world_size}",
                    plans.all_to_all((2 * world_size, 3, 2 * world_size), world_size, dim, dim),
                )
            )
        for op in ("sum", "avg"):
            cases.append(
                (f"reduce-{op}-W{world_size}", plans.reduce((2, 3), world_size, world_size - 1, op, dtype="float64"))
            )
        for batch in (1, 2):
            cases.append(
                (
                    f"ulysses-B{batch}-W{world_size}",
                    plans.all_to_all_4d((batch, 2, 2 * world_size, 3), world_size, 2, 1),
                )
            )
            cases.append(
                (
                    f"ulysses-rev-B{batch}-W{world_size}",
                    plans.all_to_all_4d((batch, 2 * world_size, 2, 3), world_size, 1, 2),
                )
            )
    return cases


LINEAR_PLANS = _linear_plans()


def _inner(left, right):
    return sum(float(np.vdot(a, b)) for a, b in zip(left, right, strict=True))


def _check_dot_product(plan, seed):
    world_size = plan.world_size
    xs = _normal([plan.in_shape] * world_size, seed)
    cotangents = _normal([plan.out_shape] * world_size, seed + 1)
    grads = reference.vjp(plan, xs, cotangents)
    assert [grad.shape for grad in grads] == [plan.in_shape] * world_size
    forward = _inner(reference.run(plan, xs), cotangents)
    np.testing.assert_allclose(forward, _inner(xs, grads), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("plan", [plan for _, plan in LINEAR_PLANS], ids=[name for name, _ in LINEAR_PLANS])
def test_vjp_dot_product_identity(plan):
    _check_dot_product(plan, seed=7)


@given(all_to_all_cases())
def test_all_to_all_vjp_dot_product_identity(case):
    xs, scatter_dim, gather_dim = case
    plan = plans.all_to_all(xs[0].shape, len(xs), scatter_dim, gather_dim)
    _check_dot_product(plan, seed=11)


def _finite_difference(loss, xs, step=1e-6):
    """Central differences of scalar `loss(xs)` with respect to every element of every rank's input."""
    grads = []
    for rank, x in enumerate(xs):
        grad = np.zeros_like(x)
        for index in np.ndindex(x.shape):
            shifted = []
            for sign in (1.0, -1.0):
                moved = [y.copy() for y in xs]
                moved[rank][index] += sign * step
                shifted.append(loss(moved))
            grad[index] = (shifted[0] - shifted[1]) / (2 * step)
        grads.append(grad)
    return grads


def _assert_grads_close(actual, expected):
    for rank, (grad, want) in enumerate(zip(actual, expected, strict=True)):
        assert grad.shape == want.shape, f"rank {rank}"
        np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-6, err_msg=f"rank {rank}")


FD_PLANS = [
    ("all_reduce-sum", plans.all_reduce((2, 2), 3, "sum", dtype="float64")),
    ("all_reduce-avg", plans.all_reduce((2, 2), 3, "avg", dtype="float64")),
    ("all_reduce-max", plans.all_reduce((2, 2), 3, "max", dtype="float64")),
    ("all_reduce-min", plans.all_reduce((2, 2), 3, "min", dtype="float64")),
    ("all_reduce-product", plans.all_reduce((2, 2), 3, "product", dtype="float64")),
    ("all_gather", plans.all_gather((2, 2), 3, 1)),
    ("reduce_scatter-sum", plans.reduce_scatter((2, 6), 3, -1, "sum", dtype="float64")),
    ("reduce_scatter-avg", plans.reduce_scatter((6, 2), 3, 0, "avg", dtype="float64")),
    ("all_to_all", plans.all_to_all((2, 4, 3), 2, 1, 2)),
    ("all_to_all_4d", plans.all_to_all_4d((2, 1, 4, 2), 2, 2, 1)),
    ("all_to_all_4d-reverse", plans.all_to_all_4d((1, 4, 1, 2), 2, 1, 2)),
    ("all_to_all-same-dim", plans.all_to_all((2, 6), 3, 1, 1)),
    ("reduce-sum", plans.reduce((2, 2), 3, 2, "sum", dtype="float64")),
    ("reduce-avg", plans.reduce((2, 2), 3, 0, "avg", dtype="float64")),
]


@pytest.mark.parametrize("plan", [plan for _, plan in FD_PLANS], ids=[name for name, _ in FD_PLANS])
def test_vjp_sum_convention_matches_finite_differences(plan):
    """convention="sum": the objective is sum_r <y_r, c_r> over all ranks' outputs."""
    world_size = plan.world_size
    xs = _normal([plan.in_shape] * world_size, seed=3)  # distinct values: max/min have no ties
    cotangents = _normal([plan.out_shape] * world_size, seed=4)

    def loss(inputs):
        return _inner(reference.run(plan, inputs), cotangents)

    _assert_grads_close(reference.vjp(plan, xs, cotangents), _finite_difference(loss, xs))


REPLICATED_PLANS = [
    ("all_reduce-sum", lambda W: plans.all_reduce((2, 2), W, "sum", dtype="float64", convention="replicated")),
    ("all_reduce-avg", lambda W: plans.all_reduce((2, 2), W, "avg", dtype="float64", convention="replicated")),
    ("all_reduce-max", lambda W: plans.all_reduce((2, 2), W, "max", dtype="float64", convention="replicated")),
    ("all_reduce-product", lambda W: plans.all_reduce((2, 2), W, "product", dtype="float64", convention="replicated")),
    ("all_gather-0", lambda W: plans.all_gather((2, 2), W, 0, convention="replicated")),
    ("all_gather-last", lambda W: plans.all_gather((2, 2), W, -1, convention="replicated")),
]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("make_plan", [make for _, make in REPLICATED_PLANS], ids=[n for n, _ in REPLICATED_PLANS])
def test_vjp_replicated_convention_matches_finite_differences(make_plan, world_size):
    """convention="replicated": one loss L(y) of the replicated output; every rank holds dL/dy."""
    plan = make_plan(world_size)
    xs = _normal([plan.in_shape] * world_size, seed=5)
    (cotangent,) = _normal([plan.out_shape], seed=6)

    def loss(inputs):
        outs = reference.run(plan, inputs)
        for out in outs[1:]:
            np.testing.assert_array_equal(out, outs[0])  # the output is replicated
        return float(np.vdot(outs[0], cotangent))

    grads = reference.vjp(plan, xs, [cotangent] * world_size)
    _assert_grads_close(grads, _finite_difference(loss, xs))


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("scale_grad", [False, True])
def test_vjp_of_shard_is_the_gradient_of_the_replicated_input(world_size, dim, scale_grad):
    """One input x shared by every rank, rank r's output block r of it, the objective sum_r <y_r, c_r>: the
    gradient of x (every rank's, identical) is the all_gather of the cotangents (/ W with scale_grad)."""
    plan = plans.shard((2 * world_size, 3 * world_size), world_size, dim, scale_grad=scale_grad, dtype="float64")
    (x,) = _normal([plan.in_shape], seed=5)
    cotangents = _normal([plan.out_shape] * world_size, seed=6)

    def loss(inputs):
        return _inner(reference.run(plan, [inputs[0]] * world_size), cotangents)

    (want,) = _finite_difference(loss, [x])
    _assert_grads_close(
        reference.vjp(plan, [x] * world_size, cotangents), [want / (world_size if scale_grad else 1)] * world_size
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_vjp_replicated_all_reduce_sum_is_the_identity(world_size):
    plan = plans.all_reduce((2, 3), world_size, dtype="float64", convention="replicated")
    xs = _normal([(2, 3)] * world_size, seed=1)
    cotangents = _normal([(2, 3)] * world_size, seed=2)
    _assert_ranks_equal(reference.vjp(plan, xs, cotangents), cotangents)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_vjp_replicated_all_gather_is_the_own_slice(world_size, dim):
    plan = plans.all_gather((2, 3), world_size, dim, convention="replicated")
    xs = _normal([(2, 3)] * world_size, seed=1)
    cotangents = _normal([plan.out_shape] * world_size, seed=2)
    expected = [np.split(ct, world_size, axis=dim)[rank] for rank, ct in enumerate(cotangents)]
    _assert_ranks_equal(reference.vjp(plan, xs, cotangents), expected)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_vjp_sum_convention_of_all_reduce_sums_the_cotangents(world_size):
    plan = plans.all_reduce((2, 3), world_size, dtype="float64")
    xs = _normal([(2, 3)] * world_size, seed=1)
    cotangents = _integers((2, 3), world_size, seed=2)
    _assert_ranks_equal(reference.vjp(plan, xs, cotangents), [sum(cotangents)] * world_size)


def test_vjp_max_splits_ties_equally():
    xs = [np.array([1.0, 5.0]), np.array([3.0, 5.0]), np.array([3.0, 2.0])]
    plan = plans.all_reduce((2,), 3, "max", dtype="float64")
    grads = reference.vjp(plan, xs, [np.ones(2)] * 3)  # summed cotangent: 3
    _assert_ranks_equal(grads, [np.array([0.0, 1.5]), np.array([1.5, 1.5]), np.array([1.5, 0.0])])


def test_vjp_min_goes_to_the_minimum():
    xs = [np.array([1.0, 5.0]), np.array([3.0, -5.0])]
    plan = plans.all_reduce((2,), 2, "min", dtype="float64")
    grads = reference.vjp(plan, xs, [np.array([1.0, 2.0]), np.array([10.0, 20.0])])
    _assert_ranks_equal(grads, [np.array([11.0, 0.0]), np.array([0.0, 22.0])])


def test_vjp_product_is_exact_at_zeros():
    xs = [np.array([0.0, 2.0, 0.0]), np.array([3.0, 0.0, 0.0]), np.array([4.0, 5.0, 7.0])]
    plan = plans.all_reduce((3,), 3, "product", dtype="float64")
    grads = reference.vjp(plan, xs, [np.ones(3)] * 3)  # summed cotangent: 3
    _assert_ranks_equal(grads, [np.array([36.0, 0.0, 0.0]), np.array([0.0, 30.0, 0.0]), np.array([0.0, 0.0, 0.0])])


def test_vjp_of_reduce_scatter_avg_divides_by_world_size():
    plan = plans.reduce_scatter((4,), 2, 0, "avg", dtype="float64")
    grads = reference.vjp(plan, _integers((4,), 2), [np.array([2.0, 4.0]), np.array([6.0, 8.0])])
    _assert_ranks_equal(grads, [np.array([1.0, 2.0, 3.0, 4.0])] * 2)


@pytest.mark.parametrize("plan", [plan for _, plan in LINEAR_PLANS], ids=[name for name, _ in LINEAR_PLANS])
def test_transpose_twice_gives_the_forward_back(plan):
    """Double backward: the transpose of the VJP plan computes the forward again."""
    twice = gradients.vjp_plan(gradients.vjp_plan(plan))
    assert (twice.in_shape, twice.out_shape, steps.dims(twice.step)) == (
        plan.in_shape,
        plan.out_shape,
        steps.dims(plan.step),
    )
    xs = _normal([plan.in_shape] * plan.world_size, seed=9)
    for out, want in zip(reference.run(twice, xs), reference.run(plan, xs), strict=True):
        np.testing.assert_allclose(out, want, rtol=1e-14, atol=1e-14)

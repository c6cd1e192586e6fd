"""Hypothesis over the ops tests/torch/test_ops.py does not cover: broadcast, gather, scatter, permute, sum_grad and
all_reduce max/min/product. Random shapes (size-1 dims, 0-d where the op allows), dims (negative too), rank
arguments, world sizes 1-4, float64 and bfloat16 (integers forward-only for the reductions), transposed
non-contiguous inputs and cotangents; every rank's output and input gradient against the reference.

Default profile: 25 examples per test; ``HYPOTHESIS_PROFILE=slow``: 200 (CI).
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from commlib.tools import cases, parity
from commlib_torch.tools.parity_jobs import merge, run_case

WORLD_SIZES = (1, 2, 3, 4)
FLOATS = ("float64", "bfloat16")


def _check(pool, case: cases.Case, seed: int) -> parity.Row:
    arrays = cases.make_arrays(case, seed)
    outputs, gradients, error = merge(case, pool(case.world_size).run(run_case, case, arrays))
    return parity.check(case, arrays, outputs, gradients, error)


def _name(op, shape, kwargs, dtype, transposed, draw="normal") -> str:
    return f"prop:{op}{list(shape)}{dict(kwargs)},{dtype},{'T' if transposed else ''}{draw}"


@st.composite
def _shapes(draw, min_ndim=0):
    return [draw(st.integers(1, 3)) for _ in range(draw(st.integers(min_ndim, 4)))]


@st.composite
def _common(draw, dtypes=FLOATS, min_ndim=0):
    """(world_size, shape, dtype, transposed): the draws every op shares."""
    return (draw(st.sampled_from(WORLD_SIZES)), draw(_shapes(min_ndim)), draw(st.sampled_from(dtypes)),
            draw(st.booleans()))


def _make(op, world_size, shape, dtype, transposed, kwargs, draw="normal") -> cases.Case:
    kwargs = tuple(kwargs)
    return cases.Case(_name(op, shape, kwargs, dtype, transposed, draw), op, world_size, tuple(shape), dtype, kwargs,
                      transposed, draw=draw)


@st.composite
def broadcast_cases(draw):
    world_size, shape, dtype, transposed = draw(_common())
    src = draw(st.integers(0, world_size - 1))
    return _make("broadcast", world_size, shape, dtype, transposed, [("src", src)])


@st.composite
def gather_cases(draw):
    world_size, shape, dtype, transposed = draw(_common(min_ndim=1))
    dst = draw(st.integers(0, world_size - 1))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    return _make("gather", world_size, shape, dtype, transposed, [("dst", dst), ("dim", dim)])


@st.composite
def scatter_cases(draw):
    world_size, shape, dtype, transposed = draw(_common(min_ndim=1))
    src = draw(st.integers(0, world_size - 1))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    shape[dim] *= world_size
    return _make("scatter", world_size, shape, dtype, transposed, [("src", src), ("dim", dim)])


@st.composite
def permute_cases(draw):
    """A partial permutation: distinct sources, distinct destinations (a rank may send to itself)."""
    world_size, shape, dtype, transposed = draw(_common())
    sources = draw(st.lists(st.integers(0, world_size - 1), unique=True, max_size=world_size))
    destinations = draw(st.permutations(range(world_size)))[: len(sources)]
    perm = tuple(zip(sources, destinations, strict=True))
    return _make("permute", world_size, shape, dtype, transposed, [("perm", perm)])


@st.composite
def sum_grad_cases(draw):
    return _make("sum_grad", *draw(_common()), [])


@st.composite
def reduction_cases(draw, op):
    """max/min/product in both conventions; "small" draws give ties and zeros; bfloat16 sometimes accumulated
    in float32; int32 forward-only."""
    world_size, shape, dtype, transposed = draw(_common(dtypes=(*FLOATS, "int32")))
    kwargs = [("op", op), ("convention", draw(st.sampled_from(["sum", "replicated"])))]
    if dtype == "bfloat16" and draw(st.booleans()):
        kwargs.append(("accum_dtype", "float32"))
    small = draw(st.sampled_from(["normal", "small"]))
    return _make("all_reduce", world_size, shape, dtype, transposed, kwargs, small)


def _assert_passes(pool, case, seed):
    row = _check(pool, case, seed)
    assert row.passed, row


SEEDS = st.integers(0, 2**16)


@given(broadcast_cases(), SEEDS)
def test_broadcast_property(pool, case, seed):
    _assert_passes(pool, case, seed)


@given(gather_cases(), SEEDS)
def test_gather_property(pool, case, seed):
    _assert_passes(pool, case, seed)


@given(scatter_cases(), SEEDS)
def test_scatter_property(pool, case, seed):
    _assert_passes(pool, case, seed)


@given(permute_cases(), SEEDS)
def test_permute_property(pool, case, seed):
    _assert_passes(pool, case, seed)


@given(sum_grad_cases(), SEEDS)
def test_sum_grad_property(pool, case, seed):
    _assert_passes(pool, case, seed)


@pytest.mark.parametrize("op", ["max", "min", "product"])
@given(data=st.data(), seed=SEEDS)
def test_all_reduce_extremum_and_product_property(pool, op, data, seed):
    _assert_passes(pool, data.draw(reduction_cases(op)), seed)

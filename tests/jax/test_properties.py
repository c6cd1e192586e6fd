"""Hypothesis over every op of issue 3 in float64: random shapes (size-1 dims, 0-d where the op allows), dims
(negative too), rank arguments, world sizes 1-4 and, per example, one mode of `parity_runner.modes_for(W)`
(shard_map check_vma on/off, pmap, the 2 x 2 mesh at W = 4) or the 2 x 2 mesh with the tuple axis reversed;
every rank's output and input gradient against the numpy reference (`commlib.tools.parity.check`).

Default profile: 25 examples per test; ``HYPOTHESIS_PROFILE=slow`` (CI): 200. Dims are drawn from {1, 2}
(times W on a split dim) so examples often lower to a program already compiled: `tests.jax.programs.run`
traces every example but compiles each distinct program once, which keeps the slow profile to minutes.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from commlib.tools import cases
from commlib_jax.tools.parity_runner import modes_for
from tests.jax import programs

WORLD_SIZES = (1, 2, 3, 4)
SEEDS = st.integers(0, 2**16)


def _modes(world_size: int) -> tuple[str, ...]:
    return modes_for(world_size) + ((programs.REVERSED_MESH,) if world_size == 4 else ())


@st.composite
def _setting(draw, min_ndim=0, max_ndim=3):
    """(world_size, mode, shape): the draws every op shares; shape is a list to adjust a split dim."""
    world_size = draw(st.sampled_from(WORLD_SIZES))
    mode = draw(st.sampled_from(_modes(world_size)))
    shape = draw(st.lists(st.integers(1, 2), min_size=min_ndim, max_size=max_ndim))
    return world_size, mode, shape


@st.composite
def _dim(draw, ndim: int) -> int:
    return draw(st.integers(-ndim, ndim - 1))


def _case(op, world_size, shape, kwargs, draw="normal") -> cases.Case:
    kwargs = tuple(kwargs)
    name = f"prop:{op}{list(shape)}{dict(kwargs)}{draw}"
    return cases.Case(name, op, world_size, tuple(shape), "float64", kwargs, draw=draw)


@st.composite
def all_to_all_cases(draw):
    """Distinct scatter and gather dims (equal ones are the case table's error row), either spelled negative."""
    world_size, mode, shape = draw(_setting(min_ndim=2))
    ndim = len(shape)
    scatter = draw(_dim(ndim))
    gather = (scatter + draw(st.integers(1, ndim - 1))) % ndim - draw(st.sampled_from([0, ndim]))
    shape[scatter] *= world_size
    return _case("all_to_all", world_size, shape, [("scatter_dim", scatter), ("gather_dim", gather)]), mode


@st.composite
def all_gather_cases(draw):
    world_size, mode, shape = draw(_setting(min_ndim=1))
    convention = draw(st.sampled_from(["sum", "replicated"]))
    return _case("all_gather", world_size, shape, [("dim", draw(_dim(len(shape)))), ("convention", convention)]), mode


@st.composite
def reduce_scatter_cases(draw):
    world_size, mode, shape = draw(_setting(min_ndim=1))
    dim = draw(_dim(len(shape)))
    shape[dim] *= world_size
    op = draw(st.sampled_from(["sum", "avg"]))
    return _case("reduce_scatter", world_size, shape, [("dim", dim), ("op", op)]), mode


@st.composite
def all_reduce_cases(draw):
    """Every reduction in both conventions; "small" draws (integers in [-1, 2]) give ties and zeros."""
    world_size, mode, shape = draw(_setting())
    op = draw(st.sampled_from(["sum", "avg", "max", "min", "product"]))
    convention = draw(st.sampled_from(["sum", "replicated"]))
    values = draw(st.sampled_from(["normal", "small"]))
    return _case("all_reduce", world_size, shape, [("op", op), ("convention", convention)], values), mode


@st.composite
def broadcast_cases(draw):
    world_size, mode, shape = draw(_setting())
    return _case("broadcast", world_size, shape, [("src", draw(st.integers(0, world_size - 1)))]), mode


@st.composite
def gather_cases(draw):
    world_size, mode, shape = draw(_setting(min_ndim=1))
    dst = draw(st.integers(0, world_size - 1))
    return _case("gather", world_size, shape, [("dst", dst), ("dim", draw(_dim(len(shape))))]), mode


@st.composite
def scatter_cases(draw):
    world_size, mode, shape = draw(_setting(min_ndim=1))
    src, dim = draw(st.integers(0, world_size - 1)), draw(_dim(len(shape)))
    shape[dim] *= world_size
    return _case("scatter", world_size, shape, [("src", src), ("dim", dim)]), mode


@st.composite
def permute_cases(draw):
    """A partial permutation: distinct sources, distinct destinations (a rank may send to itself)."""
    world_size, mode, shape = draw(_setting())
    sources = draw(st.lists(st.integers(0, world_size - 1), unique=True, max_size=world_size))
    destinations = draw(st.permutations(range(world_size)))[: len(sources)]
    return _case("permute", world_size, shape, [("perm", tuple(zip(sources, destinations, strict=True)))]), mode


@st.composite
def sum_grad_cases(draw):
    world_size, mode, shape = draw(_setting())
    return _case("sum_grad", world_size, shape, []), mode


STRATEGIES = {
    "all_to_all": all_to_all_cases(),
    "all_gather": all_gather_cases(),
    "reduce_scatter": reduce_scatter_cases(),
    "all_reduce": all_reduce_cases(),
    "broadcast": broadcast_cases(),
    "gather": gather_cases(),
    "scatter": scatter_cases(),
    "permute": permute_cases(),
    "sum_grad": sum_grad_cases(),
}


@pytest.mark.parametrize("op", list(STRATEGIES))
@given(data=st.data(), seed=SEEDS)
def test_property(op, data, seed):
    case, mode = data.draw(STRATEGIES[op], label="case, mode")
    arrays = cases.make_arrays(case, seed)
    row = programs.check(case, arrays, programs.mapped(case, mode), mode)
    assert row.passed, row

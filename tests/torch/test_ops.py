"""Every op on real gloo process groups, every rank's output and input gradient against the reference.

The parity case table covers each op, both conventions, batch > 1, size-1 dims, non-contiguous inputs and
cotangents, negative dims, bfloat16 and the rejected calls, at world sizes 1-4; hypothesis adds random
shapes and dims in float64.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from commlib.tools import cases, parity
from commlib_torch.tools.parity_jobs import merge, run_case

WORLD_SIZES = (1, 2, 3, 4)


def _check(pool, case: cases.Case, seed: int = 0) -> parity.Row:
    arrays = cases.make_arrays(case, seed)
    outputs, gradients, error = merge(case, pool(case.world_size).run(run_case, case, arrays))
    return parity.check(case, arrays, outputs, gradients, error)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_case_table(pool, world_size):
    failed = [row for row in (_check(pool, case) for case in cases.case_table(world_size)) if not row.passed]
    report = "\n".join(f"{row.case}: out {row.out_error} grad {row.grad_error} {row.detail}" for row in failed)
    assert not failed, report


@st.composite
def _all_to_all_cases(draw):
    world_size = draw(st.sampled_from(WORLD_SIZES))
    ndim = draw(st.integers(1, 4))
    scatter = draw(st.integers(0, ndim - 1))
    gather = draw(st.integers(0, ndim - 1))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[scatter] *= world_size
    negative = draw(st.booleans())
    return cases.Case(
        f"all_to_all{shape}", "all_to_all", world_size, tuple(shape), "float64",
        (("scatter_dim", scatter - ndim if negative else scatter), ("gather_dim", gather)),
        transposed=draw(st.booleans()),
    )


@st.composite
def _dim_cases(draw, op):
    world_size = draw(st.sampled_from(WORLD_SIZES))
    ndim = draw(st.integers(1, 4))
    dim = draw(st.integers(-ndim, ndim - 1))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    kwargs = [("dim", dim)]
    if op == "reduce_scatter":
        shape[dim] *= world_size
        kwargs.append(("op", draw(st.sampled_from(["sum", "avg"]))))
    else:
        kwargs.append(("convention", draw(st.sampled_from(["sum", "replicated"]))))
    return cases.Case(f"{op}{shape}", op, world_size, tuple(shape), "float64", tuple(kwargs), draw(st.booleans()))


@given(_all_to_all_cases())
def test_all_to_all_property(pool, case):
    row = _check(pool, case)
    assert row.passed, row


@given(st.one_of(_dim_cases("all_gather"), _dim_cases("reduce_scatter")))
def test_gather_scatter_property(pool, case):
    row = _check(pool, case)
    assert row.passed, row


@given(st.sampled_from(WORLD_SIZES), st.lists(st.integers(1, 4), min_size=0, max_size=3),
       st.sampled_from(["sum", "avg"]), st.sampled_from(["sum", "replicated"]))
def test_all_reduce_property(pool, world_size, shape, op, convention):
    kwargs = (("op", op), ("convention", convention))
    case = cases.Case(f"all_reduce{shape}", "all_reduce", world_size, tuple(shape), "float64", kwargs)
    row = _check(pool, case)
    assert row.passed, row


def test_check_detects_a_wrong_gradient():
    """The comparison the tests rely on fails on a perturbed result."""
    case = cases.case_table(2)[0]
    arrays = cases.make_arrays(case, 0)
    outputs, gradients = cases.expected(case, arrays)
    assert parity.check(case, arrays, outputs, gradients, None).passed
    gradients["x"][1] = gradients["x"][1] + 1e-3
    assert not parity.check(case, arrays, outputs, gradients, None).passed
    assert not parity.check(case, arrays, None, None, "CommError: x").passed

"""Hypothesis over every op on real gloo process groups: the shared strategies of tests/strategies.py (random
shapes, size-1 dims, 0-d where the op allows, negative dims, rank arguments, both conventions, ties and zeros,
world sizes 1-4, float64 and bfloat16, integers forward-only for the reductions, transposed non-contiguous
inputs and cotangents); every rank's output and input gradient against the reference.

Default profile: 25 examples per test; ``HYPOTHESIS_PROFILE=slow``: 200 (CI).
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from commlib.tools import cases, parity
from commlib_torch.tools.parity_jobs import merge, run_case
from tests import strategies


def _check(pool, case: cases.Case, seed: int) -> parity.Row:
    arrays = cases.make_arrays(case, seed)
    outputs, gradients, error = merge(case, pool(case.world_size).run(run_case, case, arrays))
    return parity.check(case, arrays, outputs, gradients, error)


@pytest.mark.parametrize("op", strategies.OPS)
@given(data=st.data(), seed=strategies.SEEDS)
def test_property(pool, op, data, seed):
    case = data.draw(strategies.cases(op, strategies.TORCH), label="case")
    row = _check(pool, case, seed)
    assert row.passed, row

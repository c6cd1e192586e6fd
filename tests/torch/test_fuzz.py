"""The fuzz loop that found the stride-2 and bool-scatter bugs, part of the suite: seeded (hypothesis, derandomized) and
bounded (`EXAMPLES` cases, ~15 s on 2 cores). Every op, even or with uneven sizes (zeros included), on real
gloo groups of W = 1-4, float64 / float32 / bfloat16, bool and int32 through the ops that only move data, both
conventions, contiguous, transposed or stride-2 (``base[..., ::2]``) inputs and cotangents (a stride-2
cotangent is handed to backward as it is): every rank's output and input gradient against
`commlib.reference`, and a call the spec rejects raises its text on every rank."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commlib.tools import cases, parity
from commlib_torch.tools.parity_jobs import merge, run_case
from tests import strategies

EXAMPLES = 200
FUZZ = strategies.Space(max_size=3, dtypes=("float64", "bfloat16"), transposed=True)

pytestmark = pytest.mark.timeout(300)


@settings(
    max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(case=strategies.fuzz_cases(FUZZ), strided=st.booleans(), seed=strategies.SEEDS)
def test_fuzz(pool, case, strided, seed):
    arrays = cases.make_arrays(case, seed)
    replies = pool(case.world_size).run(run_case, case, arrays, strided=strided, timeout=60.0)
    outputs, gradients, error = merge(case, replies)
    row = parity.check(case, arrays, outputs, gradients, error)
    assert row.passed, (row, strided)

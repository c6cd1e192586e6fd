"""The attention layers fuzzed on real gloo groups (W = 1-4): `tests.layer_fuzz.layer_cases`, seeded
(hypothesis, derandomized) and bounded (`EXAMPLES` calls). Every rank's output and q, k, v gradients against
the float64 reference; a call the spec rejects raises its text on every rank; a call that hangs fails after
`TIMEOUT` seconds instead of waiting for gloo's."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings

from commlib.tools import cases, parity
from commlib_torch.tools.parity_jobs import merge, run_case
from tests import strategies
from tests.layer_fuzz import layer_cases

EXAMPLES = int(os.environ.get("COMMLIB_FUZZ_EXAMPLES", "100"))  # more for a longer hunt
TIMEOUT = 20.0

pytestmark = pytest.mark.timeout(300)


@settings(
    max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(case=layer_cases(), seed=strategies.SEEDS)
def test_layer_fuzz(pool, case, seed):
    arrays = cases.make_arrays(case, seed)
    replies = pool(case.world_size).run(run_case, case, arrays, timeout=TIMEOUT)
    want = cases.error_text(case)
    if want is not None:  # every rank raises the spec's error (its "Received:" part is the rank's own shapes)
        assert [reply[0] for reply in replies] == ["error"] * case.world_size, replies
        assert {reply[1].split(" Received: ")[0] for reply in replies} == {want.split(" Received: ")[0]}, replies
        return
    outputs, gradients, error = merge(case, replies)
    row = parity.check(case, arrays, outputs, gradients, error)
    assert row.passed, row

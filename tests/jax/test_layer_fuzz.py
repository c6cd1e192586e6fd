"""The attention layers fuzzed on simulated CPU devices (JAX side of tests/torch/test_layer_fuzz.py):
`tests.layer_fuzz.layer_cases` at W = 2 and 4, seeded and bounded (`EXAMPLES` calls, each a compile), one
random mode per call (shard_map with check_vma True or False, pmap; USP under shard_map only): every rank's
output and q, k, v gradients against the float64 reference, and a call the spec rejects raises its text."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commlib.tools import cases
from commlib_jax.tools.parity_runner import modes_for
from tests import strategies
from tests.jax import programs
from tests.layer_fuzz import layer_cases

EXAMPLES = int(os.environ.get("COMMLIB_FUZZ_EXAMPLES", "20"))  # more for a longer hunt


@settings(
    max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(data=st.data(), seed=strategies.SEEDS)
def test_layer_fuzz(data, seed):
    case = data.draw(layer_cases(world_sizes=(2, 4)), label="case")
    mode = data.draw(st.sampled_from(modes_for(case.world_size, case)), label="mode")
    row = programs.check(case, cases.make_arrays(case, seed), programs.mapped(case, mode), mode)
    want = cases.error_text(case)
    if want is not None and not row.passed:  # the spec's error, but "Received:" gives the padded shapes JAX holds
        assert row.detail.count(want.split(" Received: ")[0]) == 2, row
        return
    assert row.passed, row

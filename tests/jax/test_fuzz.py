"""The fuzz loop that found the stride-2 and bool-scatter bugs, part of the suite (JAX side): seeded (hypothesis,
derandomized) and bounded (`EXAMPLES` cases, ~15 s on 2 cores: each compiles). Every op, even or with uneven
sizes (zeros included, the padded layout), on 4 simulated devices, float64 / float32, bool and int32 through
the ops that only move data, both conventions, one random mode per case (shard_map with check_vma True or
False, pmap): every rank's output and input gradient against `commlib.reference`, and a call the spec rejects
raises its text. (JAX arrays have no strides: the non-contiguous cases are torch's, tests/torch/test_fuzz.py.)"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commlib.tools import cases
from commlib_jax.tools.parity_runner import modes_for
from tests import strategies
from tests.jax import programs

EXAMPLES = 60
FUZZ = strategies.Space(max_size=2, dtypes=("float64",), transposed=False, world_sizes=(4,))


@settings(
    max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(data=st.data(), seed=strategies.SEEDS)
def test_fuzz(data, seed):
    case = data.draw(strategies.fuzz_cases(FUZZ), label="case")
    mode = data.draw(st.sampled_from(modes_for(case.world_size)), label="mode")
    row = programs.check(case, cases.make_arrays(case, seed), programs.mapped(case, mode), mode)
    assert row.passed, row

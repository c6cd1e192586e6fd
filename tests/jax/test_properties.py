"""Hypothesis over every op in float64, with the shared strategies of tests/strategies.py (random shapes, size-1
dims, 0-d where the op allows, negative dims, rank arguments, both conventions, world sizes 1-4) and, per example,
one mode of `parity_runner.modes_for(W)`
(shard_map check_vma on/off, pmap, the 2 x 2 mesh at W = 4) or the 2 x 2 mesh with the tuple axis reversed;
every rank's output and input gradient against the numpy reference (`commlib.tools.parity.check`).

Default profile: 25 examples per test; ``HYPOTHESIS_PROFILE=slow`` (CI): 50, not the profile's 200: every
example traces and lowers its own program (~0.06 s each on CPU, 170 s for the file at 200), and the same
strategies run at 200 examples per op through torch (tests/torch/test_properties.py) against the same
reference, while every op's case table runs in every JAX mode (tests/jax/test_ops.py). Dims are drawn from {1, 2}
(times W on a split dim) so examples often lower to a program already compiled: `tests.jax.programs.run`
traces every example but compiles each distinct program once, which keeps the slow profile to minutes.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commlib.tools import cases
from commlib_jax.tools.parity_runner import modes_for
from tests import strategies
from tests.jax import programs


def _modes(world_size: int) -> tuple[str, ...]:
    return modes_for(world_size) + ((programs.REVERSED_MESH,) if world_size == 4 else ())


@pytest.mark.parametrize("op", strategies.OPS)
@settings(max_examples=min(settings().max_examples, 50))
@given(data=st.data(), seed=strategies.SEEDS)
def test_property(op, data, seed):
    case = data.draw(strategies.cases(op, strategies.JAX), label="case")
    mode = data.draw(st.sampled_from(_modes(case.world_size)), label="mode")
    arrays = cases.make_arrays(case, seed)
    row = programs.check(case, arrays, programs.mapped(case, mode), mode)
    assert row.passed, row

"""The JAX runner of ``commlib parity --workload sequence`` on 4 simulated CPU devices: every helper's outputs and
gradients in both check_vma modes (padding rows of the inputs hold 7.0) are the float64 reference's at W = 2
and 4 (USP on a 2 x 2 mesh with a tuple axis name, an empty shard)."""

from __future__ import annotations

import numpy as np
import pytest

from commlib.tools import sequence_parity as spec
from commlib_jax.tools import sequence_parity

CASES = [
    (layout, mode) for world_size in (2, 4) for layout in spec.layouts(world_size) for mode in sequence_parity.MODES
]


@pytest.mark.parametrize(("layout", "mode"), CASES, ids=[f"{spec.name(layout)}-{mode}" for layout, mode in CASES])
def test_helpers_store_the_reference(layout, mode):
    got, want = sequence_parity.helpers(layout, 0, mode), spec.expected(layout)
    for rank, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert set(mine) == set(spec.OUTPUTS)
        for key in spec.OUTPUTS:
            np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-13, atol=1e-14, err_msg=f"rank {rank} {key}")

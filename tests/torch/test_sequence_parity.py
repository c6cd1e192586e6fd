"""The torch runner's jobs of ``commlib parity --workload sequence`` on real gloo ranks: every helper's stored
outputs and gradients (padded to the JAX layout) are the float64 reference's at W = 3 and 4, and the
transformers example's model row (Ulysses, S = 37) measures its own first step within the tolerance."""

from __future__ import annotations

import numpy as np
import pytest

from commlib.tools import sequence_parity as spec
from commlib_torch.tools import sequence_parity

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world_size", [3, 4])
def test_helpers_job_stores_the_reference(pool, world_size):
    for layout in spec.layouts(world_size):
        got, want = pool(world_size).run(sequence_parity.helpers, layout, 0), spec.expected(layout)
        for rank, (mine, theirs) in enumerate(zip(got, want, strict=True)):
            assert set(mine) == set(spec.OUTPUTS)
            for key in spec.OUTPUTS:
                np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-13, atol=1e-14,
                                           err_msg=f"{spec.name(layout)} rank {rank} {key}")


def test_model_job_measures_the_transformers_example(pool):
    pytest.importorskip("transformers")
    replies = pool(4).run(sequence_parity.model, "ulysses", spec.MODEL_LENGTH)
    for errors in replies:
        assert set(errors) == {"loss", "logits", "gradients"}
        assert max(errors.values()) < spec.TOLERANCE and errors["gradients"] > 0  # float64 rounding, not zero

"""The torch runner's job of ``commlib parity --workload masks`` on real gloo ranks at W = 1-4: every case's stored
output and dq, dk, dv (padded to the JAX layout) pass the workload's own comparison with the float64 reference
(within 1e-10, padding rows exactly 0)."""

from __future__ import annotations

import pytest

from commlib.tools import mask_parity as spec
from commlib_torch.tools import mask_parity

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_case_passes_the_comparison(pool, tmp_path, world_size):
    results = spec.MaskResults("torch")
    for case in spec.cases(world_size):
        results.add(case.name, "gloo", pool(world_size).run(mask_parity.masked, case, 0))
    results.save(tmp_path, {})
    rows = spec.compare("torch", tmp_path, world_size, 0)
    assert len(rows) == len(spec.cases(world_size))
    assert [row.case for row in rows if not row.passed] == []
    assert max(max(row.out_error, row.grad_error) for row in rows) > 0  # float64 rounding: the rows were compared

"""The torch runner's job of ``commlib parity --workload moe`` on real gloo ranks at W = 1-4: every case in both
layouts (exact only where T differs between ranks) passes the workload's own comparison with the float64
reference `simulate_moe` (every rank's dispatched rows, output, x / y / weights gradients, counts; NaN in the
padded rows reaching nothing)."""

from __future__ import annotations

import pytest

from commlib.tools import moe_parity as spec
from commlib_torch.tools import moe_parity

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_case_passes_the_comparison(pool, tmp_path, world_size):
    results = spec.MoeResults("torch")
    runs = [(case, mode) for case in spec.cases(world_size) for mode in spec.modes("torch", case)]
    for case, mode in runs:
        results.add(case.name, mode, pool(world_size).run(moe_parity.layer, case, 0, mode))
    results.save(tmp_path, {})
    rows = spec.compare("torch", tmp_path, world_size, 0)
    assert len(rows) == len(runs) and {row.mode for row in rows} == {"exact", "padded"}
    assert [(row.case, row.mode) for row in rows if not row.passed] == []
    assert max(max(row.out_error, row.grad_error) for row in rows) > 0  # rounding: the rows were compared

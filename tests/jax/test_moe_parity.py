"""The JAX runner of ``commlib parity --workload moe`` on 4 simulated CPU devices (shard_map, check_vma on): every
case with one T per rank, in its one program, passes the workload's own comparison with the float64 reference
`simulate_moe` (every rank's dispatched rows, output, x / y / weights gradients, counts; NaN in the padded rows
and in the padded rows' cotangent reaching nothing). One world size: the program's compile is most of the time."""

from __future__ import annotations

from commlib.tools import moe_parity as spec
from commlib_jax.tools import moe_parity

W = 4


def test_every_case_passes_the_comparison(tmp_path):
    results = spec.MoeResults("jax")
    for mode in moe_parity.MODES:
        for name, ranks in moe_parity.layers(W, 0, mode).items():
            results.add(name, mode, ranks)
    results.save(tmp_path, {})
    rows = spec.compare("jax", tmp_path, W, 0)
    assert len(rows) == len([case for case in spec.cases(W) if case.same_tokens])
    assert [(row.case, row.mode) for row in rows if not row.passed] == []
    assert max(max(row.out_error, row.grad_error) for row in rows) > 0  # rounding: the rows were compared

"""The JAX runner of ``commlib parity --workload masks`` on simulated CPU devices, check_vma on and off: every
case's output and dq, dk, dv (every shard padded to ``max_size`` rows holding 7.0, ids -1) pass the workload's own
comparison with the float64 reference (within 1e-10, padding and padded rows exactly 0) at W = 4 (USP 2 x 2; the
layers at W = 1-4 are tests/jax/test_masks.py's; about 50 s of compiling, so one world size)."""

from __future__ import annotations

from commlib.tools import mask_parity as spec
from commlib_jax.tools import mask_parity

W = 4


def test_every_case_passes_the_comparison(tmp_path):
    results = spec.MaskResults("jax")
    for case in spec.cases(W):
        for mode in mask_parity.MODES:
            results.add(case.name, mode, mask_parity.masked(case, 0, mode))
    results.save(tmp_path, {})
    rows = spec.compare("jax", tmp_path, W, 0)
    assert len(rows) == 2 * len(spec.cases(W))
    assert [(row.case, row.mode) for row in rows if not row.passed] == []
    assert max(max(row.out_error, row.grad_error) for row in rows) > 0  # float64 rounding: the rows were compared

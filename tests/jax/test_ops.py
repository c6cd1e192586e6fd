"""The parity case table on simulated CPU devices: every case of `commlib.cases.case_table(W)` for W = 1..4
in every mode of `parity_runner.modes_for(W)` -- shard_map with check_vma on and off, pmap, and at W = 4 a
2 x 2 mesh with the tuple axis ("x", "y") in row-major rank order -- run by the parity runner's own
`run_case` and compared with the numpy reference by `commlib.tools.parity.check`: every rank's output and input
gradients, and for the rejected calls the spec's error text, raised at trace time.

One test per (W, mode): each case compiles its own program, so the run time is the case count times a
compile (about 0.1-0.3 s each on CPU), ~13 x 48 in all.
"""

import numpy as np
import pytest

from commlib import CommError
from commlib.tools import cases, parity
from commlib_jax.tools.parity_runner import modes_for, run_case
from tests.jax.programs import error_text

SEED = 0
GROUPS = [(world_size, mode) for world_size in (1, 2, 3, 4) for mode in modes_for(world_size)]


def _row(case: cases.Case, mode: str) -> parity.Row:
    arrays = cases.make_arrays(case, SEED)
    try:
        outputs, gradients = run_case(case, arrays, mode)
    except (CommError, TypeError) as error:
        return parity.check(case, arrays, None, None, error_text(error), "jax", mode)
    return parity.check(case, arrays, outputs, gradients, None, "jax", mode)


def _report(rows) -> str:
    return "\n".join(f"{row.case}: out {row.out_error} grad {row.grad_error} {row.detail}" for row in rows)


@pytest.mark.parametrize(("world_size", "mode"), GROUPS, ids=[f"W{w}-{m}" for w, m in GROUPS])
def test_case_table(world_size, mode):
    table = cases.case_table(world_size)
    rows = [_row(case, mode) for case in table]
    failed = [row for row in rows if not row.passed]
    assert not failed, _report(failed)
    _assert_compared_by_kind(table, rows)


def _assert_compared_by_kind(table, rows) -> None:
    """Exactly the rejected calls were compared by their error text, every other case by its values."""
    rejected = {case.name for case in table if cases.error_text(case) is not None}
    by_text = {row.case for row in rows if row.out_error is None}
    assert rejected and by_text == rejected, (sorted(rejected), sorted(by_text))


def test_check_fails_on_a_perturbed_jax_result():
    """The comparison fails when one rank's JAX gradient or output is off, or a wrong error text comes back."""
    case = next(case for case in cases.case_table(4) if case.op == "all_gather")
    arrays = cases.make_arrays(case, SEED)
    outputs, gradients = run_case(case, arrays, "shard_map[check_vma=True]")
    assert parity.check(case, arrays, outputs, gradients, None).passed
    shifted = {"x": [g + (1e-3 if rank == 3 else 0.0) for rank, g in enumerate(gradients["x"])]}
    assert not parity.check(case, arrays, outputs, shifted, None).passed
    assert not parity.check(case, arrays, [np.zeros_like(o) for o in outputs], gradients, None).passed
    rejected = next(case for case in cases.case_table(4) if cases.error_text(case) is not None)
    assert not parity.check(rejected, cases.make_arrays(rejected, SEED), None, None, "CommError: other").passed

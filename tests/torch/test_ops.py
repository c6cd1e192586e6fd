"""Every op on real gloo process groups, every rank's output and input gradient against the reference.

The parity case table covers each op, both conventions, batch > 1, size-1 dims, non-contiguous inputs and
cotangents, negative dims, bfloat16 and the rejected calls, at world sizes 1-4 (hypothesis adds random cases:
test_properties.py).
"""

from __future__ import annotations

import pytest
import torch

import commlib_torch
from commlib.tools import cases, parity
from commlib_torch.tools.parity_jobs import merge, run_case

# --- per-rank jobs: the pool's workers run them (module level: pickled by reference) ------------------------
# torch.func transforms over commlib's ops.


def vmap_all_reduce(ctx) -> str:
    """``torch.func.vmap`` over all_reduce: the error text this rank gets."""
    try:
        torch.func.vmap(commlib_torch.all_reduce)(torch.ones(3, 2))
    except TypeError as error:
        return f"TypeError: {error}"
    return "no error"


# --- the tests ----------------------------------------------------------------------------------------------


WORLD_SIZES = (1, 2, 3, 4)


def _check(pool, case: cases.Case, seed: int = 0) -> parity.Row:
    arrays = cases.make_arrays(case, seed)
    outputs, gradients, error = merge(case, pool(case.world_size).run(run_case, case, arrays))
    return parity.check(case, arrays, outputs, gradients, error)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_case_table(pool, world_size):
    table = cases.case_table(world_size)
    rows = [_check(pool, case) for case in table]
    failed = [row for row in rows if not row.passed]
    report = "\n".join(f"{row.case}: out {row.out_error} grad {row.grad_error} {row.detail}" for row in failed)
    assert not failed, report
    rejected = {case.name for case in table if cases.error_text(case) is not None}
    by_text = {row.case for row in rows if row.out_error is None}  # compared by error text, not by values
    assert rejected and by_text == rejected, (sorted(rejected), sorted(by_text))


@pytest.mark.parametrize("world_size", [2, 4])
def test_case_table_through_torch_func(pool, world_size):
    """``torch.func.vjp`` over every op gives the reference's outputs and gradients (the same Functions: they
    keep forward and setup_context apart, as torch.func requires)."""
    table = [case for case in cases.case_table(world_size) if case.differentiable and cases.error_text(case) is None]
    rows = []
    for case in table:
        arrays = cases.make_arrays(case, 0)
        per_rank = pool(case.world_size).run(run_case, case, arrays, grad_mode="func")
        rows.append(parity.check(case, arrays, *merge(case, per_rank)))
    failed = [f"{row.case}: out {row.out_error} grad {row.grad_error} {row.detail}" for row in rows if not row.passed]
    assert len(rows) > 50 and not failed, "\n".join(failed)


def test_torch_func_vmap_is_refused_by_name(pool):
    (message,) = set(pool(2).run(vmap_all_reduce))
    assert message == (
        "TypeError: all_reduce: torch.func.vmap is not supported: each rank runs the collective "
        "once, not once per batch element; put the batch in the tensor (a leading dim) or loop over "
        "it. torch.func.grad, vjp and functional_call work. Received: transform='vmap'"
    )


def test_check_detects_a_wrong_gradient():
    """The comparison the tests rely on fails on a perturbed result."""
    case = cases.case_table(2)[0]
    arrays = cases.make_arrays(case, 0)
    outputs, gradients = cases.expected(case, arrays)
    assert parity.check(case, arrays, outputs, gradients, None).passed
    gradients["x"][1] = gradients["x"][1] + 1e-3
    assert not parity.check(case, arrays, outputs, gradients, None).passed
    assert not parity.check(case, arrays, None, None, "CommError: x").passed
